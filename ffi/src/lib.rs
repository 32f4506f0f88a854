//! The C ABI of strata (`include/strata.h`, generated from this crate by
//! cbindgen). Every `extern "C"` function is thin: it validates what C
//! passed, looks up handles, calls the `strata` crate, and turns the result
//! into a status. `libstrata.so`/`.a` are built from this crate by the
//! artifact crate in `ffi/cdylib`.
//!
//! | file | what |
//! |------|------|
//! | `status.rs` | status codes, `strata_status_string`, the per-thread last error, the panic boundary |
//! | `cast.rs` | every conversion between C pointers and Rust values |
//! | `handle.rs` | handle tables: type tag, generation, slot index |
//! | `objects.rs` | the opaque handle types and the objects behind them |
//! | `enums.rs` | tiers, devices, engines, access modes as validated integers |
//! | `runtime.rs` | `strata_config` (a partial configuration over `strata::config`'s defaults), runtime create/destroy, the resolved configuration and stats as JSON |
//! | `buffer.rs` | alloc/free, read/write, evict, prefetch and tickets |
//! | `pin.rs` | pins with their addresses, device maps and launches |
//! | `dlpack.rs` | DLPack export of pinned ranges |
//! | `hotness.rs` | counter harvest, trace recording, the balancer and its policy |
//! | `offload.rs` | the MoE expert cache and the offloaded Adam optimizer |
//! | `embedding.rs` | the tiered embedding table: pooled gathers, fused SGD and row-wise Adagrad |
//!
//! Conventions (see the header's preamble): every function returns an
//! `int` status (`STRATA_OK`, `STRATA_PENDING`, or a negative
//! `STRATA_ERR_*` whose value is fixed forever) with the message of a
//! failure in `strata_last_error()`; handles are 64-bit values carrying a
//! type tag and a generation, so a freed or forged one is
//! `STRATA_ERR_INVALID_HANDLE`; every body runs inside `catch_unwind`;
//! freeing NULL is a no-op; every pointer, length and enum value from C is
//! checked before use.
//!
//! Everything the Rust API offers is exposed.

mod buffer;
mod cast;
mod dlpack;
mod embedding;
mod enums;
mod handle;
mod hotness;
mod objects;
mod offload;
mod pin;
mod runtime;
mod status;
// After status: cbindgen writes a module's functions in this order.
mod last_error;

pub use buffer::*;
pub use dlpack::*;
pub use embedding::*;
pub use enums::*;
pub use hotness::*;
pub use last_error::*;
pub use objects::{
    strata_buffer, strata_expert_pin, strata_launch, strata_map, strata_moe, strata_optim,
    strata_pin, strata_runtime, strata_ticket,
};
pub use offload::*;
pub use pin::*;
pub use runtime::*;
pub use status::*;
