//! The balancer: every interval it harvests the access counters of every
//! buffer, replays what was touched (and, as hints, what was prefetched)
//! into placement policies, and executes their decisions under the tiers'
//! high watermarks and the links' rate limits. A policy per level, each
//! modelling the set of pages that belong at or above its tier:
//!
//! - the first models the fastest tier (device memory; host DRAM in a
//!   runtime without a device tier): promotions into it from any tier, and
//!   demotions out of it, cascading to the first tier below with room (so
//!   the tier below holds what the fastest tier let go: hot CXL pages come
//!   up into DRAM, cold DRAM pages go down to CXL);
//! - with [`BalancerConfig::with_lower_levels`], one more per memory tier
//!   below it, modelling the fastest tiers down to that one (device + host,
//!   or DRAM + CXL): pages it holds that a faster level does not are
//!   promoted into its tier from below (NVMe into CXL, or into host DRAM
//!   under a device tier), and pages it drops that sit in its tier are
//!   demoted below it — what Linux TPP and Memtis do for CXL memory, here
//!   with the runtime's own counts. Off by default: measured on real DRAM
//!   and disk its whole-page promotions did not pay for themselves
//!   (`docs/perf.md`, issue 14).
//!
//! Promotions from NVMe into host memory (a runtime without a device tier,
//! NVMe right below its fastest tier) are left to the page's next read by
//! default
//! ([`BalancerConfig::promote_on_read`]): the balancer marks the page, and
//! the read that finds the mark starts its move.
//!
//! Each policy sees one access per touched page per interval, repeated up to
//! [`BalancerConfig::repeat`] times (default [`MAX_REPEAT`]) for pages
//! counted more often, coldest first, so the hottest pages are also the
//! most recent. Its decisions are kept in a shadow set of the pages it
//! holds: a page in its tier that it does not hold (placed there by a first
//! write, or by an explicit prefetch) is the first to leave when room is
//! needed. Every move goes through the migration engine at balance
//! priority, behind demand moves and prefetches.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;

use super::mover::{Priority, Request, Source};
use super::table::Table;
use super::Inner;
use crate::error::{Error, Result};
use crate::hotness::HarvestParams;
use crate::policy::{self, Outcome, Policy, PolicyKind};
use crate::tier::Tier;

/// Accesses replayed per touched page per interval, at most, by default.
pub const MAX_REPEAT: u32 = 8;

/// How the balancer runs. Start from [`BalancerConfig::default`] and set
/// what differs (`BalancerConfig::default().with_policy(PolicyKind::Lfu)`,
/// or assign the fields); new fields may be added in any release.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct BalancerConfig {
    /// Time between rounds (background mode).
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
    /// page is a candidate.
    pub min_accesses: u64,
    /// Accesses the policy sees per touched page and round, at most (its
    /// count, capped): more tells a frequency policy more within a round,
    /// and costs a policy access each.
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
    /// they then served from memory (`docs/perf.md`, issue 14).
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
    /// still misses. Marks count against the tier's room like moves. On
    /// (the default): measured on real DRAM and disk (`strata bench pages`,
    /// 4 KiB reads of 64 KiB pages, DRAM over NVMe) it read 2.1–2.6× fewer
    /// bytes from disk than background promotion and served as many reads
    /// per second on a stationary Zipf, 1.2× more on a shifting one with a
    /// quarter of the p99 (`docs/perf.md`, issue 14).
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
            interval: Duration::from_millis(20),
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
    /// round (at least 1).
    pub fn with_repeat(mut self, repeat: u32) -> Self {
        self.repeat = repeat.max(1);
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
    /// Promotions put off by a rate limit or a full tier.
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
}

/// One adjacent pair of tiers: a policy modelling the pages that belong in
/// `upper` or above.
struct Level {
    upper: Tier,
    policy: Box<dyn Policy>,
    /// Pages (buffer << 32 | page) the policy holds.
    held: HashSet<u64>,
}

impl Level {
    /// Replays the round's accesses; the last decision per page stands
    /// (true: keep at or above `upper`). Bypasses are counted in `bypasses`.
    fn decide(
        &mut self,
        hints: &[(Tier, u64)],
        touched: &[(u32, u64)],
        repeat: u32,
        bypasses: &mut u64,
    ) -> BTreeMap<u64, bool> {
        let mut want: BTreeMap<u64, bool> = BTreeMap::new();
        // Prefetches into this level's tier first: a policy that honours
        // hints holds the page (and may evict for it); not an access.
        for &(_, page) in hints.iter().filter(|(t, _)| *t == self.upper) {
            match self.policy.hint(page) {
                Outcome::Hit | Outcome::Bypass => {}
                Outcome::Miss { evicted } => {
                    self.held.insert(page);
                    if let Some(e) = evicted {
                        self.held.remove(&e);
                        want.insert(e, false);
                    }
                }
            }
        }
        for &(count, page) in touched {
            for _ in 0..count.min(repeat.max(1)) {
                match self.policy.access(page) {
                    Outcome::Hit => {
                        want.insert(page, true);
                    }
                    Outcome::Miss { evicted } => {
                        self.held.insert(page);
                        want.insert(page, true);
                        if let Some(e) = evicted {
                            self.held.remove(&e);
                            want.insert(e, false);
                        }
                    }
                    Outcome::Bypass => {
                        *bypasses += 1;
                        break;
                    }
                }
            }
        }
        want
    }
}

/// The balancer's state: a policy per adjacent pair of tiers.
pub(crate) struct Balancer {
    config: BalancerConfig,
    /// The fastest tier first; one level per memory tier with a tier below.
    levels: Vec<Level>,
    /// Rate-limit budget in bytes (promotions into the fastest tier).
    budget: f64,
    /// Per-link budgets in bytes, indexed `from * 4 + to`.
    link_budget: [f64; 16],
    topped: Instant,
    /// Pages (ids) marked for promotion into the fastest tier at their
    /// next read, not read yet.
    marked: HashSet<u64>,
}

impl Balancer {
    pub(crate) fn new(rt: &Inner, config: BalancerConfig) -> Result<Self> {
        if config.policy.needs_trace() {
            return Err(Error::invalid(format!(
                "the {} policy needs the whole trace in advance; the balancer runs online",
                config.policy
            )));
        }
        if !(config.decay > 0.0 && config.decay <= 1.0) {
            return Err(Error::invalid(format!(
                "harvest decay {} is not in (0, 1]",
                config.decay
            )));
        }
        let tiers: Vec<Tier> = rt.stores().map(|s| s.tier()).collect();
        let fast = tiers[0];
        if tiers.len() < 2 {
            return Err(Error::invalid(format!(
                "the balancer needs a tier below the {fast} tier to place pages in"
            )));
        }
        let mut levels = Vec::new();
        let mut capacity = 0usize;
        let balanced = if config.lower_levels {
            tiers.len() - 1
        } else {
            1
        };
        for &upper in &tiers[..balanced] {
            let store = rt.store(upper).expect("configured");
            capacity += ((store.capacity_pages() as f64 * rt.watermarks.high) as usize).max(1);
            levels.push(Level {
                upper,
                policy: policy::build(config.policy, capacity, None)?,
                held: HashSet::new(),
            });
        }
        // From now on prefetches are kept as hints for the rounds.
        rt.hints.on.store(true, Ordering::Relaxed);
        Ok(Self {
            config,
            levels,
            budget: 0.0,
            link_budget: [0.0; 16],
            topped: Instant::now(),
            marked: HashSet::new(),
        })
    }

    /// Takes back every mark not yet taken by a read (the balancer is
    /// replaced or stopped: nothing would settle or account for them).
    pub(crate) fn take_back_marks(&mut self, rt: &Inner) {
        if self.marked.is_empty() {
            return;
        }
        let tables: Vec<Arc<Table>> = {
            let list = rt.tables.lock();
            list.iter().filter_map(Weak::upgrade).collect()
        };
        let by_id: HashMap<u32, &Arc<Table>> = tables.iter().map(|t| (t.id, t)).collect();
        let fast = self.levels[0].upper;
        for p in self.marked.drain() {
            still_marked(&by_id, p, fast, false);
        }
    }

    /// Tops up the rate-limit budgets for the time since the last round.
    fn top_up(&mut self) {
        let now = Instant::now();
        let dt = (now - self.topped).as_secs_f64();
        let window = self.config.interval.as_secs_f64().max(0.001) * 4.0;
        if let Some(rate) = self.config.rate_limit {
            self.budget = (self.budget + rate as f64 * dt).min(rate as f64 * window);
        }
        for (b, limit) in self
            .link_budget
            .iter_mut()
            .zip(self.config.link_rate_limits)
        {
            if let Some(rate) = limit {
                *b = (*b + rate as f64 * dt).min(rate as f64 * window);
            }
        }
        self.topped = now;
    }

    /// Keeps the pages of `pages` (ids, in order of preference) that the
    /// links' budgets afford for a move to `dst`, given each page's tier
    /// now; deducts them. The rest are `deferred`.
    fn afford(
        &mut self,
        by_id: &HashMap<u32, &Arc<Table>>,
        pages: Vec<u64>,
        dst: Tier,
        page_size: f64,
        deferred: &mut u64,
    ) -> Vec<u64> {
        let mut kept = Vec::with_capacity(pages.len());
        for p in pages {
            let Some(src) = tier_of(by_id, p) else {
                continue;
            };
            let link = src as usize * 4 + dst as usize;
            if self.config.link_rate_limits[link].is_some() {
                if self.link_budget[link] < page_size {
                    *deferred += 1;
                    continue;
                }
                self.link_budget[link] -= page_size;
            }
            kept.push(p);
        }
        kept
    }

    /// One round.
    pub(crate) fn step(&mut self, rt: &Inner) -> BalanceReport {
        let mut report = BalanceReport::default();
        let page_size = rt.page_size() as f64;
        let tables: Vec<Arc<Table>> = {
            let list = rt.tables.lock();
            list.iter().filter_map(Weak::upgrade).collect()
        };
        let by_id: HashMap<u32, &Arc<Table>> = tables.iter().map(|t| (t.id, t)).collect();

        // 1. What was touched, with counts.
        let mut touched: Vec<(u32, u64)> = Vec::new();
        for t in &tables {
            let params = HarvestParams {
                decay: self.config.decay,
                k: 0,
                shift: rt.sample_shift.unwrap_or(0),
            };
            let mut scores = t.scores.lock();
            let id = (t.id as u64) << 32;
            crate::hotness::harvest_touched(
                &t.counters,
                &mut scores,
                &|_| false,
                params,
                &mut |p, c| touched.push((c, id | p)),
            );
        }
        let scale = 1u64 << rt.sample_shift.unwrap_or(0);
        let min = self.config.min_accesses;
        touched.retain(|&(c, _)| c as u64 * scale >= min);
        touched.sort_unstable();

        // 2. Every level's policy decides (the prefetches since the last
        // round as hints, then the accesses); the last decision per page
        // stands.
        let hints = rt.hints.take();
        let repeat = self.config.repeat;
        let mut wants = Vec::with_capacity(self.levels.len());
        for (k, level) in self.levels.iter_mut().enumerate() {
            let mut bypasses = 0;
            wants.push(level.decide(&hints, &touched, repeat, &mut bypasses));
            if k == 0 {
                report.bypasses += bypasses;
            }
            level
                .held
                .retain(|p| by_id.contains_key(&((p >> 32) as u32)));
        }
        self.top_up();
        let count: HashMap<u64, u32> = touched.iter().map(|&(c, p)| (p, c)).collect();

        // 3. The fastest tier: demotions, then promotions within the
        // budget and the room.
        let want = &wants[0];
        let demote: Vec<u64> = want.iter().filter(|(_, &w)| !w).map(|(&p, _)| p).collect();
        let fast = self.levels[0].upper;
        let demote = self.afford_down(rt, &by_id, demote, fast, page_size);
        report.demotions += demote_pages(rt, &by_id, &demote, fast);
        let store = rt.store(fast).expect("checked at start");
        let high = ((store.capacity_pages() as f64 * rt.watermarks.high) as usize).max(1);
        // The moves reads started for marked pages finish first (single
        // pages), counted and their failures kept.
        settle_read_promotions(rt, true);
        // Earlier marks: those a read took (or a move cleared), or whose
        // page the policy let go since (unmarked now), are done.
        let held = &self.levels[0].held;
        self.marked
            .retain(|&p| still_marked(&by_id, p, fast, held.contains(&p)));
        // Only where the fastest tier demotes straight to NVMe: with a
        // memory tier below it, a promoted page's later demotion lands
        // there, where its next reads are memory reads.
        let on_read = self.config.promote_on_read
            && matches!(fast, Tier::Host | Tier::Cxl)
            && rt.tiers_below(fast).first() == Some(&Tier::Nvme);
        // Candidates not in the fast tier yet, hottest first.
        let mut promote: Vec<u64> = want
            .iter()
            .filter(|(_, &w)| w)
            .map(|(&p, _)| p)
            .filter(|&p| tier_of(&by_id, p).is_some_and(|t| t != fast))
            .collect();
        promote.sort_by_key(|p| std::cmp::Reverse(count.get(p).copied().unwrap_or(0)));
        promote.retain(|p| !self.marked.contains(p));
        // Room below the high watermark (marks hold theirs): strangers
        // leave first.
        let used = store.used_pages() as usize + self.marked.len();
        let short = (used + promote.len()).saturating_sub(high);
        if short > 0 {
            let strangers = strangers(&tables, &self.levels[0].held, short, fast);
            report.demotions += demote_pages(rt, &by_id, &strangers, fast);
        }
        let room = high.saturating_sub(store.used_pages() as usize + self.marked.len());
        if promote.len() > room {
            report.deferred += (promote.len() - room) as u64;
            promote.truncate(room);
        }
        // The rate limit, on what fits.
        if self.config.rate_limit.is_some() {
            let affordable = (self.budget / page_size).max(0.0) as usize;
            if promote.len() > affordable {
                report.deferred += (promote.len() - affordable) as u64;
                promote.truncate(affordable);
            }
            self.budget -= promote.len() as f64 * page_size;
        }
        let mut promote = self.afford(&by_id, promote, fast, page_size, &mut report.deferred);
        if on_read {
            promote.retain(|&p| {
                if !mark(&by_id, p, fast) {
                    return true;
                }
                self.marked.insert(p);
                report.marked += 1;
                false
            });
        }
        report.promotions += move_pages(&by_id, &promote, fast, Source::Not(fast));

        // 4. Each lower level: its tier's pages it dropped go below it; the
        // pages it holds (and no faster level does) come up into it.
        for (k, want) in wants.iter().enumerate().skip(1) {
            let upper = self.levels[k].upper;
            let held_above = |p: &u64| self.levels[..k].iter().any(|l| l.held.contains(p));
            let demote: Vec<u64> = want
                .iter()
                .filter(|(p, &w)| !w && !held_above(p))
                .map(|(&p, _)| p)
                .collect();
            let mut promote: Vec<u64> = want
                .iter()
                .filter(|(p, &w)| w && !held_above(p))
                .map(|(&p, _)| p)
                .filter(|&p| tier_of(&by_id, p).is_some_and(|t| t > upper))
                .collect();
            let demote = self.afford_down(rt, &by_id, demote, upper, page_size);
            report.demotions_below += demote_pages(rt, &by_id, &demote, upper);
            promote.sort_by_key(|p| std::cmp::Reverse(count.get(p).copied().unwrap_or(0)));
            let store = rt.store(upper).expect("configured");
            let high = ((store.capacity_pages() as f64 * rt.watermarks.high) as usize).max(1);
            let short = (store.used_pages() as usize + promote.len()).saturating_sub(high);
            if short > 0 {
                let strangers = strangers(&tables, &self.levels[k].held, short, upper);
                report.demotions_below += demote_pages(rt, &by_id, &strangers, upper);
            }
            let room = high.saturating_sub(store.used_pages() as usize);
            if promote.len() > room {
                report.deferred += (promote.len() - room) as u64;
                promote.truncate(room);
            }
            let promote = self.afford(&by_id, promote, upper, page_size, &mut report.deferred);
            report.promotions_below += move_pages(&by_id, &promote, upper, Source::Below(upper));
        }
        rt.counters
            .promotions
            .fetch_add(report.promotions, Ordering::Relaxed);
        rt.counters
            .demotions
            .fetch_add(report.demotions, Ordering::Relaxed);
        rt.counters
            .bypasses
            .fetch_add(report.bypasses, Ordering::Relaxed);
        report
    }

    /// Keeps the pages of `pages` in `tier` whose demotion to the first
    /// tier below it the link's budget affords; deducts them. Pages not in
    /// `tier` pass (they will not move).
    fn afford_down(
        &mut self,
        rt: &Inner,
        by_id: &HashMap<u32, &Arc<Table>>,
        pages: Vec<u64>,
        tier: Tier,
        page_size: f64,
    ) -> Vec<u64> {
        let Some(&below) = rt.tiers_below(tier).first() else {
            return pages;
        };
        let link = tier as usize * 4 + below as usize;
        if self.config.link_rate_limits[link].is_none() {
            return pages;
        }
        let mut kept = Vec::with_capacity(pages.len());
        for p in pages {
            if tier_of(by_id, p) == Some(tier) {
                if self.link_budget[link] < page_size {
                    continue;
                }
                self.link_budget[link] -= page_size;
            }
            kept.push(p);
        }
        kept
    }
}

/// Up to `n` pages in `fast` the policy does not hold, coldest-scored first.
fn strangers(tables: &[Arc<Table>], held: &HashSet<u64>, n: usize, fast: Tier) -> Vec<u64> {
    let mut v: Vec<(f32, u64)> = Vec::new();
    for t in tables {
        let scores = t.scores.lock();
        for (p, e) in t.pages.iter().enumerate() {
            let id = (t.id as u64) << 32 | p as u64;
            if !held.contains(&id) && e.lock().tier() == Some(fast) {
                v.push((scores[p], id));
            }
        }
    }
    if v.len() > n {
        v.select_nth_unstable_by(n, |a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        v.truncate(n);
    }
    v.into_iter().map(|x| x.1).collect()
}

/// The tier page id `p` is in now.
fn tier_of(by_id: &HashMap<u32, &Arc<Table>>, p: u64) -> Option<Tier> {
    by_id.get(&((p >> 32) as u32)).and_then(|t| {
        let idx = (p & 0xFFFF_FFFF) as usize;
        t.pages.get(idx).and_then(|e| e.lock().tier())
    })
}

/// Whether page id `p` is in tier `tier` now.
fn is_in(by_id: &HashMap<u32, &Arc<Table>>, p: u64, tier: Tier) -> bool {
    tier_of(by_id, p) == Some(tier)
}

/// Moves `pages` (ids) out of `fast` (any tier with tiers below), cascading down; returns how many
/// left it (pages not there to begin with do not count).
fn demote_pages(rt: &Inner, by_id: &HashMap<u32, &Arc<Table>>, pages: &[u64], fast: Tier) -> u64 {
    let slower = rt.tiers_below(fast);
    let there: Vec<u64> = pages
        .iter()
        .copied()
        .filter(|&p| is_in(by_id, p, fast))
        .collect();
    let mut left = there.clone();
    for &dst in &slower {
        if left.is_empty() {
            break;
        }
        for (t, ps) in group(by_id, &left) {
            // The pages stay readable; the error is kept for Runtime::check.
            let request = Request {
                pages: ps,
                dst,
                from: Source::Only(fast),
                priority: Priority::Balance,
                room: None,
            };
            if let Err(e) = rt.mover.run(t, request) {
                t.rt.note_background("the balancer's demotions", e);
            }
        }
        left.retain(|&p| is_in(by_id, p, fast));
    }
    (there.len() - left.len()) as u64
}

/// Marks page `p` (an id) on NVMe for promotion into `fast` at its next
/// read; false when it is not on NVMe (or pinned, or gone).
fn mark(by_id: &HashMap<u32, &Arc<Table>>, p: u64, fast: Tier) -> bool {
    let Some(t) = by_id.get(&((p >> 32) as u32)) else {
        return false;
    };
    t.pages
        .get((p & 0xFFFF_FFFF) as usize)
        .is_some_and(|e| e.lock().mark_promotion(fast, |src| src == Tier::Nvme))
}

/// Whether page `p` (an id) still carries the mark of [`mark`]: not when
/// a read took it or a move cleared it, and not when the policy no longer
/// `holds` the page (the mark is taken back).
fn still_marked(by_id: &HashMap<u32, &Arc<Table>>, p: u64, fast: Tier, holds: bool) -> bool {
    let Some(e) = by_id
        .get(&((p >> 32) as u32))
        .and_then(|t| t.pages.get((p & 0xFFFF_FFFF) as usize))
    else {
        return false;
    };
    let mut e = e.lock();
    if e.promote_on_read != Some(fast) {
        return false;
    }
    if !holds {
        e.promote_on_read = None;
    }
    holds
}

/// Moves `pages` (ids) into `dst`; returns how many arrived.
fn move_pages(by_id: &HashMap<u32, &Arc<Table>>, pages: &[u64], dst: Tier, from: Source) -> u64 {
    for (t, ps) in group(by_id, pages) {
        let request = Request {
            pages: ps,
            dst,
            from,
            priority: Priority::Balance,
            room: None,
        };
        if let Err(e) = t.rt.mover.run(t, request) {
            t.rt.note_background("the balancer's moves", e);
        }
    }
    pages.iter().filter(|&&p| is_in(by_id, p, dst)).count() as u64
}

/// Page ids grouped by buffer, as indices.
fn group<'a>(
    by_id: &HashMap<u32, &'a Arc<Table>>,
    pages: &[u64],
) -> Vec<(&'a Arc<Table>, Vec<usize>)> {
    let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for &p in pages {
        groups
            .entry((p >> 32) as u32)
            .or_default()
            .push((p & 0xFFFF_FFFF) as usize);
    }
    groups
        .into_iter()
        .filter_map(|(id, ps)| {
            let t = by_id.get(&id)?;
            let ps = ps.into_iter().filter(|&p| p < t.pages.len()).collect();
            Some((*t, ps))
        })
        .collect()
}

/// The background thread; stops when dropped.
pub(crate) struct BalancerThread {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BalancerThread {
    pub(crate) fn start(rt: Weak<Inner>, interval: Duration) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("strata-balancer".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    // Woken early by `drop` (or spuriously: an early round).
                    std::thread::park_timeout(interval);
                    let Some(rt) = rt.upgrade() else { return };
                    if s.load(Ordering::Acquire) {
                        return;
                    }
                    rt.background("the balancer", || {
                        if let Some(b) = rt.balancer.lock().as_mut() {
                            b.step(&rt);
                        }
                    });
                }
            })
            .map_err(|e| Error::io("starting the balancer thread", e))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for BalancerThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            super::join(t);
        }
    }
}

/// Hinted pages waiting for the balancer's next round: prefetches tell the
/// policies what is about to be used (`Policy::hint`).
#[derive(Default)]
pub(crate) struct Hints {
    /// Whether a balancer is configured (no hints are kept otherwise).
    pub(crate) on: AtomicBool,
    pages: Mutex<Vec<(Tier, u64)>>,
    /// The moves reads started for pages the balancer marked
    /// ([`BalancerConfig::promote_on_read`]), until
    /// [`settle_read_promotions`] counts them and keeps their failures.
    pub(crate) read_promotions: Mutex<Vec<ReadPromotion>>,
}

/// A move a read started for a page the balancer marked.
pub(crate) struct ReadPromotion {
    pub(crate) ticket: super::mover::Ticket,
    pub(crate) table: Weak<Table>,
    pub(crate) page: usize,
    pub(crate) dst: Tier,
}

/// Counts a promotion a read carried out.
pub(crate) fn count_read_promotion(rt: &Inner) {
    rt.counters.promotions.fetch_add(1, Ordering::Relaxed);
    rt.counters
        .promotions_on_read
        .fetch_add(1, Ordering::Relaxed);
}

/// Settles the moves reads started (all of them when `wait`, else those
/// done): a page that arrived counts as a promotion; a failure other than a
/// full tier is kept for `Runtime::check`.
pub(crate) fn settle_read_promotions(rt: &Inner, wait: bool) {
    let started = std::mem::take(&mut *rt.hints.read_promotions.lock());
    let mut open = Vec::new();
    for ReadPromotion {
        ticket,
        table,
        page,
        dst,
    } in started
    {
        let result = match (ticket.poll(), wait) {
            (Some(r), _) => r,
            (None, true) => ticket.wait(),
            (None, false) => {
                open.push(ReadPromotion {
                    ticket,
                    table,
                    page,
                    dst,
                });
                continue;
            }
        };
        match result {
            Err(e) => {
                if e.kind() != crate::error::ErrorKind::OutOfCapacity {
                    rt.note_background("a promotion a read started", e);
                }
            }
            Ok(()) => {
                let arrived = table.upgrade().is_some_and(|t| {
                    t.pages
                        .get(page)
                        .is_some_and(|e| e.lock().tier() == Some(dst))
                });
                if arrived {
                    count_read_promotion(rt);
                }
            }
        }
    }
    if !open.is_empty() {
        rt.hints.read_promotions.lock().extend(open);
    }
}

/// Hints kept between rounds, at most; later ones are dropped.
const MAX_HINTS: usize = 1 << 16;

impl Hints {
    /// Notes that `pages` of buffer `id` were prefetched into `tier`.
    pub(crate) fn add(&self, tier: Tier, id: u32, pages: std::ops::Range<usize>) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut v = self.pages.lock();
        let room = MAX_HINTS.saturating_sub(v.len());
        v.extend(
            pages
                .take(room)
                .map(|p| (tier, (id as u64) << 32 | p as u64)),
        );
    }

    fn take(&self) -> Vec<(Tier, u64)> {
        std::mem::take(&mut *self.pages.lock())
    }
}

/// Shared by `Runtime`'s balancer methods.
pub(crate) type BalancerSlot = Mutex<Option<Balancer>>;
