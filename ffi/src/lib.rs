//! The C ABI of strata (`include/strata.h`). Every function here is thin:
//! the logic lives in the `strata` crate. This crate grows with the C-ABI
//! issue; today it carries the status codes and their descriptions.

use std::ffi::{c_char, c_int};

use strata::ErrorKind;

/// Success.
pub const STRATA_OK: c_int = 0;

/// The C status of an error kind: the kind's fixed code, negated.
pub fn status_of(kind: ErrorKind) -> c_int {
    -kind.code()
}

#[cfg(test)]
const KINDS: [ErrorKind; 10] = [
    ErrorKind::InvalidArgument,
    ErrorKind::NoDevice,
    ErrorKind::OutOfCapacity,
    ErrorKind::Io,
    ErrorKind::NoSpace,
    ErrorKind::Corrupted,
    ErrorKind::Unsupported,
    ErrorKind::Closed,
    ErrorKind::NotFound,
    ErrorKind::PermissionDenied,
];

/// The library version as a NUL-terminated string with static lifetime.
/// Thread-safe; the caller must not free it.
#[no_mangle]
pub extern "C" fn strata_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A static, NUL-terminated description of a status code ("ok", "i/o error",
/// …; "unknown status" for a value strata never returns). Thread-safe; the
/// caller must not free it.
#[no_mangle]
pub extern "C" fn strata_status_string(status: c_int) -> *const c_char {
    const NAMES: [&str; 11] = [
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
    let name = status
        .checked_neg()
        .and_then(|i| usize::try_from(i).ok())
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("unknown status\0");
    name.as_ptr().cast()
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
        assert_eq!(s(strata_status_string(STRATA_OK)), "ok");
        for kind in KINDS {
            assert_eq!(s(strata_status_string(status_of(kind))), kind.name());
        }
        assert_eq!(s(strata_status_string(5)), "unknown status");
        assert_eq!(s(strata_status_string(c_int::MIN)), "unknown status");
        assert_eq!(s(strata_version()), env!("CARGO_PKG_VERSION"));
    }
}
