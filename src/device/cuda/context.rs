//! A GPU's primary context, and the probe that comes before any driver
//! call.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use super::errors::{driver, no_device};
use crate::device::traits::GpuInfo;
use crate::error::Result;

/// `Ok` where the CUDA driver library loads; `NoDevice` where it does not
/// (cudarc panics on the first call into a library it cannot load).
fn driver_present() -> Result<()> {
    // SAFETY: is_culib_present only tries to dlopen the library and reports
    // whether that worked; it calls no driver function.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(no_device(
            "the CUDA driver library (libcuda.so) is not present",
        ))
    }
}

/// The GPUs the driver sees (see [`crate::device::probe_gpus`]).
pub(crate) fn probe_gpus() -> Result<Vec<GpuInfo>> {
    driver_present()?;
    result::init().map_err(|e| no_device(format!("cuInit failed: {e:?}")))?;
    let count = result::device::get_count()
        .map_err(|e| no_device(format!("cuDeviceGetCount failed: {e:?}")))?;
    if count <= 0 {
        return Err(no_device("the CUDA driver reports no GPU"));
    }
    (0..count)
        .map(|ordinal| {
            let dev = result::device::get(ordinal)
                .map_err(|e| no_device(format!("cuDeviceGet({ordinal}) failed: {e:?}")))?;
            let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
            // SAFETY: `dev` is a valid device handle returned by cuDeviceGet.
            let memory_bytes = unsafe { result::device::total_mem(dev) }.unwrap_or(0) as u64;
            let attr = |a| {
                // SAFETY: as above; `a` is a valid attribute enum value.
                unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
            };
            let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
            let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
            Ok(GpuInfo {
                ordinal: ordinal as u32,
                name,
                memory_bytes,
                compute_capability: format!("{major}.{minor}"),
            })
        })
        .collect()
}

pub(super) struct Inner {
    ordinal: usize,
    device: sys::CUdevice,
    raw: sys::CUcontext,
    /// Whether the GPU has memory pools (stream-ordered allocation).
    async_alloc: bool,
    /// The modules loaded in this context, by name; unloaded when it drops.
    modules: Mutex<HashMap<String, sys::CUmodule>>,
}

// SAFETY: the context and module handles are the driver's, usable from any
// thread once the context is current there, which every call through
// `Context::bind` makes it; the module table is behind a lock.
unsafe impl Send for Inner {}
// SAFETY: as for Send: nothing is mutated through `&Inner` except the
// module table, under its lock.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every object of the context (stream, event, buffer, kernel) holds
        // a handle to it, so none is left: unload the modules, release the
        // primary context.
        // SAFETY: `raw` is the primary context retained in `open`, not yet
        // released.
        if unsafe { result::ctx::set_current(self.raw) }.is_ok() {
            for (_, module) in self.modules.get_mut().drain() {
                // SAFETY: loaded in this context by `Context::module` and
                // unloaded once, here; no kernel of it is left (see above).
                let _ = unsafe { result::module::unload(module) };
            }
        }
        // SAFETY: retained once in `open`, released once here.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A GPU's primary context (the one the CUDA runtime, and so PyTorch, uses
/// too), current on the calling thread for each call made through it.
/// One handle per GPU per process while any is alive: [`Context::open`]
/// returns the live one, so modules load once, and buffers, streams and
/// registrations of every user of the GPU belong to the same context.
#[derive(Clone)]
pub struct Context(Arc<Inner>);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context(GPU {})", self.0.ordinal)
    }
}

/// The open contexts, by ordinal.
fn open_contexts() -> &'static Mutex<HashMap<usize, Weak<Inner>>> {
    static OPEN: OnceLock<Mutex<HashMap<usize, Weak<Inner>>>> = OnceLock::new();
    OPEN.get_or_init(Default::default)
}

impl Context {
    /// GPU `ordinal`'s primary context. `NoDevice` where the driver
    /// library is absent, the driver does not start, or there is no such
    /// GPU.
    pub fn open(ordinal: usize) -> Result<Self> {
        driver_present()?;
        let mut open = open_contexts().lock();
        if let Some(inner) = open.get(&ordinal).and_then(Weak::upgrade) {
            return Ok(Self(inner));
        }
        let opening = |e: result::DriverError| no_device(format!("opening GPU {ordinal}: {e:?}"));
        result::init().map_err(opening)?;
        let index =
            i32::try_from(ordinal).map_err(|_| no_device(format!("there is no GPU {ordinal}")))?;
        let device = result::device::get(index).map_err(opening)?;
        // SAFETY: `device` is a handle cuDeviceGet returned.
        let raw = unsafe { result::primary_ctx::retain(device) }.map_err(opening)?;
        // Owned from here: a failure below releases it.
        let mut inner = Inner {
            ordinal,
            device,
            raw,
            async_alloc: false,
            modules: Mutex::default(),
        };
        // SAFETY: a valid device handle and attribute.
        let pools = unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
            )
        }
        .map_err(opening)?;
        inner.async_alloc = pools > 0;
        let ctx = Self(Arc::new(inner));
        ctx.bind()?;
        open.insert(ordinal, Arc::downgrade(&ctx.0));
        Ok(ctx)
    }

    /// Makes the context current on the calling thread, straight through
    /// the driver: never fails on an error an earlier call recorded (see
    /// the [module docs](super)).
    pub(super) fn bind(&self) -> Result<()> {
        let current = result::ctx::get_current().map_err(|e| driver("cuCtxGetCurrent", e))?;
        if current != Some(self.0.raw) {
            // SAFETY: `raw` is a retained primary context, live while `self`
            // is.
            unsafe { result::ctx::set_current(self.0.raw) }
                .map_err(|e| driver("cuCtxSetCurrent", e))?;
        }
        Ok(())
    }

    /// [`bind`](Self::bind) for `Drop`s, which cannot return the error:
    /// whether the context is current.
    pub(super) fn bind_quietly(&self) -> bool {
        self.bind().is_ok()
    }

    /// Whether `self` and `other` are the same context.
    pub(super) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The modules loaded in this context, by name (`module.rs`).
    pub(super) fn modules(&self) -> &Mutex<HashMap<String, sys::CUmodule>> {
        &self.0.modules
    }

    pub(super) fn async_alloc(&self) -> bool {
        self.0.async_alloc
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// The GPU's name ("GPU" where the driver gives none).
    pub fn name(&self) -> String {
        result::device::get_name(self.0.device).unwrap_or_else(|_| "GPU".into())
    }

    /// Free and total device memory, in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    /// Waits for all work in the context, on every stream.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        result::ctx::synchronize().map_err(|e| driver("cuCtxSynchronize", e))
    }
}
