//! Device backends behind one trait, chosen at run time:
//!
//! - **cuda** (cargo feature `cuda`, module `cuda`): the driver is loaded at
//!   run time, so the feature builds without a CUDA toolkit; where the
//!   driver library is missing every entry point reports `NoDevice`.
//!   `cuda` is the one safe layer over the driver and NVRTC (context,
//!   streams, events, device and pinned buffers, modules and launches)
//!   that the backend, the kernels and the bench's graph kernels use.
//! - **sim** ([`sim`]): host memory under a capacity budget behind a link
//!   model that accounts modelled time beside wall time. Reports call it
//!   "simulated".
//!
//! [`DeviceStore`](crate::tier::DeviceStore) puts page slots on either.
//!
//! CUDA kernels (`kernels/*.cu`) are compiled at run time by
//! `cuda::nvrtc` (one set of options for all) and launched by
//! `cuda/hotness.rs` (the access-counter harvest) and `cuda/adam.rs` (the
//! offloaded Adam update).

#[cfg(feature = "cuda")]
pub mod cuda;
// The paths the runtime and the optimizer have always used.
#[cfg(feature = "cuda")]
pub(crate) use cuda::adam as cuda_adam;
#[cfg(feature = "cuda")]
pub(crate) use cuda::hotness as cuda_hotness;
#[cfg(feature = "cuda")]
pub use cuda::nvrtc;
pub mod sim;

use std::ptr::NonNull;
use std::sync::Arc;

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::link::{LinkModel, LinkStats};

#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;

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

/// NVRTC's (major, minor) version where the library loads; `None` where
/// it does not, or without the `cuda` feature.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    #[cfg(feature = "cuda")]
    {
        nvrtc::version()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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

/// Opens the backend `choice` asks for. `capacity_cap` sizes the simulated
/// device (and caps a real one, to emulate a smaller GPU); a simulated
/// device models [`sim::PCIE_GEN4_X16`].
pub fn open(choice: DeviceChoice, capacity_cap: u64) -> Result<Arc<dyn DeviceBackend>> {
    open_with_link(choice, capacity_cap, sim::PCIE_GEN4_X16)
}

/// [`open`], a simulated device modelling `sim_link` (a real GPU ignores
/// it).
pub fn open_with_link(
    choice: DeviceChoice,
    capacity_cap: u64,
    sim_link: LinkModel,
) -> Result<Arc<dyn DeviceBackend>> {
    let sim = || -> Result<Arc<dyn DeviceBackend>> {
        Ok(Arc::new(sim::SimBackend::new(capacity_cap, sim_link)?))
    };
    match choice {
        DeviceChoice::Sim => sim(),
        DeviceChoice::Cuda => open_cuda(capacity_cap),
        DeviceChoice::Auto => match open_cuda(capacity_cap) {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == ErrorKind::NoDevice => sim(),
            Err(e) => Err(e),
        },
    }
}

fn open_cuda(capacity_cap: u64) -> Result<Arc<dyn DeviceBackend>> {
    #[cfg(feature = "cuda")]
    {
        Ok(Arc::new(cuda::CudaBackend::new(0, capacity_cap)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = capacity_cap;
        Err(Error::new(
            ErrorKind::NoDevice,
            "strata was built without the cuda feature",
        ))
    }
}

/// `len` elements of `size` bytes of `backend`'s memory (at least one),
/// and its device address.
fn device_array(
    backend: &dyn DeviceBackend,
    len: usize,
    size: usize,
    what: &str,
) -> Result<(Box<dyn DeviceMemory>, u64)> {
    let bytes = len
        .checked_mul(size)
        .filter(|&b| b > 0)
        .ok_or_else(|| Error::invalid(format!("a device array of {len} {what}")))?;
    let memory = backend.alloc(bytes)?;
    if memory.len() < bytes {
        return Err(Error::invalid("device allocation shorter than asked"));
    }
    let address = memory.device_address(0);
    Ok((memory, address))
}

/// An array of 64-bit words in device memory that the host updates one
/// word at a time while kernels may read it (a device map on a GPU).
/// Host-side writes are serialized; kernels' reads are outside Rust's view.
pub struct DeviceWords {
    memory: parking_lot::Mutex<Box<dyn DeviceMemory>>,
    len: usize,
    address: u64,
}

impl std::fmt::Debug for DeviceWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceWords({} at {:#x})", self.len, self.address)
    }
}

impl DeviceWords {
    /// `len` words of `backend`'s memory.
    pub fn new(backend: &dyn DeviceBackend, len: usize) -> Result<Self> {
        let (memory, address) = device_array(backend, len, 8, "words")?;
        Ok(Self {
            memory: parking_lot::Mutex::new(memory),
            len,
            address,
        })
    }

    /// The device address of word 0.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Writes word `i`.
    pub fn set(&self, i: usize, value: u64) -> Result<()> {
        self.upload(i, &[value])
    }

    /// Writes `values` from word `at` on.
    pub fn upload(&self, at: usize, values: &[u64]) -> Result<()> {
        if at
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::invalid(format!(
                "words {at}+{} exceed the array's {}",
                values.len(),
                self.len
            )));
        }
        let memory = self.memory.lock();
        // SAFETY: the range is inside the allocation (checked above, and the
        // allocation is at least `len * 8` bytes); host-side writers are
        // serialized by the lock, and nothing on the host reads the range.
        unsafe { memory.copy_in(at * 8, bytemuck::cast_slice(values)) }
    }
}

/// A buffer's access counters in device memory (one u32 per page) for
/// CUDA kernels to bump (`strata_touch` / `strata_load` in
/// `include/strata_device.cuh`); the host drains them into the runtime's
/// counters when the buffer's launches end.
pub struct DeviceCounters {
    memory: parking_lot::Mutex<Box<dyn DeviceMemory>>,
    len: usize,
    address: u64,
}

impl std::fmt::Debug for DeviceCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceCounters({} at {:#x})", self.len, self.address)
    }
}

impl DeviceCounters {
    /// `len` counters of `backend`'s memory, zeroed.
    pub fn new(backend: &dyn DeviceBackend, len: usize) -> Result<Self> {
        let (memory, address) = device_array(backend, len, 4, "counters")?;
        let c = Self {
            memory: parking_lot::Mutex::new(memory),
            len,
            address,
        };
        c.zero()?;
        Ok(c)
    }

    /// The device address of counter 0.
    pub fn address(&self) -> u64 {
        self.address
    }

    fn zero(&self) -> Result<()> {
        Self::zero_locked(&**self.memory.lock(), self.len)
    }

    fn zero_locked(memory: &dyn DeviceMemory, len: usize) -> Result<()> {
        let zeros = vec![0u8; len * 4];
        // SAFETY: the range is the allocation's first `len * 4` bytes
        // (checked in `new`); host-side access is serialized by the lock
        // the caller holds.
        unsafe { memory.copy_in(0, &zeros) }
    }

    /// Reads the counts and sets them back to zero. Counts a kernel adds
    /// between the read and the reset are lost (call it when no kernel
    /// runs; they are access samples, never data). Two drains never both
    /// return the same counts: the read and the reset are one step under
    /// the lock.
    pub fn drain(&self) -> Result<Vec<u32>> {
        let mut counts = vec![0u32; self.len];
        let memory = self.memory.lock();
        // SAFETY: as in `zero_locked`; the destination is a host vector of
        // exactly `len * 4` bytes.
        unsafe { memory.copy_out(0, bytemuck::cast_slice_mut(&mut counts))? };
        if counts.iter().any(|&c| c != 0) {
            Self::zero_locked(&**memory, self.len)?;
        }
        Ok(counts)
    }
}

impl std::fmt::Debug for dyn DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// The drain at the end of a buffer's last launch: counts come back once,
    /// the counters read zero afterwards (on the simulated device the
    /// counters' address is host memory, so a "kernel" bumps them directly).
    #[test]
    fn device_counters_start_at_zero_and_a_drain_resets_them() {
        let sim = sim::SimBackend::new(1 << 20, sim::PCIE_GEN4_X16).unwrap();
        let c = DeviceCounters::new(&sim, 5).unwrap();
        assert_eq!(c.drain().unwrap(), [0; 5]);
        let counters = c.address() as *const AtomicU32;
        for (page, n) in [(0usize, 3u32), (4, 1), (0, 2)] {
            // SAFETY: `page` < 5 counters, 4-byte aligned host memory that
            // lives as long as `c`; only atomics touch it meanwhile.
            unsafe { &*counters.add(page) }.fetch_add(n, Ordering::Relaxed);
        }
        assert_eq!(c.drain().unwrap(), [5, 0, 0, 0, 1]);
        assert_eq!(c.drain().unwrap(), [0; 5]);
        assert_eq!(
            DeviceCounters::new(&sim, 0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
