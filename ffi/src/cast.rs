//! Every conversion between C pointers and Rust values, in one place (the
//! rustls-ffi habit). Each `unsafe fn` here states what the C caller must
//! guarantee; each checks what can be checked (NULL, alignment, lengths
//! that overflow) before it touches memory, and returns a [`Fail`] saying
//! which argument was wrong.

use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr::NonNull;

use crate::status::{Fail, R, STRATA_ERR_BUFFER_TOO_SMALL, STRATA_OK};

/// The bits of an opaque handle. Handles are never dereferenced: a handle's
/// "pointer" is an index, a generation and a type tag (see `handle.rs`), so
/// a forged one is caught, never followed.
#[inline]
pub(crate) fn handle_bits<T>(p: *const T) -> u64 {
    p.addr() as u64
}

/// An opaque handle from its bits (a pointer with no provenance: it is only
/// ever compared, never dereferenced, by anyone).
#[inline]
pub(crate) fn handle_ptr<T>(bits: u64) -> *mut T {
    std::ptr::without_provenance_mut(bits as usize)
}

/// A place to store an out-parameter, checked for NULL and alignment.
pub(crate) struct Out<T>(NonNull<T>);

/// Stores a value through an optional out-parameter, if there is one.
pub(crate) trait SetOpt<T> {
    fn set(self, value: T);
}

impl<T> SetOpt<T> for Option<Out<T>> {
    #[inline]
    fn set(self, value: T) {
        if let Some(out) = self {
            out.set(value);
        }
    }
}

impl<T> Out<T> {
    /// Stores `value`.
    #[inline]
    pub(crate) fn set(self, value: T) {
        // SAFETY: `out` checked that the pointer is non-NULL and aligned,
        // and its caller guaranteed that it points to writable memory for a
        // `T` (the C function's contract).
        unsafe { self.0.as_ptr().write(value) }
    }
}

/// Checks an out-parameter before any work is done, so that a bad pointer
/// fails the call before it changes anything.
///
/// # Safety
/// `p` is NULL or points to memory writable as a `T` until the call returns.
#[inline]
pub(crate) unsafe fn out<T>(p: *mut T, what: &str) -> R<Out<T>> {
    let p = NonNull::new(p).ok_or_else(|| Fail::null(what))?;
    if !p.is_aligned() {
        return Err(Fail::invalid(format!("{what} is misaligned")));
    }
    Ok(Out(p))
}

/// An optional out-parameter: `None` for NULL (the caller does not want
/// the value), else checked as by [`out`] — before any work is done.
///
/// # Safety
/// As [`out`].
#[inline]
pub(crate) unsafe fn out_opt<T>(p: *mut T, what: &str) -> R<Option<Out<T>>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded from the caller.
    unsafe { out(p, what) }.map(Some)
}

/// Copies a `T` in from the caller.
///
/// # Safety
/// `p` is NULL or points to a readable, initialized `T` whose every bit
/// pattern is valid (plain integers, floats and pointers).
pub(crate) unsafe fn read_in<T: Copy>(p: *const T, what: &str) -> R<T> {
    let p = NonNull::new(p.cast_mut()).ok_or_else(|| Fail::null(what))?;
    if !p.is_aligned() {
        return Err(Fail::invalid(format!("{what} is misaligned")));
    }
    // SAFETY: non-NULL and aligned (checked); readable (the caller).
    Ok(unsafe { p.as_ptr().read() })
}

/// Copies in a versioned struct: its first field, a `u32`, is read first
/// and must be `version` (the struct's size in this library's layout), so
/// that a struct of another layout is refused before more of it is read;
/// `init` names the function that fills it.
///
/// # Safety
/// `p` is NULL or points to a readable, initialized `T` whose every bit
/// pattern is valid and whose first field is a `u32` (or, for a struct of
/// another layout, at least to that `u32`).
pub(crate) unsafe fn read_versioned<T: Copy>(
    p: *const T,
    version: u32,
    what: &str,
    init: &str,
) -> R<T> {
    // SAFETY: NULL or readable at least for its first field (the contract).
    let found = unsafe { read_in(p.cast::<u32>(), what) }?;
    if found != version {
        return Err(Fail::invalid(format!(
            "{what} version {found} is not {version}: fill the struct with {init} (a program \
             built against an older strata.h must be rebuilt)"
        )));
    }
    // SAFETY: a whole `T` of this layout (its version says so).
    unsafe { read_in(p, what) }
}

fn check_len(len: usize, what: &str) -> R<()> {
    if len > isize::MAX as usize {
        return Err(Fail::invalid(format!(
            "{what}: length {len} is larger than any object can be"
        )));
    }
    Ok(())
}

/// One array of a call as raw memory: its address, its length in
/// elements, and its name.
pub(crate) struct Region<'a>(usize, usize, &'a str);

/// `len` values of `T` at `p`, for [`disjoint`].
pub(crate) fn region<'a, T>(p: *const T, len: usize, what: &'a str) -> Region<'a> {
    Region(
        p as usize,
        len.saturating_mul(std::mem::size_of::<T>()),
        what,
    )
}

/// Refuses a call whose written arrays share memory with another of its
/// arrays: Rust would hold a `&mut` beside another reference to the same
/// bytes. Checked on the raw addresses, before any slice is made; NULL
/// and empty arrays take no memory.
pub(crate) fn disjoint(written: &[Region<'_>], read: &[Region<'_>]) -> R<()> {
    let span = |r: &Region<'_>| (r.0 != 0 && r.1 > 0).then(|| r.0..r.0.saturating_add(r.1));
    for (i, w) in written.iter().enumerate() {
        let Some(a) = span(w) else { continue };
        for o in written[i + 1..].iter().chain(read) {
            match span(o) {
                Some(b) if a.start < b.end && b.start < a.end => {
                    return Err(Fail::invalid(format!(
                        "{} and {} share memory: pass separate arrays",
                        w.2, o.2
                    )))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// The caller's bytes. A zero length never reads the pointer (NULL is fine).
///
/// # Safety
/// When `len > 0`, `p` is NULL or points to `len` readable bytes that no one
/// writes during the call.
#[inline]
pub(crate) unsafe fn bytes<'a>(p: *const c_void, len: usize, what: &str) -> R<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Fail::null(what));
    }
    check_len(len, what)?;
    // SAFETY: non-NULL and `len` fits an object (checked); readable and not
    // written meanwhile (the caller). Bytes need no alignment.
    Ok(unsafe { std::slice::from_raw_parts(p.cast(), len) })
}

/// The caller's writable bytes. A zero length never reads the pointer.
///
/// # Safety
/// When `len > 0`, `p` is NULL or points to `len` writable bytes that no
/// one else reads or writes during the call.
#[inline]
pub(crate) unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize, what: &str) -> R<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Fail::null(what));
    }
    check_len(len, what)?;
    // SAFETY: as in `bytes`, and the caller gives us exclusive access.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast(), len) })
}

/// The caller's writable array of `len` values. A zero length never reads
/// the pointer.
///
/// # Safety
/// When `len > 0`, `p` is NULL or points to `len` writable `T`s that no one
/// else reads or writes during the call.
pub(crate) unsafe fn slice_mut<'a, T: Copy>(p: *mut T, len: usize, what: &str) -> R<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Fail::null(what));
    }
    if p.align_offset(std::mem::align_of::<T>()) != 0 {
        return Err(Fail::invalid(format!("{what} is not aligned for its type")));
    }
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Fail::invalid(format!("{what}: {len} elements overflow")))
        .and_then(|b| check_len(b, what))?;
    // SAFETY: non-NULL, aligned, and `len` elements fit an object (checked);
    // writable and exclusively ours during the call (the caller).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// The caller's array of `len` values. A zero length never reads the
/// pointer.
///
/// # Safety
/// When `len > 0`, `p` is NULL or points to `len` readable `T`s that no one
/// writes during the call.
pub(crate) unsafe fn slice<'a, T: Copy>(p: *const T, len: usize, what: &str) -> R<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Fail::null(what));
    }
    if p.align_offset(std::mem::align_of::<T>()) != 0 {
        return Err(Fail::invalid(format!("{what} is not aligned for its type")));
    }
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Fail::invalid(format!("{what}: {len} elements overflow")))
        .and_then(|b| check_len(b, what))?;
    // SAFETY: non-NULL, aligned, `len` elements fit an object (checked);
    // readable and unchanged during the call (the caller).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The bytes of a NUL-terminated string, or `None` for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays unchanged
/// during the call.
pub(crate) unsafe fn c_str_bytes<'a>(p: *const c_char) -> Option<&'a [u8]> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated (the caller).
    Some(unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes())
}

/// A caller's buffer for a C string, checked before any work is done (see
/// [`text_out`]).
pub(crate) struct TextOut<'a> {
    dst: &'a mut [u8],
    null: bool,
}

/// Checks the caller's buffer `buf` of `cap` bytes for a C string: NULL is
/// fine only when `cap` is 0.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes that no one else reads or
/// writes until the call returns.
pub(crate) unsafe fn text_out<'a>(buf: *mut c_char, cap: usize, what: &str) -> R<TextOut<'a>> {
    // SAFETY: forwarded from the caller.
    let dst = unsafe { bytes_mut(buf.cast(), cap, what) }?;
    Ok(TextOut {
        dst,
        null: buf.is_null(),
    })
}

impl TextOut<'_> {
    /// Writes `text` and a NUL, truncating to fit: `STRATA_OK`, or
    /// `STRATA_ERR_BUFFER_TOO_SMALL` if it was truncated (or, with no room
    /// at all, not written).
    pub(crate) fn write(self, text: &[u8]) -> c_int {
        let Some(room) = self.dst.len().checked_sub(1) else {
            return if text.is_empty() && self.null {
                STRATA_OK
            } else {
                STRATA_ERR_BUFFER_TOO_SMALL
            };
        };
        let n = text.len().min(room);
        self.dst[..n].copy_from_slice(&text[..n]);
        self.dst[n] = 0;
        if n < text.len() {
            STRATA_ERR_BUFFER_TOO_SMALL
        } else {
            STRATA_OK
        }
    }
}

/// Copies `src` into the caller's array `dst` (checked beforehand with
/// [`slice_mut`]; as many as fit) and stores `src.len()` in `count`:
/// `STRATA_OK`, or `STRATA_ERR_BUFFER_TOO_SMALL` when `dst` is shorter.
pub(crate) fn copy_array<T: Copy>(src: &[T], dst: &mut [T], count: Out<usize>) -> c_int {
    let n = src.len().min(dst.len());
    dst[..n].copy_from_slice(&src[..n]);
    count.set(src.len());
    if n < src.len() {
        STRATA_ERR_BUFFER_TOO_SMALL
    } else {
        STRATA_OK
    }
}

/// A string handed to C, to be given back to [`string_from_raw`].
pub(crate) fn string_into_raw(s: CString) -> *mut c_char {
    s.into_raw()
}

/// Takes back a string made by [`string_into_raw`].
///
/// # Safety
/// `p` came from [`string_into_raw`] and has not been taken back yet (the
/// caller checks this against its registry of live strings).
pub(crate) unsafe fn string_from_raw(p: *mut c_char) -> CString {
    // SAFETY: forwarded from the caller.
    unsafe { CString::from_raw(p) }
}

/// A box handed to C.
pub(crate) fn box_into_raw<T>(b: Box<T>) -> *mut T {
    Box::into_raw(b)
}

/// Takes back a box made by [`box_into_raw`].
///
/// # Safety
/// `p` came from [`box_into_raw`] for the same `T` and has not been taken
/// back yet (the caller checks this against its registry).
pub(crate) unsafe fn box_from_raw<T>(p: *mut T) -> Box<T> {
    // SAFETY: forwarded from the caller.
    unsafe { Box::from_raw(p) }
}

/// An address as a pointer for C (a DLPack tensor's data).
pub(crate) fn address_ptr(address: u64) -> *mut c_void {
    // The address is one strata's own stores handed out: host memory of a
    // live arena, or device memory (never dereferenced on this side).
    std::ptr::with_exposed_provenance_mut(address as usize)
}
