//! `strata._strata`: the Python binding of the strata crate (the `strata`
//! package in `python/strata` re-exports it). A thin layer, as the C ABI
//! is: every method converts its arguments, calls the Rust API and
//! converts the result or the error; no tiering logic lives here.
//!
//! | file | what |
//! |------|------|
//! | `errors.rs` | `StrataError` and one subclass per `ErrorKind` |
//! | `convert.rs` | tiers, byte ranges and offsets from Python values |
//! | `pybuf.rs` | the buffer protocol (the only raw C-API calls besides DLPack's capsule) |
//! | `runtime.rs` | `Runtime`: keyword arguments (a partial configuration) or TOML, `config`, `alloc`, `stats`; `resolve_config` |
//! | `buffer.rs` | `Buffer` and `Ticket` |
//! | `dlpack.rs` | `Pin` and its DLPack capsules |
//! | `optim.rs` | `OffloadedAdam`, under `strata.optim`'s torch optimizers |
//! | `embedding.rs` | `RowTable` and the balancer's controls, under `strata.nn` |
//! | `moe.rs` | `ExpertCache`, `ExpertSlot`, `parse_moe_trace`, under `strata.moe` |
//!
//! Every call that can wait — on I/O, a page move or a device copy —
//! releases the GIL (`Python::detach`) around the Rust call.

use pyo3::prelude::*;

mod buffer;
mod convert;
mod dlpack;
mod embedding;
mod errors;
mod moe;
mod optim;
mod pybuf;
mod runtime;

#[pymodule]
fn _strata(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<runtime::Runtime>()?;
    m.add_function(wrap_pyfunction!(runtime::resolve_config, m)?)?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<buffer::Ticket>()?;
    m.add_class::<dlpack::Pin>()?;
    m.add_class::<optim::OffloadedAdam>()?;
    embedding::register(m)?;
    m.add_class::<moe::ExpertCache>()?;
    m.add_class::<moe::ExpertSlot>()?;
    m.add_function(wrap_pyfunction!(moe::parse_moe_trace, m)?)?;
    errors::register(m)?;
    Ok(())
}
