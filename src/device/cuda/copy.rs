//! Copies between host memory and device buffers, queued on a stream.
//! Those from and into Rust slices are complete when they return; the
//! asynchronous copies (from and into pinned memory) are `unsafe`, their
//! contracts saying what the caller keeps alive and untouched until the
//! stream has done them. (Launches, the other work a stream carries, are
//! in `module.rs`.)

use bytemuck::Pod;
use cudarc::driver::{result, sys};

use super::errors::driver;
use super::memory::{DeviceBuffer, ManagedBuffer};
use super::stream::Stream;
use crate::error::{Error, Result};

impl Stream {
    fn check<T>(&self, buffer: &DeviceBuffer<T>) -> Result<()> {
        if self.context().same(buffer.context()) {
            Ok(())
        } else {
            Err(Error::invalid(
                "the buffer belongs to another context than the stream",
            ))
        }
    }

    /// `len` zeroed elements of device memory, allocated and zeroed in the
    /// stream's order (the zeros are there for everything queued after).
    pub fn alloc_zeros<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::alloc_on(self, len)?;
        self.memset_zeros(&mut b)?;
        Ok(b)
    }

    /// Queues setting every byte of `buffer` to zero.
    pub fn memset_zeros<T>(&self, buffer: &mut DeviceBuffer<T>) -> Result<()> {
        self.check(buffer)?;
        self.context().bind()?;
        // SAFETY: the whole of an allocation of this context, exclusively
        // borrowed; queued on a stream of the current context.
        unsafe { result::memset_d8_async(buffer.device_address(), 0, buffer.bytes(), self.raw()) }
            .map_err(|e| driver("cuMemsetD8Async", e))
    }

    /// A device copy of `src`, complete on return.
    pub fn clone_htod<T: Pod>(&self, src: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::alloc_on(self, src.len())?;
        self.memcpy_htod(src, &mut b)?;
        Ok(b)
    }

    /// Copies `src` to the start of `dst` after the stream's earlier work;
    /// complete on return.
    pub fn memcpy_htod<T: Pod>(&self, src: &[T], dst: &mut DeviceBuffer<T>) -> Result<()> {
        // SAFETY: `dst` is exclusively borrowed, so nothing else on the host
        // side reads or writes it.
        unsafe { self.write_many(dst, &[(0, src)]) }
    }

    /// A host copy of `src`, read after the stream's earlier work.
    pub fn clone_dtoh<T: Pod>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); src.len()];
        self.memcpy_dtoh(src, &mut v)?;
        Ok(v)
    }

    /// Copies the start of `src` into `dst` after the stream's earlier
    /// work; complete on return.
    pub fn memcpy_dtoh<T: Pod>(&self, src: &DeviceBuffer<T>, dst: &mut [T]) -> Result<()> {
        self.check(src)?;
        let at = src.address_of(0, dst.len())?;
        self.context().bind()?;
        // SAFETY: the range is inside `src` (checked above); `dst` is written
        // only until the stream synchronizes, before this returns. Writers
        // of `src` on the host side need `&mut`; those on the device are
        // ordered before this copy on this stream, or by the launch
        // contract.
        let queued = unsafe { result::memcpy_dtoh_async(dst, at, self.raw()) }
            .map_err(|e| driver("cuMemcpyDtoHAsync", e));
        let synced = self.synchronize();
        queued?;
        synced
    }

    /// Copies each `(at, src)` into `dst` from element `at`, queued back to
    /// back (so the per-copy latency overlaps the transfers) and waited for
    /// once; complete on return, also when a copy fails to queue. Every
    /// range is checked to lie inside `dst` before any is queued.
    ///
    /// # Safety
    /// Nothing reads or writes the destination ranges meanwhile (`dst` is
    /// only borrowed shared: the host side's other users are the caller's
    /// to exclude), and the ranges do not overlap.
    pub unsafe fn write_many<T: Pod>(
        &self,
        dst: &DeviceBuffer<T>,
        copies: &[(usize, &[T])],
    ) -> Result<()> {
        self.check(dst)?;
        let addresses = copies
            .iter()
            .map(|&(at, src)| dst.address_of(at, src.len()))
            .collect::<Result<Vec<_>>>()?;
        self.context().bind()?;
        let mut queued = Ok(());
        for (&(_, src), &to) in copies.iter().zip(&addresses) {
            // SAFETY: the range is inside `dst` (checked above) and not used
            // by others (the caller's contract); `src` outlives the copy
            // because the stream is synchronized below before returning.
            queued = unsafe { result::memcpy_htod_async(to, src, self.raw()) }
                .map_err(|e| driver("cuMemcpyHtoDAsync", e));
            if queued.is_err() {
                break;
            }
        }
        let synced = self.synchronize();
        queued?;
        synced
    }

    /// Copies elements `at..at + dst.len()` of `src` into each `(at, dst)`,
    /// queued back to back and waited for once; complete on return, also
    /// when a copy fails to queue.
    ///
    /// # Safety
    /// Nothing writes the source ranges meanwhile.
    pub unsafe fn read_many<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        copies: &mut [(usize, &mut [T])],
    ) -> Result<()> {
        self.check(src)?;
        let addresses = copies
            .iter()
            .map(|(at, dst)| src.address_of(*at, dst.len()))
            .collect::<Result<Vec<_>>>()?;
        self.context().bind()?;
        let mut queued = Ok(());
        for ((_, dst), &from) in copies.iter_mut().zip(&addresses) {
            // SAFETY: the range is inside `src` (checked above) and not
            // written meanwhile (the caller's contract); `dst` is written
            // only until the stream synchronizes below, before returning.
            queued = unsafe { result::memcpy_dtoh_async(dst, from, self.raw()) }
                .map_err(|e| driver("cuMemcpyDtoHAsync", e));
            if queued.is_err() {
                break;
            }
        }
        let synced = self.synchronize();
        queued?;
        synced
    }

    /// Queues a copy of `src` into `dst` from element `at`; it runs after
    /// the stream's earlier work, and this returns before it has.
    ///
    /// # Safety
    /// `src` is pinned memory ([`PinnedBuffer`](super::PinnedBuffer)), and
    /// it stays allocated and unwritten, and the destination range unused
    /// by others, until the stream has run the copy (an [`Event`](super::Event) recorded
    /// after it has completed, or the stream was synchronized).
    pub unsafe fn upload_async<T: Pod>(
        &self,
        src: &[T],
        dst: &DeviceBuffer<T>,
        at: usize,
    ) -> Result<()> {
        self.check(dst)?;
        let to = dst.address_of(at, src.len())?;
        self.context().bind()?;
        // SAFETY: the range is inside `dst` (checked above); the caller's
        // contract keeps `src` and the range as the copy needs them.
        unsafe { result::memcpy_htod_async(to, src, self.raw()) }
            .map_err(|e| driver("cuMemcpyHtoDAsync", e))
    }

    /// Queues a copy of elements `at..at + dst.len()` of `src` into `dst`;
    /// it runs after the stream's earlier work, and this returns before it
    /// has.
    ///
    /// # Safety
    /// `dst` is pinned memory, and it stays allocated and is neither read
    /// nor written, and the source range is not written, until the stream
    /// has run the copy.
    pub unsafe fn download_async<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        at: usize,
        dst: &mut [T],
    ) -> Result<()> {
        self.check(src)?;
        let from = src.address_of(at, dst.len())?;
        self.context().bind()?;
        // SAFETY: the range is inside `src` (checked above); the caller's
        // contract keeps `dst` and the range as the copy needs them.
        unsafe { result::memcpy_dtoh_async(dst, from, self.raw()) }
            .map_err(|e| driver("cuMemcpyDtoHAsync", e))
    }

    /// Queues a migration of `buffer`'s pages to the host (a trial that
    /// starts cold). CUDA 13's headers name only the `CUmemLocation` form
    /// (`cuMemPrefetchAsync_v2`, CUDA 12.2+), and cudarc panics on a driver
    /// symbol that is missing: the `_v2` entry point where the driver
    /// exports it, the legacy one (a device ordinal) on older drivers.
    pub fn prefetch_to_host<T>(&self, buffer: &ManagedBuffer<T>) -> Result<()> {
        /// `CU_DEVICE_CPU` of cuda.h: the host as a prefetch target.
        const CU_DEVICE_CPU: sys::CUdevice = -1;
        self.context().bind()?;
        let (at, len) = (buffer.device_address(), buffer.bytes());
        // SAFETY: only looks a symbol up in the loaded driver library.
        let v2 =
            unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemPrefetchAsync_v2") }.is_ok();
        let r = if v2 {
            let host = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            };
            // SAFETY: a managed range of a live allocation; a prefetch moves
            // pages, never their contents; the symbol exists (checked).
            unsafe { sys::cuMemPrefetchAsync_v2(at, len, host, 0, self.raw()) }
        } else {
            // SAFETY: as above.
            unsafe { sys::cuMemPrefetchAsync(at, len, CU_DEVICE_CPU, self.raw()) }
        };
        r.result().map_err(|e| driver("cuMemPrefetchAsync", e))
    }
}
