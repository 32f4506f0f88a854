//! An MoE expert cache: experts live in host memory (or NVMe) and a fixed
//! number of device slots hold the ones in use.
//!
//! Each registered expert is a runtime [`Buffer`] kept in the host tier
//! (cascading to NVMe when the host budget is full). [`ExpertCache::new`]
//! builds a private runtime whose device tier is sized to exactly
//! `device_slots` experts, with background eviction off, so this cache
//! alone decides what is in device memory; [`ExpertCache::on`] puts the
//! cache on a runtime shared with the caller's buffers, where the experts
//! take their place in the same per-tier budgets and `device_slots` bounds
//! the cache's share of the device tier (an expert the runtime moved away
//! between fetches is found gone and moved again). Either way:
//!
//! - [`ExpertCache::fetch`] pins the expert's pages where it is read — the
//!   device tier, or the host tier for an expert read in place (below) —
//!   and returns their addresses there; it blocks only when the expert is
//!   not there yet (a miss, or a prefetch still in flight). A full cache
//!   first evicts a victim back to the host tier.
//! - [`ExpertCache::prefetch`] starts asynchronous moves (runtime prefetch
//!   tickets) for experts a router predicts for an upcoming layer. A
//!   prefetched expert is protected from eviction until it is used, until
//!   `protect_fetches` fetches have passed, or until its layer's unused
//!   prefetches are cancelled ([`ExpertCache::cancel_prefetches`]; those
//!   still on their way are dropped, what they had not read yet never
//!   read).
//! - Eviction ([`Eviction::Lrfu`], the default) scores every expert by
//!   LRFU ([`crate::policy::lrfu`]) — the sum over its past uses of
//!   `decay^(age in fetches)` — which weighs frequency and recency in one
//!   number (decay 1 is LFU, decay → 0 is LRU); the resident, unpinned,
//!   unprotected expert the policy ranks lowest goes. [`Eviction::Lru`] with `per_layer` is the mixtral-offloading
//!   baseline; [`Eviction::NoCache`] moves every fetch into a slot (a
//!   read in place still moves nothing).
//! - Where the host budget cannot hold every expert, host memory may cache
//!   them ([`MoeConfig::host_cache`], off by default): every expert has its copy on NVMe,
//!   one moved into device memory leaves host memory, and one evicted
//!   takes the host slot of the expert there least worth keeping if it is
//!   worth more, so the device slots and the host tier hold distinct
//!   experts, those the reuse estimate values most, with no write after
//!   registration.
//! - Where the device's memory is the host's (the simulated device), an
//!   expert in host memory may be read where it is
//!   ([`MoeConfig::host_in_place`]): its fetch pins it in the host tier,
//!   takes no slot and moves nothing, and the slots hold only experts read
//!   from NVMe.
//!
//! The cache's bookkeeping lock is held while a fetch moves its expert (and
//! while a victim is evicted), so concurrent fetches serialize: slot counts
//! and device residency can never disagree. Prefetches only queue moves.
//!
//! **Stall time.** On the simulated device the cache runs a modelled clock:
//! host→device transfers share one link — the device backend's own link
//! model, the one the runtime accounts every simulated copy with
//! ([`crate::device::sim`]; [`MoeConfig::sim_link`], by default PCIe Gen4
//! x16, 25 GB/s and 5 µs per transfer, one transfer per expert; an expert
//! registered on NVMe crosses [`MoeConfig::sim_nvme_link`] where it is
//! set, the disk's read being what its move waits for) — the
//! caller advances the clock
//! by its compute time ([`ExpertCache::advance`]), and a fetch stalls for
//! the modelled time until the bytes it waits for have crossed the link
//! (its own transfer, or the rest of a prefetch in flight). Demand
//! transfers go ahead of queued prefetches, which cross one runtime page
//! at a time, so a wrong prefetch delays a demand fetch by at most the page
//! on the wire (priority copy streams, page-sized prefetch copies; see
//! [`MoeConfig::link_priority`]); a prefetch whose layer has run can be
//! cancelled ([`ExpertCache::cancel_prefetches`]). On a real GPU stall
//! time is the wall time `fetch` waited. [`MoeStats::stall_modelled`] says
//! which.
//!
//! **Lookahead.** [`TransitionPredictor`] counts which experts follow
//! which across layers (as MoE-Infinity does) and predicts the next layer's
//! experts from the current layer's routing, for [`ExpertCache::prefetch`].
//! (The synthetic router `strata bench moe` draws from lives in the
//! `strata-bench` crate.)
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;

use crate::device::{BackendKind, DeviceChoice};
use crate::error::{Error, ErrorKind, Result};
use crate::link::LinkModel;
use crate::policy::lrfu::{self, Ranking};

use super::reuse::Reuse;
use crate::runtime::{Buffer, Pin, Placement, Runtime, Ticket};
use crate::tier::{NvmeConfig, Tier};

/// The furthest [`ExpertCache::advance`] takes the modelled clock, in
/// seconds (about 30 years; up to there an `f64` clock still resolves a
/// tenth of a microsecond, what the link's transfers need).
pub const MAX_MODELLED_SECONDS: f64 = 1e9;

/// How the cache picks victims.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// Lowest LRFU score: Σ decay^(fetches since each use), 0 < decay ≤ 1.
    Lrfu {
        /// Per-fetch decay of past uses.
        decay: f64,
    },
    /// The expert whose next use is expected farthest away: its layer's
    /// next visit, or a later one, with the chance that its layer's router
    /// picks it (the share of its layer's visits that used it, past visits
    /// decayed by `decay` per later visit) — what a decoder that visits its
    /// layers in a cycle will use soonest stays (`reuse.rs`). Prefetches whose victim is worth more than the
    /// prediction are declined.
    Reuse {
        /// Per-visit decay of a layer's past visits.
        decay: f64,
    },
    /// Least recently used.
    Lru,
    /// No caching: every fetch moves the expert (it is evicted first).
    NoCache,
}

/// How to build an [`ExpertCache`]. Start from [`MoeConfig::new`] and set
/// what differs; new fields may be added in any release.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MoeConfig {
    /// Device backend (sim without a GPU).
    pub device: DeviceChoice,
    /// Experts the device holds at once.
    pub device_slots: usize,
    /// Bytes of the largest expert (a slot's size).
    pub slot_bytes: u64,
    /// Host memory for the experts.
    pub host_bytes: u64,
    /// An NVMe tier for experts beyond the host budget.
    pub nvme: Option<NvmeConfig>,
    /// Runtime page size.
    pub page_size: usize,
    /// Victim choice.
    pub eviction: Eviction,
    /// Slots split evenly between layers, victims only from the same layer
    /// (mixtral-offloading); otherwise one pool for all layers.
    pub per_layer: bool,
    /// A prefetched expert not yet used is protected for this many fetches.
    pub protect_fetches: u64,
    /// With [`Eviction::Reuse`], a miss of an expert registered on NVMe
    /// counts as this many misses of one in host memory when a victim is
    /// chosen (a victim's loss is its reuse value times its miss's cost):
    /// about the ratio of the device link's bandwidth to the disk's. 4 by
    /// default (PCIe Gen4 x16 against one Gen4 NVMe drive; on the
    /// simulated device a host copy against this machine's virtual disk);
    /// 1 weighs every miss alike.
    pub nvme_miss_cost: f64,
    /// When the host tier cannot hold every expert (the first one goes to
    /// NVMe), it becomes a cache: the experts registered in it get a copy
    /// on NVMe too (written once, at that registration), an expert moved
    /// into device memory gives up its host slot, and an evicted one takes
    /// the host slot of the expert there least worth keeping (by the reuse
    /// estimate) if it is worth more — an expert in host memory and one in
    /// device memory are never the same one, and nothing is written after
    /// registration. Each expert leaving device memory for host memory is
    /// copied there on the evicting thread: on the simulated device at 25%
    /// and 50% of a tiny Mixtral's experts in device slots this read 10%
    /// less from the disk at 50% and waited 30% less for it, and spent as
    /// much time copying (docs/perf-log.md). Off by default: the host tier
    /// keeps the experts registered in it.
    pub host_cache: bool,
    /// An expert held in host memory and not in a device slot is fetched
    /// where it is: pinned in the host tier, its addresses host memory, no
    /// slot taken, no victim evicted and nothing moved
    /// ([`MoeStats::served_in_place`]); the device slots then hold only
    /// experts read from NVMe. For a device whose memory is the host's —
    /// the simulated device, where the expert arithmetic reads host memory
    /// either way — this is the cheaper place to read a host expert from,
    /// and the modelled clock charges it nothing (no transfer happens; a
    /// GPU reading host memory in place would pay the link on every use).
    /// Refused on a CUDA device (`Unsupported`): its kernels would need the
    /// host tier mapped into the device's address space, which is not
    /// built. Off by default.
    pub host_in_place: bool,
    /// Number of layers (needed for `per_layer`).
    pub layers: usize,
    /// Modelled link (simulated device): demand transfers go ahead of
    /// queued prefetches, which cross a page at a time; off, one FIFO of
    /// whole transfers. Configurations without prefetch move the same
    /// either way.
    pub link_priority: bool,
    /// The link the simulated device that [`ExpertCache::new`] opens
    /// models (default PCIe Gen4 x16); the cache's clock runs on it, the
    /// backend's own model. [`ExpertCache::on`] uses its runtime's device.
    pub sim_link: LinkModel,
    /// On the simulated device, the link a move of an expert registered
    /// on NVMe is modelled on (the disk's read bandwidth: its read is what
    /// the move waits for); `None`, the default: [`sim_link`](Self::sim_link)
    /// for every move. An expert registered in host memory crosses
    /// `sim_link`.
    pub sim_nvme_link: Option<LinkModel>,
}

impl MoeConfig {
    /// A simulated device of `device_slots` slots of `slot_bytes`, LRFU
    /// eviction with decay 0.999, host memory for `host_bytes`.
    pub fn new(device_slots: usize, slot_bytes: u64, host_bytes: u64) -> Self {
        Self {
            device: DeviceChoice::Sim,
            device_slots,
            slot_bytes,
            host_bytes,
            nvme: None,
            page_size: 64 << 10,
            eviction: Eviction::Lrfu { decay: 0.999 },
            per_layer: false,
            protect_fetches: 16,
            nvme_miss_cost: 4.0,
            host_cache: false,
            host_in_place: false,
            layers: 1,
            link_priority: true,
            sim_link: crate::device::sim::PCIE_GEN4_X16,
            sim_nvme_link: None,
        }
    }
}

/// What the cache reports.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct MoeStats {
    /// Calls to `fetch`.
    pub fetches: u64,
    /// Fetches that found the expert resident or on its way (no transfer of
    /// their own).
    pub hits: u64,
    /// Hits on a prefetch that had not finished yet (they waited).
    pub late_prefetch_hits: u64,
    /// Prefetches started.
    pub prefetches: u64,
    /// Prefetched experts fetched before they were evicted.
    pub prefetches_used: u64,
    /// Predictions not prefetched because no slot could be freed.
    pub prefetches_dropped: u64,
    /// Predictions not prefetched because the expert they would evict is
    /// worth more ([`Eviction::Reuse`]).
    pub prefetches_declined: u64,
    /// Prefetches cancelled before they finished (their slot freed).
    pub prefetches_cancelled: u64,
    /// Experts evicted.
    pub evictions: u64,
    /// Bytes moved into device memory (demand and prefetch; of a cancelled
    /// prefetch, what crossed the modelled link before it was cancelled).
    pub bytes_moved: u64,
    /// Time `fetch` waited, seconds (modelled on the simulated device).
    pub stall_seconds: f64,
    /// Whether `stall_seconds` is modelled (simulated device) or measured.
    pub stall_modelled: bool,
    /// Fetches of an expert the cache held whose pages the shared runtime
    /// had moved out of device memory meanwhile (background eviction, the
    /// balancer): misses, moved again ([`ExpertCache::on`] only).
    pub displaced: u64,
    /// Misses whose read [`ExpertCache::read_ahead`] started before their
    /// fetch: counted as misses (not hits, not prefetches); their fetch
    /// waits only for what is left of the read.
    pub reads_ahead: u64,
    /// Moves into device memory (misses, reads ahead, prefetches) of
    /// experts on NVMe: the cache's disk reads. The others came from host
    /// memory.
    pub moves_from_nvme: u64,
    /// Evictions that kept the expert in host memory in place of one
    /// worth less there ([`MoeConfig::host_cache`]), which went back to its
    /// NVMe copy with no I/O.
    pub host_swaps: u64,
    /// Fetches served from the expert's copy in host memory, where it is
    /// ([`MoeConfig::host_in_place`]): neither hits nor moves.
    pub served_in_place: u64,
}

impl MoeStats {
    /// Hits over fetches.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.fetches)
    }
    /// Prefetched and then used, over prefetched (0 with no prefetches).
    pub fn prefetch_accuracy(&self) -> f64 {
        ratio(self.prefetches_used, self.prefetches)
    }

    /// Experts moved into device memory: the misses' transfers (read ahead
    /// or not) and the prefetches started.
    pub fn moves(&self) -> u64 {
        self.misses() + self.prefetches
    }

    /// Fetches whose expert was moved into device memory for them (read
    /// ahead or not): neither hits nor served in place.
    pub fn misses(&self) -> u64 {
        self.fetches - self.hits - self.served_in_place
    }

    /// Of [`moves`](Self::moves), those whose expert was fetched before it
    /// left device memory: every miss's (its fetch is the use) and each
    /// prefetch that was used. A prefetch evicted, cancelled or never
    /// fetched did not pay.
    pub fn moves_paid(&self) -> u64 {
        self.misses() + self.prefetches_used
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

struct Expert {
    layer: u32,
    /// Shared with owned pins (see [`ExpertCache::fetch_owned`]).
    buffer: std::sync::Arc<Buffer>,
}

#[derive(Default)]
struct Meta {
    resident: bool,
    pins: u32,
    /// Prefetched and not used yet: the tick it was prefetched at.
    protected_since: Option<u64>,
    ticket: Option<Ticket>,
    /// Modelled time its last transfer completes.
    ready_at: f64,
    /// Its prefetch is still queued on the modelled link.
    in_flight: bool,
    /// Its move was started by `read_ahead`: the next fetch is a miss.
    ahead: bool,
    /// Held in host memory (its only copy there, or, in device memory,
    /// the clean copy it came from): a miss copies it from there, no disk
    /// read. As the cache placed it: on a shared runtime
    /// ([`ExpertCache::on`]) other pressure may move it since.
    in_host: bool,
    /// It has a copy on NVMe (registered there, or given one when the host
    /// tier became a cache): leaving host memory is free.
    nvme_copy: bool,
}

/// A prefetch the modelled link has not finished.
struct Pending {
    expert: usize,
    /// Bytes still to cross the link.
    left: u64,
    /// Modelled time it was queued.
    issued: f64,
    /// It comes from NVMe (crosses the NVMe link).
    nvme: bool,
}

/// The link model of `rt`'s device backend, for a simulated device (a real
/// GPU's transfers are measured, not modelled): the cache's clock
/// schedules its transfers on the model the backend accounts every copy
/// with.
fn device_link(rt: &Runtime) -> Option<LinkModel> {
    rt.device_link_model()
}

/// The modelled link and clock of the simulated device.
///
/// Two priority classes share one link. Demand transfers (a fetch that
/// waits) go first; prefetches queue behind them and cross in chunks of
/// one runtime page, so a demand transfer waits at most for the prefetch
/// chunk already on the wire — the behaviour of a copy engine fed from a
/// high-priority stream for demand and page-sized copies on a low-priority
/// stream for prefetch. A transfer pays the link latency once per
/// contiguous run: a prefetch interrupted by a demand transfer pays it
/// again when it resumes. With `priority` off the link is one FIFO and
/// every transfer crosses whole (the model before chunking).
struct Clock {
    now: f64,
    /// When the link ends its committed work: demand transfers and the
    /// prefetch chunk on the wire.
    link_free: f64,
    link: LinkModel,
    /// The link of a move from NVMe, where it differs from `link`.
    nvme: Option<LinkModel>,
    /// Bytes a prefetch crosses between preemption points.
    chunk: u64,
    priority: bool,
    /// Prefetches not yet fully across, oldest first.
    queue: VecDeque<Pending>,
    /// The expert whose prefetch chunk crossed last, while the link keeps
    /// streaming it (its next chunk pays no latency).
    streaming: Option<usize>,
}

impl Clock {
    /// Link time of `bytes` (from NVMe with `nvme`), with or without the
    /// per-transfer latency.
    fn time(&self, bytes: u64, setup: bool, nvme: bool) -> f64 {
        let link = match self.nvme {
            Some(l) if nvme => l,
            _ => self.link,
        };
        let t = link.time(bytes as usize).as_secs_f64();
        if setup {
            t
        } else {
            t - link.latency_ns as f64 * 1e-9
        }
    }

    /// Moves the queued prefetch chunks that start before `t` (a chunk on
    /// the wire runs to its end), recording when each prefetch completes.
    fn run_until(&mut self, t: f64, meta: &mut [Meta]) {
        while let Some(p) = self.queue.front() {
            let start = self.link_free.max(p.issued);
            if start >= t {
                break;
            }
            let (expert, bytes, nvme) = (p.expert, p.left.min(self.chunk), p.nvme);
            let setup = self.streaming != Some(expert);
            self.link_free = start + self.time(bytes, setup, nvme);
            self.streaming = Some(expert);
            let p = self.queue.front_mut().expect("peeked");
            p.left -= bytes;
            if p.left == 0 {
                self.queue.pop_front();
                meta[expert].in_flight = false;
                meta[expert].ready_at = self.link_free;
            }
        }
    }

    /// A demand transfer of `bytes` (from NVMe with `nvme`), ahead of
    /// queued prefetches; returns when it completes.
    fn demand(&mut self, bytes: u64, nvme: bool, meta: &mut [Meta]) -> f64 {
        self.run_until(self.now, meta);
        let start = self.now.max(self.link_free);
        self.link_free = start + self.time(bytes, true, nvme);
        self.streaming = None;
        self.link_free
    }

    /// Queues a prefetch of `bytes` for `expert`. Without priority it
    /// crosses whole, in order with demand transfers; returns when it
    /// completes in that case.
    fn prefetch(&mut self, expert: usize, bytes: u64, nvme: bool, meta: &mut [Meta]) {
        if self.priority {
            self.run_until(self.now, meta);
            self.queue.push_back(Pending {
                expert,
                left: bytes,
                issued: self.now,
                nvme,
            });
            meta[expert].in_flight = true;
        } else {
            let done = self.demand(bytes, nvme, meta);
            meta[expert].ready_at = done;
        }
    }

    /// A fetch needs `expert`, whose prefetch is still queued: the rest of
    /// it moves now, at demand priority. Returns when it completes.
    fn promote(&mut self, expert: usize, meta: &mut [Meta]) -> f64 {
        self.run_until(self.now, meta);
        let Some(at) = self.queue.iter().position(|p| p.expert == expert) else {
            return meta[expert].ready_at;
        };
        let p = self.queue.remove(at).expect("found");
        let setup = !(at == 0 && self.streaming == Some(expert) && self.link_free >= self.now);
        let start = self.now.max(self.link_free);
        self.link_free = start + self.time(p.left, setup, p.nvme);
        self.streaming = None;
        meta[expert].in_flight = false;
        meta[expert].ready_at = self.link_free;
        self.link_free
    }

    /// Drops the rest of `expert`'s queued prefetch (the chunk on the wire
    /// still finishes); returns the bytes that will not cross.
    fn cancel(&mut self, expert: usize, meta: &mut [Meta]) -> u64 {
        self.run_until(self.now, meta);
        let mut dropped = 0;
        self.queue.retain(|p| {
            if p.expert == expert {
                dropped += p.left;
            }
            p.expert != expert
        });
        if self.streaming == Some(expert) {
            self.streaming = None;
        }
        meta[expert].in_flight = false;
        dropped
    }

    /// Modelled seconds until the link is idle, queued prefetches included.
    fn backlog(&self) -> f64 {
        let mut t = (self.link_free - self.now).max(0.0);
        for p in &self.queue {
            t += self.time(p.left, self.streaming != Some(p.expert), p.nvme);
        }
        t
    }
}

struct State {
    meta: Vec<Meta>,
    /// The eviction policy's order of the experts (by index), by fetch tick.
    ranking: Box<dyn Ranking>,
    /// The reuse estimate ([`Eviction::Reuse`]; kept for every policy).
    reuse: Reuse,
    tick: u64,
    resident: usize,
    resident_per_layer: Vec<usize>,
    /// Experts with `in_host`.
    in_host: usize,
    /// Experts the host tier holds once it is a cache
    /// ([`MoeConfig::host_cache`]); 0 before.
    host_slots: usize,
    clock: Option<Clock>,
    stats: MoeStats,
}

/// The expert cache; see the module docs.
pub struct ExpertCache {
    rt: Runtime,
    /// Whether `rt` is shared with others (see [`ExpertCache::on`]).
    shared: bool,
    config: MoeConfig,
    experts: Vec<Expert>,
    index: HashMap<(u32, u32), usize>,
    state: Mutex<State>,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("experts", &self.experts.len())
            .field("device_slots", &self.config.device_slots)
            .finish()
    }
}

/// An expert pinned in device memory; see [`ExpertCache::fetch`].
#[must_use = "the expert is unpinned when the guard drops"]
pub struct ExpertPin<'a> {
    cache: &'a ExpertCache,
    index: usize,
    /// `Some` until the guard drops: the runtime's pin goes first, then
    /// the cache's count (an expert the cache counts unpinned is never
    /// still pinned in the runtime).
    pin: Option<Pin<'a>>,
}

impl ExpertPin<'_> {
    /// Address of each page of the expert in [`tier`](Self::tier), in
    /// order (one address when the expert fits in a page). Valid until the
    /// guard drops.
    pub fn addresses(&self) -> &[u64] {
        self.held().addresses()
    }
    /// Where the expert is read from: the device, or host memory for an
    /// expert served in place ([`MoeConfig::host_in_place`]).
    pub fn tier(&self) -> Tier {
        self.held().tier()
    }
    /// The first page's address.
    pub fn address(&self) -> u64 {
        self.held().addresses()[0]
    }
    fn held(&self) -> &Pin<'_> {
        self.pin.as_ref().expect("held until the guard drops")
    }
    /// The runtime buffer holding the expert.
    pub fn buffer(&self) -> &Buffer {
        &self.cache.experts[self.index].buffer
    }
}

impl Drop for ExpertPin<'_> {
    fn drop(&mut self) {
        drop(self.pin.take());
        self.cache.state.lock().meta[self.index].pins -= 1;
    }
}

/// An expert pinned in device memory, owning a reference to its cache; see
/// [`ExpertCache::fetch_owned`].
#[must_use = "the expert is unpinned when the guard drops"]
pub struct OwnedExpertPin {
    cache: std::sync::Arc<ExpertCache>,
    index: usize,
    /// As [`ExpertPin`]'s: dropped before the cache's count.
    pin: Option<crate::runtime::OwnedPin>,
}

impl std::fmt::Debug for OwnedExpertPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedExpertPin")
            .field("index", &self.index)
            .finish()
    }
}

impl OwnedExpertPin {
    /// Address of each page of the expert in [`tier`](Self::tier), in
    /// order.
    pub fn addresses(&self) -> &[u64] {
        self.held().addresses()
    }
    /// Where the expert is read from (see [`ExpertPin::tier`]).
    pub fn tier(&self) -> Tier {
        self.held().tier()
    }
    fn held(&self) -> &crate::runtime::OwnedPin {
        self.pin.as_ref().expect("held until the guard drops")
    }
    /// The runtime buffer holding the expert (shared: a holder may pin
    /// ranges of it again, e.g. to export them through DLPack).
    pub fn buffer(&self) -> &std::sync::Arc<Buffer> {
        &self.cache.experts[self.index].buffer
    }
    /// The cache it was fetched from.
    pub fn cache(&self) -> &std::sync::Arc<ExpertCache> {
        &self.cache
    }
}

impl Drop for OwnedExpertPin {
    fn drop(&mut self) {
        drop(self.pin.take());
        self.cache.state.lock().meta[self.index].pins -= 1;
    }
}

/// The most layers an expert cache holds: layer ids are below it (the
/// cache keeps per-layer counts, sized by the highest id).
pub const MAX_LAYERS: u32 = 1 << 16;

impl ExpertCache {
    /// Builds the runtime: a device tier of exactly `device_slots` slots.
    pub fn new(config: MoeConfig) -> Result<Self> {
        Self::check(&config)?;
        let page = config.page_size as u64;
        let slot_pages = config.slot_bytes.div_ceil(page);
        let device_bytes = slot_pages
            .checked_mul(config.device_slots as u64)
            .and_then(|p| p.checked_mul(page))
            .ok_or_else(|| Error::invalid("device slots overflow a byte count"))?;
        let mut b = Runtime::builder()
            .page_size(config.page_size)
            .device(config.device, device_bytes)
            .sim_link(config.sim_link)
            .host(config.host_bytes)
            .background_eviction(false)
            .sampling(None);
        if let Some(n) = &config.nvme {
            b = b.nvme(n.clone());
        }
        let rt = b.build()?;
        // The simulated device's slots are this process's memory: more than
        // the machine has available is refused here, not met by the OOM
        // killer as they are backed below.
        if rt.device_backend() == Some(BackendKind::Sim) {
            if let Some(available) = crate::sys::mem_available_bytes() {
                if device_bytes > available {
                    return Err(Error::new(
                        ErrorKind::OutOfCapacity,
                        format!(
                            "the simulated device's {} slots take {device_bytes} bytes of host memory; {available} are available",
                            config.device_slots
                        ),
                    ));
                }
            }
        }
        // Every slot will hold experts: backed now, not by the first reads.
        rt.commit_device_memory();
        Self::with_runtime(rt, config, false)
    }

    /// The configuration's own checks.
    fn check(config: &MoeConfig) -> Result<()> {
        crate::size::check_page_size(config.page_size).map_err(|e| e.context("page_size"))?;
        if config.layers > MAX_LAYERS as usize {
            return Err(Error::invalid(format!(
                "{} layers: an expert cache holds at most {MAX_LAYERS}",
                config.layers
            )));
        }
        if config.device_slots == 0 || config.slot_bytes == 0 {
            return Err(Error::invalid(
                "an expert cache needs at least one device slot of at least one byte",
            ));
        }
        if config.per_layer && (config.layers == 0 || config.device_slots < config.layers) {
            return Err(Error::invalid(format!(
                "per-layer slots need at least one slot per layer: {} slots, {} layers",
                config.device_slots, config.layers
            )));
        }
        if let Some(l) = config.sim_nvme_link {
            l.check().map_err(|e| e.context("sim_nvme_link"))?;
        }
        if !(config.nvme_miss_cost.is_finite() && config.nvme_miss_cost > 0.0) {
            return Err(Error::invalid(format!(
                "nvme_miss_cost {} is not a positive number",
                config.nvme_miss_cost
            )));
        }
        Self::ranking(config.eviction).map(drop)
    }

    /// The policy that orders the experts for `eviction`.
    fn ranking(eviction: Eviction) -> Result<Box<dyn Ranking>> {
        Ok(match eviction {
            Eviction::Lrfu { decay } => Box::new(lrfu::Scores::new(decay)?),
            Eviction::Reuse { decay } => {
                if !(decay > 0.0 && decay <= 1.0) {
                    return Err(Error::invalid(format!(
                        "reuse decay {decay} is not in (0, 1]"
                    )));
                }
                // Ties of the reuse estimate go to the least recently used.
                Box::new(lrfu::Recency::default())
            }
            Eviction::Lru | Eviction::NoCache => Box::new(lrfu::Recency::default()),
        })
    }

    /// Checks `config` and makes the cache on `rt`; `shared` when others
    /// use `rt` too.
    fn with_runtime(rt: Runtime, config: MoeConfig, shared: bool) -> Result<Self> {
        Self::check(&config)?;
        if config.host_in_place && rt.device_backend() != Some(BackendKind::Sim) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "host_in_place needs a device whose memory is the host's (the simulated device): \
                 a GPU's kernels cannot read the host tier in place yet",
            ));
        }
        let clock = device_link(&rt).map(|link| Clock {
            now: 0.0,
            link_free: 0.0,
            link,
            nvme: config.sim_nvme_link,
            chunk: config.page_size as u64,
            priority: config.link_priority,
            queue: VecDeque::new(),
            streaming: None,
        });
        let layers = config.layers.max(1);
        Ok(Self {
            rt,
            shared,
            experts: Vec::new(),
            index: HashMap::new(),
            state: Mutex::new(State {
                meta: Vec::new(),
                ranking: Self::ranking(config.eviction)?,
                reuse: Reuse::new(match config.eviction {
                    Eviction::Reuse { decay } => decay,
                    _ => 1.0,
                }),
                tick: 0,
                resident: 0,
                resident_per_layer: vec![0; layers],
                in_host: 0,
                host_slots: 0,
                stats: MoeStats {
                    stall_modelled: clock.is_some(),
                    ..MoeStats::default()
                },
                clock,
            }),
            config,
        })
    }

    /// An expert cache on `rt`, a runtime the caller shares with its own
    /// buffers (and other offload objects): the experts' pages take their
    /// place in `rt`'s host tier (cascading to NVMe) under the same budgets
    /// as everything else, and `config.device_slots` slots of `rt`'s
    /// device tier are the cache's to fill. Every move goes through `rt`'s
    /// migration engine: a fetch is a demand pin (room made in the device
    /// tier by demoting the coldest pages of any buffer), a prefetch a
    /// prefetch. `config.device`, `host_bytes`, `nvme` and `page_size` are
    /// the runtime's own here and are not used.
    ///
    /// The runtime's background eviction and balancer may move an expert
    /// that is not pinned; the cache then finds it gone at its next fetch
    /// (a miss, counted as one) and brings it back.
    pub fn on(rt: &Runtime, config: MoeConfig) -> Result<Self> {
        if !rt.tiers().contains(&Tier::Device) {
            return Err(Error::invalid(
                "an expert cache needs a runtime with a device tier",
            ));
        }
        let page = rt.page_size() as u64;
        let slot_pages = config.slot_bytes.div_ceil(page);
        let device_pages = rt
            .stats()
            .tiers
            .iter()
            .find(|t| t.tier == Tier::Device)
            .map_or(0, |t| (t.used_pages + t.free_pages) as u64);
        let wanted = slot_pages.saturating_mul(config.device_slots as u64);
        if wanted > device_pages {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "{} device slots of {} pages need {wanted} pages; the runtime's device tier has {device_pages}",
                    config.device_slots, slot_pages
                ),
            ));
        }
        let config = MoeConfig {
            page_size: rt.page_size(),
            ..config
        };
        Self::with_runtime(rt.clone(), config, true)
    }

    /// The runtime underneath (for its stats).
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// Registers expert `expert` of `layer` with its weights, stored in the
    /// host tier (NVMe when the host budget is full).
    pub fn register(&mut self, layer: u32, expert: u32, weights: &[u8]) -> Result<()> {
        if weights.is_empty() || weights.len() as u64 > self.config.slot_bytes {
            return Err(Error::invalid(format!(
                "expert ({layer}, {expert}) has {} bytes; a slot holds 1 to {}",
                weights.len(),
                self.config.slot_bytes
            )));
        }
        if layer >= MAX_LAYERS {
            return Err(Error::invalid(format!(
                "layer {layer} is beyond the most an expert cache holds ({MAX_LAYERS} layers, ids from 0)"
            )));
        }
        if self.config.per_layer && layer as usize >= self.config.layers {
            return Err(Error::invalid(format!(
                "layer {layer} is beyond the configured {} layers",
                self.config.layers
            )));
        }
        if self.index.contains_key(&(layer, expert)) {
            return Err(Error::invalid(format!(
                "expert ({layer}, {expert}) is registered already"
            )));
        }
        let buffer = self
            .rt
            .alloc_with(weights.len() as u64, Placement::Prefer(Tier::Host))?;
        buffer.write(0, weights)?;
        // A full host tier places pages in the fastest tier with room — the
        // device; they belong below it until fetched.
        buffer.evict(0..buffer.len(), Tier::Host)?;
        // An expert the host tier took only some pages of is read from
        // NVMe all the same: counted as on NVMe. Only one wholly there has
        // a copy on NVMe of every page (its pages in host memory have none).
        let pages = buffer.len().div_ceil(self.rt.page_size() as u64) as usize;
        let wholly = |tier| (0..pages).all(|p| buffer.tier_of(p).ok().flatten() == Some(tier));
        let on_nvme = !wholly(Tier::Host);
        let nvme_copy = wholly(Tier::Nvme);
        if on_nvme && self.config.host_cache && self.state.get_mut().host_slots == 0 {
            // Before the new expert joins: if this fails, nothing of it is
            // registered (its buffer goes with this call).
            self.host_becomes_a_cache()?;
        }
        let i = self.experts.len();
        self.experts.push(Expert {
            layer,
            buffer: std::sync::Arc::new(buffer),
        });
        self.index.insert((layer, expert), i);
        let st = self.state.get_mut();
        st.meta.push(Meta {
            in_host: !on_nvme,
            nvme_copy,
            ..Meta::default()
        });
        st.in_host += usize::from(!on_nvme);
        st.reuse.add(layer);
        // One pool for all layers: any layer may register (per-layer slots
        // checked the layer above).
        if st.resident_per_layer.len() <= layer as usize {
            st.resident_per_layer.resize(layer as usize + 1, 0);
        }
        Ok(())
    }

    /// The first expert registered on NVMe: the host tier cannot hold
    /// them all, and becomes a cache ([`MoeConfig::host_cache`]). Each
    /// expert in it, not in device memory, gets its copy on NVMe: written
    /// there and read back, the NVMe copy kept clean.
    fn host_becomes_a_cache(&mut self) -> Result<()> {
        let st = self.state.get_mut();
        for (i, e) in self.experts.iter().enumerate() {
            let m = &mut st.meta[i];
            if !m.in_host || m.nvme_copy || m.resident {
                continue;
            }
            let b = &e.buffer;
            b.evict(0..b.len(), Tier::Nvme)?;
            b.prefetch(0..b.len(), Tier::Host).wait()?;
            m.nvme_copy = true;
            let pages = b.len().div_ceil(self.rt.page_size() as u64) as usize;
            if !(0..pages).all(|p| matches!(b.tier_of(p), Ok(Some(Tier::Host)))) {
                // No room came back for it (a shared runtime's others).
                m.in_host = false;
                st.in_host -= 1;
            }
        }
        st.host_slots = st.in_host.max(1);
        Ok(())
    }

    /// The indices of `experts` of `layer`: an error if any is unknown.
    fn lookup_all(&self, layer: u32, experts: &[u32]) -> Result<Vec<usize>> {
        experts.iter().map(|&e| self.lookup(layer, e)).collect()
    }

    fn lookup(&self, layer: u32, expert: u32) -> Result<usize> {
        self.index.get(&(layer, expert)).copied().ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("expert ({layer}, {expert}) is not registered"),
            )
        })
    }

    fn slots_for(&self, layer: u32) -> usize {
        if self.config.per_layer {
            let l = self.config.layers;
            // The first `slots % layers` layers get one more.
            self.config.device_slots / l
                + usize::from((layer as usize) < self.config.device_slots % l)
        } else {
            self.config.device_slots
        }
    }

    fn full(&self, s: &State, layer: u32) -> bool {
        if self.config.per_layer {
            s.resident_per_layer[layer as usize] >= self.slots_for(layer)
        } else {
            s.resident >= self.config.device_slots
        }
    }

    /// The victim for a new expert of `layer`: unpinned, and unprotected
    /// unless `demand` allows taking the oldest protected one. Unpinned
    /// means by anyone: a pin taken through the expert's buffer (a view
    /// that outlived its fetch) keeps its pages in device memory, where an
    /// eviction would leave them while the cache counted the slot free.
    /// That pin is looked for only on the expert the policy chose (another
    /// is chosen if it has one): finding it takes the expert's page locks,
    /// which a move in flight holds until its reads end, and the cache's
    /// lock is held here.
    fn victim(&self, s: &State, layer: u32, demand: bool) -> Option<usize> {
        let protect = |m: &Meta| {
            m.protected_since
                .is_some_and(|t| s.tick.saturating_sub(t) < self.config.protect_fetches)
        };
        let mut held_outside: Vec<usize> = Vec::new();
        loop {
            let candidates = || {
                s.meta.iter().enumerate().filter(|(i, m)| {
                    m.resident
                        && m.pins == 0
                        && (!self.config.per_layer || self.experts[*i].layer == layer)
                        && !held_outside.contains(i)
                })
            };
            let unprotected = candidates()
                .filter(|(_, m)| !protect(m))
                .map(|(i, _)| i as u64);
            let mut best = if let Eviction::Reuse { .. } = self.config.eviction {
                unprotected
                    .min_by(|&a, &b| {
                        let (va, vb) = (self.loss(s, a as usize), self.loss(s, b as usize));
                        va.total_cmp(&vb)
                            .then_with(|| s.ranking.rank(a).cmp(&s.ranking.rank(b)))
                    })
                    .map(|i| i as usize)
            } else {
                lrfu::victim(&*s.ranking, unprotected).map(|i| i as usize)
            };
            if best.is_none() && demand {
                best = candidates()
                    .min_by_key(|(_, m)| m.protected_since)
                    .map(|(i, _)| i);
            }
            match best {
                Some(v) if self.experts[v].buffer.any_pinned() => held_outside.push(v),
                _ => return best,
            }
        }
    }

    /// What a miss of expert `i` costs, in misses served from host memory:
    /// [`MoeConfig::nvme_miss_cost`] for an expert not held in host memory.
    fn miss_cost(&self, s: &State, i: usize) -> f64 {
        if s.meta[i].in_host {
            1.0
        } else {
            self.config.nvme_miss_cost
        }
    }

    /// What evicting expert `i` is expected to cost ([`Eviction::Reuse`]):
    /// its reuse value (the rate of its next uses) times its miss's cost.
    fn loss(&self, s: &State, i: usize) -> f64 {
        s.reuse.value(i) * self.miss_cost(s, i)
    }

    /// Whether a prefetch of expert `i` of `layer` would evict an expert
    /// worth more than the prediction ([`Eviction::Reuse`] only): the
    /// prediction's worth is that of an expert of `layer` used with the
    /// probability that a prefetch is used (the share so far; 1 until
    /// there are a few), times its miss's cost; the victim's is its
    /// [`loss`](Self::loss).
    fn declines(&self, s: &State, layer: u32, i: usize) -> bool {
        if !matches!(self.config.eviction, Eviction::Reuse { .. }) || !self.full(s, layer) {
            return false;
        }
        let Some(v) = self.victim(s, layer, false) else {
            return false;
        };
        let accuracy = if s.stats.prefetches >= 16 {
            s.stats.prefetches_used as f64 / s.stats.prefetches as f64
        } else {
            1.0
        };
        self.loss(s, v) >= s.reuse.worth(accuracy, layer) * self.miss_cost(s, i)
    }

    /// Evicts `victim` back to the host tier (or below); `incoming`, the
    /// expert it makes room for, keeps its place in host memory.
    fn evict(&self, s: &mut State, victim: usize, incoming: Option<usize>) -> Result<()> {
        // The victim's move, if one was started, is waited for. Its failure
        // (a read error, or on a shared runtime no room) is no error of this
        // eviction nor of the call that needed the room: the expert's copy
        // below is intact, whatever pages did arrive are moved back, and a
        // later fetch of the expert moves it again (and reports an error
        // that persists).
        if let Some(t) = s.meta[victim].ticket.take() {
            // What has not started of it never will: it would only be
            // moved back.
            self.experts[victim].buffer.cancel(&t);
            let _ = t.wait();
        }
        // The pages move first: if that fails, the victim is still
        // resident as far as the cache counts (its pages are still there).
        if s.meta[victim].nvme_copy && s.host_slots > 0 && s.in_host >= s.host_slots {
            self.swap_into_host(s, victim, incoming)?;
        }
        let b = &self.experts[victim].buffer;
        b.evict(0..b.len(), Tier::Host)?;
        if let (Some(c), true) = (&mut s.clock, s.meta[victim].in_flight) {
            s.stats.bytes_moved -= c.cancel(victim, &mut s.meta);
        }
        let m = &mut s.meta[victim];
        m.resident = false;
        m.protected_since = None;
        m.ahead = false;
        s.resident -= 1;
        s.resident_per_layer[self.experts[victim].layer as usize] -= 1;
        s.stats.evictions += 1;
        let m = &mut s.meta[victim];
        if !m.in_host && self.all_in(victim, Tier::Host) {
            m.in_host = true;
            s.in_host += 1;
        }
        Ok(())
    }

    /// The host tier is full as `victim` leaves device memory: the expert
    /// there least worth keeping (by the reuse estimate; not `incoming`)
    /// goes back to its NVMe copy, no I/O, if `victim` is worth more.
    fn swap_into_host(&self, s: &mut State, victim: usize, incoming: Option<usize>) -> Result<()> {
        let worth = s.reuse.value(victim);
        let mut held_outside: Vec<usize> = Vec::new();
        let (value, h) = loop {
            let least = (0..self.experts.len())
                .filter(|&j| {
                    let m = &s.meta[j];
                    m.in_host
                        && m.nvme_copy
                        && !m.resident
                        && m.pins == 0
                        && j != victim
                        && Some(j) != incoming
                        && !held_outside.contains(&j)
                })
                .map(|j| (s.reuse.value(j), j))
                .min_by(|a, b| a.0.total_cmp(&b.0));
            match least {
                None => return Ok(()),
                // Pages someone outside the cache still holds (a tensor
                // over an expert read in place) cannot leave; looked for
                // on the chosen expert only, as in `victim`.
                Some((_, j)) if self.experts[j].buffer.any_pinned() => held_outside.push(j),
                Some(found) => break found,
            }
        };
        if value >= worth {
            return Ok(());
        }
        let b = &self.experts[h].buffer;
        b.evict(0..b.len(), Tier::Nvme)?;
        s.meta[h].in_host = false;
        s.in_host -= 1;
        s.stats.host_swaps += 1;
        Ok(())
    }

    /// Frees slots for `incoming`, of `layer`, until one is free.
    fn make_room(&self, s: &mut State, layer: u32, incoming: usize, demand: bool) -> Result<bool> {
        while self.full(s, layer) {
            match self.victim(s, layer, demand) {
                Some(v) => self.evict(s, v, Some(incoming))?,
                None if demand => {
                    return Err(Error::new(
                        ErrorKind::OutOfCapacity,
                        format!(
                            "every device slot for layer {layer} holds a pinned expert; drop a pin first"
                        ),
                    ))
                }
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// A fetch moves expert `i` (`bytes`; from NVMe with `from_nvme`)
    /// itself: counted, and on the modelled link a demand transfer the
    /// fetch stalls for.
    fn demand_transfer(&self, s: &mut State, i: usize, bytes: u64, from_nvme: bool) {
        s.stats.moves_from_nvme += u64::from(from_nvme);
        s.stats.bytes_moved += bytes;
        if let Some(c) = &mut s.clock {
            let done = c.demand(bytes, from_nvme, &mut s.meta);
            s.stats.stall_seconds += done - c.now;
            c.now = done;
            s.meta[i].ready_at = done;
        }
    }

    /// Whether every page of expert `i` is in `tier` now.
    fn all_in(&self, i: usize, tier: Tier) -> bool {
        let b = &self.experts[i].buffer;
        let pages = b.len().div_ceil(self.rt.page_size() as u64) as usize;
        (0..pages).all(|p| b.tier_of(p).ok().flatten() == Some(tier))
    }

    /// Whether every page of expert `i` is in device memory now.
    fn in_device(&self, i: usize) -> bool {
        self.all_in(i, Tier::Device)
    }

    /// Whether a fetch of expert `i` reads it where it is, in host memory
    /// ([`MoeConfig::host_in_place`]): not in a slot, every page there.
    fn in_place(&self, s: &State, i: usize) -> bool {
        let m = &s.meta[i];
        self.config.host_in_place && m.in_host && !m.resident && self.all_in(i, Tier::Host)
    }

    /// Marks expert `i` resident; returns whether it comes from NVMe. One
    /// with a copy there gives up its host slot as it moves.
    fn mark_resident(&self, s: &mut State, i: usize) -> bool {
        let m = &mut s.meta[i];
        let from_nvme = !m.in_host;
        if m.in_host && m.nvme_copy {
            m.in_host = false;
            s.in_host -= 1;
        }
        s.meta[i].resident = true;
        s.resident += 1;
        s.resident_per_layer[self.experts[i].layer as usize] += 1;
        from_nvme
    }

    /// The expert pinned where it is read until the guard drops: in
    /// device memory, or in host memory where it is read in place
    /// ([`MoeConfig::host_in_place`]; [`ExpertPin::tier`] says which).
    /// Blocks only if it is not resident yet (a miss: evict a victim, move
    /// it) or its prefetch is still in flight. The pin is for reading
    /// ([`Buffer::pin_read`]): the expert's copy in host memory stays valid,
    /// so evicting it again moves nothing. Change an expert's weights
    /// through its buffer's `write`, never through the pinned address.
    pub fn fetch(&self, layer: u32, expert: u32) -> Result<ExpertPin<'_>> {
        self.fetch_with(layer, expert, |b, tier| b.pin_read(0..b.len(), tier))
            .map(|(index, pin)| ExpertPin {
                cache: self,
                index,
                pin: Some(pin),
            })
    }

    /// [`fetch`](Self::fetch) for holders that cannot keep a borrow of the
    /// cache (the C ABI's handle tables): the guard owns a reference to it.
    pub fn fetch_owned(
        self: &std::sync::Arc<Self>,
        layer: u32,
        expert: u32,
    ) -> Result<OwnedExpertPin> {
        self.fetch_with(layer, expert, |b, tier| b.pin_read_owned(0..b.len(), tier))
            .map(|(index, pin)| OwnedExpertPin {
                cache: self.clone(),
                index,
                pin: Some(pin),
            })
    }

    /// The bookkeeping of a fetch; `pin` pins the expert's buffer in the
    /// tier it is read from.
    fn fetch_with<'a, P>(
        &'a self,
        layer: u32,
        expert: u32,
        pin: impl FnOnce(&'a std::sync::Arc<Buffer>, Tier) -> Result<P>,
    ) -> Result<(usize, P)> {
        let i = self.lookup(layer, expert)?;
        let start = Instant::now();
        let mut s = self.state.lock();
        let s = &mut *s;
        s.tick += 1;
        s.stats.fetches += 1;
        s.reuse.at(layer);
        let tick = s.tick;
        if self.config.eviction == Eviction::NoCache && s.meta[i].resident && s.meta[i].pins == 0 {
            self.evict(s, i, None)?;
        }
        let bytes = self.experts[i].buffer.len();
        // On a shared runtime, background eviction or the balancer may
        // have moved an unpinned expert out of device memory: a miss, its
        // slot still the cache's.
        // A prefetch on its way is waited for first. One that failed (a
        // read error; on a shared runtime also its room taken by others) is
        // no error of this fetch: a miss, which the pin below moves again
        // (and whose error, if it persists, it returns).
        let mut prefetch_failed = false;
        let mut tier = Tier::Device;
        let mut missed = false;
        if s.meta[i].resident {
            if let Some(t) = s.meta[i].ticket.take() {
                prefetch_failed = t.wait().is_err();
            }
        }
        // Moved again: its prefetch failed, or (on a shared runtime) its
        // pages left device memory; on a shared runtime either is counted
        // as displaced.
        let again = s.meta[i].resident
            && s.meta[i].pins == 0
            && (prefetch_failed || (self.shared && !self.in_device(i)));
        if again {
            s.stats.displaced += u64::from(self.shared);
            s.meta[i].protected_since = None;
            s.meta[i].ahead = false;
            // The failed move's modelled transfer goes with it: the
            // demand transfer below is the one the fetch waits for.
            if let (Some(c), true) = (&mut s.clock, s.meta[i].in_flight) {
                s.stats.bytes_moved -= c.cancel(i, &mut s.meta);
            }
            let from_nvme = !s.meta[i].in_host;
            self.demand_transfer(s, i, bytes, from_nvme);
        } else if s.meta[i].resident {
            let m = &mut s.meta[i];
            let ahead = std::mem::take(&mut m.ahead);
            if ahead {
                // Its read was started for this fetch: a miss, overlapped.
                m.protected_since = None;
                s.stats.reads_ahead += 1;
            } else {
                s.stats.hits += 1;
                if m.protected_since.take().is_some() {
                    s.stats.prefetches_used += 1;
                }
            }
            if let Some(c) = &mut s.clock {
                c.run_until(c.now, &mut s.meta);
                let ready = if s.meta[i].in_flight {
                    c.promote(i, &mut s.meta)
                } else {
                    s.meta[i].ready_at
                };
                if ready > c.now {
                    s.stats.late_prefetch_hits += u64::from(!ahead);
                    s.stats.stall_seconds += ready - c.now;
                    c.now = ready;
                }
            }
        } else if self.in_place(s, i) {
            // No transfer: the simulated device's memory is the host's,
            // and the expert arithmetic reads the host tier as it reads a
            // slot.
            tier = Tier::Host;
            s.stats.served_in_place += 1;
        } else {
            self.make_room(s, layer, i, true)?;
            missed = true;
        }
        s.ranking.touch(i as u64, tick);
        s.reuse.touch(i);
        s.meta[i].pins += 1;
        let pinned = pin(&self.experts[i].buffer, tier);
        match pinned {
            Ok(p) => {
                // A miss is resident (and its move counted) once its pin
                // has moved it: a failed one leaves the expert as it was.
                if missed {
                    let from_nvme = self.mark_resident(s, i);
                    self.demand_transfer(s, i, bytes, from_nvme);
                }
                if s.clock.is_none() {
                    s.stats.stall_seconds += start.elapsed().as_secs_f64();
                }
                Ok((i, p))
            }
            Err(e) => {
                s.meta[i].pins -= 1;
                Err(e)
            }
        }
    }

    /// Starts moving `experts` of `layer` into device memory in the
    /// background (a router's predictions for an upcoming layer). Experts
    /// already resident or read in place are skipped, so a caller that caps its predictions
    /// does better to cap those that need a read ([`is_ready`](Self::is_ready)
    /// false), as `strata.moe` does; predictions for which no unprotected
    /// slot can be freed are dropped. Returns how many moves started. A
    /// move that fails later (a read error) is nobody's error: the expert's
    /// copy below is intact, and its fetch moves it again, returning the
    /// error only if that move fails too.
    pub fn prefetch(&self, layer: u32, experts: &[u32]) -> Result<usize> {
        if self.config.eviction == Eviction::NoCache {
            return Ok(0);
        }
        // Every expert known before any move starts: an error starts none.
        let ids = self.lookup_all(layer, experts)?;
        let mut started = 0;
        let mut s = self.state.lock();
        let s = &mut *s;
        for i in ids {
            if s.meta[i].resident || self.in_place(s, i) {
                continue;
            }
            if self.declines(s, layer, i) {
                s.stats.prefetches_declined += 1;
                continue;
            }
            if !self.make_room(s, layer, i, false)? {
                s.stats.prefetches_dropped += 1;
                continue;
            }
            self.start_move(s, i);
            s.stats.prefetches += 1;
            started += 1;
        }
        Ok(started)
    }

    /// Starts the reads of `experts` of `layer`, which the caller is about
    /// to fetch (a layer's routed experts that are not resident), so that
    /// they run while the caller computes on the experts it has: each
    /// fetch then waits only for its own read's remainder. Unlike a
    /// prefetch these are misses in the stats (`reads_ahead`), not
    /// predictions. Experts already resident are skipped, and so are those
    /// for which no unpinned, unprotected slot can be freed (their fetch
    /// makes room itself). Returns how many reads started. Fetch the
    /// layer's resident experts first, as `strata.moe` does: one left
    /// unpinned may be the victim that makes room for another's read.
    pub fn read_ahead(&self, layer: u32, experts: &[u32]) -> Result<usize> {
        if self.config.eviction == Eviction::NoCache {
            return Ok(0);
        }
        let ids = self.lookup_all(layer, experts)?;
        let mut s = self.state.lock();
        let s = &mut *s;
        s.reuse.at(layer);
        let mut started = 0;
        for i in ids {
            if s.meta[i].resident || self.in_place(s, i) || !self.make_room(s, layer, i, false)? {
                continue;
            }
            self.start_move(s, i);
            // Protected like a prefetch until its fetch (a lookahead for
            // the next layer must not take its slot).
            s.meta[i].ahead = true;
            started += 1;
        }
        Ok(started)
    }

    /// Marks expert `i` resident and starts its move into device memory
    /// (the caller made room), protected from eviction until fetched.
    fn start_move(&self, s: &mut State, i: usize) {
        let from_nvme = self.mark_resident(s, i);
        s.stats.moves_from_nvme += u64::from(from_nvme);
        let b = &self.experts[i].buffer;
        let tick = s.tick;
        let m = &mut s.meta[i];
        m.protected_since = Some(tick);
        m.ticket = Some(b.prefetch(0..b.len(), Tier::Device));
        if let Some(c) = &mut s.clock {
            c.prefetch(i, b.len(), from_nvme, &mut s.meta);
        }
        s.stats.bytes_moved += b.len();
    }

    /// Cancels the prefetches of `layer` that no fetch has used and whose
    /// transfer has not finished — call it once the layer has run, when
    /// they can only be late or wrong. The rest of each transfer is dropped
    /// (its batches still queued never run) and its slot freed; the expert
    /// stays in host memory, whose copy is the one a later fetch moves
    /// again, so a cancelled prefetch never leaves a partial expert behind.
    /// (On a real GPU a page already on the way cannot be aborted: this
    /// waits for it, then frees the slot.) A finished prefetch no fetch
    /// used stays resident, no longer protected. Reads a fetch of `layer`
    /// started (`read_ahead`) that was never fetched are not prefetches:
    /// they stay, unprotected. Returns how many were cancelled.
    pub fn cancel_prefetches(&self, layer: u32) -> Result<usize> {
        self.cancel_prefetches_except(layer, &[])
    }

    /// [`cancel_prefetches`](Self::cancel_prefetches) for the experts of
    /// `layer` not in `keep` — call it as soon as the layer's router has
    /// picked `keep`: a wrong guess's read still queued then never runs, and
    /// the disk reads what the layer needs sooner. An expert of `keep` not
    /// registered is `NotFound`, and nothing is cancelled.
    pub fn cancel_prefetches_except(&self, layer: u32, keep: &[u32]) -> Result<usize> {
        let kept = self.lookup_all(layer, keep)?;
        let mut s = self.state.lock();
        let s = &mut *s;
        if let Some(c) = &mut s.clock {
            c.run_until(c.now, &mut s.meta);
        }
        let mut cancelled = 0;
        for i in 0..self.experts.len() {
            let m = &mut s.meta[i];
            if self.experts[i].layer != layer || !m.resident || m.pins > 0 || kept.contains(&i) {
                continue;
            }
            if std::mem::take(&mut m.ahead) {
                // A read started for a fetch of this layer that never came
                // (the forward stopped): an ordinary resident expert from
                // now on, neither a prefetch nor protected.
                m.protected_since = None;
                continue;
            }
            if m.protected_since.is_none() {
                continue;
            }
            let unfinished = match &s.clock {
                Some(_) => m.in_flight,
                None => m.ticket.as_ref().is_some_and(|t| t.poll().is_none()),
            };
            if unfinished {
                self.evict(s, i, None)?;
                s.stats.evictions -= 1;
                s.stats.prefetches_cancelled += 1;
                cancelled += 1;
            } else {
                // Arrived, and not what the layer used: ranked by the
                // policy like any resident expert from now on.
                s.meta[i].protected_since = None;
            }
        }
        Ok(cancelled)
    }

    /// Advances the modelled clock by the caller's compute time (simulated
    /// device only; a no-op on a real GPU, where time passes by itself).
    /// `InvalidArgument` for a duration that is negative or not finite, or
    /// that would take the clock past [`MAX_MODELLED_SECONDS`] (where the
    /// modelled times would lose their precision); the clock is unchanged.
    pub fn advance(&self, seconds: f64) -> Result<()> {
        if !seconds.is_finite() || seconds < 0.0 {
            return Err(Error::invalid(format!(
                "advance({seconds}): not a duration"
            )));
        }
        let mut s = self.state.lock();
        let s = &mut *s;
        if let Some(c) = &mut s.clock {
            if c.now + seconds > MAX_MODELLED_SECONDS {
                return Err(Error::invalid(format!(
                    "advance({seconds}): the modelled clock ({} s) would pass {MAX_MODELLED_SECONDS:e} s",
                    c.now
                )));
            }
            c.now += seconds;
            c.run_until(c.now, &mut s.meta);
        }
        Ok(())
    }

    /// The host→device link the modelled clock runs on: the simulated
    /// device backend's; `None` on a real GPU.
    pub fn link(&self) -> Option<LinkModel> {
        self.state.lock().clock.as_ref().map(|c| c.link)
    }

    /// The modelled clock (seconds since the cache was made) on the
    /// simulated device; `None` on a real GPU.
    pub fn modelled_now(&self) -> Option<f64> {
        self.state.lock().clock.as_ref().map(|c| c.now)
    }

    /// Modelled seconds until the host→device link is idle (simulated
    /// device); `None` on a real GPU.
    pub fn link_backlog(&self) -> Option<f64> {
        self.state.lock().clock.as_ref().map(Clock::backlog)
    }

    /// Whether the expert is in device memory (or on its way).
    pub fn is_resident(&self, layer: u32, expert: u32) -> Result<bool> {
        let i = self.lookup(layer, expert)?;
        Ok(self.state.lock().meta[i].resident)
    }

    /// Whether a fetch of the expert needs no read of its own: it is in
    /// device memory (or on its way), or read in place from host memory
    /// ([`MoeConfig::host_in_place`]).
    pub fn is_ready(&self, layer: u32, expert: u32) -> Result<bool> {
        let i = self.lookup(layer, expert)?;
        let s = self.state.lock();
        Ok(s.meta[i].resident || self.in_place(&s, i))
    }

    /// Counters so far.
    pub fn stats(&self) -> MoeStats {
        self.state.lock().stats.clone()
    }
}

/// Counts, per layer boundary, which experts of layer l+1 follow which of
/// layer l for the same token (MoE-Infinity's activation matrix), plus
/// each layer's overall popularity, and predicts the next layer's experts
/// from the current layer's routing.
#[derive(Debug, Clone)]
pub struct TransitionPredictor {
    experts: usize,
    /// `[layer][from * experts + to]`.
    counts: Vec<Vec<f32>>,
    popularity: Vec<Vec<f32>>,
    /// Counts shrink by this factor per observation so drift is followed.
    decay: f32,
}

/// The most a [`TransitionPredictor`]'s tables may take.
const PREDICTOR_BYTES: u64 = 1 << 30;

impl TransitionPredictor {
    /// A predictor for `layers` layers of `experts` experts each.
    /// `InvalidArgument` where its tables (an `experts × experts` matrix per
    /// pair of adjacent layers) would pass 1 GiB.
    pub fn new(layers: usize, experts: usize) -> Result<Self> {
        let floats = (experts as u64)
            .checked_mul(experts as u64)
            .and_then(|m| m.checked_mul(layers.saturating_sub(1) as u64))
            .and_then(|m| m.checked_add((layers as u64).checked_mul(experts as u64)?));
        if floats.is_none_or(|f| f > PREDICTOR_BYTES / 4) {
            return Err(Error::invalid(format!(
                "a predictor for {layers} layers of {experts} experts would need more than 1 GiB of tables"
            )));
        }
        Ok(Self {
            experts,
            counts: vec![vec![0.0; experts * experts]; layers.saturating_sub(1)],
            popularity: vec![vec![0.0; experts]; layers],
            decay: 0.999,
        })
    }

    /// `InvalidArgument` unless `layer` is one of the predictor's and every
    /// expert of `sets` one of a layer's.
    fn check(&self, layer: usize, sets: &[&[u32]]) -> Result<()> {
        if layer >= self.popularity.len() {
            return Err(Error::invalid(format!(
                "layer {layer}: the predictor has {} layers",
                self.popularity.len()
            )));
        }
        if let Some(&x) = sets
            .iter()
            .flat_map(|s| s.iter())
            .find(|&&x| x as usize >= self.experts)
        {
            return Err(Error::invalid(format!(
                "expert {x}: the predictor's layers have {} experts",
                self.experts
            )));
        }
        Ok(())
    }

    /// Records one token's routing at `layer` (and, if given, at the
    /// layer before). `InvalidArgument` for a layer or an expert beyond the
    /// predictor's, and nothing is recorded.
    pub fn observe(
        &mut self,
        layer: usize,
        previous: Option<&[u32]>,
        routed: &[u32],
    ) -> Result<()> {
        self.check(layer, &[routed, previous.unwrap_or(&[])])?;
        let e = self.experts;
        for p in &mut self.popularity[layer] {
            *p *= self.decay;
        }
        for &x in routed {
            self.popularity[layer][x as usize] += 1.0;
        }
        if let (Some(prev), true) = (previous, layer > 0) {
            let c = &mut self.counts[layer - 1];
            for &a in prev {
                let row = &mut c[a as usize * e..(a as usize + 1) * e];
                for v in row.iter_mut() {
                    *v *= self.decay;
                }
                for &b in routed {
                    row[b as usize] += 1.0;
                }
            }
        }
        Ok(())
    }

    /// Up to `n` experts of `layer + 1` whose estimated probability given
    /// `routed` at `layer` is at least `min_confidence`, best first (none
    /// after the last layer). `InvalidArgument` for a layer or an expert
    /// beyond the predictor's.
    pub fn predict(
        &self,
        layer: usize,
        routed: &[u32],
        n: usize,
        min_confidence: f32,
    ) -> Result<Vec<u32>> {
        self.check(layer, &[routed])?;
        let e = self.experts;
        let Some(c) = self.counts.get(layer) else {
            return Ok(Vec::new());
        };
        // The largest P(b follows a) over the routed experts a, where
        // P(b | a) = count(a→b) / observations of a (each observation adds
        // one count per expert chosen alongside, `routed.len()` in all).
        let k = routed.len().max(1) as f32;
        let mut score = vec![0.0f32; e];
        for &a in routed {
            let row = &c[a as usize * e..(a as usize + 1) * e];
            let seen: f32 = row.iter().sum::<f32>() / k;
            if seen > 0.0 {
                for (s, v) in score.iter_mut().zip(row) {
                    *s = s.max((v / seen).min(1.0));
                }
            }
        }
        let mut order: Vec<u32> = (0..e as u32).collect();
        order.sort_by(|&a, &b| score[b as usize].total_cmp(&score[a as usize]));
        Ok(order
            .into_iter()
            .take(n)
            .filter(|&x| score[x as usize] >= min_confidence && score[x as usize] > 0.0)
            .collect())
    }
}

/// One token's routing: its experts at every layer (`[layer]`).
pub type TokenRoute = Vec<Vec<u32>>;

/// A routing trace as [`parse_routing`] reads it.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct RoutingTrace {
    /// Per token, the experts routed at every layer (`[token][layer]`).
    pub routes: Vec<TokenRoute>,
    /// Per token, the experts the recorded run prefetched for each layer
    /// (`[token][layer]`: its lookahead, issued while the layer before
    /// ran); empty everywhere when the trace records none.
    pub prefetched: Vec<TokenRoute>,
    /// Whether any `prefetched` line was read.
    pub has_prefetches: bool,
    /// Layers seen.
    pub layers: usize,
    /// Experts per layer seen.
    pub experts: usize,
}

/// The most `tokens × layers` a routing trace may hold ([`parse_routing`]
/// refuses more: each is a list of its own).
pub const MAX_ROUTING_CELLS: usize = 1 << 25;

/// Parses a routing trace: `token layer expert` per line (blank lines and
/// `#` comments skipped), tokens in non-decreasing order. Returns, per
/// token, the experts of every layer (`[token][layer]`), and the number of
/// layers and experts seen. Lookahead lines (`token layer expert
/// prefetched`, see [`parse_routing`]) are skipped.
pub fn parse_trace(text: &str, source: &str) -> Result<(Vec<TokenRoute>, usize, usize)> {
    let t = parse_routing(text, source)?;
    Ok((t.routes, t.layers, t.experts))
}

/// Parses a routing trace as [`parse_trace`] does, keeping its lookahead
/// lines too: `token layer expert prefetched` says the recorded run
/// prefetched `expert` for `layer` of `token` (`strata.moe` writes them
/// with its routing when it records one step a token).
pub fn parse_routing(text: &str, source: &str) -> Result<RoutingTrace> {
    let mut out = RoutingTrace::default();
    let mut last: Option<u64> = None;
    let (mut layers, mut experts) = (0usize, 0usize);
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| Error::invalid(format!("{source}:{}: {why}: {line:?}", n + 1));
        let f: Vec<&str> = line.split_whitespace().collect();
        let prefetch = match f.len() {
            3 => false,
            4 if f[3] == "prefetched" => true,
            _ => {
                return Err(bad(
                    "expected `token layer expert` or `token layer expert prefetched`",
                ))
            }
        };
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad("not a whole number"));
        let (t, l, e) = (num(f[0])?, num(f[1])?, num(f[2])?);
        if l > 4096 || e > 1 << 20 {
            return Err(bad("layer above 4096 or expert above 2^20"));
        }
        match last {
            Some(p) if t < p => return Err(bad("tokens must not decrease")),
            Some(p) if t == p => {}
            _ => {
                out.routes.push(Vec::new());
                out.prefetched.push(Vec::new());
            }
        }
        last = Some(t);
        let tok = if prefetch {
            out.has_prefetches = true;
            out.prefetched.last_mut()
        } else {
            out.routes.last_mut()
        }
        .expect("pushed above");
        if tok.len() <= l as usize {
            tok.resize(l as usize + 1, Vec::new());
        }
        if !tok[l as usize].contains(&(e as u32)) {
            tok[l as usize].push(e as u32);
        }
        layers = layers.max(l as usize + 1);
        experts = experts.max(e as usize + 1);
        // Every token gets every layer's list: a short file naming a high
        // layer once would otherwise ask for tokens × layers lists.
        let cells = out.routes.len().saturating_mul(layers);
        if cells > MAX_ROUTING_CELLS {
            return Err(bad(&format!(
                "{} tokens × {layers} layers is {cells} routing lists, more than the \
                 {MAX_ROUTING_CELLS} a trace may hold",
                out.routes.len()
            )));
        }
    }
    if out.routes.iter().all(|t| t.is_empty()) {
        return Err(Error::invalid(format!("{source}: no routing lines")));
    }
    for t in out.routes.iter_mut().chain(&mut out.prefetched) {
        t.resize(layers, Vec::new());
    }
    out.layers = layers;
    out.experts = experts;
    Ok(out)
}

#[cfg(test)]
#[path = "moe_faults.rs"]
mod faults;
