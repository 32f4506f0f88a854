//! The CUDA side of device discovery, through cudarc's driver API.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use super::{no_device, BackendKind, DeviceBackend, DeviceMemory, GpuInfo, HostRegistration};
use crate::error::{Error, ErrorKind, Result};
use crate::link::{LinkCounter, LinkStats};

pub(super) fn probe_gpus() -> Result<Vec<GpuInfo>> {
    // cudarc panics on the first call into a driver library it cannot load.
    // SAFETY: is_culib_present only tries to dlopen the library and reports
    // whether that worked; it calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return Err(no_device(
            "the CUDA driver library (libcuda.so) is not present",
        ));
    }
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

/// Device memory strata leaves to others (the CUDA context, kernels' own
/// allocations, the caller's tensors): 5% of the GPU, at least 512 MiB.
fn reserve(total: u64) -> u64 {
    (total / 20).max(512 << 20)
}

/// A CUDA GPU as strata's device tier.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    h2d_stream: Arc<CudaStream>,
    d2h_stream: Arc<CudaStream>,
    capacity: u64,
    name: String,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
}

impl CudaBackend {
    /// Opens GPU `ordinal`; strata may use its free memory minus a reserve,
    /// at most `cap` bytes (to emulate a smaller GPU).
    pub fn new(ordinal: usize, cap: u64) -> Result<Self> {
        // SAFETY: only tries to load the driver library; calls nothing in it.
        if !unsafe { sys::is_culib_present() } {
            return Err(no_device(
                "the CUDA driver library (libcuda.so) is not present",
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| no_device(format!("opening GPU {ordinal}: {e:?}")))?;
        let (free, total) = ctx.mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        let capacity = (free as u64).saturating_sub(reserve(total as u64)).min(cap);
        let name = result::device::get_name(ctx.cu_device()).unwrap_or_else(|_| "GPU".into());
        Ok(Self {
            h2d_stream: ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?,
            d2h_stream: ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?,
            ctx,
            capacity,
            name,
            h2d: Arc::new(LinkCounter::default()),
            d2h: Arc::new(LinkCounter::default()),
        })
    }
}

impl CudaBackend {
    /// The CUDA context (for kernels: see `cuda_hotness`).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

fn driver(call: &str, e: DriverError) -> Error {
    Error::new(ErrorKind::Io, format!("{call} failed: {e:?}"))
}

impl DeviceBackend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn description(&self) -> String {
        format!("GPU {} ({})", self.ctx.ordinal(), self.name)
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>> {
        if bytes as u64 > self.capacity {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "GPU has {} bytes for strata; {bytes} requested",
                    self.capacity
                ),
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: a plain allocation in the context just bound to this thread.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            Error::new(
                ErrorKind::OutOfCapacity,
                format!("cuMemAlloc({bytes}) failed: {e:?}"),
            )
        })?;
        Ok(Box::new(CudaMemory {
            ctx: self.ctx.clone(),
            ptr,
            len: bytes,
            h2d_stream: self.h2d_stream.clone(),
            d2h_stream: self.d2h_stream.clone(),
            h2d: self.h2d.clone(),
            d2h: self.d2h.clone(),
        }))
    }

    fn link_stats(&self) -> (LinkStats, LinkStats) {
        (self.h2d.stats(), self.d2h.stats())
    }

    unsafe fn register_host(
        &self,
        base: NonNull<u8>,
        len: usize,
    ) -> Result<Option<HostRegistration>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range stays mapped while the
        // registration lives; the driver pins it and maps it for the GPU.
        unsafe { sys::cuMemHostRegister_v2(base.as_ptr().cast(), len, flags) }
            .result()
            .map_err(|e| driver("cuMemHostRegister", e))?;
        let guard = Registered {
            ctx: self.ctx.clone(),
            base: base.as_ptr() as usize,
        };
        let mut device_base: sys::CUdeviceptr = 0;
        // SAFETY: `base` was registered with DEVICEMAP just above; the out
        // pointer is a local.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_base, base.as_ptr().cast(), 0) }
            .result()
            .map_err(|e| driver("cuMemHostGetDevicePointer", e))?;
        Ok(Some(HostRegistration {
            device_base,
            guard: Box::new(guard),
        }))
    }
}

/// A `cuMemHostRegister`ed range, unregistered on drop.
struct Registered {
    ctx: Arc<CudaContext>,
    base: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: the context outlives the registration (we hold an Arc);
        // `base` is the pointer registered in it, still mapped (the arena
        // drops its registrations before unmapping).
        if unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }.is_ok() {
            // SAFETY: as above.
            let _ = unsafe { sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void) };
        }
    }
}

struct CudaMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    h2d_stream: Arc<CudaStream>,
    d2h_stream: Arc<CudaStream>,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
}

impl DeviceMemory for CudaMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn device_address(&self, offset: usize) -> u64 {
        self.ptr + offset as u64
    }

    unsafe fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()> {
        let t = Instant::now();
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: the caller guarantees the range is inside the allocation
        // and exclusively theirs; `src` outlives the copy because we wait
        // for the stream before returning.
        unsafe {
            result::memcpy_htod_async(self.ptr + offset as u64, src, self.h2d_stream.cu_stream())
        }
        .map_err(|e| driver("cuMemcpyHtoDAsync", e))?;
        // Wait on the stream directly: cudarc's `CudaStream::synchronize`
        // first reports errors recorded earlier, and could return before
        // this copy finished, with the caller's memory still in use.
        // SAFETY: the stream belongs to this context, which is current.
        unsafe { result::stream::synchronize(self.h2d_stream.cu_stream()) }
            .map_err(|e| driver("cuStreamSynchronize", e))?;
        self.h2d.record(src.len(), t.elapsed(), Duration::ZERO);
        Ok(())
    }

    unsafe fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let t = Instant::now();
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: as in `copy_in`; `dst` is written only until the stream
        // synchronizes, before this function returns.
        unsafe {
            result::memcpy_dtoh_async(dst, self.ptr + offset as u64, self.d2h_stream.cu_stream())
        }
        .map_err(|e| driver("cuMemcpyDtoHAsync", e))?;
        // Wait on the stream directly: cudarc's `CudaStream::synchronize`
        // first reports errors recorded earlier, and could return before
        // this copy finished, with the caller's memory still in use.
        // SAFETY: the stream belongs to this context, which is current.
        unsafe { result::stream::synchronize(self.d2h_stream.cu_stream()) }
            .map_err(|e| driver("cuStreamSynchronize", e))?;
        self.d2h.record(dst.len(), t.elapsed(), Duration::ZERO);
        Ok(())
    }

    unsafe fn copy_in_many(&self, copies: &[(usize, &[u8])]) -> Result<()> {
        let t = Instant::now();
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let mut bytes = 0;
        let mut issued = Ok(());
        for &(offset, src) in copies {
            // SAFETY: as in `copy_in`, per copy; every source outlives the
            // copies because we wait for the stream below, also when a later
            // copy fails to queue.
            issued = unsafe {
                result::memcpy_htod_async(
                    self.ptr + offset as u64,
                    src,
                    self.h2d_stream.cu_stream(),
                )
            }
            .map_err(|e| driver("cuMemcpyHtoDAsync", e));
            if issued.is_err() {
                break;
            }
            bytes += src.len();
        }
        // SAFETY: the stream belongs to this context, which is current.
        let synced = unsafe { result::stream::synchronize(self.h2d_stream.cu_stream()) }
            .map_err(|e| driver("cuStreamSynchronize", e));
        issued?;
        synced?;
        self.h2d.record(bytes, t.elapsed(), Duration::ZERO);
        Ok(())
    }

    unsafe fn copy_out_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<()> {
        let t = Instant::now();
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let mut bytes = 0;
        let mut issued = Ok(());
        for (offset, dst) in copies.iter_mut() {
            // SAFETY: as in `copy_out`, per copy; every destination is
            // written only until the stream synchronizes below.
            issued = unsafe {
                result::memcpy_dtoh_async(
                    dst,
                    self.ptr + *offset as u64,
                    self.d2h_stream.cu_stream(),
                )
            }
            .map_err(|e| driver("cuMemcpyDtoHAsync", e));
            if issued.is_err() {
                break;
            }
            bytes += dst.len();
        }
        // SAFETY: the stream belongs to this context, which is current.
        let synced = unsafe { result::stream::synchronize(self.d2h_stream.cu_stream()) }
            .map_err(|e| driver("cuStreamSynchronize", e));
        issued?;
        synced?;
        self.d2h.record(bytes, t.elapsed(), Duration::ZERO);
        Ok(())
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // Errors here cannot be returned. Make the context current directly
        // (cudarc's `bind_to_thread` may fail on an unrelated recorded
        // error, which would leak the allocation).
        // SAFETY: the context outlives this allocation (we hold an Arc).
        if unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }.is_ok() {
            // SAFETY: `ptr` came from malloc_sync in this context and no copy
            // is in flight (every copy synchronizes before returning).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
