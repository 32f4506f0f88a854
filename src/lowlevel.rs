//! The machinery under the runtime, public so that strata's own benchmarks
//! (`strata-bench`), tests and tools can measure or drive one layer alone:
//! the slot allocator, raw I/O queues and sessions, arenas, link throttles,
//! device words and counters.
//!
//! **Not part of the stable API.** Items here change with the
//! implementation in any release, wherever they are reached from: some
//! (the device words and counters, link counters and throttles, the
//! filesystem probes) are also reachable under the module that defines
//! them, and the traits for plugging in an engine or a device backend
//! ([`IoEngine`](crate::io::IoEngine), `device::DeviceBackend`) name
//! types from here — implementing those traits is outside the promise
//! too. Programs using strata need [`Runtime`](crate::Runtime) and
//! [`Buffer`](crate::Buffer), the tier stores in [`tier`](crate::tier),
//! and the engines in [`io`](crate::io) as [`io::engine`](crate::io::engine)
//! returns them.

pub use crate::device::sim::PCIE_GEN4_X16;
pub use crate::device::{DeviceCounters, DeviceMemory, DeviceWords, HostRegistration};
pub use crate::io::buf::BufPool;
pub use crate::io::raw::{RawOp, RawQueue};
pub use crate::link::{LinkCounter, Throttle};
pub use crate::sys::arena::{Arena, ARENA_ALIGN};
pub use crate::sys::{fs_free_bytes, process_cpu_time};
pub use crate::tier::cxl::local_memcpy_bandwidth;
pub use crate::tier::host::ArenaRegistrar;
pub use crate::tier::nvme::{NvmeCompletion, NvmeSession, Rejected};
pub use crate::tier::slots::SlotAllocator;

/// The optimizer's CUDA update (`kernels/adam.cu`).
#[cfg(feature = "cuda")]
pub mod cuda_adam {
    pub use crate::device::cuda_adam::{Chunk, CudaAdam, ENTRY_POINTS, TILE};
}
/// The access-counter harvest on the GPU (`kernels/hotness.cu`).
#[cfg(feature = "cuda")]
pub mod cuda_hotness {
    pub use crate::device::cuda_hotness::{CudaHotness, ENTRY_POINTS};
}
