//! Loaded modules, their kernels, and launches: a context's modules
//! ([`Context::module`]) and a stream's launches ([`Stream::launch`]) are
//! defined here, above the context and the stream.

use std::ffi::{c_void, CString};

use bytemuck::Pod;
use cudarc::driver::{result, sys};

use super::context::Context;
use super::errors::driver;
use super::memory::DeviceBuffer;
use super::nvrtc::Ptx;
use super::stream::Stream;
use crate::error::{Error, Result};

impl Context {
    /// The module named `key` in this context: loaded from the PTX `ptx`
    /// returns the first time (compiled there, typically, by
    /// [`nvrtc::compile`](super::nvrtc::compile)), the same module on every
    /// later call. Modules stay loaded until the context drops.
    pub fn module(&self, key: &str, ptx: impl FnOnce() -> Result<Ptx>) -> Result<Module> {
        if let Some(&raw) = self.modules().lock().get(key) {
            return Ok(Module::new(self.clone(), raw));
        }
        // Compiled outside the lock: another thread may load another
        // module meanwhile (or this one: then its copy is used).
        let image = CString::new(ptx()?.to_src())
            .map_err(|_| Error::invalid(format!("the PTX of {key} has a NUL byte")))?;
        let mut modules = self.modules().lock();
        if let Some(&raw) = modules.get(key) {
            return Ok(Module::new(self.clone(), raw));
        }
        self.bind()?;
        // SAFETY: `image` is NUL-terminated PTX text, alive across the call;
        // the context is current.
        let raw = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(|e| driver(&format!("cuModuleLoadData({key})"), e))?;
        modules.insert(key.to_string(), raw);
        Ok(Module::new(self.clone(), raw))
    }
}

impl Stream {
    /// A launch of `kernel` on this stream, its arguments to be added.
    pub fn launch<'a>(&'a self, kernel: &'a Kernel) -> Launch<'a> {
        Launch::new(self, kernel)
    }
}

/// A module loaded in a context ([`Context::module`]); it stays loaded as
/// long as the context.
pub struct Module {
    ctx: Context,
    raw: sys::CUmodule,
}

// SAFETY: a handle into the context's module table, which keeps the module
// loaded until the context drops (this holds the context); module handles
// may be used from any thread with the context current (every call binds
// it).
unsafe impl Send for Module {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Module {}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Module({:p} in {:?})", self.raw, self.ctx)
    }
}

impl Module {
    pub(super) fn new(ctx: Context, raw: sys::CUmodule) -> Self {
        Self { ctx, raw }
    }

    /// The kernel `name` (an `extern "C"` `__global__` function).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid(format!("a kernel name with a NUL byte: {name:?}")))?;
        self.ctx.bind()?;
        // SAFETY: the module is loaded (see `Module`); the context is current.
        let raw = unsafe { result::module::get_function(self.raw, cname) }
            .map_err(|e| driver(&format!("cuModuleGetFunction({name})"), e))?;
        Ok(Kernel {
            ctx: self.ctx.clone(),
            raw,
            name: name.to_string(),
        })
    }
}

/// A kernel of a loaded module, launched with [`Stream::launch`].
pub struct Kernel {
    ctx: Context,
    raw: sys::CUfunction,
    name: String,
}

// SAFETY: a function handle of a module that stays loaded while the
// context lives (this holds the context); usable from any thread with the
// context current.
unsafe impl Send for Kernel {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({})", self.name)
    }
}

impl Kernel {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A launch's grid: blocks, threads per block, dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks, (x, y, z).
    pub grid_dim: (u32, u32, u32),
    /// Threads per block, (x, y, z).
    pub block_dim: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// One thread per element: blocks of 1024 threads, as many as `n`
    /// needs.
    pub fn for_num_elems(n: u32) -> Self {
        const THREADS: u32 = 1024;
        Self {
            grid_dim: (n.div_ceil(THREADS), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl<T: bytemuck::Pod> Sealed for &T {}
    impl<T> Sealed for &super::DeviceBuffer<T> {}
    impl<T> Sealed for &mut super::DeviceBuffer<T> {}
}

/// What a kernel parameter can be: a reference to a value passed by value
/// (any [`Pod`]: integers, floats, device addresses, `repr(C)` structs of
/// them), or to a [`DeviceBuffer`], passed as its device address:
/// `&mut` for a buffer the kernel writes (borrowed exclusively until the
/// launch is dropped), `&` for one it only reads.
pub trait KernelArg<'a>: sealed::Sealed {
    /// Where the parameter's bytes are, for `cuLaunchKernel`.
    #[doc(hidden)]
    fn param(self) -> *mut c_void;
}

impl<'a, T: Pod> KernelArg<'a> for &'a T {
    fn param(self) -> *mut c_void {
        (self as *const T).cast_mut().cast()
    }
}

impl<'a, T> KernelArg<'a> for &'a DeviceBuffer<T> {
    fn param(self) -> *mut c_void {
        (self.ptr_ref() as *const sys::CUdeviceptr)
            .cast_mut()
            .cast()
    }
}

impl<'a, T> KernelArg<'a> for &'a mut DeviceBuffer<T> {
    fn param(self) -> *mut c_void {
        (self.ptr_ref() as *const sys::CUdeviceptr)
            .cast_mut()
            .cast()
    }
}

/// A launch being put together ([`Stream::launch`]): arguments in the
/// kernel's order, then [`launch`](Self::launch). The arguments stay
/// borrowed until the launch is dropped.
pub struct Launch<'a> {
    stream: &'a Stream,
    kernel: &'a Kernel,
    params: Vec<*mut c_void>,
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Launch({}, {} arguments)",
            self.kernel.name,
            self.params.len()
        )
    }
}

impl<'a> Launch<'a> {
    pub(super) fn new(stream: &'a Stream, kernel: &'a Kernel) -> Self {
        Self {
            stream,
            kernel,
            params: Vec::new(),
        }
    }

    /// Adds the next argument.
    pub fn arg(&mut self, arg: impl KernelArg<'a>) -> &mut Self {
        self.params.push(arg.param());
        self
    }

    /// Queues the kernel on the stream over `config`'s grid.
    ///
    /// # Safety
    /// The arguments match the kernel's parameters in number, order and
    /// type. Every address the kernel dereferences (a buffer argument, an
    /// address inside a value) is memory of the stream's context that stays
    /// allocated until the kernel has run, and the kernel stays inside it
    /// (its bounds are the caller's to pass and the kernel's to keep). No
    /// other work (host code, another stream) writes what the kernel reads,
    /// or touches what it writes, until the kernel has run (a buffer passed
    /// `&` may still be written by the kernel: the borrow is the caller's
    /// word, not the driver's).
    pub unsafe fn launch(&mut self, config: LaunchConfig) -> Result<()> {
        if !self.stream.context().same(&self.kernel.ctx) {
            return Err(Error::invalid(
                "the kernel belongs to another context than the stream",
            ));
        }
        self.stream.context().bind()?;
        // SAFETY: the caller's contract for the kernel and its arguments;
        // every parameter points at a value borrowed for 'a, alive across
        // this call (the driver copies the values when the launch is
        // queued); the kernel and stream belong to the current context.
        unsafe {
            result::launch_kernel(
                self.kernel.raw,
                config.grid_dim,
                config.block_dim,
                config.shared_mem_bytes,
                self.stream.raw(),
                &mut self.params,
            )
        }
        .map_err(|e| driver(&self.kernel.name, e))
    }
}
