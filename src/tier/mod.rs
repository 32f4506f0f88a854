//! Tier stores: slot allocators over a medium, one file per medium.
//!
//! | tier   | store               | medium                                            |
//! |--------|---------------------|---------------------------------------------------|
//! | Device | [`DeviceStore`]     | GPU memory, or host memory on the simulated device |
//! | Host   | [`HostStore`]       | an mmap arena in DRAM, THP, optionally NUMA-bound |
//! | Cxl    | [`CxlStore`]        | a HostStore on a CPU-less NUMA node, or emulated  |
//! | Nvme   | [`NvmeStore`]       | an O_DIRECT file or block device over an IoEngine |

pub(crate) mod cxl;
pub(crate) mod device;
pub(crate) mod host;
pub(crate) mod nvme;
pub(crate) mod slots;
mod store;

pub use crate::link::LinkModel;
pub use cxl::{
    CxlBacking, CxlConfig, CxlMode, CxlStore, CXL_DEFAULT_BANDWIDTH_FRACTION,
    CXL_DEFAULT_LATENCY_NS,
};
pub use device::DeviceStore;
pub use host::{HostConfig, HostStore};
pub use nvme::{NvmeConfig, NvmeStats, NvmeStore};
pub use slots::Slot;
pub use store::{PageStore, Tier};
