//! A CUDA GPU as strata's device tier: page slots in device memory,
//! copies on one stream per direction, host arenas registered for
//! zero-copy.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::context::Context;
use super::memory::{DeviceBuffer, RegisteredHost};
use super::stream::Stream;
use crate::device::traits::{BackendKind, DeviceBackend, DeviceMemory, HostRegistration};
use crate::error::{Error, ErrorKind, Result};
use crate::link::{LinkCounter, LinkStats};

/// Device memory strata leaves to others (the CUDA context, kernels' own
/// allocations, the caller's tensors): 5% of the GPU, at least 512 MiB.
fn reserve(total: u64) -> u64 {
    (total / 20).max(512 << 20)
}

/// A CUDA GPU as strata's device tier.
pub struct CudaBackend {
    ctx: Context,
    h2d_stream: Stream,
    d2h_stream: Stream,
    capacity: u64,
    name: String,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
}

impl CudaBackend {
    /// Opens GPU `ordinal`; strata may use its free memory minus a reserve,
    /// at most `cap` bytes (to emulate a smaller GPU).
    pub fn new(ordinal: usize, cap: u64) -> Result<Self> {
        let ctx = Context::open(ordinal)?;
        let (free, total) = ctx.memory_info()?;
        let capacity = free.saturating_sub(reserve(total)).min(cap);
        Ok(Self {
            h2d_stream: ctx.stream()?,
            d2h_stream: ctx.stream()?,
            name: ctx.name(),
            ctx,
            capacity,
            h2d: Arc::new(LinkCounter::default()),
            d2h: Arc::new(LinkCounter::default()),
        })
    }

    /// The CUDA context (for kernels: see `hotness.rs`).
    pub fn context(&self) -> &Context {
        &self.ctx
    }
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
        Ok(Box::new(CudaMemory {
            memory: DeviceBuffer::alloc(&self.ctx, bytes)?,
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
        // SAFETY: the caller guarantees the range stays mapped while the
        // registration lives (the guard below is the registration).
        let registered = unsafe { RegisteredHost::new(&self.ctx, base, len)? };
        Ok(Some(HostRegistration {
            device_base: registered.device_address(),
            guard: Box::new(registered),
        }))
    }
}

/// One allocation of device memory, copied on the backend's streams.
struct CudaMemory {
    memory: DeviceBuffer<u8>,
    h2d_stream: Stream,
    d2h_stream: Stream,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
}

impl DeviceMemory for CudaMemory {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn device_address(&self, offset: usize) -> u64 {
        self.memory.device_address() + offset as u64
    }

    unsafe fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: the caller's contract (the range is theirs alone).
        unsafe { self.copy_in_many(&[(offset, src)]) }
    }

    unsafe fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's contract (no one writes the range).
        unsafe { self.copy_out_many(&mut [(offset, dst)]) }
    }

    unsafe fn copy_in_many(&self, copies: &[(usize, &[u8])]) -> Result<()> {
        let t = Instant::now();
        // SAFETY: the caller guarantees the ranges are theirs alone and do
        // not overlap; the copies are complete when this returns.
        unsafe { self.h2d_stream.write_many(&self.memory, copies)? };
        let bytes = copies.iter().map(|(_, src)| src.len()).sum();
        self.h2d.record(bytes, t.elapsed(), Duration::ZERO);
        Ok(())
    }

    unsafe fn copy_out_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<()> {
        let t = Instant::now();
        // SAFETY: the caller guarantees no one writes the ranges meanwhile;
        // the copies are complete when this returns.
        unsafe { self.d2h_stream.read_many(&self.memory, copies)? };
        let bytes = copies.iter().map(|(_, dst)| dst.len()).sum();
        self.d2h.record(bytes, t.elapsed(), Duration::ZERO);
        Ok(())
    }
}
