//! Owning handles to memory the GPU reads: device memory, page-locked host
//! memory, Unified Memory and registered host ranges. Each frees itself on
//! drop, binding its context straight through the driver (an unrelated
//! earlier error never leaks the memory).

use std::marker::PhantomData;
use std::ptr::NonNull;

use bytemuck::Pod;
use cudarc::driver::{result, sys};

use super::context::Context;
use super::errors::{alloc_failed, bytes_of, driver};
use super::stream::Stream;
use crate::error::{Error, Result};

/// `len` elements of `T` in device memory. The host never dereferences it:
/// copies go through a [`Stream`], kernels get its address.
pub struct DeviceBuffer<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Context,
    /// The stream a stream-ordered allocation is freed on.
    stream: Option<Stream>,
    _element: PhantomData<T>,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} at {:#x})", self.len, self.ptr)
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// `len` elements of device memory (`cuMemAlloc`), freed by `cuMemFree`
    /// on drop. The contents are unspecified (any bytes are a valid `T`).
    pub fn alloc(ctx: &Context, len: usize) -> Result<Self> {
        let bytes = bytes_of::<T>(len)?;
        ctx.bind()?;
        // SAFETY: a plain allocation in the context just bound; freed once,
        // by Drop. At least one byte: cuMemAlloc refuses zero.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| alloc_failed("cuMemAlloc", bytes, e))?;
        Ok(Self {
            ptr,
            len,
            ctx: ctx.clone(),
            stream: None,
            _element: PhantomData,
        })
    }

    /// `len` elements allocated in `stream`'s order where the GPU has
    /// memory pools (`cuMemAllocAsync`, freed on the same stream), else as
    /// [`alloc`](Self::alloc) (freed after the stream's work). The contents
    /// are unspecified.
    pub(super) fn alloc_on(stream: &Stream, len: usize) -> Result<Self> {
        let ctx = stream.context();
        if !ctx.async_alloc() {
            let mut b = Self::alloc(ctx, len)?;
            b.stream = Some(stream.clone());
            return Ok(b);
        }
        let bytes = bytes_of::<T>(len)?;
        ctx.bind()?;
        // SAFETY: a stream-ordered allocation on a stream of the context
        // just bound; freed once, by Drop, on the same stream.
        let ptr = unsafe { result::malloc_async(stream.raw(), bytes.max(1)) }
            .map_err(|e| alloc_failed("cuMemAllocAsync", bytes, e))?;
        Ok(Self {
            ptr,
            len,
            ctx: ctx.clone(),
            stream: Some(stream.clone()),
            _element: PhantomData,
        })
    }
}

impl<T> DeviceBuffer<T> {
    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Length in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address of element 0 (what kernels dereference).
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The device address of elements `at..at + n`, which must lie inside
    /// the buffer (`InvalidArgument` otherwise).
    pub(super) fn address_of(&self, at: usize, n: usize) -> Result<u64> {
        if at.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(format!(
                "elements {at}+{n} exceed the device buffer's {}",
                self.len
            )));
        }
        Ok(self.ptr + (at * std::mem::size_of::<T>()) as u64)
    }

    /// The device pointer as kernels take it (a parameter points at it).
    pub(super) fn ptr_ref(&self) -> &sys::CUdeviceptr {
        &self.ptr
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if !self.ctx.bind_quietly() {
            return;
        }
        match &self.stream {
            Some(s) if self.ctx.async_alloc() => {
                // SAFETY: allocated by cuMemAllocAsync on this stream; freed
                // once, in stream order (after the work queued on it).
                let _ = unsafe { result::free_async(self.ptr, s.raw()) };
            }
            stream => {
                if let Some(s) = stream {
                    s.synchronize_quietly();
                }
                // SAFETY: allocated by cuMemAlloc in this context, freed
                // once. No copy is in flight: copies from and into slices
                // complete before they return, and the contracts of the
                // asynchronous copies and of launches keep the buffer alive
                // until their work is done.
                let _ = unsafe { result::free_sync(self.ptr) };
            }
        }
    }
}

/// `len` elements of page-locked host memory (`cuMemHostAlloc`): the
/// source or target of asynchronous copies, and (when
/// [mapped](Self::mapped_from_slice)) memory kernels read over the bus.
/// Host code reads and writes it as a slice; see
/// [`Stream::upload_async`] for when it may not.
pub struct PinnedBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Where kernels see it, when mapped.
    device: Option<u64>,
    ctx: Context,
}

// SAFETY: the buffer owns its allocation alone (as a Box would), so it
// moves between threads as `T` does.
unsafe impl<T: Send> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads through `&self` (as a Box would).
unsafe impl<T: Sync> Sync for PinnedBuffer<T> {}

impl<T> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({} at {:p})", self.len, self.ptr)
    }
}

impl<T: Pod> PinnedBuffer<T> {
    /// `len` zeroed elements, not mapped, not write-combined (the host may
    /// read results back fast).
    pub fn new(ctx: &Context, len: usize) -> Result<Self> {
        Self::alloc(ctx, len, 0, &[])
    }

    /// A copy of `data`, mapped for kernels at
    /// [`device_address`](Self::device_address) (zero-copy: every kernel
    /// read crosses the bus) and usable by every context (`PORTABLE`).
    pub fn mapped_from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let mut b = Self::alloc(ctx, data.len(), flags, data)?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: the allocation was made with DEVICEMAP in the context bound
        // by `alloc`; the out pointer is a local. On failure `b` drops and
        // frees the allocation.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, b.ptr.as_ptr().cast(), 0) }
            .result()
            .map_err(|e| driver("cuMemHostGetDevicePointer", e))?;
        b.device = Some(device);
        Ok(b)
    }

    /// `len` elements, `init` first and zeros after it.
    fn alloc(ctx: &Context, len: usize, flags: u32, init: &[T]) -> Result<Self> {
        let bytes = bytes_of::<T>(len)?;
        ctx.bind()?;
        // SAFETY: a plain allocation in the context just bound; freed once,
        // by Drop. At least one byte, so the pointer is never dangling.
        let host = unsafe { result::malloc_host(bytes.max(1), flags) }
            .map_err(|e| alloc_failed("cuMemHostAlloc", bytes, e))?;
        let ptr = NonNull::new(host.cast::<T>())
            .ok_or_else(|| Error::invalid("cuMemHostAlloc returned null"))?;
        // SAFETY: `host` is `bytes` writable bytes, page-aligned (so aligned
        // for T), just allocated and not yet shared; `init` has at most
        // `len` elements, and does not overlap it.
        unsafe {
            std::ptr::copy_nonoverlapping(init.as_ptr(), ptr.as_ptr(), init.len());
            std::ptr::write_bytes(ptr.as_ptr().add(init.len()), 0, len - init.len());
        }
        Ok(Self {
            ptr,
            len,
            device: None,
            ctx: ctx.clone(),
        })
    }
}

impl<T> PinnedBuffer<T> {
    /// Where kernels read the buffer, when it is mapped.
    pub fn device_address(&self) -> Option<u64> {
        self.device
    }
}

impl<T> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialized elements (the constructors write every
        // one), aligned, owned by `self` and alive while it is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.ctx.bind_quietly() {
            // SAFETY: allocated by cuMemHostAlloc, freed once; no copy or
            // kernel uses it any more (the contracts of the asynchronous
            // copies and of launches).
            let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
        }
    }
}

/// `len` elements of Unified Memory (`cuMemAllocManaged`): one address for
/// host and kernels, pages migrating to whichever touches them.
pub struct ManagedBuffer<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Context,
    _element: PhantomData<T>,
}

impl<T> std::fmt::Debug for ManagedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ManagedBuffer({} at {:#x})", self.len, self.ptr)
    }
}

impl<T: Pod> ManagedBuffer<T> {
    /// A copy of `data` in Unified Memory, written from the host (so its
    /// pages start there).
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        let bytes = bytes_of::<T>(data.len())?;
        ctx.bind()?;
        // SAFETY: a plain allocation in the context just bound; freed once,
        // by Drop.
        let ptr = unsafe {
            result::malloc_managed(bytes.max(1), sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL)
        }
        .map_err(|e| alloc_failed("cuMemAllocManaged", bytes, e))?;
        let b = Self {
            ptr,
            len: data.len(),
            ctx: ctx.clone(),
            _element: PhantomData,
        };
        // SAFETY: managed memory is host-addressable at its device address,
        // `bytes` long, aligned (the driver's allocations are), and no
        // kernel has seen it yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut T, data.len()) };
        Ok(b)
    }
}

impl<T> ManagedBuffer<T> {
    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of element 0, for kernels and host alike.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    pub(super) fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T> Drop for ManagedBuffer<T> {
    fn drop(&mut self) {
        if self.ctx.bind_quietly() {
            // SAFETY: allocated by cuMemAllocManaged in this context, freed
            // once; no kernel uses it any more (the launch contract).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Host memory the caller owns, registered with the driver
/// (`cuMemHostRegister`, `PORTABLE | DEVICEMAP`): pinned for asynchronous
/// copies and mapped for kernels. Unregistered on drop.
pub struct RegisteredHost {
    ctx: Context,
    base: usize,
    device: u64,
}

impl std::fmt::Debug for RegisteredHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegisteredHost({:#x} at {:#x})", self.base, self.device)
    }
}

impl RegisteredHost {
    /// Registers `len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base+len` is mapped host memory and stays mapped for as long
    /// as the registration lives.
    pub unsafe fn new(ctx: &Context, base: NonNull<u8>, len: usize) -> Result<Self> {
        ctx.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range stays mapped while the
        // registration lives; the driver pins it and maps it for the GPU.
        unsafe { sys::cuMemHostRegister_v2(base.as_ptr().cast(), len, flags) }
            .result()
            .map_err(|e| driver("cuMemHostRegister", e))?;
        // Owned from here: a failure below unregisters it.
        let mut r = Self {
            ctx: ctx.clone(),
            base: base.as_ptr() as usize,
            device: 0,
        };
        // SAFETY: `base` was registered with DEVICEMAP just above; the out
        // pointer is a field of a live local.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut r.device, base.as_ptr().cast(), 0) }
            .result()
            .map_err(|e| driver("cuMemHostGetDevicePointer", e))?;
        Ok(r)
    }

    /// The device address of the range's first byte.
    pub fn device_address(&self) -> u64 {
        self.device
    }
}

impl Drop for RegisteredHost {
    fn drop(&mut self) {
        if self.ctx.bind_quietly() {
            // SAFETY: `base` was registered in this context and is still
            // mapped (the contract of `new`); unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void) };
        }
    }
}
