//! How the balancer runs ([`BalancerConfig`]) and what one round did
//! ([`BalanceReport`]).
#![forbid(unsafe_code)]

use std::time::Duration;

use serde::Serialize;

use crate::policy::PolicyKind;
use crate::tier::Tier;

/// Accesses replayed per touched page per interval, at most, by default.
pub const MAX_REPEAT: u32 = 8;

/// The largest [`BalancerConfig::repeat`] a balancer takes: a round
/// replays up to this many accesses per touched page (a page counted to
/// the counters' ceiling would otherwise cost billions).
pub const REPEAT_LIMIT: u32 = 1024;

/// How the balancer runs. Start from [`BalancerConfig::default`] and set
/// what differs (`BalancerConfig::default().with_policy(PolicyKind::Lfu)`,
/// or assign the fields); new fields may be added in any release.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct BalancerConfig {
    /// Time between rounds (background mode). The default, 10 ms, lets a
    /// round's decisions follow a shifting hot set within about a
    /// thousand reads at `bench pages`' rates (at 20 ms its misses were
    /// 1.15× the best online reference's on a shifting hot set, at 10 ms
    /// 1.13×, at no cost in reads a second: `docs/perf.md`).
    pub interval: Duration,
    /// Bytes per second promoted at most (`None`: no limit).
    pub rate_limit: Option<u64>,
    /// The placement policy.
    pub policy: PolicyKind,
    /// Harvest decay (the scores the lists and the C ABI report).
    pub decay: f32,
    /// A page is a candidate for promotion only when it was accessed at
    /// least this often in the round (scaled for sampling). Moving a page
    /// costs about as much as reading it once over the link, so a workload
    /// whose reads are `s` bytes wide can set `page_size / s` to promote
    /// only pages read through at least once per round. 0: every touched
    /// page is a candidate. It is also the margin by which a candidate's
    /// decayed score (in accesses; at decay 0.5 about twice a steady
    /// page's count per round) must beat a resident's to displace it where
    /// the tier has no free room; at 0, any strict win.
    pub min_accesses: u64,
    /// Accesses the policy sees per touched page and round, at most (its
    /// count, capped): more tells a frequency policy more within a round,
    /// and costs a policy access each. 1 to [`REPEAT_LIMIT`].
    pub repeat: u32,
    /// Bytes per second the balancer moves at most over each link, indexed
    /// `from * 4 + to` by tier (see [`with_link_rate_limit`](Self::with_link_rate_limit));
    /// `None`: no limit beyond [`rate_limit`](Self::rate_limit).
    pub link_rate_limits: [Option<u64>; 16],
    /// Whether the pairs of tiers below the fastest are balanced too (a
    /// policy per pair: promotions from NVMe into CXL, or into host DRAM
    /// under a device tier). Off (the default), only the fastest tier is:
    /// promotions into it from any tier, demotions out of it cascading to
    /// the first tier below with room. Measured on real DRAM and disk
    /// (`strata bench pages --cxl`, 4 KiB reads of 64 KiB pages), the lower
    /// levels' whole-page promotions cost more disk reads than the reads
    /// they then served from memory (`docs/perf.md`, "Pages on real DRAM and disk").
    pub lower_levels: bool,
    /// Whether promotions from NVMe into a fastest tier in host memory
    /// (DRAM or CXL; a runtime without a device tier) whose next tier down
    /// is NVMe are left to the page's next read instead of moved in the
    /// background: the balancer
    /// marks the page, and the read that finds the mark moves it whole (one
    /// whole-page read from NVMe where the read alone would have read its
    /// range) and goes on from memory. A promotion then costs no disk read
    /// of its own, and a page the policy takes in but nobody reads again
    /// is never read from disk at all; the first read after the decision
    /// still misses. Marks hold no room: the read that takes one makes
    /// room for its move through the engine, off the reader's thread. On
    /// (the default): measured on real DRAM and disk (`strata bench pages`,
    /// 4 KiB reads of 64 KiB pages, DRAM over NVMe) it read 2.1–2.6× fewer
    /// bytes from disk than background promotion and served as many reads
    /// per second on a stationary Zipf, 1.2× more on a shifting one with a
    /// quarter of the p99 (`docs/perf.md`, "Pages on real DRAM and disk").
    /// With a memory tier between the fastest tier and NVMe (DRAM over
    /// CXL), and with a device tier, promotions are moved in the
    /// background either way: there a promoted page's later demotion lands
    /// in memory, and the same measurement with CXL below DRAM served 15%
    /// fewer reads per second when they waited for reads.
    pub promote_on_read: bool,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(10),
            rate_limit: None,
            policy: PolicyKind::Default,
            decay: 0.5,
            min_accesses: 0,
            repeat: MAX_REPEAT,
            link_rate_limits: [None; 16],
            lower_levels: false,
            promote_on_read: true,
        }
    }
}

impl BalancerConfig {
    /// With `interval` between background rounds.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// With promotions limited to `bytes_per_sec` (`None`: no limit).
    pub fn with_rate_limit(mut self, bytes_per_sec: Option<u64>) -> Self {
        self.rate_limit = bytes_per_sec;
        self
    }

    /// With `policy` placing the pages.
    pub fn with_policy(mut self, policy: PolicyKind) -> Self {
        self.policy = policy;
        self
    }

    /// With harvest decay `decay`.
    pub fn with_decay(mut self, decay: f32) -> Self {
        self.decay = decay;
        self
    }

    /// With promotion candidates needing `min_accesses` accesses a round.
    pub fn with_min_accesses(mut self, min_accesses: u64) -> Self {
        self.min_accesses = min_accesses;
        self
    }

    /// With the balancer's moves from tier `from` to tier `to` limited to
    /// `bytes_per_sec` (`None`: no limit). Promotions are limited on the
    /// link they take; demotions on the link to the first tier below.
    pub fn with_link_rate_limit(
        mut self,
        from: Tier,
        to: Tier,
        bytes_per_sec: Option<u64>,
    ) -> Self {
        self.link_rate_limits[from as usize * 4 + to as usize] = bytes_per_sec;
        self
    }

    /// With the tiers below the fastest balanced too (`true`) or only the
    /// fastest tier (`false`, the default).
    pub fn with_lower_levels(mut self, on: bool) -> Self {
        self.lower_levels = on;
        self
    }

    /// With promotions from NVMe left to the pages' next reads (`true`) or
    /// moved in the background (`false`); see
    /// [`promote_on_read`](Self::promote_on_read).
    pub fn with_promote_on_read(mut self, on: bool) -> Self {
        self.promote_on_read = on;
        self
    }

    /// With the policy seeing at most `repeat` accesses per touched page a
    /// round (1 to [`REPEAT_LIMIT`]).
    pub fn with_repeat(mut self, repeat: u32) -> Self {
        self.repeat = repeat.clamp(1, REPEAT_LIMIT);
        self
    }
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BalanceReport {
    /// Pages moved into the fastest tier (device memory, or host DRAM
    /// without a device tier).
    pub promotions: u64,
    /// Pages moved out of it.
    pub demotions: u64,
    /// Touched pages the policy chose to leave where they are (served in
    /// place, zero-copy).
    pub bypasses: u64,
    /// Promotions put off by a rate limit or a full tier (no room below
    /// the high watermark, or none a page would outscore its resident for:
    /// see the module's notes on strangers).
    pub deferred: u64,
    /// Pages moved up into a tier below the fastest (NVMe into CXL, or
    /// into host DRAM under a device tier).
    pub promotions_below: u64,
    /// Pages moved down out of a tier below the fastest.
    pub demotions_below: u64,
    /// Pages marked this round for promotion at their next read
    /// ([`BalancerConfig::promote_on_read`]); a read that carries one out
    /// counts in [`Stats::promotions`](crate::runtime::Stats::promotions).
    pub marked: u64,
    /// Promotions held back because their buffer's recent promotions did
    /// not pay (most left the fastest tier with no access) and the page
    /// showed no reuse across rounds: it is served where it is.
    pub held_back: u64,
    /// Touched pages replayed into the fastest tier's policy: none when
    /// every resident page was already in that tier, below its high
    /// watermark (nothing to promote, no room to make), and the round
    /// skipped its policies.
    pub replayed: u64,
}
