//! # strata
//!
//! A memory-tiering runtime for GPU programs whose data does not fit in GPU
//! memory. Every page of an allocation lives in one of four tiers — GPU
//! memory, host DRAM, CXL memory, NVMe — and moves between them as it
//! warms and cools.
//!
//! ```text
//!  Tier stores (slot allocators over a medium)          src/tier/
//!    DeviceStore ─ GPU memory (cuda) or simulated       device.rs
//!    HostStore ─ mmap arena, THP, NUMA-bound (mbind)    host.rs
//!    CxlStore  ─ HostStore on a CPU-less node, or emulated   cxl.rs
//!    NvmeStore ─ O_DIRECT file/device, XXH3 per page    nvme.rs
//!  I/O engines: io_uring | psync, under one retrying queue   src/io/
//!  Device backends: cuda (cudarc) | sim (link model)    src/device/
//!  OS layer: arenas, NUMA topology, memory tiers        src/sys/
//!  Placement policies (pure: no I/O, no unsafe)         src/policy/
//!    lru (UVM-like) | lfu | gmt | lookahead | belady | default (W-TinyLFU)
//!  Page-access traces: format, replay                   src/trace.rs, policy/replay.rs
//!  Offloading: MoE expert cache, offloaded Adam         src/offload/
//! ```
//!
//! | cargo feature | what it adds |
//! |---------------|--------------|
//! | `cuda` | the CUDA backend via cudarc, loading `libcuda` at run time (builds without a toolkit) |
//!
//! ```
//! use strata::tier::{HostConfig, HostStore, PageStore};
//! let store = HostStore::new(&HostConfig::new(1 << 20, 64 << 10))?;
//! let mut slot = store.alloc()?;
//! store.write_page(&mut slot, &vec![7u8; 64 << 10])?;
//! assert_eq!(store.bytes(&slot)?[0], 7);
//! store.free(slot)?;
//! # Ok::<(), strata::Error>(())
//! ```

pub mod config;
pub mod device;
pub mod error;
pub mod hotness;
pub mod info;
pub mod io;
pub mod link;
pub mod lowlevel;
pub mod offload;
pub mod policy;
pub mod runtime;
pub mod size;
pub mod sys;
pub mod tier;
pub mod trace;

pub use error::{Error, ErrorKind, Result};
pub use runtime::{Buffer, Runtime};
pub use tier::Tier;
