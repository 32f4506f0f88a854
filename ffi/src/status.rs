//! Status codes, the per-thread last error, and the panic boundary every
//! exported function runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use strata::ErrorKind;

/// Success.
pub const STRATA_OK: c_int = 0;
/// Not an error: the request is still running (`strata_ticket_poll`,
/// `strata_ticket_wait_timeout`).
pub const STRATA_PENDING: c_int = 1;
/// A parameter or input was malformed or out of range.
pub const STRATA_ERR_INVALID_ARGUMENT: c_int = -1;
/// No GPU (or no CUDA driver library) is available.
pub const STRATA_ERR_NO_DEVICE: c_int = -2;
/// A tier (or every tier) is full.
pub const STRATA_ERR_OUT_OF_CAPACITY: c_int = -3;
/// An I/O operation failed.
pub const STRATA_ERR_IO: c_int = -4;
/// The storage medium ran out of space.
pub const STRATA_ERR_NO_SPACE: c_int = -5;
/// Data read back does not match its checksum.
pub const STRATA_ERR_CORRUPTED: c_int = -6;
/// The operation is not supported here.
pub const STRATA_ERR_UNSUPPORTED: c_int = -7;
/// The object was closed: its runtime was destroyed.
pub const STRATA_ERR_CLOSED: c_int = -8;
/// A path or object does not exist.
pub const STRATA_ERR_NOT_FOUND: c_int = -9;
/// Permission denied by the operating system.
pub const STRATA_ERR_PERMISSION_DENIED: c_int = -10;
/// A handle that is not live: freed, never issued, or of another type.
/// (Codes of the C ABI alone start at -100, so that error kinds the Rust
/// library adds later keep -11, -12, … without a clash.)
pub const STRATA_ERR_INVALID_HANDLE: c_int = -100;
/// strata panicked: a bug in strata. The message says where; the objects
/// involved may be left in any state that is safe to free.
pub const STRATA_ERR_PANIC: c_int = -101;
/// A pointer argument that must not be NULL was NULL.
pub const STRATA_ERR_NULL_POINTER: c_int = -102;
/// A caller's buffer is too small; the length needed was written where the
/// function says.
pub const STRATA_ERR_BUFFER_TOO_SMALL: c_int = -103;

/// The C status of an error kind: the kind's fixed code, negated.
pub fn status_of(kind: ErrorKind) -> c_int {
    -kind.code()
}

/// A failed call: its status and a one-line message.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) status: c_int,
    pub(crate) message: String,
}

impl Fail {
    #[cold]
    pub(crate) fn new(status: c_int, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    #[cold]
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(STRATA_ERR_INVALID_ARGUMENT, message)
    }

    #[cold]
    pub(crate) fn null(what: &str) -> Self {
        Self::new(STRATA_ERR_NULL_POINTER, format!("{what} is NULL"))
    }
}

impl From<strata::Error> for Fail {
    #[cold]
    fn from(e: strata::Error) -> Self {
        Self::new(status_of(e.kind()), e.message())
    }
}

/// What the functions of this crate return inside the boundary.
pub(crate) type R<T = c_int> = Result<T, Fail>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

#[cold]
fn record(function: &str, message: &str) {
    let text = format!("{function}: {message}").replace('\0', "\\0");
    let text = CString::new(text).unwrap_or_default();
    // During thread teardown the slot may be gone; the status still tells.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = text);
}

#[cold]
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_string());
    format!("internal error (a bug in strata, please report it): {what}")
}

/// Runs an exported function's body: its status, or its error's status with
/// the message recorded as this thread's last error; a panic becomes
/// `STRATA_ERR_PANIC`. Every `extern "C"` function of this crate returns
/// through here (or through [`boundary_void`]).
#[inline]
pub(crate) fn boundary(function: &'static str, body: impl FnOnce() -> R) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(fail)) => {
            record(function, &fail.message);
            fail.status
        }
        Err(payload) => {
            record(function, &panic_message(&*payload));
            STRATA_ERR_PANIC
        }
    }
}

/// The boundary for a function that cannot return a status (the DLPack
/// deleter): a failure is recorded as this thread's last error only.
pub(crate) fn boundary_void(function: &'static str, body: impl FnOnce() -> R<()>) {
    let _ = boundary(function, || body().map(|()| STRATA_OK));
}

/// The library version as a NUL-terminated string with static lifetime.
/// Thread-safe; never free it.
#[no_mangle]
pub extern "C" fn strata_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A static, NUL-terminated description of a status code ("ok", "i/o error",
/// "invalid handle", …; "unknown status" for a value strata never returns).
/// Thread-safe; never free it.
#[no_mangle]
pub extern "C" fn strata_status_string(status: c_int) -> *const c_char {
    const KINDS: [&str; 11] = [
        "ok\0",
        "invalid argument\0",
        "no device\0",
        "out of capacity\0",
        "i/o error\0",
        "no space left\0",
        "corrupted\0",
        "unsupported\0",
        "closed\0",
        "not found\0",
        "permission denied\0",
    ];
    let name = match status {
        STRATA_PENDING => "pending\0",
        STRATA_ERR_INVALID_HANDLE => "invalid handle\0",
        STRATA_ERR_PANIC => "internal error (panic)\0",
        STRATA_ERR_NULL_POINTER => "null pointer\0",
        STRATA_ERR_BUFFER_TOO_SMALL => "buffer too small\0",
        _ => status
            .checked_neg()
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| KINDS.get(i))
            .copied()
            .unwrap_or("unknown status\0"),
    };
    name.as_ptr().cast()
}

/// The message of the most recent call on this thread that returned an
/// error, NUL-terminated and prefixed with the function's name
/// (`"strata_read: range 0+4096 exceeds the buffer's 100 bytes"`); "" if
/// none has failed yet. A successful call leaves it as it was. The string is
/// owned by strata and stays valid until the next strata call on this
/// thread; never free it. Each thread has its own.
#[no_mangle]
pub extern "C" fn strata_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// This thread's last error message, without its NUL.
pub(crate) fn last_error_bytes() -> Vec<u8> {
    LAST_ERROR
        .try_with(|e| e.borrow().as_bytes().to_vec())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn s(p: *const c_char) -> &'static str {
        // SAFETY: both functions return pointers to static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    }

    #[test]
    fn statuses_match_the_rust_kinds() {
        let kinds = [
            (ErrorKind::InvalidArgument, STRATA_ERR_INVALID_ARGUMENT),
            (ErrorKind::NoDevice, STRATA_ERR_NO_DEVICE),
            (ErrorKind::OutOfCapacity, STRATA_ERR_OUT_OF_CAPACITY),
            (ErrorKind::Io, STRATA_ERR_IO),
            (ErrorKind::NoSpace, STRATA_ERR_NO_SPACE),
            (ErrorKind::Corrupted, STRATA_ERR_CORRUPTED),
            (ErrorKind::Unsupported, STRATA_ERR_UNSUPPORTED),
            (ErrorKind::Closed, STRATA_ERR_CLOSED),
            (ErrorKind::NotFound, STRATA_ERR_NOT_FOUND),
            (ErrorKind::PermissionDenied, STRATA_ERR_PERMISSION_DENIED),
        ];
        // The numbers are the ABI: a C program compiled against an older
        // header sees the same ones.
        assert_eq!(
            kinds.map(|(_, status)| status),
            [-1, -2, -3, -4, -5, -6, -7, -8, -9, -10]
        );
        assert_eq!(
            [
                STRATA_OK,
                STRATA_ERR_INVALID_HANDLE,
                STRATA_ERR_PANIC,
                STRATA_ERR_NULL_POINTER,
                STRATA_ERR_BUFFER_TOO_SMALL
            ],
            [0, -100, -101, -102, -103]
        );
        assert_eq!(s(strata_status_string(STRATA_OK)), "ok");
        for (kind, status) in kinds {
            assert_eq!(status_of(kind), status);
            assert_eq!(s(strata_status_string(status)), kind.name());
        }
        assert_eq!(
            s(strata_status_string(STRATA_ERR_INVALID_HANDLE)),
            "invalid handle"
        );
        assert_eq!(s(strata_status_string(STRATA_PENDING)), "pending");
        assert_eq!(s(strata_status_string(5)), "unknown status");
        assert_eq!(s(strata_status_string(-11)), "unknown status");
        assert_eq!(s(strata_status_string(c_int::MIN)), "unknown status");
        assert_eq!(s(strata_version()), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn the_boundary_records_errors_and_panics() {
        let status = boundary("strata_test", || Err(Fail::invalid("bad\0input")));
        assert_eq!(status, STRATA_ERR_INVALID_ARGUMENT);
        assert_eq!(s(strata_last_error()), "strata_test: bad\\0input");
        let status = boundary("strata_test", || panic!("boom"));
        assert_eq!(status, STRATA_ERR_PANIC);
        assert!(s(strata_last_error()).contains("boom"));
        assert_eq!(boundary("strata_test", || Ok(STRATA_OK)), STRATA_OK);
        assert!(s(strata_last_error()).contains("boom"), "success leaves it");
    }
}
