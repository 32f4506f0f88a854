//! One error type for the whole crate: a flat [`ErrorKind`], a message and an
//! optional source. Each kind maps one-to-one onto a C status code whose
//! numeric value is fixed forever (see [`ErrorKind::code`]).

use std::fmt;
use std::io;
use std::sync::Arc;

/// What went wrong, coarsely enough that a caller can act on it.
///
/// The discriminants are the C ABI status codes (negated there); never reuse
/// or renumber one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A parameter or input was malformed or out of range.
    InvalidArgument = 1,
    /// No GPU (or no CUDA driver library) is available.
    NoDevice = 2,
    /// A tier (or every tier) is full.
    OutOfCapacity = 3,
    /// An I/O operation failed (EIO and friends).
    Io = 4,
    /// The storage medium ran out of space (ENOSPC).
    NoSpace = 5,
    /// Data read back does not match its checksum.
    Corrupted = 6,
    /// The operation is not supported here (e.g. O_DIRECT on tmpfs).
    Unsupported = 7,
    /// The object was closed or shut down.
    Closed = 8,
    /// A path or object does not exist.
    NotFound = 9,
    /// Permission denied by the operating system.
    PermissionDenied = 10,
}

impl ErrorKind {
    /// The stable numeric code of this kind (the C status is its negation).
    pub fn code(self) -> i32 {
        self as i32
    }

    /// A short lowercase name, stable across releases.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NoDevice => "no device",
            ErrorKind::OutOfCapacity => "out of capacity",
            ErrorKind::Io => "i/o error",
            ErrorKind::NoSpace => "no space left",
            ErrorKind::Corrupted => "corrupted",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Closed => "closed",
            ErrorKind::NotFound => "not found",
            ErrorKind::PermissionDenied => "permission denied",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The crate's error: a kind, a one-line message naming the problem, and the
/// operating-system error behind it where there is one.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Arc<io::Error>>,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An [`ErrorKind::InvalidArgument`] error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// Wraps an operating-system error, choosing the kind from its errno and
    /// prefixing `context` (what was being done) to the message.
    pub fn io(context: impl fmt::Display, err: io::Error) -> Self {
        let kind = kind_of_io(&err);
        Self {
            kind,
            message: format!("{context}: {err}"),
            source: Some(Arc::new(err)),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The one-line message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The raw OS error number behind this error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source.as_ref().and_then(|e| e.raw_os_error())
    }

    /// The same error with `context` prefixed to its message.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

fn kind_of_io(err: &io::Error) -> ErrorKind {
    match err.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => ErrorKind::NotFound,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => ErrorKind::PermissionDenied,
        Some(libc::ENOMEM) => ErrorKind::OutOfCapacity,
        Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => ErrorKind::Unsupported,
        _ => match err.kind() {
            io::ErrorKind::NotFound => ErrorKind::NotFound,
            io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            io::ErrorKind::InvalidInput => ErrorKind::InvalidArgument,
            _ => ErrorKind::Io,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_kind() {
        let e = Error::io("writing page 3", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(e.message().starts_with("writing page 3: "));
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let e = Error::io("reading", io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(e.kind(), ErrorKind::Io);
        for (errno, kind) in [
            (libc::EDQUOT, ErrorKind::NoSpace),
            (libc::ENOENT, ErrorKind::NotFound),
            (libc::ENOTDIR, ErrorKind::NotFound),
            (libc::EACCES, ErrorKind::PermissionDenied),
            (libc::EPERM, ErrorKind::PermissionDenied),
            (libc::EROFS, ErrorKind::PermissionDenied),
            (libc::ENOMEM, ErrorKind::OutOfCapacity),
            (libc::ENOSYS, ErrorKind::Unsupported),
            (libc::EOPNOTSUPP, ErrorKind::Unsupported),
        ] {
            let e = Error::io("x", io::Error::from_raw_os_error(errno));
            assert_eq!(e.kind(), kind, "errno {errno}");
        }
    }

    #[test]
    fn codes_are_fixed() {
        // These numbers are part of the C ABI: changing one is a breaking change.
        let kinds = [
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
        for (k, code) in kinds.into_iter().zip(1..) {
            assert_eq!(k.code(), code, "{k}");
        }
    }
}
