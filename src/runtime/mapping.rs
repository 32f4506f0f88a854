//! The storage of a buffer's device map: one 64-bit address per page that
//! kernels translate through, a copy in device memory on cuda, and the
//! per-page access counters CUDA kernels count into. The page table points
//! an entry at a page's new home when a move commits; `map.rs` fills the
//! map and hands it to kernels.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::device::{BackendKind, DeviceCounters, DeviceWords};
use crate::error::Result;
use crate::tier::DeviceStore;

/// The map's storage.
pub(crate) struct MapShared {
    /// The map as the host (and the simulated device) sees it.
    pub(crate) entries: Box<[AtomicU64]>,
    /// Whether each entry points into device memory (for accounting).
    pub(crate) on_device: Box<[AtomicBool]>,
    /// Its copy in device memory, on cuda.
    pub(crate) device: Option<DeviceWords>,
    /// Per-page access counters in device memory for CUDA kernels, on
    /// cuda; drained into the buffer's counters when its launches end.
    pub(crate) device_counters: Option<DeviceCounters>,
    pub(crate) page_size: usize,
}

impl MapShared {
    /// A map of `pages` entries, with its device copies when `device` runs
    /// on cuda.
    pub(crate) fn new(
        pages: usize,
        device: Option<&DeviceStore>,
        page_size: usize,
    ) -> Result<Self> {
        let cuda = device.filter(|d| d.backend() == BackendKind::Cuda);
        let words = cuda
            .map(|d| DeviceWords::new(d.backend_handle(), pages))
            .transpose()?;
        let device_counters = cuda
            .map(|d| DeviceCounters::new(d.backend_handle(), pages))
            .transpose()?;
        Ok(Self {
            entries: (0..pages).map(|_| AtomicU64::new(0)).collect(),
            on_device: (0..pages).map(|_| AtomicBool::new(false)).collect(),
            device: words,
            device_counters,
            page_size,
        })
    }

    /// Points page `p` at `address`. The device copy (on cuda) follows at
    /// once only while a launch may read it (`live`): otherwise the next
    /// launch's `prepare` uploads every entry in one copy, and a copy per
    /// move would cost a synchronous transfer each for nothing.
    pub(crate) fn set(&self, p: usize, address: u64, on_device: bool, live: bool) {
        self.on_device[p].store(on_device, Ordering::Relaxed);
        self.entries[p].store(address, Ordering::Release);
        if let (Some(d), true) = (&self.device, live) {
            // An error leaves the device copy stale until the next
            // `prepare`, which uploads every entry and reports it.
            let _ = d.set(p, address);
        }
    }
}
