//! Device backends. This part: finding out whether a GPU is here.
//!
//! With the `cuda` feature, cudarc loads `libcuda` at run time. cudarc
//! panics on the first driver call when the library is missing, so
//! [`probe_gpus`] checks for it first and reports `NoDevice` instead.

#[cfg(feature = "cuda")]
mod cuda;

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};

/// One GPU as `strata info` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// Total device memory, bytes.
    pub memory_bytes: u64,
    /// Compute capability, e.g. "9.0".
    pub compute_capability: String,
}

/// The GPUs visible through the CUDA driver; `NoDevice` (with the reason)
/// when there are none, the driver library is missing, or strata was built
/// without the `cuda` feature.
pub fn probe_gpus() -> Result<Vec<GpuInfo>> {
    #[cfg(feature = "cuda")]
    {
        cuda::probe_gpus()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::new(
            ErrorKind::NoDevice,
            "strata was built without the cuda feature",
        ))
    }
}

#[allow(dead_code)]
pub(crate) fn no_device(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::NoDevice, why)
}
