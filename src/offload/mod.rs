//! Offloading modules built on the runtime (design §5).
//!
//! | file | what |
//! |------|------|
//! | `moe.rs` | [`moe::ExpertCache`]: MoE experts in host/NVMe, a fixed number of device slots, router lookahead prefetch; the synthetic router of `strata bench moe` |
//! | `optim.rs` | [`optim::OffloadedAdam`]: Adam/AdamW with fp32 master weights and moments in host, CXL or NVMe, streamed in chunks |
//!
//! Both are Rust APIs here; a C ABI for them is not part of this module
//! (the `ffi/` crate would wrap them), and there is no CUDA update kernel
//! yet: the optimizer update runs on the CPU.
#![forbid(unsafe_code)]

pub mod moe;
pub mod optim;
