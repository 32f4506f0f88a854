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
//! The files, top down: this one opens a backend (and probes GPUs); the
//! backends (`sim.rs`, `cuda/`) and the runtime's device arrays
//! (`arrays.rs`: page-table words, access counters) build on `traits.rs`,
//! which says what a backend and its memory are.
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
mod arrays;
pub mod sim;
mod traits;

use std::sync::Arc;

use crate::error::{ErrorKind, Result};
use crate::link::LinkModel;

pub use arrays::{DeviceCounters, DeviceWords};
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
pub use traits::{
    BackendKind, DeviceBackend, DeviceChoice, DeviceMemory, GpuInfo, HostRegistration,
};

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
        Err(traits::no_device(
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
            // A GPU was found but could not be opened (held by another
            // process, out of memory): the simulated device, at its own
            // default size where the cap was the GPU's to decide.
            Err(e) if e.kind() == ErrorKind::NoDevice => {
                let cap = if capacity_cap == u64::MAX {
                    sim::DEFAULT_CAPACITY
                } else {
                    capacity_cap
                };
                Ok(Arc::new(sim::SimBackend::new(cap, sim_link)?))
            }
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
        Err(traits::no_device(
            "strata was built without the cuda feature",
        ))
    }
}
