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
//! device memory ([`Launch::map_address`]) for CUDA kernels, which count
//! their accesses into per-page counters in device memory
//! ([`Launch::counters_address`]); when the buffer's last launch ends the
//! runtime adds those counts to the buffer's own, which the balancer and
//! `harvest` read.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::accounting::Counters;
use super::inner::Inner;
use super::mapping::MapShared;
use super::page::one_more;
use super::record::TraceSink;
use super::request::{Priority, Request, Source};
use super::table::{lost, Lost, Resident, Table, Zero};
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

/// What a launch's kernels do with the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Kernels only read: pages may be promoted while they run; writes
    /// through the runtime are refused until the launch ends.
    ReadOnly,
    /// Kernels may write: no page in memory moves while they run.
    ReadWrite,
}

/// A buffer's device map: one address per page that kernels translate
/// through; see [`DeviceMap::prepare`] and [`Launch`].
pub struct DeviceMap {
    table: Arc<Table>,
    rt: Arc<Inner>,
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
    pub(crate) fn of(table: &Arc<Table>, rt: &Arc<Inner>) -> Result<Self> {
        let mut slot = table.map.lock();
        let shared = match &*slot {
            Some(s) => s.clone(),
            None => {
                let s = Arc::new(MapShared::new(
                    table.pages.len(),
                    table.rt.tiers.device(),
                    table.rt.page_size(),
                )?);
                *slot = Some(s.clone());
                s
            }
        };
        Ok(Self {
            table: table.clone(),
            rt: rt.clone(),
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
    /// memory tiers cannot hold the whole buffer, and with `InvalidArgument`
    /// while a launch of the buffer in the other mode is live (read-only and
    /// read-write launches exclude each other; launches of one mode may
    /// overlap) or a borrowed view forbids it.
    pub fn prepare(&self, access: Access) -> Result<Launch<'_>> {
        let table = &self.table;
        {
            let mut l = table.launches.lock();
            if l.dropped || l.closed {
                return Err(Error::new(
                    ErrorKind::Closed,
                    "the buffer of this device map was freed",
                ));
            }
            if l.exclusive || (access == Access::ReadWrite && l.views > 0) {
                return Err(Error::invalid(
                    "a borrowed view of the buffer is live (Buffer::view): read-write launches, and any launch during a mutable view, wait until it drops",
                ));
            }
            // A read-only launch lends its kernels the bytes as unchanging
            // (on the simulated device as `&[u8]`: Reader::page), which a
            // read-write launch of the same buffer could write under them.
            let (others, other, this) = match access {
                Access::ReadOnly => (l.read_write, "read-write", "read-only"),
                Access::ReadWrite => (l.read_only, "read-only", "read-write"),
            };
            if others > 0 {
                return Err(Error::invalid(format!(
                    "a {other} launch of the buffer is live: a {this} launch waits until it ends (read-only launches read the bytes as unchanging)"
                )));
            }
            match access {
                Access::ReadOnly => one_more(&mut l.read_only),
                Access::ReadWrite => one_more(&mut l.read_write),
            }
        }
        // From here the guard ends the launch on every way out.
        let launch = Launch::new(self, access, next_epoch());
        let memory = table.rt.tiers.memory();
        self.stage(&memory)?;
        self.fill(&memory, access)?;
        Ok(launch)
    }

    /// NVMe pages into a memory tier, host first (a staging tier: the
    /// balancer promotes what is hot), after making room by moving pages of
    /// other buffers to NVMe where the memory tiers are too full.
    fn stage(&self, memory: &[Tier]) -> Result<()> {
        let table = &self.table;
        let tiers = &table.rt.tiers;
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
        let mut staging: Vec<Tier> = memory
            .iter()
            .copied()
            .filter(|&t| t != Tier::Device)
            .collect();
        staging.extend(memory.iter().copied().filter(|&t| t == Tier::Device));
        let mut left = on_nvme;
        loop {
            // Room for what is left, as far as NVMe can take other pages
            // (each page staged frees an NVMe slot for the next round): in
            // its free slots, and onto the clean copies it holds of pages in
            // memory (demoted with no I/O; a full NVMe gives those up for
            // the others).
            let short = (left.len() + zero).saturating_sub(tiers.free_pages(memory));
            if short > 0 {
                let nvme_room = tiers.free_pages(&[Tier::Nvme])
                    + table.rt.acct.clean_copies(Tier::Nvme) as usize;
                self.rt.mover.make_room_for_launch(short.min(nvme_room));
            }
            let before = left.len();
            for &t in &staging {
                if left.is_empty() {
                    break;
                }
                let request = Request {
                    pages: left,
                    dst: t,
                    from: Source::Only(Tier::Nvme),
                    priority: Priority::Demand,
                    room: None,
                };
                left = self.rt.mover.run(table, request)?;
            }
            let staged = before - left.len();
            Counters::add(&table.rt.counters().faults, staged as u64);
            if left.is_empty() || staged == 0 {
                return Ok(());
            }
        }
    }

    /// Every entry, materializing never-written pages (in `memory`).
    fn fill(&self, memory: &[Tier], access: Access) -> Result<()> {
        let table = &self.table;
        let zeros = vec![0u8; table.rt.page_size()];
        let mut values = Vec::with_capacity(table.pages.len());
        for p in 0..table.pages.len() {
            let mut entry = table.pages[p].lock();
            if matches!(entry.loc, Zero) {
                entry.loc = self.rt.mover.first_write(table, &zeros, Some(memory))?;
            }
            // A move that copied the page before this launch does not
            // commit (the entry names the page's slot now). Kernels may
            // write through a read-write map: the clean copy goes; a
            // read-only launch leaves it, so that a demotion after the
            // launch still needs no copy.
            match access {
                Access::ReadWrite => table.note_write(&mut entry),
                Access::ReadOnly => entry.note_mapped(),
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
            self.shared.on_device[p].store(entry.tier() == Some(Tier::Device), Ordering::Relaxed);
            self.shared.entries[p].store(address, Ordering::Release);
            values.push(address);
        }
        if let Some(d) = &self.shared.device {
            d.upload(0, &values)?;
            // A promotion under another launch may have swapped an entry
            // while the bulk upload was on its way: send those again.
            for (p, &v) in values.iter().enumerate() {
                let now = self.shared.entries[p].load(Ordering::Acquire);
                if now != v {
                    d.set(p, now)?;
                }
            }
        }
        Ok(())
    }

    /// [`prepare`](Self::prepare) for holders that cannot keep a borrow of
    /// the map alive (the C ABI's handle tables): the guard holds its own
    /// reference to the map and ends the launch when it drops.
    pub fn prepare_owned(&self, access: Access) -> Result<OwnedLaunch> {
        let launch = self.prepare(access)?;
        let epoch = launch.epoch;
        // The owned guard ends the launch instead (a `Launch` holds nothing
        // but the borrow, the access mode and its number).
        let _ = std::mem::ManuallyDrop::new(launch);
        Ok(OwnedLaunch {
            map: DeviceMap {
                table: self.table.clone(),
                rt: self.rt.clone(),
                shared: self.shared.clone(),
            },
            access,
            epoch,
        })
    }

    /// Each page's access count since the last harvest (kernels and the
    /// runtime's reads and writes bump them, sampled as configured).
    pub fn counts(&self) -> Vec<u32> {
        self.table
            .counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    /// Adds `counts` (one per page, in page order) to the pages' access
    /// counts: how CUDA kernels that count accesses in device memory (the
    /// graph kernels count into one u32 per page, copied back after each
    /// launch) hand them to the balancer.
    pub fn add_counts(&self, counts: &[u32]) -> Result<()> {
        let counters = &self.table.counters;
        if counts.len() != counters.len() {
            return Err(Error::invalid(format!(
                "{} counts for a map of {} pages",
                counts.len(),
                counters.len()
            )));
        }
        for (c, &n) in counters.iter().zip(counts) {
            crate::hotness::count_many(c, n);
        }
        Ok(())
    }
}

/// A prepared map while kernels run; see [`DeviceMap::prepare`]. Drop it
/// only once the launch's kernels have finished: dropping it frees the
/// old copies of pages promoted meanwhile, which a kernel may still read.
#[must_use = "the launch ends when the guard drops"]
pub struct Launch<'a> {
    map: &'a DeviceMap,
    access: Access,
    /// What `load` needs, looked up once per launch.
    entries: &'a [AtomicU64],
    counters: &'a [std::sync::atomic::AtomicU32],
    shift: Option<u32>,
    trace: &'a TraceSink,
    buffer: u32,
    page_shift: u32,
    len: u64,
    host_readable: bool,
    /// This launch's number in the process: mixed into its readers' seeds,
    /// so that a kernel run again samples other accesses.
    epoch: u64,
}

/// A new launch's number.
fn next_epoch() -> u64 {
    static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("access", &self.access)
            .field("pages", &self.map.pages())
            .finish()
    }
}

impl<'a> Launch<'a> {
    /// The guard of a launch already counted in the table.
    fn new(map: &'a DeviceMap, access: Access, epoch: u64) -> Self {
        let table = &map.table;
        Launch {
            map,
            access,
            entries: &map.shared.entries,
            counters: &table.counters,
            shift: table.rt.sample_shift,
            trace: &table.rt.trace,
            buffer: table.id,
            page_shift: map.shared.page_size.trailing_zeros(),
            len: table.len,
            host_readable: access == Access::ReadOnly && map.shared.device.is_none(),
            epoch,
        }
    }

    /// Where kernels find the map: a device address on cuda, a host
    /// address on the simulated device.
    pub fn map_address(&self) -> u64 {
        match &self.map.shared.device {
            Some(d) => d.address(),
            None => self.map.shared.entries.as_ptr() as u64,
        }
    }

    /// Page `p`'s current entry.
    ///
    /// # Panics
    /// If `p` is not below [`pages`](DeviceMap::pages) (as indexing does;
    /// this sits on a kernel's path).
    pub fn entry(&self, p: usize) -> u64 {
        self.entries[p].load(Ordering::Acquire)
    }

    /// Where kernels count their accesses (`counters` of `strata_touch` /
    /// `strata_load`, one u32 per page): device memory on cuda, added to
    /// the buffer's counters when its last launch ends; on the simulated
    /// device the buffer's counters themselves, in host memory (Rust
    /// kernels count through [`load`](Self::load) and [`reader`](Self::reader)).
    /// 0 while the runtime's sampling is off: a kernel given it counts
    /// nothing (`strata_touch` skips a null array).
    pub fn counters_address(&self) -> u64 {
        if self.shift.is_none() {
            return 0;
        }
        match &self.map.shared.device_counters {
            Some(c) => c.address(),
            None => self.counters.as_ptr() as u64,
        }
    }

    /// The `shift` kernels sample with (`strata_touch` counts one access
    /// in 2^shift): the runtime's sampling, which the balancer scales the
    /// counts back by; `None` while sampling is off (and
    /// [`counters_address`](Self::counters_address) is 0).
    pub fn sample_shift(&self) -> Option<u32> {
        self.shift
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
        let (page, address) = self.locate::<T>(index);
        crate::hotness::touch(self.counters, page, self.shift);
        self.trace.record(self.buffer, page);
        // SAFETY: `locate` returned the address of `size_of::<T>()` bytes
        // inside a mapped page, readable while this launch lives (see there).
        unsafe { std::ptr::read_unaligned(address as *const T) }
    }

    /// A kernel thread's view: loads like [`load`](Self::load), counting
    /// accesses on the thread's own sampler (no thread-local state on the
    /// access path, as a GPU thread keeps its sampler in registers). Give
    /// each thread of a launch a different `seed`; the launch's own number
    /// is mixed in, so the same kernel launched again samples other
    /// accesses.
    pub fn reader(&self, seed: u64) -> Reader<'_, '_> {
        Reader {
            launch: self,
            sampler: crate::hotness::Sampler::new(
                seed ^ crate::hotness::mix(self.epoch ^ 0x5EED_0F1A_0C4E),
            ),
        }
    }

    /// Page and host address of element `index` of the buffer as `[T]`.
    #[inline]
    fn locate<T: bytemuck::Pod>(&self, index: u64) -> (usize, usize) {
        let size = std::mem::size_of::<T>();
        assert!(
            self.host_readable,
            "Launch::load needs a read-only launch on the simulated device"
        );
        assert!(
            size > 0 && (1usize << self.page_shift) % size == 0,
            "element size must divide the page size"
        );
        let offset = index
            .checked_mul(size as u64)
            .filter(|&o| {
                o.checked_add(size as u64)
                    .is_some_and(|end| end <= self.len)
            })
            .unwrap_or_else(|| panic!("index {index} is beyond the buffer"));
        let page = (offset >> self.page_shift) as usize;
        let within = (offset & ((1u64 << self.page_shift) - 1)) as usize;
        let base = self.entries[page].load(Ordering::Acquire);
        // `prepare` stored in every entry the host address of a slot of a
        // memory tier (on the simulated device, device memory is host memory
        // too). While this read-only launch lives: no mapped page leaves
        // memory; a promotion swaps the entry but retires the old slot
        // instead of freeing it (freed when the last launch ends); and writes
        // through the runtime are refused, so no one writes these bytes.
        // `within + size <= page_size` since `size` divides the page size and
        // `offset` is a multiple of `size`.
        (page, base as usize + within)
    }
}

/// One kernel thread's reads through a launch; see [`Launch::reader`].
pub struct Reader<'l, 'a> {
    launch: &'l Launch<'a>,
    sampler: crate::hotness::Sampler,
}

impl<'l> Reader<'l, '_> {
    /// As [`load`](Self::load), also returning the element's page and
    /// whether that page was in device memory when read (for benchmarks'
    /// accounting of device hits and zero-copy reads).
    #[inline]
    pub fn load_at<T: bytemuck::Pod>(&mut self, index: u64) -> (T, usize, bool) {
        let l = self.launch;
        let (page, address) = l.locate::<T>(index);
        let on_device = l.map.shared.on_device[page].load(Ordering::Relaxed);
        if let Some(shift) = l.shift {
            if self.sampler.hit(shift) {
                crate::hotness::count_one(&l.counters[page]);
            }
        }
        l.trace.record(l.buffer, page);
        // SAFETY: as in `Launch::load`.
        (
            unsafe { std::ptr::read_unaligned(address as *const T) },
            page,
            on_device,
        )
    }

    /// Page `page`'s bytes as this launch's kernels read them (its last
    /// page ends with the buffer), and whether the page was in device
    /// memory when looked up: for simulated kernels that read a page many
    /// times, look it up once and count each access with
    /// [`touch`](Self::touch). The view is valid while the launch lives —
    /// for a read-only launch on the simulated device, the same guarantee
    /// [`load`](Self::load) relies on.
    ///
    /// # Panics
    /// When `page` is beyond the buffer, or the launch is not a read-only
    /// one on the simulated device (as [`Launch::load`]).
    #[inline]
    pub fn page(&self, page: usize) -> (&'l [u8], bool) {
        let l = self.launch;
        assert!(
            l.host_readable,
            "Reader::page needs a read-only launch on the simulated device"
        );
        let size = 1u64 << l.page_shift;
        let start = page as u64 * size;
        assert!(start < l.len, "page {page} is beyond the buffer");
        let len = size.min(l.len - start) as usize;
        let base = l.entries[page].load(Ordering::Acquire);
        let on_device = l.map.shared.on_device[page].load(Ordering::Relaxed);
        // SAFETY: as in `Launch::locate`: the entry holds the host address
        // of a slot of at least a page, readable and unwritten while this
        // read-only launch lives, and the returned borrow cannot outlive
        // the launch (lifetime `'l`, this reader's borrow of it); `len`
        // is at most a page.
        let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
        (bytes, on_device)
    }

    /// Counts one access of page `page` on this reader's sampler (and in
    /// the runtime's trace), as [`load`](Self::load) does: pair it with
    /// reads from [`page`](Self::page).
    ///
    /// # Panics
    /// If `page` is not a page of the buffer (as indexing does).
    #[inline]
    pub fn touch(&mut self, page: usize) {
        let l = self.launch;
        if let Some(shift) = l.shift {
            if self.sampler.hit(shift) {
                crate::hotness::count_one(&l.counters[page]);
            }
        }
        l.trace.record(l.buffer, page);
    }

    /// As [`Launch::load`], counted on this reader's sampler.
    #[inline]
    pub fn load<T: bytemuck::Pod>(&mut self, index: u64) -> T {
        let l = self.launch;
        let (page, address) = l.locate::<T>(index);
        if let Some(shift) = l.shift {
            if self.sampler.hit(shift) {
                crate::hotness::count_one(&l.counters[page]);
            }
        }
        l.trace.record(l.buffer, page);
        // SAFETY: as in `Launch::load`.
        unsafe { std::ptr::read_unaligned(address as *const T) }
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
                Some((std::mem::take(&mut l.retired), l.dropped))
            } else {
                None
            }
        };
        let Some((retired, dropped)) = retired else {
            return;
        };
        table.free_retired(retired);
        // The buffer went while this launch ran: its pages go now.
        if dropped {
            table.clear();
        }
        // The last launch ended: what CUDA kernels counted goes to the
        // balancer. A failed copy loses samples, not data: counted in the
        // runtime's errors.
        if let Some(c) = &self.map.shared.device_counters {
            match c.drain() {
                // Sampling off: kernels were given no counters; nothing
                // counted goes to the balancer.
                Ok(_) if self.shift.is_none() => {}
                Ok(counts) => {
                    for (h, n) in self.counters.iter().zip(counts) {
                        crate::hotness::count_many(h, n);
                    }
                }
                Err(_) => table.rt.note_lost_counts(),
            }
        }
    }
}

/// A [`Launch`] that owns a reference to its map; see
/// [`DeviceMap::prepare_owned`].
#[must_use = "the launch ends when the guard drops"]
pub struct OwnedLaunch {
    map: DeviceMap,
    access: Access,
    epoch: u64,
}

impl std::fmt::Debug for OwnedLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.launch().fmt(f)
    }
}

impl OwnedLaunch {
    /// The borrowed guard's view, which must not end the launch.
    fn launch(&self) -> std::mem::ManuallyDrop<Launch<'_>> {
        std::mem::ManuallyDrop::new(Launch::new(&self.map, self.access, self.epoch))
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

    /// As [`Launch::entry`] (and panics as it does).
    pub fn entry(&self, p: usize) -> u64 {
        self.launch().entry(p)
    }

    /// As [`Launch::counters_address`].
    pub fn counters_address(&self) -> u64 {
        self.launch().counters_address()
    }

    /// As [`Launch::sample_shift`].
    pub fn sample_shift(&self) -> Option<u32> {
        self.launch().sample_shift()
    }
}

impl Drop for OwnedLaunch {
    fn drop(&mut self) {
        drop(Launch::new(&self.map, self.access, self.epoch));
    }
}
