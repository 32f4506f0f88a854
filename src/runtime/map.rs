//! Device maps: per buffer, one 64-bit address per page that kernels
//! translate through (the EMOGI/BaM idea) — device memory for pages in the
//! device tier, the kernel-visible address of registered host memory for
//! pages in DRAM or CXL.
//!
//! [`DeviceMap::prepare`] starts a launch: it stages NVMe pages (and
//! materializes never-written ones) into memory tiers, fills the map and
//! returns a [`Launch`] guard. While a launch lives, no mapped page leaves
//! memory. Under a read-only launch pages may still be promoted: the page is
//! copied to its faster tier, its map entry swapped (one 64-bit store), and
//! the old copy stays allocated until the last launch ends, so a kernel
//! that loaded the old address keeps reading valid, identical bytes;
//! writes through the runtime are refused meanwhile. Under a read-write
//! launch nothing in memory moves at all.
//!
//! On the simulated device the map is host memory and "kernels" are Rust
//! code reading through [`Launch::load`]; on cuda the map is also copied to
//! device memory ([`Launch::map_address`]) for CUDA kernels.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::table::{lost, Lost, Resident, Table, Zero};
use crate::device::DeviceWords;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::{DeviceStore, Tier};

/// What a launch's kernels do with the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Kernels only read: pages may be promoted while they run; writes
    /// through the runtime are refused until the launch ends.
    ReadOnly,
    /// Kernels may write: no page in memory moves while they run.
    ReadWrite,
}

/// The map's storage.
pub(crate) struct MapShared {
    /// The map as the host (and the simulated device) sees it.
    entries: Box<[AtomicU64]>,
    /// Per-page access counts bumped by simulated kernels.
    counters: Box<[AtomicU32]>,
    /// Its copy in device memory, on cuda.
    device: Option<DeviceWords>,
    page_size: usize,
}

impl MapShared {
    /// Points page `p` at `address` (one 64-bit store on either side).
    pub(crate) fn set(&self, p: usize, address: u64) {
        self.entries[p].store(address, Ordering::Release);
        if let Some(d) = &self.device {
            // An error leaves the device copy stale until the next
            // `prepare`, which uploads every entry and reports it.
            let _ = d.set(p, address);
        }
    }
}

/// A buffer's device map; see the [module docs](self).
pub struct DeviceMap {
    table: Arc<Table>,
    shared: Arc<MapShared>,
}

impl std::fmt::Debug for DeviceMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMap")
            .field("pages", &self.shared.entries.len())
            .finish()
    }
}

impl DeviceMap {
    /// The buffer's map, made on first use.
    pub(crate) fn of(table: &Arc<Table>) -> Result<Self> {
        let mut slot = table.map.lock();
        let shared = match &*slot {
            Some(s) => s.clone(),
            None => {
                let n = table.pages.len();
                let device = table
                    .rt
                    .store(Tier::Device)
                    .and_then(|s| s.as_any().downcast_ref::<DeviceStore>())
                    .filter(|d| d.backend() == crate::device::BackendKind::Cuda)
                    .map(|d| DeviceWords::new(d.backend_handle(), n))
                    .transpose()?;
                let s = Arc::new(MapShared {
                    entries: (0..n).map(|_| AtomicU64::new(0)).collect(),
                    counters: (0..n).map(|_| AtomicU32::new(0)).collect(),
                    device,
                    page_size: table.rt.page_size(),
                });
                *slot = Some(s.clone());
                s
            }
        };
        Ok(Self {
            table: table.clone(),
            shared,
        })
    }

    /// Pages mapped.
    pub fn pages(&self) -> usize {
        self.shared.entries.len()
    }

    /// Makes every page addressable by kernels (NVMe pages staged into a
    /// memory tier, never-written pages materialized as zeros), fills the
    /// map and returns the launch guard. Fails with `OutOfCapacity` when the
    /// memory tiers cannot hold the whole buffer.
    pub fn prepare(&self, access: Access) -> Result<Launch<'_>> {
        let table = &self.table;
        {
            let mut l = table.launches.lock();
            match access {
                Access::ReadOnly => l.read_only += 1,
                Access::ReadWrite => l.read_write += 1,
            }
        }
        // From here the guard ends the launch on every way out.
        let launch = Launch { map: self, access };
        let memory: Vec<Tier> = table
            .rt
            .stores()
            .map(|s| s.tier())
            .filter(|&t| t != Tier::Nvme)
            .collect();

        // 1. NVMe pages into a memory tier, host first (a staging tier: the
        // balancer promotes what is hot), after making room by moving pages
        // of other buffers to NVMe where the memory tiers are too full.
        let (mut on_nvme, mut zero) = (Vec::new(), 0usize);
        for (p, e) in table.pages.iter().enumerate() {
            match &e.lock().loc {
                Resident {
                    tier: Tier::Nvme, ..
                } => on_nvme.push(p),
                Zero => zero += 1,
                _ => {}
            }
        }
        let free = |tiers: &[Tier]| -> usize {
            tiers
                .iter()
                .filter_map(|&t| table.rt.store(t))
                .map(|s| s.capacity_pages().saturating_sub(s.used_pages()) as usize)
                .sum()
        };
        let mut staging: Vec<Tier> = memory
            .iter()
            .copied()
            .filter(|&t| t != Tier::Device)
            .collect();
        staging.extend(memory.iter().copied().filter(|&t| t == Tier::Device));
        let mut left = on_nvme;
        loop {
            // Room for what is left, as far as NVMe can take other pages
            // (each page staged frees an NVMe slot for the next round).
            let short = (left.len() + zero).saturating_sub(free(&memory));
            if short > 0 {
                let nvme_free = free(&[Tier::Nvme]);
                super::reclaim::make_room(&table.rt, short.min(nvme_free));
            }
            let before = left.len();
            for &t in &staging {
                if left.is_empty() {
                    break;
                }
                left = table.move_batched(&left, t, &|src| src == Tier::Nvme)?;
            }
            let staged = before - left.len();
            table
                .rt
                .counters
                .faults
                .fetch_add(staged as u64, Ordering::Relaxed);
            if left.is_empty() || staged == 0 {
                break;
            }
        }

        // 2. Every entry, materializing never-written pages.
        let zeros = vec![0u8; table.rt.page_size()];
        let mut values = Vec::with_capacity(table.pages.len());
        for p in 0..table.pages.len() {
            let mut entry = table.pages[p].lock();
            if matches!(entry.loc, Zero) {
                entry.loc = table.first_write(&zeros, Some(&memory))?;
            }
            let address = match &entry.loc {
                Resident { tier, slot } if *tier != Tier::Nvme => {
                    table.store(*tier).kernel_address(slot)
                }
                Lost => return Err(lost(p)),
                _ => {
                    return Err(Error::new(
                        ErrorKind::OutOfCapacity,
                        format!(
                            "page {p} cannot be staged into a memory tier: all full ({})",
                            table.rt.capacity_report()
                        ),
                    ))
                }
            };
            self.shared.entries[p].store(address, Ordering::Release);
            values.push(address);
        }
        if let Some(d) = &self.shared.device {
            d.upload(0, &values)?;
        }
        Ok(launch)
    }

    /// [`prepare`](Self::prepare) for holders that cannot keep a borrow of
    /// the map alive (the C ABI's handle tables): the guard holds its own
    /// reference to the map and ends the launch when it drops.
    pub fn prepare_owned(&self, access: Access) -> Result<OwnedLaunch> {
        let launch = self.prepare(access)?;
        // The owned guard ends the launch instead (a `Launch` holds nothing
        // but the borrow and the access mode).
        let _ = std::mem::ManuallyDrop::new(launch);
        Ok(OwnedLaunch {
            map: DeviceMap {
                table: self.table.clone(),
                shared: self.shared.clone(),
            },
            access,
        })
    }

    /// Each page's access count so far (simulated kernels bump them).
    pub fn counts(&self) -> Vec<u32> {
        self.shared
            .counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// A prepared map while kernels run; see [`DeviceMap::prepare`].
#[must_use = "the launch ends when the guard drops"]
pub struct Launch<'a> {
    map: &'a DeviceMap,
    access: Access,
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("access", &self.access)
            .field("pages", &self.map.pages())
            .finish()
    }
}

impl Launch<'_> {
    /// Where kernels find the map: a device address on cuda, a host
    /// address on the simulated device.
    pub fn map_address(&self) -> u64 {
        match &self.map.shared.device {
            Some(d) => d.address(),
            None => self.map.shared.entries.as_ptr() as u64,
        }
    }

    /// Page `p`'s current entry.
    pub fn entry(&self, p: usize) -> u64 {
        self.map.shared.entries[p].load(Ordering::Acquire)
    }

    /// Reads element `index` of the buffer seen as an array of `T`, the way
    /// a kernel does: through the map, bumping the page's counter. Simulated
    /// device and read-only launches only (cuda kernels read device memory
    /// the host cannot dereference).
    ///
    /// # Panics
    /// When `index` is beyond the buffer, `T`'s size does not divide the
    /// page size, the launch is read-write, or the map lives on a GPU —
    /// like slice indexing, these are bugs in the calling kernel.
    #[inline]
    pub fn load<T: bytemuck::Pod>(&self, index: u64) -> T {
        let shared = &*self.map.shared;
        let size = std::mem::size_of::<T>();
        assert!(
            self.access == Access::ReadOnly && shared.device.is_none(),
            "Launch::load needs a read-only launch on the simulated device"
        );
        assert!(
            size > 0 && shared.page_size % size == 0,
            "element size must divide the page size"
        );
        let offset = index
            .checked_mul(size as u64)
            .filter(|&o| o + size as u64 <= self.map.table.len)
            .unwrap_or_else(|| panic!("index {index} is beyond the buffer"));
        let page = (offset / shared.page_size as u64) as usize;
        let within = (offset % shared.page_size as u64) as usize;
        shared.counters[page].fetch_add(1, Ordering::Relaxed);
        let base = shared.entries[page].load(Ordering::Acquire);
        // SAFETY: `prepare` stored in every entry the host address of a slot
        // of a memory tier (on the simulated device, device memory is host
        // memory too). While this read-only launch lives: no mapped page
        // leaves memory; a promotion swaps the entry but retires the old
        // slot instead of freeing it (freed when the last launch ends); and
        // writes through the runtime are refused, so no one writes these
        // bytes. `within + size <= page_size` since `size` divides the page
        // size and `offset` is a multiple of `size`. The read is unaligned-safe.
        unsafe { std::ptr::read_unaligned((base as usize + within) as *const T) }
    }
}

impl Drop for Launch<'_> {
    fn drop(&mut self) {
        let table = &self.map.table;
        let retired = {
            let mut l = table.launches.lock();
            match self.access {
                Access::ReadOnly => l.read_only -= 1,
                Access::ReadWrite => l.read_write -= 1,
            }
            if l.read_only + l.read_write == 0 {
                std::mem::take(&mut l.retired)
            } else {
                Vec::new()
            }
        };
        table.free_retired(retired);
    }
}

/// A [`Launch`] that owns a reference to its map; see
/// [`DeviceMap::prepare_owned`].
#[must_use = "the launch ends when the guard drops"]
pub struct OwnedLaunch {
    map: DeviceMap,
    access: Access,
}

impl std::fmt::Debug for OwnedLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.launch().fmt(f)
    }
}

impl OwnedLaunch {
    /// The borrowed guard's view, which must not end the launch.
    fn launch(&self) -> std::mem::ManuallyDrop<Launch<'_>> {
        std::mem::ManuallyDrop::new(Launch {
            map: &self.map,
            access: self.access,
        })
    }

    /// The launch's access mode.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Pages mapped.
    pub fn pages(&self) -> usize {
        self.map.pages()
    }

    /// As [`Launch::map_address`].
    pub fn map_address(&self) -> u64 {
        self.launch().map_address()
    }

    /// As [`Launch::entry`].
    pub fn entry(&self, p: usize) -> u64 {
        self.launch().entry(p)
    }
}

impl Drop for OwnedLaunch {
    fn drop(&mut self) {
        drop(Launch {
            map: &self.map,
            access: self.access,
        });
    }
}
