//! `strata_last_error_copy`: this thread's last error message copied into
//! the caller's buffer (above `cast`, whose checks of the caller's pointers
//! it uses, and `status`, which keeps the message).

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::cast::{self, SetOpt};
use crate::status::{last_error_bytes, R, STRATA_ERR_PANIC};

/// Copies this thread's last error message (see `strata_last_error`) into
/// `buf` of `cap` bytes, NUL-terminated and truncated to fit when `cap` is
/// too small, and stores its full length (without the NUL) in `*len` if
/// `len` is not NULL. `buf` may be NULL when `cap` is 0 (to ask for the
/// length). Returns `STRATA_OK`, `STRATA_ERR_BUFFER_TOO_SMALL` (truncated;
/// `*len` and the truncated text are written), `STRATA_ERR_NULL_POINTER`
/// (`buf` NULL with `cap` > 0) or `STRATA_ERR_INVALID_ARGUMENT` (`len`
/// misaligned, or inside `buf`), when neither `buf` nor `*len` is changed;
/// it never changes the last error itself.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes; `len` is NULL or points
/// to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_last_error_copy(
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> c_int {
    let run = || -> R {
        // Both outputs are checked before either is written, and apart.
        cast::disjoint(
            &[cast::region(buf, cap, "buf"), cast::region(len, 1, "len")],
            &[],
        )?;
        // SAFETY: the caller passes NULL or a writable size_t.
        let len = unsafe { cast::out_opt(len, "len") }?;
        // SAFETY: the caller passes NULL or `cap` writable bytes.
        let buf = unsafe { cast::text_out(buf, cap, "buf") }?;
        let text = last_error_bytes();
        len.set(text.len());
        Ok(buf.write(&text))
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(s)) => s,
        Ok(Err(f)) => f.status,
        Err(_) => STRATA_ERR_PANIC,
    }
}
