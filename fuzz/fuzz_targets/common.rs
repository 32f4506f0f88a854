//! What both fuzz targets check of every C-ABI status.

use std::ffi::CStr;

use strata_ffi::*;

const DOCUMENTED: [i32; 16] = [
    STRATA_OK,
    STRATA_PENDING,
    STRATA_ERR_INVALID_ARGUMENT,
    STRATA_ERR_NO_DEVICE,
    STRATA_ERR_OUT_OF_CAPACITY,
    STRATA_ERR_IO,
    STRATA_ERR_NO_SPACE,
    STRATA_ERR_CORRUPTED,
    STRATA_ERR_UNSUPPORTED,
    STRATA_ERR_CLOSED,
    STRATA_ERR_NOT_FOUND,
    STRATA_ERR_PERMISSION_DENIED,
    STRATA_ERR_INVALID_HANDLE,
    STRATA_ERR_NULL_POINTER,
    STRATA_ERR_BUFFER_TOO_SMALL,
    STRATA_ERR_PANIC,
];

/// Checks a status: documented, never a panic, and explained when it fails.
pub fn st(status: i32) -> i32 {
    assert!(DOCUMENTED.contains(&status), "undocumented status {status}");
    // SAFETY: strata_last_error returns a NUL-terminated string valid until
    // the next strata call on this thread; it is read at once.
    let message = unsafe { CStr::from_ptr(strata_last_error()) }.to_string_lossy();
    assert_ne!(status, STRATA_ERR_PANIC, "panic: {message}");
    if status < 0 {
        assert!(!message.is_empty(), "status {status} without a message");
    }
    status
}

/// Threads of this process (the runtimes' workers end shortly after their
/// last handle goes; the targets wait for them before the leak check).
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}
