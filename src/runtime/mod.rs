//! The tiered runtime: buffers larger than any one tier, a page table that
//! says where each page lives, and moves between tiers.
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
//!
//! # Layering
//!
//! Shared state sits below the code that uses it. The table lists the
//! files bottom first: each imports only files listed before it, so
//! nothing below the engine can reach it, and a move running in a lane
//! never calls back up.
//!
//! | layer | file | what |
//! |-------|------|------|
//! | state | `page.rs` | a page's entry and its transitions (begin move, commit, abandon, lose, keep and drop a clean copy); no I/O; loom-checked |
//! | | `tiers.rs` | the tier stores, held by type ([`Watermarks`] too) |
//! | | `accounting.rs` | capacity promised and held by moves, counters, pinned pages, link counters, buffer numbers |
//! | | `background.rs` | failures of background work (counted, the first kept), panic catching, wake-ups, the balancer's thread, joins |
//! | | `record.rs` | trace recording ([`TraceRecorder`]) |
//! | | `shared.rs` | what every page table shares: the five above, and the one way a slot is given back |
//! | | `mapping.rs` | a device map's storage (the entries kernels translate through) |
//! | table | `table.rs` | the page table: page locks, first writes, reservations of a batch, **the one commit**; [`Placement`] |
//! | copy | `copy_memory.rs` | memory↔memory: page by page under the lock |
//! | | `copy_device.rs` | host↔device: one batched transfer |
//! | | `copy_nvme.rs` | memory↔NVMe: a batch's reads or writes in flight on one session |
//! | | `batch.rs` | the one batch interface: locks a batch, hands each kind of move to its path |
//! | requests | `request.rs` | what a move request says (pages, destination, source, priority, room) |
//! | | `ticket.rs` | [`Ticket`]: the handle of an asynchronous request |
//! | | `registry.rs` | every live buffer's page table |
//! | | `victims.rs` | CLOCK choice of the pages room-making demotes |
//! | | `clean.rs` | clean copies dropped for a tier's room, before any demotion |
//! | | `lanes.rs` | the engine's lanes, queues and in-flight window |
//! | engine | `mover.rs` | the migration engine: schedules every move on its lanes |
//! | | `room.rs` | the engine's room-making: clean copies dropped, then victims demoted through its own lanes |
//! | users | `hints.rs` | what the balancer hears between rounds (prefetches, moves reads started) |
//! | | `reclaim.rs` | background eviction: watches the watermarks, submits room requests |
//! | | `balance_config.rs` | [`BalancerConfig`], [`BalanceReport`] |
//! | | `payback.rs` | a buffer's payback: whether its promotions paid, and the judgement that holds it to reused pages |
//! | | `balance_pages.rs` | the balancer's page ids, marks, and the requests it submits |
//! | | `balancer.rs` | the balancer: policies decide, moves are submitted |
//! | top | `inner.rs` | the runtime put together (engine, balancer, reclaimer over the shared state) |
//! | | `map.rs` | [`DeviceMap`]s and kernel [`Launch`]es |
//! | | `buffer.rs` | [`Buffer`]: read/write at any offset, prefetch, evict |
//! | | `pin.rs` | [`Pin`]s: pages held resident, their addresses lent |
//! | | `view.rs` | [`View`]s: pinned host pages lent as slices |
//! | | `stats.rs` | [`Stats`] |
//! | | `mod.rs` | [`Runtime`], [`RuntimeBuilder`] |
//!
//! There is no exception to the order. The reclaimer and the balancer only
//! submit requests; the engine picks room-making's victims and runs their
//! demotions, and its threads are started by `inner.rs` with the rounds
//! they run (so a thread below `inner.rs` never names it).
// Only `map.rs` (a simulated kernel's load through the map) and `view.rs`
// (slices of pinned pages) need unsafe.
#![deny(unsafe_code)]

mod accounting;
mod background;
mod balance_config;
mod balance_pages;
mod balancer;
mod batch;
mod buffer;
mod clean;
mod copy_device;
mod copy_memory;
mod copy_nvme;
mod hints;
mod inner;
mod lanes;
mod map;
mod mapping;
mod mover;
mod page;
mod payback;
mod pin;
mod reclaim;
mod record;
mod registry;
mod request;
mod room;
mod shared;
mod stats;
mod table;
mod ticket;
mod tiers;
mod victims;
mod view;

use std::sync::Arc;

use crate::device::{BackendKind, DeviceChoice};
use crate::error::{Error, ErrorKind, Result};
use crate::io::IoEngine;
use crate::link::LinkModel;
use crate::size::{check_page_size, format_size};
use crate::tier::{CxlConfig, HostConfig, NvmeConfig, NvmeStats, Tier};

pub use balance_config::{BalanceReport, BalancerConfig, MAX_REPEAT, REPEAT_LIMIT};
pub use buffer::{Buffer, Residency};
pub use map::{Access, DeviceMap, Launch, Reader};
pub use pin::Pin;
pub use record::TraceRecorder;
pub use stats::{LinkUse, PriorityUse, Stats, TierStats};
pub use table::Placement;
pub use ticket::Ticket;
pub use tiers::Watermarks;
pub use view::{OwnedViewMut, View, ViewMut};
// Guards that own their buffer or map, for the C ABI.
pub use map::OwnedLaunch;
pub use pin::OwnedPin;

use inner::Inner;
use shared::Shared;
use table::Table;
use tiers::Tiers;

/// How to build a [`Runtime`]: per-tier capacities in bytes; a tier with
/// none configured is absent (the host tier is always present).
#[derive(Clone)]
pub struct RuntimeBuilder {
    page_size: usize,
    device: DeviceChoice,
    device_capacity: u64,
    sim_link: LinkModel,
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
            .field("sim_link", &self.sim_link)
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
            page_size: crate::size::DEFAULT_PAGE_SIZE,
            device: DeviceChoice::Auto,
            device_capacity: 0,
            sim_link: crate::device::sim::PCIE_GEN4_X16,
            host: HostConfig::new(256 << 20, crate::size::DEFAULT_PAGE_SIZE),
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
    /// The host↔device link a simulated device models (default
    /// [`PCIE_GEN4_X16`](crate::device::sim::PCIE_GEN4_X16)); a real GPU's
    /// copies are measured and ignore it.
    pub fn sim_link(mut self, link: LinkModel) -> Self {
        self.sim_link = link;
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
        let tiers = Tiers::open(
            self.page_size,
            tiers::DeviceSpec {
                choice: self.device,
                capacity: self.device_capacity,
                sim_link: self.sim_link,
            },
            self.host,
            self.cxl,
            self.nvme,
            self.nvme_engine,
        )?;
        let shared = Arc::new(Shared::new(
            tiers,
            self.sample_shift,
            self.watermarks,
            self.page_size,
        ));
        let inner = Inner::start(shared, self.policy, self.background_eviction)?;
        Ok(Runtime { inner })
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
            .field("page_size", &self.page_size())
            .field("tiers", &self.tiers())
            .finish()
    }
}

impl Runtime {
    /// A builder with defaults: 64 KiB pages, a 256 MiB host tier, no
    /// device, CXL or NVMe tier.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    fn rt(&self) -> &Shared {
        &self.inner.shared
    }

    /// The configured tiers, fastest first.
    pub fn tiers(&self) -> Vec<Tier> {
        self.rt().tiers.list()
    }

    /// Access counting: counts sample one access in 2^k (`Some(k)`), or
    /// none are counted.
    pub fn sampling(&self) -> Option<u32> {
        self.rt().sample_shift
    }

    /// The page size.
    pub fn page_size(&self) -> usize {
        self.rt().page_size()
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
        let rt = self.rt();
        if let Placement::Prefer(t) = placement {
            if rt.store(t).is_none() {
                return Err(Error::invalid(format!(
                    "placement hint names the {t} tier, which is not configured"
                )));
            }
        }
        let page = rt.page_size() as u64;
        let pages = bytes.div_ceil(page);
        let id = rt.acct.promise(pages, |promised| {
            Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "cannot allocate {}: {} of {} promised across the tiers ({})",
                    format_size(bytes),
                    format_size(promised * page),
                    format_size(rt.acct.total_pages() * page),
                    rt.capacity_report()
                ),
            )
        })?;
        let table = Arc::new(Table::new(
            self.inner.shared.clone(),
            id,
            bytes,
            pages,
            placement,
        ));
        self.inner.mover.tables().add(&table);
        Ok(Buffer::new(table, self.inner.clone()))
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
        stats::collect(&self.inner)
    }

    /// The NVMe tier's counters (bytes read and written, the time it had
    /// I/O in flight), if there is one.
    pub fn nvme_stats(&self) -> Option<NvmeStats> {
        self.inner.shared.tiers.nvme().map(|s| s.stats())
    }

    /// Records every page access (one in 2^`shift` when sampled) to a
    /// trace file at `path` (created or truncated) until the returned
    /// recorder finishes or drops. One recording at a time.
    pub fn record_trace(&self, path: &std::path::Path, shift: u32) -> Result<TraceRecorder> {
        TraceRecorder::start(self.inner.shared.clone(), path, shift)
    }

    /// Starts (or restarts, with a fresh policy) the balancer in the
    /// background: every `config.interval` it harvests the access counters
    /// and promotes and demotes pages as the policy decides. The policy
    /// models the fastest tier: device memory, or host DRAM in a runtime
    /// without a device tier (over CXL and NVMe). Needs a tier below it.
    pub fn start_balancer(&self, config: BalancerConfig) -> Result<()> {
        let b = self.inner.new_balancer(config)?;
        self.inner.replace_balancer(Some(b));
        self.inner.start_balancer_thread(config.interval)
    }

    /// Sets the balancer's configuration (a fresh policy) without starting
    /// the background thread: rounds then run when
    /// [`balance_once`](Self::balance_once) is called.
    pub fn configure_balancer(&self, config: BalancerConfig) -> Result<()> {
        let b = self.inner.new_balancer(config)?;
        self.inner.replace_balancer(Some(b));
        Ok(())
    }

    /// Stops the background balancer (its policy state is kept for
    /// [`balance_once`](Self::balance_once); its marks for promotion at the
    /// next read are taken back, and the moves reads started are waited
    /// for and counted).
    pub fn stop_balancer(&self) {
        self.inner.stop_balancer();
    }

    /// Runs one balancer round now, on this thread (a balancer with the
    /// default configuration is made on first use). Deterministic runs —
    /// benchmarks, tests — call this between phases instead of running the
    /// background thread.
    pub fn balance_once(&self) -> Result<BalanceReport> {
        self.inner.balance_once()
    }

    /// The first failure of background work (background eviction, the
    /// balancer: an I/O error demoting a page, a panic in a round; or a
    /// slot a store refused to take back, see [`Stats::failed_frees`])
    /// since the last check, which this clears; `Ok` if there was none.
    /// Pages a failed background move touched stay readable where they
    /// were (or are counted in `Stats::lost_pages` and refused, never
    /// misread).
    pub fn check(&self) -> Result<()> {
        self.inner.settle_read_promotions(false);
        self.rt().background.take().map_or(Ok(()), Err)
    }

    /// Stops the background work (balancer, background eviction), waits
    /// for every queued and running move to finish, and returns the first
    /// background failure not yet returned by [`check`](Self::check).
    /// It stops them for every handle of this runtime (clones share it).
    /// Buffers still alive go on working, without background threads
    /// ([`start_balancer`](Self::start_balancer) through another handle
    /// starts the balancer again; background eviction stays off);
    /// dropping the last handle and buffer does the same, dropping the
    /// result.
    pub fn shutdown(self) -> Result<()> {
        self.stop_balancer();
        self.inner.stop_reclaimer();
        self.inner.mover.drain();
        self.check()
    }

    /// [`stats`](Self::stats) as JSON.
    pub fn stats_json(&self) -> String {
        serde_json::to_string(&self.stats()).expect("stats serialize")
    }

    /// Which backend the device tier runs on, if there is one.
    pub fn device_backend(&self) -> Option<BackendKind> {
        self.rt().tiers.device().map(|d| d.backend())
    }

    /// Backs the device tier's memory with memory now. A GPU's always is;
    /// the simulated device's host arena is otherwise backed page by page
    /// at first touch, and an NVMe read into an untouched page then zeroes
    /// it first, in the thread that submits the read. Call it where the
    /// whole tier will be used (an expert cache's slots) and its first
    /// touches would land in a timed run. No device tier: nothing to do.
    pub fn commit_device_memory(&self) {
        if let Some(d) = self.rt().tiers.device() {
            d.commit();
        }
    }

    /// The link the device tier's simulated backend accounts its copies
    /// with; `None` without a device tier or on a real GPU.
    pub fn device_link_model(&self) -> Option<LinkModel> {
        self.rt()
            .tiers
            .device()
            .and_then(|d| d.backend_handle().link_model())
    }
}
