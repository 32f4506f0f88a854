//! What `Runtime::stats` reports: per-tier use, the books' counters, link
//! traffic and the engine's figures, gathered from the layers below.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use serde::Serialize;

use super::accounting::Counters;
use super::inner::Inner;
use crate::link::LinkStats;
use crate::tier::Tier;

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
    /// Of `used_pages`, clean copies: slots holding the current bytes of a
    /// page resident in a faster tier, freed with no I/O when this tier
    /// needs the room.
    pub clean_copies: u64,
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
    /// Promotions that kept the page's copy in the slower tier as a clean
    /// copy (valid until that tier needs the room or the page is written).
    pub clean_kept: u64,
    /// Demotions that needed no write: the page went back to its clean
    /// copy (not in `moves`, which counts pages copied).
    pub clean_demotions: u64,
    /// Clean copies freed for their tier's room.
    pub clean_dropped: u64,
    /// Clean copies freed because their page was written (or pinned
    /// writable), before the write was acknowledged.
    pub clean_invalidated: u64,
    /// Balancer: pages promoted into the fastest tier (device memory, or
    /// host DRAM without a device tier).
    pub promotions: u64,
    /// Of `promotions`, those a read carried out: NVMe pages the balancer
    /// marked, moved whole by their next read (see
    /// [`BalancerConfig::promote_on_read`](crate::runtime::BalancerConfig::promote_on_read)).
    pub promotions_on_read: u64,
    /// Promotions into the fastest tier (by anyone: the balancer, a
    /// prefetch, a pin) whose page was accessed there before it left: the
    /// move paid. Accesses are those the runtime counts: every read and
    /// write through the buffer, and a kernel's counted accesses (sampled
    /// as the kernels' counters are).
    pub promotions_paid: u64,
    /// Promotions into the fastest tier whose page left it again with no
    /// access: the move did not pay. Pages still there are in neither.
    pub promotions_unpaid: u64,
    /// Pages of prefetches declined: their tier was full, and making room
    /// would have demoted pages referenced since the clock hand last
    /// passed (see [`Ticket::declined`](super::Ticket::declined)).
    pub prefetches_declined: u64,
    /// Balancer: promotions held back because the buffer's recent
    /// promotions did not pay and the page showed no reuse across rounds
    /// (it is served where it is).
    pub promotions_held_back: u64,
    /// Balancer: pages demoted out of the fastest tier.
    pub demotions: u64,
    /// Balancer: touched pages left in place (served zero-copy).
    pub bypasses: u64,
    /// Failures of background work (background eviction, the balancer),
    /// panics included; the first is returned by [`Runtime::check`](super::Runtime::check).
    pub background_errors: u64,
    /// Read-backs of CUDA kernels' per-page access counts that failed at
    /// the end of a launch (those access samples are lost; no data is).
    pub lost_count_readbacks: u64,
    /// Slots a store refused to take back (a page table only ever holds
    /// its stores' own slots, so this stays 0 unless something is wrong);
    /// such a slot is never used again, and the first refusal is returned
    /// by [`Runtime::check`](super::Runtime::check).
    pub failed_frees: u64,
    /// Pages whose data was lost to I/O errors: reading one fails with
    /// `ErrorKind::Io` ("page N was lost"). A move whose reads the I/O
    /// engine never returns puts each page back on its NVMe slot (a read
    /// does not change it), so no page is lost that way; the staging
    /// buffer or host slot such a read was filling stays with it, gone from
    /// the tiers (the engine may still complete the read into it).
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
    /// Batches run (up to 32 pages each; up to 128 for a prefetch or a
    /// balancer move over the device link; 4 for background eviction).
    pub batches: u64,
    /// Mean time a batch waited in its lane's queue, in microseconds.
    pub mean_queued_us: f64,
    /// Seconds lanes spent running these batches (wall time of their
    /// copies, commits and the room they made).
    pub busy_seconds: f64,
    /// CPU seconds those batches took on the lanes: their wall time less
    /// the time a lane waited for a core, a lock or the disk.
    pub cpu_seconds: f64,
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

/// The runtime's figures now.
pub(crate) fn collect(inner: &Inner) -> Stats {
    let rt = &inner.shared;
    let c = rt.counters();
    let device = rt.tiers.device();
    Stats {
        backend: device.map(|d| d.backend().label()),
        page_size: rt.page_size(),
        tiers: rt
            .tiers
            .stores()
            .map(|s| {
                // Read once: a second read may see a slot taken or freed
                // since, and used + free would not be the capacity.
                let used = s.used_pages();
                TierStats {
                    tier: s.tier(),
                    used_pages: used,
                    free_pages: s.capacity_pages().saturating_sub(used),
                    pinned_pages: rt.acct.pinned[s.tier() as usize].load(Ordering::Relaxed),
                    clean_copies: rt.acct.clean_copies(s.tier()),
                    emulated: s.emulated(),
                }
            })
            .collect(),
        reserved_pages: rt.acct.promised(),
        moves: Counters::get(&c.moves),
        failed_moves: Counters::get(&c.failed_moves),
        lost_count_readbacks: Counters::get(&c.lost_counts),
        lost_pages: Counters::get(&c.lost_pages),
        failed_frees: Counters::get(&c.failed_frees),
        background_errors: rt.background.count(),
        first_writes: Counters::get(&c.first_writes),
        abandoned_moves: Counters::get(&c.abandoned),
        faults: Counters::get(&c.faults),
        reclaimed_pages: Counters::get(&c.reclaimed_pages),
        in_flight_moves: inner.mover.in_flight(),
        clean_kept: Counters::get(&c.clean_kept),
        clean_demotions: Counters::get(&c.clean_demotions),
        clean_dropped: Counters::get(&c.clean_dropped),
        clean_invalidated: Counters::get(&c.clean_invalidated),
        promotions: Counters::get(&c.promotions),
        promotions_on_read: Counters::get(&c.promotions_on_read),
        demotions: Counters::get(&c.demotions),
        promotions_paid: Counters::get(&c.promotions_paid),
        promotions_held_back: Counters::get(&c.held_back),
        prefetches_declined: Counters::get(&c.prefetches_declined),
        promotions_unpaid: Counters::get(&c.promotions_unpaid),
        bypasses: Counters::get(&c.bypasses),
        device_links: device.map(|d| d.link_stats()),
        links: Tier::ALL
            .iter()
            .flat_map(|&from| Tier::ALL.iter().map(move |&to| (from, to)))
            .filter_map(|(from, to)| {
                let stats = rt.acct.link(from, to).stats();
                (stats.ops > 0).then_some(LinkUse { from, to, stats })
            })
            .collect(),
        engine: ["demand", "prefetch", "balance", "reclaim"]
            .into_iter()
            .zip(inner.mover.priority_report())
            .map(
                |(priority, (batches, mean_queued_us, busy_seconds, cpu_seconds))| PriorityUse {
                    priority,
                    batches,
                    mean_queued_us,
                    busy_seconds,
                    cpu_seconds,
                },
            )
            .collect(),
    }
}
