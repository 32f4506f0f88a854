//! The CUDA layer (cargo feature `cuda`): the only code in strata, its
//! benches included, that calls cudarc. Three layers, as cudarc's own:
//!
//! 1. **cudarc's `sys` and `result`** (the driver and NVRTC loaded at run
//!    time, raw calls and calls returning `Result`), called only from the
//!    files of the next layer, where every `unsafe` block of the CUDA path
//!    lives:
//! 2. **Safe owning types** that free themselves on drop:
//!    - [`Context`] (`context.rs`): a GPU's primary context, one handle per
//!      GPU per process; the probe and memory queries. The modules loaded
//!      in it are cached by name ([`Context::module`], in `module.rs`).
//!    - [`Stream`] and [`Event`] (`stream.rs`): the order of a stream's
//!      work, and waits.
//!    - [`DeviceBuffer`], [`PinnedBuffer`] (page-locked host memory,
//!      optionally mapped for kernels), [`ManagedBuffer`] (Unified Memory)
//!      and [`RegisteredHost`] (`memory.rs`).
//!    - A stream's copies between host and device memory (`copy.rs`; those
//!      from and into Rust slices complete on return).
//!    - [`Module`], [`Kernel`], [`Launch`] (`module.rs`: the context's
//!      module cache and a stream's launches) and [`nvrtc`] (run-time
//!      compilation of `kernels/*.cu` to [`Ptx`]).
//!
//!    Each file uses only the ones listed before it (and `errors.rs`, how
//!    failures are reported): a type's methods that need a type further
//!    down the list are defined in that type's file (`Context::stream` in
//!    `stream.rs`, `Stream::launch` in `module.rs`).
//! 3. **Users**: the device backend ([`CudaBackend`], `backend.rs`), the
//!    access-counter harvest (`hotness.rs`), the offloaded Adam's update
//!    (`adam.rs`), and the bench's graph kernels through this public API.
//!
//! Two rules hold throughout. cudarc panics on the first call into a
//! driver library it cannot load, so [`Context::open`] and
//! [`probe_gpus`](crate::device::probe_gpus) check for it first and report
//! `NoDevice`. And this layer never calls cudarc's safe `CudaContext`
//! or `CudaStream` methods: their `bind_to_thread` and `synchronize` first
//! report (and clear) an error some unrelated call recorded earlier, and
//! then return without making the context current or waiting for the
//! stream. Here binding a context ([`Context`]'s every call) and waiting
//! for a stream ([`Stream::synchronize`]) go straight to the driver, so a
//! wait returns only once the stream's work is done, also in a `Drop`
//! that is about to free what a kernel reads.
//!
//! Public for strata's own bench and tests, like
//! [`lowlevel`](crate::lowlevel), and like it outside the stable API.
//!
//! Ordering between streams is the caller's: a buffer used on two streams
//! needs an [`Event`] (or a synchronizing call) between the uses. Every
//! allocation that fails is `OutOfCapacity`; other driver failures are
//! `Io`, naming the call.

pub(crate) mod adam;
mod backend;
mod context;
mod copy;
mod errors;
pub(crate) mod hotness;
mod memory;
mod module;
pub mod nvrtc;
mod stream;

pub use backend::CudaBackend;
pub use context::Context;
pub use memory::{DeviceBuffer, ManagedBuffer, PinnedBuffer, RegisteredHost};
pub use module::{Kernel, KernelArg, Launch, LaunchConfig, Module};
pub use nvrtc::Ptx;
pub use stream::{Event, Stream};

pub(crate) use context::probe_gpus;
