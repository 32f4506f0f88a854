//! How the CUDA layer reports failures: a driver call's as `Io`, an
//! allocation's as `OutOfCapacity`, a missing driver or GPU as `NoDevice`.

use cudarc::driver::DriverError;

pub(crate) use crate::device::traits::no_device;

use crate::error::{Error, ErrorKind};

/// A failed driver call `call`, as an `Io` error.
pub(super) fn driver(call: &str, e: DriverError) -> Error {
    Error::new(ErrorKind::Io, format!("{call} failed: {e:?}"))
}

/// A failed allocation, as `OutOfCapacity`.
pub(super) fn alloc_failed(what: &str, bytes: usize, e: DriverError) -> Error {
    Error::new(
        ErrorKind::OutOfCapacity,
        format!("{what}({bytes}) failed: {e:?}"),
    )
}

/// `len` elements of `T` in bytes, or `InvalidArgument` on overflow.
pub(super) fn bytes_of<T>(len: usize) -> crate::error::Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::invalid(format!("a buffer of {len} elements is too large")))
}
