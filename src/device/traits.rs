//! What a device is: the [`DeviceBackend`] trait that owns device memory
//! and the links to it, the [`DeviceMemory`] it hands out, and the types
//! they speak. The backends (`sim.rs`, `cuda/`) implement these; `mod.rs`
//! opens one.

use std::ptr::NonNull;

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::link::{LinkModel, LinkStats};

/// One GPU as `strata info` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
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

/// A `NoDevice` error: no driver, no GPU, or no `cuda` feature.
pub(crate) fn no_device(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::NoDevice, why)
}

/// Which backend a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Host memory behind a link model (no GPU).
    Sim,
    /// A CUDA GPU.
    Cuda,
}

impl BackendKind {
    /// How reports name the backend: "simulated" or "cuda".
    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Sim => "simulated",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Which backend to open: `auto` is cuda where a GPU is present, else sim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// cuda where a GPU is present, else sim.
    #[default]
    Auto,
    /// A CUDA GPU, or `NoDevice`.
    Cuda,
    /// The simulated device.
    Sim,
}

impl std::str::FromStr for DeviceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cuda" => Ok(Self::Cuda),
            "sim" => Ok(Self::Sim),
            _ => Err(Error::invalid(format!(
                "unknown device {s:?} (use auto, cuda or sim)"
            ))),
        }
    }
}

/// A device backend: it owns device memory and the links to it.
pub trait DeviceBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// One line for reports.
    fn description(&self) -> String;
    /// Device memory strata may use, in bytes.
    fn capacity(&self) -> u64;
    /// One allocation of `bytes` of device memory.
    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>>;
    /// What crossed the host→device and device→host links so far.
    fn link_stats(&self) -> (LinkStats, LinkStats);
    /// The host↔device link a simulated backend accounts its copies with
    /// (`None` for a real GPU, whose copies are measured, not modelled).
    fn link_model(&self) -> Option<LinkModel> {
        None
    }
    /// Makes `len` bytes of host memory at `base` addressable by kernels
    /// (zero-copy) and a valid source or target of asynchronous copies:
    /// `cuMemHostRegister` on cuda. `None` where kernels read host memory
    /// as it is (the simulated device).
    ///
    /// # Safety
    /// `base..base+len` is mapped for as long as the returned registration
    /// lives (the guard unregisters on drop).
    unsafe fn register_host(
        &self,
        base: NonNull<u8>,
        len: usize,
    ) -> Result<Option<HostRegistration>>;
}

/// Host memory registered with a device backend; unregistered on drop.
pub struct HostRegistration {
    /// The device address of the registered range's first byte.
    pub device_base: u64,
    /// Unregisters on drop.
    pub guard: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostRegistration({:#x})", self.device_base)
    }
}

/// One allocation of device memory.
pub trait DeviceMemory: Send + Sync {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Always false: allocations are never empty.
    fn is_empty(&self) -> bool {
        false
    }
    /// The device address of byte `offset` (what kernels dereference).
    fn device_address(&self, offset: usize) -> u64;
    /// Copies `src` to device memory at `offset`; complete on return.
    ///
    /// # Safety
    /// `offset + src.len() <= self.len()`, and the caller has exclusive use
    /// of that range for the duration of the call.
    unsafe fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies device memory at `offset` into `dst`; complete on return.
    ///
    /// # Safety
    /// `offset + dst.len() <= self.len()`, and no one writes that range for
    /// the duration of the call.
    unsafe fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Several host→device copies issued together and waited for once (on
    /// a GPU: queued on the copy stream back to back, so the per-copy
    /// launch latency overlaps the transfers); complete on return.
    ///
    /// # Safety
    /// As [`copy_in`](Self::copy_in), for every `(offset, src)`; the ranges
    /// do not overlap.
    unsafe fn copy_in_many(&self, copies: &[(usize, &[u8])]) -> Result<()> {
        for &(offset, src) in copies {
            // SAFETY: the caller's contract, per copy.
            unsafe { self.copy_in(offset, src)? };
        }
        Ok(())
    }
    /// The host memory behind the allocation, byte 0 at its base, where it
    /// has one (the simulated device's arena; `None` on a GPU): a read may
    /// land there directly ([`record_h2d`](Self::record_h2d) accounts it).
    fn host_arena(&self) -> Option<std::sync::Arc<crate::sys::Arena>> {
        None
    }
    /// Accounts `bytes` that reached the allocation by a direct read into
    /// [`host_arena`](Self::host_arena), taking `wall`, as crossing the
    /// host→device link.
    fn record_h2d(&self, _bytes: usize, _wall: std::time::Duration) {}
    /// Backs the whole allocation with memory now. A GPU's allocation
    /// always is (nothing to do); the simulated device's host arena is
    /// otherwise backed page by page at first touch.
    fn commit(&self) {}
    /// Several device→host copies issued together and waited for once.
    ///
    /// # Safety
    /// As [`copy_out`](Self::copy_out), for every `(offset, dst)`.
    unsafe fn copy_out_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<()> {
        for (offset, dst) in copies.iter_mut() {
            // SAFETY: the caller's contract, per copy.
            unsafe { self.copy_out(*offset, dst)? };
        }
        Ok(())
    }
}

impl std::fmt::Debug for dyn DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory({} bytes)", self.len())
    }
}
