//! The simulated device: "device memory" is a host arena under a capacity
//! budget, and every copy across the simulated PCIe link is accounted by a
//! link model (bandwidth and latency; PCIe Gen4 x16 by default) as modelled
//! time beside the wall time it really took. Copies are not slowed down:
//! the modelled time is reported, never slept, so tests stay fast and a
//! simulated figure is always labelled as one.

use std::sync::Arc;
use std::time::Instant;

use super::traits::{BackendKind, DeviceBackend, DeviceMemory, HostRegistration};
use crate::error::{Error, ErrorKind, Result};
use crate::link::{LinkCounter, LinkModel, LinkStats};
use crate::sys::Arena;

/// The simulated GPU's default size: 1 GiB.
pub const DEFAULT_CAPACITY: u64 = 1 << 30;

/// PCIe Gen4 x16 as the simulation's default: 25 GB/s sustained, 5 µs per
/// transfer (launch and DMA setup).
pub const PCIE_GEN4_X16: LinkModel = LinkModel {
    bandwidth: 25e9,
    latency_ns: 5_000,
};

/// The simulated GPU.
#[derive(Debug)]
pub struct SimBackend {
    capacity: u64,
    model: LinkModel,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
    /// Bytes of live allocations (the budget holds for all of them).
    allocated: Arc<std::sync::atomic::AtomicU64>,
}

impl SimBackend {
    /// A simulated device with `capacity` bytes of memory behind `model`.
    pub fn new(capacity: u64, model: LinkModel) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::invalid("simulated device capacity is zero"));
        }
        model.check()?;
        Ok(Self {
            capacity,
            model,
            h2d: Arc::new(LinkCounter::default()),
            d2h: Arc::new(LinkCounter::default()),
            allocated: Arc::default(),
        })
    }
}

impl DeviceBackend for SimBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sim
    }

    fn description(&self) -> String {
        format!(
            "simulated device: host memory behind a {:.0} GB/s, {} µs link",
            self.model.bandwidth / 1e9,
            self.model.latency_ns as f64 / 1e3
        )
    }

    unsafe fn register_host(
        &self,
        _base: std::ptr::NonNull<u8>,
        _len: usize,
    ) -> Result<Option<HostRegistration>> {
        // The simulated device's "kernels" run on the CPU and read host
        // memory where it is.
        Ok(None)
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>> {
        use std::sync::atomic::Ordering;
        let taken = self
            .allocated
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let total = used.checked_add(bytes as u64)?;
                (total <= self.capacity).then_some(total)
            });
        if taken.is_err() {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "simulated device holds {} bytes, {} of them allocated; {bytes} requested",
                    self.capacity,
                    self.allocated.load(Ordering::Acquire)
                ),
            ));
        }
        let arena = Arena::new(bytes, true, None).inspect_err(|_| {
            self.allocated.fetch_sub(bytes as u64, Ordering::AcqRel);
        })?;
        Ok(Box::new(SimMemory {
            arena: Arc::new(arena),
            allocated: self.allocated.clone(),
            len: bytes,
            model: self.model,
            h2d: self.h2d.clone(),
            d2h: self.d2h.clone(),
        }))
    }

    fn link_stats(&self) -> (LinkStats, LinkStats) {
        (self.h2d.stats(), self.d2h.stats())
    }

    fn link_model(&self) -> Option<LinkModel> {
        Some(self.model)
    }
}

struct SimMemory {
    arena: Arc<Arena>,
    allocated: Arc<std::sync::atomic::AtomicU64>,
    len: usize,
    model: LinkModel,
    h2d: Arc<LinkCounter>,
    d2h: Arc<LinkCounter>,
}

impl Drop for SimMemory {
    fn drop(&mut self) {
        self.allocated
            .fetch_sub(self.len as u64, std::sync::atomic::Ordering::AcqRel);
    }
}

impl DeviceMemory for SimMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn device_address(&self, offset: usize) -> u64 {
        self.arena.base().as_ptr() as u64 + offset as u64
    }

    fn host_arena(&self) -> Option<Arc<Arena>> {
        Some(self.arena.clone())
    }

    fn record_h2d(&self, bytes: usize, wall: std::time::Duration) {
        self.h2d.record(bytes, wall, self.model.time(bytes));
    }

    fn commit(&self) {
        self.arena.populate();
    }

    unsafe fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()> {
        let t = Instant::now();
        // SAFETY: the caller guarantees `offset + src.len() <= len` and
        // exclusive use of that range (DeviceMemory::copy_in's contract);
        // the arena is at least `len` bytes and lives as long as `self`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.arena.base().as_ptr().add(offset),
                src.len(),
            )
        };
        self.h2d
            .record(src.len(), t.elapsed(), self.model.time(src.len()));
        Ok(())
    }

    unsafe fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let t = Instant::now();
        // SAFETY: as in `copy_in`; no one writes the range while we read it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.arena.base().as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        self.d2h
            .record(dst.len(), t.elapsed(), self.model.time(dst.len()));
        Ok(())
    }

    unsafe fn copy_in_many(&self, copies: &[(usize, &[u8])]) -> Result<()> {
        let t = Instant::now();
        let mut bytes = 0;
        for &(offset, src) in copies {
            // SAFETY: as in `copy_in`, per copy (the caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    self.arena.base().as_ptr().add(offset),
                    src.len(),
                )
            };
            bytes += src.len();
        }
        // Queued back to back, the copies pay the link's latency once.
        self.h2d.record(bytes, t.elapsed(), self.model.time(bytes));
        Ok(())
    }

    unsafe fn copy_out_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<()> {
        let t = Instant::now();
        let mut bytes = 0;
        for (offset, dst) in copies.iter_mut() {
            // SAFETY: as in `copy_out`, per copy (the caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.arena.base().as_ptr().add(*offset),
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            };
            bytes += dst.len();
        }
        self.d2h.record(bytes, t.elapsed(), self.model.time(bytes));
        Ok(())
    }
}
