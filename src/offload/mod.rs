//! Offloading modules built on the runtime: each keeps its data in runtime
//! buffers, moved by the runtime's one migration engine.
//!
//! | file | what |
//! |------|------|
//! | `embedding/` | [`embedding::EmbeddingTable`]: an embedding table's rows in a buffer; pooled gathers (sum, mean, per-sample weights), fused SGD and row-wise Adagrad, parallel page reads |
//! | `moe.rs` | [`moe::ExpertCache`]: MoE experts in host/NVMe, a fixed number of device slots, router lookahead prefetch; the synthetic router of `strata bench moe` |
//! | `reuse.rs` | the expert cache's reuse estimate: each expert's chance of use at its layer's next visit over the layers until then |
//! | `optim/` | [`optim::OffloadedAdam`]: Adam/AdamW with fp32 master weights and moments in host, CXL or NVMe, streamed in chunks through a runtime (its own or the caller's); the arithmetic is [`crate::adam`]'s |
//!
//! All three are wrapped by the C ABI (`ffi/`) and the Python package
//! (`python/`); the optimizer's update runs on the CPU or, with the `cuda`
//! feature, on a GPU (`kernels/adam.cu`).
#![forbid(unsafe_code)]

pub mod embedding;
pub mod moe;
pub mod optim;
mod reuse;
