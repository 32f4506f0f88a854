//! The tiered runtime: buffers larger than any one tier, a page table that
//! says where each page lives, and moves between tiers.
//!
//! | file | what |
//! |------|------|
//! | `page.rs` | page entries and their transitions (begin move, commit, abandon, lose), no I/O; loom-checked |
//! | `table.rs` | the page table and the copy engines (batched NVMe I/O, host↔device batches), one commit |
//! | `buffer.rs` | [`Buffer`]: read/write at any offset, pins, prefetch, evict |
//! | `mover.rs` | the asynchronous mover: a lane per link, a bounded window, [`Ticket`]s |
//! | `reclaim.rs` | background eviction between [`Watermarks`], cascading down |
//! | `map.rs` | [`DeviceMap`]s and kernel [`Launch`]es |
//!
//! Every page of a [`Buffer`] is, in its page-table entry, either *zero*
//! (never written: reads return zeros, no slot is used) or resident in one
//! tier's slot. An allocation reserves capacity across all tiers at once,
//! so a first write always finds a slot; it takes the fastest tier with
//! room (or the hinted one). Moves are copy-then-commit: the page is copied
//! into a slot of the destination tier and the entry switches only once the
//! copy succeeded, so a failed move leaves the page readable where it was.
//!
//! ```
//! use strata::{Runtime, Tier};
//!
//! let rt = Runtime::builder().page_size(64 << 10).host(64 << 20).build()?;
//! let buf = rt.alloc(1 << 20)?;
//! buf.write(65000, b"spans a page boundary")?;
//! buf.prefetch(0..buf.len(), Tier::Host).wait()?;
//! let mut out = [0u8; 21];
//! buf.read(65000, &mut out)?;
//! assert_eq!(&out, b"spans a page boundary");
//! # Ok::<(), strata::Error>(())
//! ```
// Only `map.rs` (a simulated kernel's load through the map) needs unsafe.
#![deny(unsafe_code)]

mod balancer;
mod buffer;
mod map;
mod mover;
mod page;
mod reclaim;
mod record;
mod table;
mod view;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;
use serde::Serialize;

use crate::device::{self, BackendKind, DeviceChoice};
use crate::error::{Error, ErrorKind, Result};
use crate::io::IoEngine;
use crate::link::{LinkCounter, LinkStats};
use crate::size::{check_page_size, format_size};
use crate::sys::Topology;
use crate::tier::{
    CxlConfig, CxlStore, DeviceStore, HostConfig, HostStore, NvmeConfig, NvmeStore, PageStore, Tier,
};

pub use balancer::{BalanceReport, BalancerConfig, MAX_REPEAT};
pub use buffer::{Buffer, Pin, Residency};
pub use map::{Access, DeviceMap, Launch, Reader};
pub use mover::Ticket;
pub use reclaim::Watermarks;
pub use record::TraceRecorder;
pub use view::{View, ViewMut};
// Guards that own their buffer or map, for the C ABI.
pub use buffer::OwnedPin;
pub use map::OwnedLaunch;

use mover::Mover;
use reclaim::Reclaimer;
use table::Table;

/// How to build a [`Runtime`]: per-tier capacities in bytes; a tier with
/// none configured is absent (the host tier is always present).
#[derive(Clone)]
pub struct RuntimeBuilder {
    page_size: usize,
    device: DeviceChoice,
    device_capacity: u64,
    host: HostConfig,
    cxl: Option<CxlConfig>,
    nvme: Option<NvmeConfig>,
    nvme_engine: Option<Arc<dyn IoEngine>>,
    watermarks: Watermarks,
    background_eviction: bool,
    sample_shift: Option<u32>,
    policy: crate::policy::PolicyKind,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("page_size", &self.page_size)
            .field("device", &self.device)
            .field("device_capacity", &self.device_capacity)
            .field("host", &self.host)
            .field("cxl", &self.cxl)
            .field("nvme", &self.nvme)
            .field("watermarks", &self.watermarks)
            .field("background_eviction", &self.background_eviction)
            .field("sample_shift", &self.sample_shift)
            .finish()
    }
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            page_size: crate::config::DEFAULT_PAGE_SIZE,
            device: DeviceChoice::Auto,
            device_capacity: 0,
            host: HostConfig::new(256 << 20, crate::config::DEFAULT_PAGE_SIZE),
            cxl: None,
            nvme: None,
            nvme_engine: None,
            watermarks: Watermarks::default(),
            background_eviction: true,
            sample_shift: Some(0),
            policy: crate::policy::PolicyKind::Default,
        }
    }
}

impl RuntimeBuilder {
    /// Page size of every tier (a power of two, 4 KiB … 2 MiB).
    pub fn page_size(mut self, bytes: usize) -> Self {
        self.page_size = bytes;
        self
    }
    /// The device tier: which backend, and at most how many bytes of it
    /// (0: no device tier). On sim this is the simulated GPU's size; on
    /// cuda a cap below the GPU's free memory, to emulate a smaller GPU.
    pub fn device(mut self, choice: DeviceChoice, capacity: u64) -> Self {
        self.device = choice;
        self.device_capacity = capacity;
        self
    }
    /// Host DRAM tier capacity (huge pages, no NUMA binding, unless set
    /// by [`host_config`](Self::host_config)).
    pub fn host(mut self, capacity: u64) -> Self {
        self.host.capacity = capacity;
        self
    }
    /// The host DRAM tier whole: capacity, transparent huge pages, NUMA
    /// binding (its page size is set to the runtime's).
    pub fn host_config(mut self, config: HostConfig) -> Self {
        self.host = config;
        self
    }
    /// A CXL tier (its page size is set to the runtime's).
    pub fn cxl(mut self, config: CxlConfig) -> Self {
        self.cxl = Some(config);
        self
    }
    /// An NVMe tier (its page size is set to the runtime's).
    pub fn nvme(mut self, config: NvmeConfig) -> Self {
        self.nvme = Some(config);
        self
    }

    /// Runs the NVMe tier on this engine instead of the configured one
    /// (for example a fault-injecting engine in tests).
    pub fn nvme_engine(mut self, engine: Arc<dyn IoEngine>) -> Self {
        self.nvme_engine = Some(engine);
        self
    }

    /// Background eviction keeps every tier but the slowest between these
    /// fractions of its capacity (default 0.85 and 0.95).
    pub fn watermarks(mut self, watermarks: Watermarks) -> Self {
        self.watermarks = watermarks;
        self
    }

    /// Turns background eviction on (the default) or off. Off, tiers fill
    /// to the last slot and pages move only when asked to.
    pub fn background_eviction(mut self, on: bool) -> Self {
        self.background_eviction = on;
        self
    }

    /// Access counting: every access (`Some(0)`, the default), one in
    /// 2^k (`Some(k)`, k ≤ 16), or none.
    pub fn sampling(mut self, shift: Option<u32>) -> Self {
        self.sample_shift = shift;
        self
    }

    /// The balancer's placement policy (default: the default policy).
    pub fn policy(mut self, policy: crate::policy::PolicyKind) -> Self {
        self.policy = policy;
        self
    }

    /// Builds the runtime from a resolved [`Config`](crate::config::Config).
    pub fn from_config(config: &crate::config::Config) -> Self {
        let device_capacity = config.device_capacity.unwrap_or(match config.device {
            DeviceChoice::Sim => crate::config::DEFAULT_SIM_DEVICE_CAPACITY,
            // A GPU's own limit (free memory less a reserve) applies.
            DeviceChoice::Cuda => u64::MAX,
            // Auto: a GPU where present (its limit applies), else the
            // default simulated size.
            DeviceChoice::Auto => match device::probe_gpus() {
                Ok(_) => u64::MAX,
                Err(_) => crate::config::DEFAULT_SIM_DEVICE_CAPACITY,
            },
        });
        Self {
            page_size: config.page_size,
            device: config.device,
            device_capacity,
            host: config.host.clone(),
            cxl: config.cxl.clone(),
            nvme: config.nvme.clone(),
            nvme_engine: None,
            watermarks: config.watermarks,
            background_eviction: true,
            sample_shift: Some(0),
            policy: config.policy,
        }
    }

    /// Opens every configured tier.
    pub fn build(self) -> Result<Runtime> {
        check_page_size(self.page_size)?;
        self.watermarks.check()?;
        if self.sample_shift.is_some_and(|k| k > 16) {
            return Err(Error::invalid(format!(
                "sampling 1 in 2^{} accesses: at most 2^16",
                self.sample_shift.unwrap_or(0)
            )));
        }
        let page = self.page_size;
        let device = if self.device_capacity > 0 {
            let backend = device::open(self.device, self.device_capacity)?;
            Some(DeviceStore::new(backend, self.device_capacity, page)?)
        } else {
            None
        };
        let host = HostStore::new(&HostConfig {
            page_size: page,
            ..self.host
        })?;
        // Kernels reach host and CXL pages in place, and copies to and from
        // them run asynchronously, once the arenas are registered.
        if let Some(d) = &device {
            host.register_with_device(d.backend_handle())?;
        }
        let cxl = match self.cxl {
            Some(mut c) => {
                c.page_size = page;
                let cxl = CxlStore::new(&c, &Topology::detect())?;
                if let Some(d) = &device {
                    cxl.as_host().register_with_device(d.backend_handle())?;
                }
                Some(cxl)
            }
            None => None,
        };
        let nvme = match self.nvme {
            Some(mut c) => {
                c.page_size = page;
                Some(match self.nvme_engine {
                    Some(engine) => NvmeStore::with_engine(&c, engine)?,
                    None => NvmeStore::new(&c)?,
                })
            }
            None => None,
        };
        let mut stores: Vec<Box<dyn PageStore>> = Vec::new();
        if let Some(d) = device {
            stores.push(Box::new(d));
        }
        stores.push(Box::new(host));
        if let Some(c) = cxl {
            stores.push(Box::new(c));
        }
        if let Some(n) = nvme {
            stores.push(Box::new(n));
        }
        let total = stores.iter().map(|s| s.capacity_pages() as u64).sum();
        let tiers: Vec<Tier> = stores.iter().map(|s| s.tier()).collect();
        let inner = Arc::new(Inner {
            page_size: page,
            stores,
            total_pages: total,
            reserved: Mutex::new(Reservations::default()),
            slot_freed: parking_lot::Condvar::new(),
            counters: Counters::default(),
            pinned: Default::default(),
            links: Default::default(),
            mover: Mover::start(&tiers)?,
            tables: Mutex::new(Vec::new()),
            watermarks: self.watermarks,
            reclaimer: OnceLock::new(),
            sample_shift: self.sample_shift,
            policy: self.policy,
            trace: Default::default(),
            buffer_ids: Default::default(),
            balancer: Mutex::new(None),
            hints: balancer::Hints::default(),
            balancer_thread: Mutex::new(None),
            background_error: Mutex::new(None),
        });
        if self.background_eviction && tiers.len() > 1 {
            let r = Reclaimer::start(Arc::downgrade(&inner))?;
            let _ = inner.reclaimer.set(r);
        }
        Ok(Runtime { inner })
    }
}

/// Capacity spoken for, in pages.
#[derive(Debug, Default)]
struct Reservations {
    /// Promised to live buffers (every page of every allocation).
    promised: u64,
    /// Second slots held by moves until they commit (and by old copies
    /// kept for kernel launches).
    moving: u64,
}

#[derive(Debug, Default)]
struct Counters {
    moves: AtomicU64,
    failed_moves: AtomicU64,
    first_writes: AtomicU64,
    /// Moves dropped because a write changed the page meanwhile.
    abandoned: AtomicU64,
    /// Pages an access had to move first (pins, launches).
    faults: AtomicU64,
    /// Pages demoted to make room (background eviction, pins, launches).
    reclaimed_pages: AtomicU64,
    /// Balancer decisions carried out.
    promotions: AtomicU64,
    /// Of the promotions, those a read carried out.
    promotions_on_read: AtomicU64,
    demotions: AtomicU64,
    bypasses: AtomicU64,
    /// Read-backs of CUDA kernels' access counters that failed.
    lost_counts: AtomicU64,
    /// Pages whose data was lost to I/O errors, with their slots.
    lost_pages: AtomicU64,
    /// Failures of background work (reclaimer, balancer), panics included.
    background_errors: AtomicU64,
}

impl Inner {
    /// A CUDA launch's access counts could not be read back.
    pub(crate) fn note_lost_counts(&self) {
        self.counters.lost_counts.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` pages' data (and their slots) were lost to I/O errors.
    pub(crate) fn note_lost_pages(&self, n: u64) {
        self.counters.lost_pages.fetch_add(n, Ordering::Relaxed);
    }

    /// Background work (`what`) failed: counted, and the first failure
    /// kept for [`Runtime::check`] and [`Runtime::shutdown`] (cudarc's
    /// record-then-check). A full tier is a refusal, not a failure.
    pub(crate) fn note_background(&self, what: &str, e: Error) {
        if e.kind() == ErrorKind::OutOfCapacity {
            return;
        }
        self.counters
            .background_errors
            .fetch_add(1, Ordering::Relaxed);
        self.background_error
            .lock()
            .get_or_insert_with(|| e.context(what.to_string()));
    }

    /// Runs one round of background work, recording its panic as a
    /// failure: the thread that runs it lives on.
    pub(crate) fn background(&self, what: &str, work: impl FnOnce()) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
            self.note_background(
                what,
                Error::new(
                    ErrorKind::Io,
                    "a background round panicked; the thread goes on",
                ),
            );
        }
    }
}

pub(crate) struct Inner {
    page_size: usize,
    /// Fastest first; only configured tiers.
    stores: Vec<Box<dyn PageStore>>,
    total_pages: u64,
    reserved: Mutex<Reservations>,
    /// Signalled when a move gives back its second slot.
    slot_freed: parking_lot::Condvar,
    counters: Counters,
    /// Pinned pages per tier (indexed by `Tier as usize`).
    pinned: [AtomicU64; 4],
    /// Page moves per link, indexed by `from * 4 + to`.
    links: [LinkCounter; 16],
    mover: Mover,
    /// Every live buffer's page table, for the reclaimer.
    tables: Mutex<Vec<Weak<Table>>>,
    watermarks: Watermarks,
    reclaimer: OnceLock<Reclaimer>,
    /// Access counting: 1 in 2^k, or off.
    pub(crate) sample_shift: Option<u32>,
    /// The balancer's policy when none is given.
    policy: crate::policy::PolicyKind,
    /// Trace recording (off unless a recorder runs).
    pub(crate) trace: record::TraceSink,
    /// Numbers buffers for trace page ids and the balancer's page keys
    /// (`buffer << 32 | page`): unique among the buffers alive, recycled
    /// when a buffer's table is gone, so they never wrap onto a live one.
    pub(crate) buffer_ids: Mutex<BufferIds>,
    /// The balancer's policy state, when one was started.
    pub(crate) balancer: balancer::BalancerSlot,
    /// Prefetches since the balancer's last round, for its policies'
    /// `Policy::hint`: (destination tier, page id); filled only while a
    /// balancer is configured.
    pub(crate) hints: balancer::Hints,
    balancer_thread: Mutex<Option<balancer::BalancerThread>>,
    /// The first failure of background work since the last check.
    background_error: Mutex<Option<Error>>,
}

/// Buffer numbers: fresh ones while there are, but never more than
/// [`BufferIds::HELD`] freed ones waiting (the oldest freed is reused
/// first), so a number is reused late and the list stays small.
#[derive(Debug, Default)]
pub(crate) struct BufferIds {
    next: u64,
    free: std::collections::VecDeque<u32>,
}

impl BufferIds {
    /// Freed numbers held back before the oldest is reused.
    const HELD: usize = 1 << 16;

    fn take(&mut self) -> Option<u32> {
        if self.free.len() >= Self::HELD {
            return self.free.pop_front();
        }
        if let Ok(id) = u32::try_from(self.next) {
            self.next += 1;
            return Some(id);
        }
        self.free.pop_front()
    }

    pub(crate) fn give_back(&mut self, id: u32) {
        self.free.push_back(id);
    }
}

impl Inner {
    pub(crate) fn store(&self, tier: Tier) -> Option<&dyn PageStore> {
        self.stores.iter().find(|s| s.tier() == tier).map(|s| &**s)
    }

    /// The configured tiers slower than `tier`, fastest first (where its
    /// pages are demoted to).
    pub(crate) fn tiers_below(&self, tier: Tier) -> Vec<Tier> {
        self.stores()
            .map(|s| s.tier())
            .filter(|&t| t > tier)
            .collect()
    }

    pub(crate) fn stores(&self) -> impl Iterator<Item = &dyn PageStore> {
        self.stores.iter().map(|s| &**s)
    }

    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    pub(crate) fn link(&self, from: Tier, to: Tier) -> &LinkCounter {
        &self.links[from as usize * 4 + to as usize]
    }

    pub(crate) fn capacity_report(&self) -> String {
        self.stores
            .iter()
            .map(|s| {
                format!(
                    "{} {} of {} used",
                    s.tier(),
                    format_size(s.used_pages() as u64 * self.page_size as u64),
                    format_size(s.capacity_pages() as u64 * self.page_size as u64)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// A page landed in `tier`: wakes the reclaimer if it is above its
    /// high watermark.
    pub(crate) fn filled(&self, tier: Tier) {
        if let Some(r) = self.reclaimer.get() {
            if reclaim::above_high(self, tier) {
                r.wake();
            }
        }
    }

    /// Gives back a dropped buffer's promise.
    pub(crate) fn release(&self, pages: u64) {
        let mut r = self.reserved.lock();
        debug_assert!(r.promised >= pages, "releasing more than was promised");
        r.promised = r.promised.saturating_sub(pages);
    }

    /// Gives back move reservations.
    pub(crate) fn release_moves(&self, pages: u64) {
        {
            let mut r = self.reserved.lock();
            debug_assert!(r.moving >= pages, "releasing more than moves hold");
            r.moving = r.moving.saturating_sub(pages);
        }
        self.slot_freed.notify_all();
    }

    /// Reserves one page of capacity for the second slot a move holds until
    /// it commits, so that moves can never take a slot that a promised,
    /// not yet written page is owed. Allocations do not count these (a
    /// move in the background never makes an allocation fail); a first
    /// write that finds every tier full while moves hold slots waits for
    /// them (see [`Inner::wait_for_moves`]).
    pub(crate) fn reserve_move(&self) -> Result<()> {
        let mut r = self.reserved.lock();
        if r.promised + r.moving >= self.total_pages {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "no capacity to spare for a move: every page is promised ({})",
                    self.capacity_report()
                ),
            ));
        }
        r.moving += 1;
        Ok(())
    }

    /// Waits (at most `timeout`) until a move gives back its second slot;
    /// false at once if no move holds one.
    pub(crate) fn wait_for_moves(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut r = self.reserved.lock();
        let held = r.moving;
        if held == 0 {
            return false;
        }
        while r.moving >= held {
            if self.slot_freed.wait_until(&mut r, deadline).timed_out() {
                break;
            }
        }
        true
    }
}

/// Waits for a runtime thread to end, unless it is the calling thread (the
/// last reference to the runtime can be dropped on one of its own threads).
pub(crate) fn join(handle: std::thread::JoinHandle<()>) {
    if handle.thread().id() != std::thread::current().id() {
        let _ = handle.join();
    }
}

/// The runtime: the tiers and everything allocated in them.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("page_size", &self.inner.page_size)
            .field("tiers", &self.tiers())
            .finish()
    }
}

/// Where to put a buffer's pages when they are first written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// The fastest tier with a free slot.
    #[default]
    Fastest,
    /// This tier while it has room, then the fastest with room.
    Prefer(Tier),
}

/// Per-tier use.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TierStats {
    /// The tier.
    pub tier: Tier,
    /// Slots in use.
    pub used_pages: u32,
    /// Free slots.
    pub free_pages: u32,
    /// Pages pinned here.
    pub pinned_pages: u64,
    /// Whether the tier is emulated or simulated.
    pub emulated: bool,
}

/// What `rt.stats()` reports.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// The device backend ("simulated", "cuda"), if there is a device tier.
    pub backend: Option<&'static str>,
    /// Page size.
    pub page_size: usize,
    /// Per tier, fastest first.
    pub tiers: Vec<TierStats>,
    /// Pages promised to live buffers.
    pub reserved_pages: u64,
    /// Pages moved between tiers.
    pub moves: u64,
    /// Moves that failed (the page stayed where it was).
    pub failed_moves: u64,
    /// Pages materialized by their first write.
    pub first_writes: u64,
    /// Moves abandoned because a write changed the page while it moved
    /// (the write wins; the page stays where it was).
    pub abandoned_moves: u64,
    /// Pages an access had to move before it could proceed (pins, kernel
    /// launches staging NVMe pages).
    pub faults: u64,
    /// Pages demoted to make room: by background eviction, or for a pin or
    /// a kernel launch that needed a slot.
    pub reclaimed_pages: u64,
    /// Pages queued or moving in the mover.
    pub in_flight_moves: u64,
    /// Balancer: pages promoted into the fastest tier (device memory, or
    /// host DRAM without a device tier).
    pub promotions: u64,
    /// Of `promotions`, those a read carried out: NVMe pages the balancer
    /// marked, moved whole by their next read (see
    /// [`BalancerConfig::promote_on_read`](crate::runtime::BalancerConfig::promote_on_read)).
    pub promotions_on_read: u64,
    /// Balancer: pages demoted out of the fastest tier.
    pub demotions: u64,
    /// Balancer: touched pages left in place (served zero-copy).
    pub bypasses: u64,
    /// Failures of background work (background eviction, the balancer),
    /// panics included; the first is returned by [`Runtime::check`].
    pub background_errors: u64,
    /// Read-backs of CUDA kernels' per-page access counts that failed at
    /// the end of a launch (those access samples are lost; no data is).
    pub lost_count_readbacks: u64,
    /// Pages whose data was lost to I/O errors that left their reads
    /// unanswered: reading one fails with `ErrorKind::Io` ("page N was
    /// lost"), and its NVMe slot, with the staging buffer or host slot the
    /// read was filling, stays with the request that never came back: that
    /// capacity is gone from the tiers (never reused, since the engine may
    /// still complete the read into that memory).
    pub lost_pages: u64,
    /// Host→device and device→host link traffic, if there is a device tier
    /// (as the backend counts it: every copy, moves and accesses alike).
    pub device_links: Option<(LinkStats, LinkStats)>,
    /// Page moves per link that carried any (wall time of the whole move).
    pub links: Vec<LinkUse>,
    /// The migration engine's batches per priority: demand, prefetch,
    /// balance, reclaim, in that order.
    pub engine: Vec<PriorityUse>,
}

/// What the migration engine ran for one priority.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PriorityUse {
    /// "demand", "prefetch", "balance" or "reclaim".
    pub priority: &'static str,
    /// Batches run (up to 32 pages each).
    pub batches: u64,
    /// Mean time a batch waited in its lane's queue, in microseconds.
    pub mean_queued_us: f64,
    /// Seconds lanes spent running these batches (wall time of their
    /// copies, commits and the room they made).
    pub busy_seconds: f64,
}

/// Page moves over one link.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct LinkUse {
    /// Source tier.
    pub from: Tier,
    /// Destination tier.
    pub to: Tier,
    /// What crossed it.
    #[serde(flatten)]
    pub stats: LinkStats,
}

impl Runtime {
    /// A builder with defaults: 64 KiB pages, a 256 MiB host tier, no
    /// device, CXL or NVMe tier.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The configured tiers, fastest first.
    pub fn tiers(&self) -> Vec<Tier> {
        self.inner.stores.iter().map(|s| s.tier()).collect()
    }

    /// Access counting: counts sample one access in 2^k (`Some(k)`), or
    /// none are counted.
    pub fn sampling(&self) -> Option<u32> {
        self.inner.sample_shift
    }

    /// The page size.
    pub fn page_size(&self) -> usize {
        self.inner.page_size
    }

    /// Allocates `bytes` (rounded up to whole pages), placing pages in the
    /// fastest tier with room as they are first written.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        self.alloc_with(bytes, Placement::Fastest)
    }

    /// Allocates with a placement hint.
    pub fn alloc_with(&self, bytes: u64, placement: Placement) -> Result<Buffer> {
        if bytes == 0 {
            return Err(Error::invalid("allocation of zero bytes"));
        }
        if let Placement::Prefer(t) = placement {
            if self.inner.store(t).is_none() {
                return Err(Error::invalid(format!(
                    "placement hint names the {t} tier, which is not configured"
                )));
            }
        }
        let page = self.inner.page_size as u64;
        let pages = bytes.div_ceil(page);
        let id = {
            let mut r = self.inner.reserved.lock();
            let reserved = r.promised;
            if reserved + pages > self.inner.total_pages {
                return Err(Error::new(
                    ErrorKind::OutOfCapacity,
                    format!(
                        "cannot allocate {}: {} of {} promised across the tiers ({})",
                        format_size(bytes),
                        format_size(reserved * page),
                        format_size(self.inner.total_pages * page),
                        self.inner.capacity_report()
                    ),
                ));
            }
            // Numbered under the reservation's lock: a refusal takes neither.
            let id = self.inner.buffer_ids.lock().take().ok_or_else(|| {
                Error::new(
                    ErrorKind::OutOfCapacity,
                    "2^32 buffers are alive in this runtime: free some first",
                )
            })?;
            r.promised += pages;
            id
        };
        let table = Arc::new(Table::new(self.inner.clone(), id, bytes, pages, placement));
        {
            let mut tables = self.inner.tables.lock();
            // Amortized pruning of dropped buffers' entries.
            if tables.len() >= 64 && tables.len().is_power_of_two() {
                tables.retain(|t| t.strong_count() > 0);
            }
            tables.push(Arc::downgrade(&table));
        }
        Ok(Buffer::new(table))
    }

    /// Allocates room for `n` values of `T`.
    pub fn alloc_typed<T: bytemuck::Pod>(&self, n: u64) -> Result<Buffer> {
        let bytes = n
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or_else(|| Error::invalid(format!("{n} elements overflow a byte count")))?;
        self.alloc(bytes)
    }

    /// Current use and traffic.
    pub fn stats(&self) -> Stats {
        let inner = &self.inner;
        let device = inner
            .store(Tier::Device)
            .and_then(|s| s.as_any().downcast_ref::<DeviceStore>());
        Stats {
            backend: device.map(|d| d.backend().label()),
            page_size: inner.page_size,
            tiers: inner
                .stores
                .iter()
                .map(|s| TierStats {
                    tier: s.tier(),
                    used_pages: s.used_pages(),
                    free_pages: s.capacity_pages().saturating_sub(s.used_pages()),
                    pinned_pages: inner.pinned[s.tier() as usize].load(Ordering::Relaxed),
                    emulated: s.emulated(),
                })
                .collect(),
            reserved_pages: inner.reserved.lock().promised,
            moves: inner.counters.moves.load(Ordering::Relaxed),
            failed_moves: inner.counters.failed_moves.load(Ordering::Relaxed),
            lost_count_readbacks: inner.counters.lost_counts.load(Ordering::Relaxed),
            lost_pages: inner.counters.lost_pages.load(Ordering::Relaxed),
            background_errors: inner.counters.background_errors.load(Ordering::Relaxed),
            first_writes: inner.counters.first_writes.load(Ordering::Relaxed),
            abandoned_moves: inner.counters.abandoned.load(Ordering::Relaxed),
            faults: inner.counters.faults.load(Ordering::Relaxed),
            reclaimed_pages: inner.counters.reclaimed_pages.load(Ordering::Relaxed),
            in_flight_moves: inner.mover.in_flight.load(Ordering::Relaxed),
            promotions: inner.counters.promotions.load(Ordering::Relaxed),
            promotions_on_read: inner.counters.promotions_on_read.load(Ordering::Relaxed),
            demotions: inner.counters.demotions.load(Ordering::Relaxed),
            bypasses: inner.counters.bypasses.load(Ordering::Relaxed),
            device_links: device.map(|d| d.link_stats()),
            links: Tier::ALL
                .iter()
                .flat_map(|&from| Tier::ALL.iter().map(move |&to| (from, to)))
                .filter_map(|(from, to)| {
                    let stats = inner.links[from as usize * 4 + to as usize].stats();
                    (stats.ops > 0).then_some(LinkUse { from, to, stats })
                })
                .collect(),
            engine: ["demand", "prefetch", "balance", "reclaim"]
                .into_iter()
                .zip(inner.mover.priority_report())
                .map(
                    |(priority, (batches, mean_queued_us, busy_seconds))| PriorityUse {
                        priority,
                        batches,
                        mean_queued_us,
                        busy_seconds,
                    },
                )
                .collect(),
        }
    }

    /// Records every page access (one in 2^`shift` when sampled) to a
    /// trace file at `path` (created or truncated) until the returned
    /// recorder finishes or drops. One recording at a time.
    pub fn record_trace(&self, path: &std::path::Path, shift: u32) -> Result<TraceRecorder> {
        TraceRecorder::start(self.inner.clone(), path, shift)
    }

    /// Starts (or restarts, with a fresh policy) the balancer in the
    /// background: every `config.interval` it harvests the access counters
    /// and promotes and demotes pages as the policy decides. The policy
    /// models the fastest tier: device memory, or host DRAM in a runtime
    /// without a device tier (over CXL and NVMe). Needs a tier below it.
    pub fn start_balancer(&self, config: BalancerConfig) -> Result<()> {
        let b = balancer::Balancer::new(&self.inner, config)?;
        self.replace_balancer(Some(b));
        let thread = balancer::BalancerThread::start(Arc::downgrade(&self.inner), config.interval)?;
        *self.inner.balancer_thread.lock() = Some(thread);
        Ok(())
    }

    /// Sets the balancer's configuration (a fresh policy) without starting
    /// the background thread: rounds then run when
    /// [`balance_once`](Self::balance_once) is called.
    pub fn configure_balancer(&self, config: BalancerConfig) -> Result<()> {
        let b = balancer::Balancer::new(&self.inner, config)?;
        self.replace_balancer(Some(b));
        Ok(())
    }

    /// Installs `b` (or nothing) as the balancer; the old one's marks for
    /// promotion at the next read are taken back.
    fn replace_balancer(&self, b: Option<balancer::Balancer>) {
        let mut slot = self.inner.balancer.lock();
        if let Some(old) = slot.as_mut() {
            old.take_back_marks(&self.inner);
        }
        *slot = b;
    }

    /// Stops the background balancer (its policy state is kept for
    /// [`balance_once`](Self::balance_once); its marks for promotion at the
    /// next read are taken back, and the moves reads started are waited
    /// for and counted).
    pub fn stop_balancer(&self) {
        self.inner.balancer_thread.lock().take();
        if let Some(b) = self.inner.balancer.lock().as_mut() {
            b.take_back_marks(&self.inner);
        }
        balancer::settle_read_promotions(&self.inner, true);
    }

    /// Runs one balancer round now, on this thread (a balancer with the
    /// default configuration is made on first use). Deterministic runs —
    /// benchmarks, tests — call this between phases instead of running the
    /// background thread.
    pub fn balance_once(&self) -> Result<BalanceReport> {
        let mut slot = self.inner.balancer.lock();
        if slot.is_none() {
            *slot = Some(balancer::Balancer::new(
                &self.inner,
                BalancerConfig {
                    policy: self.inner.policy,
                    ..Default::default()
                },
            )?);
        }
        Ok(slot.as_mut().expect("made above").step(&self.inner))
    }

    /// The first failure of background work (background eviction, the
    /// balancer: an I/O error demoting a page, a panic in a round) since
    /// the last check, which this clears; `Ok` if there was none. Pages a
    /// failed background move touched stay readable where they were
    /// (or are counted in `Stats::lost_pages` and refused, never misread).
    pub fn check(&self) -> Result<()> {
        balancer::settle_read_promotions(&self.inner, false);
        self.inner
            .background_error
            .lock()
            .take()
            .map_or(Ok(()), Err)
    }

    /// Stops the background work (balancer, background eviction), waits
    /// for every queued and running move to finish, and returns the first
    /// background failure not yet returned by [`check`](Self::check).
    /// It stops them for every handle of this runtime (clones share it).
    /// Buffers still alive go on working, without background threads;
    /// dropping the last handle and buffer does the same, dropping the
    /// result.
    pub fn shutdown(self) -> Result<()> {
        self.stop_balancer();
        if let Some(r) = self.inner.reclaimer.get() {
            r.stop();
        }
        self.inner.mover.drain();
        self.check()
    }

    /// [`stats`](Self::stats) as JSON.
    pub fn stats_json(&self) -> String {
        serde_json::to_string(&self.stats()).expect("stats serialize")
    }

    /// Which backend the device tier runs on, if there is one.
    pub fn device_backend(&self) -> Option<BackendKind> {
        self.inner
            .store(Tier::Device)
            .and_then(|s| s.as_any().downcast_ref::<DeviceStore>())
            .map(|d| d.backend())
    }
}

#[cfg(test)]
mod buffer_id_tests {
    use super::BufferIds;

    #[test]
    fn ids_never_wrap_onto_a_live_buffer() {
        let mut ids = BufferIds::default();
        assert_eq!(
            (ids.take(), ids.take(), ids.take()),
            (Some(0), Some(1), Some(2))
        );
        ids.give_back(1);
        // Fresh numbers first, so a freed one is reused as late as possible.
        assert_eq!(ids.take(), Some(3));
        ids.next = u64::from(u32::MAX);
        assert_eq!(ids.take(), Some(u32::MAX));
        // Past 2^32 only freed numbers come back, oldest freed first.
        ids.give_back(3);
        assert_eq!(
            (ids.take(), ids.take(), ids.take()),
            (Some(1), Some(3), None)
        );
        // However many buffers come and go, the freed list stays bounded.
        let mut ids = BufferIds::default();
        for _ in 0..3 * BufferIds::HELD {
            let id = ids.take().unwrap();
            ids.give_back(id);
        }
        assert!(ids.free.len() <= BufferIds::HELD);
        assert_eq!(ids.next, BufferIds::HELD as u64);
    }
}
