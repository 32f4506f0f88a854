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
//!  Device backends: cuda | sim (link model)             src/device/
//!    safe CUDA layer: context, streams, kernels         cuda/
//!  OS layer: arenas, NUMA topology, memory tiers        src/sys/
//!  Runtime: buffers, page table, mover, reclaim, maps   src/runtime/
//!  Placement policies (pure: no I/O, no unsafe)         src/policy/
//!    lru (UVM-like) | lfu | gmt | lookahead | lrfu | belady | default (W-TinyLFU)
//!    references: arc | s3fifo | sieve | perfect-lfu | lfu-admission
//!  The machinery under it all, outside the stable API  src/lowlevel.rs
//!  Page-access traces: format, replay                   src/trace.rs, policy/replay.rs
//!  Offloading: MoE expert cache, offloaded Adam, embeddings  src/offload/
//! ```
//!
//! | cargo feature | what it adds |
//! |---------------|--------------|
//! | `cuda` | the CUDA backend and its safe layer (`device::cuda`), loading `libcuda` and `libnvrtc` at run time (builds without a toolkit) |
//!
//! ```
//! use strata::{Placement, Runtime, Tier};
//!
//! // 1 MiB of (simulated, on a machine without a GPU) device memory, 8 MiB
//! // of host DRAM; a 4 MiB buffer is larger than the device.
//! let rt = Runtime::builder()
//!     .device(strata::DeviceChoice::Sim, 1 << 20)
//!     .host(8 << 20)
//!     .build()?;
//! let buf = rt.alloc_with(4 << 20, Placement::Prefer(Tier::Device))?;
//! buf.write_as(0, &vec![1.5f32; 1 << 20])?; // 4 MiB: spills into DRAM
//! buf.prefetch(0..buf.len(), Tier::Host).wait()?;
//! let mut back = [0f32; 4];
//! buf.read_as(0, &mut back)?;
//! assert_eq!(back, [1.5; 4]);
//! assert!(buf.residency().in_tier(Tier::Host) >= 1);
//! # Ok::<(), strata::Error>(())
//! ```
//!
//! The crate root re-exports what a program needs; the modules below hold
//! the rest of the public API (per-tier configs and stores in [`tier`], I/O
//! engines in [`io`], policies in [`policy`], offloading in [`offload`]).
//! [`lowlevel`] is the machinery under the runtime, public for strata's own
//! benchmarks and tests and outside the stable API.

pub mod adam;
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

pub use config::Config;
pub use device::{BackendKind, DeviceChoice};
pub use error::{Error, ErrorKind, Result};
pub use io::EngineChoice;
pub use policy::PolicyKind;
pub use runtime::{
    Access, BalanceReport, BalancerConfig, Buffer, DeviceMap, Launch, Pin, Placement, Residency,
    Runtime, RuntimeBuilder, Stats, Ticket, View, ViewMut, Watermarks,
};
pub use tier::{CxlConfig, CxlMode, HostConfig, NvmeConfig, Tier};

// What users share across threads is shareable.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    const fn send<T: Send>() {}
    send_sync::<Runtime>();
    send_sync::<Buffer>();
    send_sync::<Ticket>();
    send_sync::<DeviceMap>();
    send_sync::<Error>();
    send_sync::<offload::moe::ExpertCache>();
    // Stepped through `&mut`: moves between threads, is not shared.
    send::<offload::optim::OffloadedAdam>();
};

// The README's Rust example, compiled and run by `cargo test --doc` (its
// other code blocks are marked sh, c, python or toml, which rustdoc skips),
// so the first example a reader copies keeps working.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
