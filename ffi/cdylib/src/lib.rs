//! The artifact crate: `libstrata.so` and `libstrata.a`, exporting every
//! `extern "C"` function of `strata-ffi` (declared in `include/strata.h`).
//! It holds no code of its own (the wasmtime layout: all code in an rlib,
//! the shared and static libraries built by a small crate that links it).

// Links strata-ffi in, so that its `#[no_mangle]` functions are exported.
pub use strata_ffi::*;
