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
//!   (`docs/perf.md`, pages).
//!
//! Promotions from NVMe into host memory (a runtime without a device tier,
//! NVMe right below its fastest tier) are left to the page's next read by
//! default
//! ([`BalancerConfig::promote_on_read`]): the balancer marks the page, and
//! the read that finds the mark starts its move.
//!
//! A page the fastest tier's policy lets go leaves at once only when its
//! demotion writes (done in the round, in the background). One with a clean
//! copy below stays while the tier has room — its reads are hits, and
//! leaving later costs no I/O — and goes first, lowest decayed score first,
//! when a round needs room (a stranger: a page the policy does not hold);
//! background reclaim and the engine's room-making take it too. The
//! candidates the free room holds come in as they are; beyond it, a round
//! displaces a stranger only for a page whose decayed score beats the
//! stranger's by more than [`BalancerConfig::min_accesses`] (the
//! highest-scored candidates against the coldest strangers): a swap of
//! equally hot pages moves a page for no hits. Demoting
//! such pages at once, with room kept for every mark not read yet, left DRAM
//! a third to two-thirds empty on a shifting hot set (`strata bench pages`).
//!
//! Every move pays for itself or is not made again: the runtime records,
//! per buffer, whether each page promoted into the fastest tier was
//! accessed there before it left (`Stats::promotions_paid`, `_unpaid`).
//! When most of a buffer's recent promotions did not pay (under 40% of at
//! least [`PAYBACK_WINDOW`](super::payback::PAYBACK_WINDOW) settled), its pages are promoted only once
//! they show reuse across rounds — an access in an earlier round still in
//! their decayed score, GMT's reuse prediction in its simplest form — and
//! the rest are served where they are; above 60% (or after
//! [`PAYBACK_PROBE`](super::payback::PAYBACK_PROBE) rounds with too few promotions to tell) the buffer is
//! promoted freely again. BFS frontiers, read once per level, stop being
//! promoted; the arrays every level reads keep theirs.
//!
//! A round that finds every resident page in the fastest tier (the tiers
//! below hold clean copies at most), that tier at or under its high
//! watermark and no prefetch since the last round replays nothing into
//! its policies: nothing is below to promote and no room is needed
//! ([`BalanceReport::replayed`] is 0). A graph that fits the device costs
//! its rounds a harvest, not a replay; the policies' recency is then that
//! of the last round that replayed.
//!
//! Each policy sees one access per touched page per interval, repeated up to
//! [`BalancerConfig::repeat`] times (default [`MAX_REPEAT`](super::MAX_REPEAT)) for pages
//! counted more often, coldest first, so the hottest pages are also the
//! most recent. Its decisions are kept in a shadow set of the pages it
//! holds: a page in its tier that it does not hold (placed there by a first
//! write, or by an explicit prefetch) is the first to leave when room is
//! needed. Every move goes through the migration engine at balance
//! priority, behind demand moves and prefetches.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::accounting::Counters;
use super::balance_config::{BalanceReport, BalancerConfig, REPEAT_LIMIT};
use super::balance_pages::{
    demote_pages, leaves_free, mark, move_pages, score_of, scored_strangers, still_marked,
    strangers, tier_of, ById,
};
use super::clean;
use super::hints::{settle_read_promotions, Hints};
use super::mover::Engine;
use super::payback::Payback;
use super::request::Source;
use super::shared::Shared;
use super::table::Table;
use crate::error::{Error, Result};
use crate::hotness::HarvestParams;
use crate::policy::{self, Outcome, Policy};
use crate::tier::Tier;

/// What a round works with.
struct Round<'a> {
    engine: &'a Engine,
    hints: &'a Hints,
    tables: &'a [Arc<Table>],
    by_id: &'a ById<'a>,
    /// Each touched page's count this round.
    count: &'a HashMap<u64, u32>,
    /// Touched pages with accesses in earlier rounds too.
    reused: &'a HashSet<u64>,
    page_size: f64,
}

impl Round<'_> {
    fn rt(&self) -> &Shared {
        self.engine.shared()
    }

    /// The tier's high watermark, in pages (at least 1).
    fn high(&self, tier: Tier) -> usize {
        let rt = self.rt();
        let store = rt.store(tier).expect("balanced tiers are configured");
        ((store.capacity_pages() as f64 * rt.watermarks.high) as usize).max(1)
    }

    fn used(&self, tier: Tier) -> usize {
        self.rt()
            .store(tier)
            .expect("balanced tiers are configured")
            .used_pages() as usize
    }

    /// Sorts `pages` hottest first.
    fn hottest_first(&self, pages: &mut [u64]) {
        pages.sort_by_key(|p| std::cmp::Reverse(self.count.get(p).copied().unwrap_or(0)));
    }
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
    /// (true: keep at or above `upper`), one per page in ascending order.
    /// Bypasses are counted in `bypasses`.
    fn decide(
        &mut self,
        hints: &[(Tier, u64)],
        touched: &[(u32, u64)],
        repeat: u32,
        bypasses: &mut u64,
    ) -> Vec<(u64, bool)> {
        let mut decisions = Decisions::default();
        // Prefetches into this level's tier first: a policy that honours
        // hints holds the page (and may evict for it); not an access.
        for &(_, page) in hints.iter().filter(|(t, _)| *t == self.upper) {
            match self.policy.hint(page) {
                Outcome::Hit | Outcome::Bypass => {}
                Outcome::Miss { evicted } => {
                    self.held.insert(page);
                    if let Some(e) = evicted {
                        self.held.remove(&e);
                        decisions.push(e, false);
                    }
                }
            }
        }
        for &(count, page) in touched {
            for _ in 0..count.min(repeat.max(1)) {
                match self.policy.access(page) {
                    Outcome::Hit => decisions.push(page, true),
                    Outcome::Miss { evicted } => {
                        self.held.insert(page);
                        decisions.push(page, true);
                        if let Some(e) = evicted {
                            self.held.remove(&e);
                            decisions.push(e, false);
                        }
                    }
                    Outcome::Bypass => {
                        *bypasses += 1;
                        break;
                    }
                }
            }
        }
        decisions.settle()
    }
}

/// A round's decisions for one level, in the order the policy made them.
/// (Kept as a list and settled once: a map updated at every access of a
/// replay, up to [`MAX_REPEAT`](super::MAX_REPEAT) a page, was most of a
/// round's CPU time on a large buffer.)
#[derive(Default)]
struct Decisions(Vec<(u64, bool)>);

impl Decisions {
    fn push(&mut self, page: u64, keep: bool) {
        // A repeat of the decision just made changes nothing.
        if self.0.last() != Some(&(page, keep)) {
            self.0.push((page, keep));
        }
    }

    /// One decision per page, the last made, in ascending page order.
    fn settle(mut self) -> Vec<(u64, bool)> {
        // Stable: each page's decisions keep their order.
        self.0.sort_by_key(|&(page, _)| page);
        let mut settled: Vec<(u64, bool)> = Vec::with_capacity(self.0.len());
        for (page, keep) in self.0 {
            match settled.last_mut() {
                Some(last) if last.0 == page => last.1 = keep,
                _ => settled.push((page, keep)),
            }
        }
        settled
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
    /// Per buffer (by number, with the buffer's serial: a number freed
    /// and reused is a new buffer), its promotions' recent payback.
    payback: HashMap<u32, (u64, Payback)>,
}

impl Balancer {
    pub(crate) fn new(rt: &Shared, hints: &Hints, config: BalancerConfig) -> Result<Self> {
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
        if !(1..=REPEAT_LIMIT).contains(&config.repeat) {
            return Err(Error::invalid(format!(
                "balancer repeat {} is not 1 to {REPEAT_LIMIT}",
                config.repeat
            )));
        }
        let tiers = rt.tiers.list();
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
        hints.on.store(true, Ordering::Relaxed);
        Ok(Self {
            config,
            levels,
            budget: 0.0,
            link_budget: [0.0; 16],
            topped: Instant::now(),
            marked: HashSet::new(),
            payback: HashMap::new(),
        })
    }

    /// Takes back every mark not yet taken by a read (the balancer is
    /// replaced or stopped: nothing would settle or account for them).
    pub(crate) fn take_back_marks(&mut self, engine: &Engine) {
        if self.marked.is_empty() {
            return;
        }
        let tables = engine.tables().live();
        let by_id: ById<'_> = tables.iter().map(|t| (t.id, t)).collect();
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
        by_id: &ById<'_>,
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
    pub(crate) fn step(&mut self, engine: &Engine, hints: &Hints) -> BalanceReport {
        let mut report = BalanceReport::default();
        let rt = engine.shared();
        let tables = engine.tables().live();
        let by_id: ById<'_> = tables.iter().map(|t| (t.id, t)).collect();

        // 1. Each buffer's payback (its counts change as pages leave the
        // fastest tier, not at harvests); what was touched, with counts.
        // A number whose buffer was freed and reused since the last round
        // starts afresh: its payback, pages held and marks were the old
        // buffer's.
        let renumbered: HashSet<u32> = self
            .payback
            .iter()
            .filter(|(id, (serial, _))| by_id.get(id).is_some_and(|t| t.serial != *serial))
            .map(|(&id, _)| id)
            .collect();
        self.payback
            .retain(|id, _| by_id.contains_key(id) && !renumbered.contains(id));
        if !renumbered.is_empty() {
            let stale = |p: &u64| renumbered.contains(&((p >> 32) as u32));
            self.marked.retain(|p| !stale(p));
            for level in &mut self.levels {
                level.held.retain(|p| !stale(p));
            }
        }
        for t in &tables {
            let (paid, unpaid) = (
                t.paid.load(Ordering::Relaxed),
                t.unpaid.load(Ordering::Relaxed),
            );
            self.payback
                .entry(t.id)
                .or_insert_with(|| (t.serial, Payback::starting_at(paid, unpaid)))
                .1
                .update(paid, unpaid);
        }
        let mut reused = HashSet::new();
        let touched = self.touched(rt, &tables, &mut reused);

        // 2. Every level's policy decides (the prefetches since the last
        // round as hints, then the accesses); the last decision per page
        // stands.
        // A cancelled prefetch's pages that did not come are no hints.
        let hinted = hints.take(&|tier, p| tier_of(&by_id, p) == Some(tier));
        if hinted.is_empty() && self.settled(rt) {
            // Nothing is below the fastest tier to promote, it has room,
            // and no prefetch is to be told: no decision this round could
            // move a page. The replay, most of a round's CPU time on large
            // buffers, is skipped (the policies hear nothing of this
            // round's accesses: their recency is that of the last round
            // that replayed); the harvest above kept the pages' scores.
            for level in &mut self.levels {
                level
                    .held
                    .retain(|p| by_id.contains_key(&((p >> 32) as u32)));
            }
            settle_read_promotions(rt, hints, true);
            return report;
        }
        let repeat = self.config.repeat;
        let mut wants = Vec::with_capacity(self.levels.len());
        for (k, level) in self.levels.iter_mut().enumerate() {
            let mut bypasses = 0;
            wants.push(level.decide(&hinted, &touched, repeat, &mut bypasses));
            if k == 0 {
                report.bypasses += bypasses;
                report.replayed = touched.len() as u64;
            }
            level
                .held
                .retain(|p| by_id.contains_key(&((p >> 32) as u32)));
        }
        self.top_up();
        let count: HashMap<u64, u32> = touched.iter().map(|&(c, p)| (p, c)).collect();
        let round = Round {
            engine,
            hints,
            tables: &tables,
            by_id: &by_id,
            count: &count,
            reused: &reused,
            page_size: rt.page_size() as f64,
        };

        // 3. The fastest tier: demotions, then promotions within the
        // budget and the room.
        self.balance_fastest(&round, &wants[0], &mut report);

        // 4. Each lower level: its tier's pages it dropped go below it; the
        // pages it holds (and no faster level does) come up into it.
        for (k, want) in wants.iter().enumerate().skip(1) {
            self.balance_level(&round, k, want, &mut report);
        }
        let c = rt.counters();
        Counters::add(&c.promotions, report.promotions);
        Counters::add(&c.demotions, report.demotions);
        Counters::add(&c.bypasses, report.bypasses);
        Counters::add(&c.held_back, report.held_back);
        report
    }

    /// Whether every resident page is in the fastest tier (the tiers
    /// below hold clean copies at most), below its high watermark.
    fn settled(&self, rt: &Shared) -> bool {
        let fast = self.levels[0].upper;
        let store = rt.store(fast).expect("balanced tiers are configured");
        let room =
            f64::from(store.used_pages()) <= f64::from(store.capacity_pages()) * rt.watermarks.high;
        room && rt.tiers.below(fast).iter().all(|&t| {
            rt.store(t)
                .is_some_and(|s| u64::from(s.used_pages()) <= rt.acct.clean_copies(t))
        })
    }

    /// What was touched since the last round: (count, page id), counted at
    /// least `min_accesses` times (scaled for sampling), coldest first.
    /// Pages of a buffer held to reused pages whose decayed score still
    /// holds an access from the last few rounds go to `reused` too.
    fn touched(
        &self,
        rt: &Shared,
        tables: &[Arc<Table>],
        reused: &mut HashSet<u64>,
    ) -> Vec<(u32, u64)> {
        let mut touched: Vec<(u32, u64)> = Vec::new();
        let scale = (1u64 << rt.sample_shift.unwrap_or(0)) as f32;
        // One access four rounds back, decayed.
        let memory = scale * self.config.decay.powi(4);
        for t in tables {
            let first = touched.len();
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
                &mut |p, c| {
                    t.note_harvest(p as usize, c);
                    touched.push((c, id | p))
                },
            );
            // Reuse is asked only of a buffer held to reused pages (a set
            // of every touched page, every round, was most of a round's
            // time on a large buffer).
            if !self.payback.get(&t.id).is_some_and(|(_, g)| g.strict) {
                continue;
            }
            for &(c, page) in &touched[first..] {
                let prior = scores[(page & 0xffff_ffff) as usize] - c as f32 * scale;
                if prior >= memory * 0.999 {
                    reused.insert(page);
                }
            }
        }
        let scale = 1u64 << rt.sample_shift.unwrap_or(0);
        let min = self.config.min_accesses;
        touched.retain(|&(c, _)| c as u64 * scale >= min);
        touched.sort_unstable();
        touched
    }

    /// The fastest tier: what the policy let go leaves it, then what it
    /// wants comes in, within the room below the high watermark, the rate
    /// limits, and (from NVMe, where promotions wait for reads) as marks.
    fn balance_fastest(&mut self, r: &Round<'_>, want: &[(u64, bool)], report: &mut BalanceReport) {
        let rt = r.rt();
        let fast = self.levels[0].upper;
        // What the policy let go leaves now only if leaving costs a write
        // (done here, in the background, not by whoever needs the room
        // later). A page with a clean copy below stays while there is
        // room: its reads are hits until then, and it leaves for nothing —
        // first, lowest score first, when room is needed (a stranger now:
        // the policy does not hold it).
        let demote: Vec<u64> = want
            .iter()
            .filter(|&&(p, w)| !w && !leaves_free(r.by_id, p, fast))
            .map(|&(p, _)| p)
            .collect();
        let demote = self.afford_down(rt, r.by_id, demote, fast, r.page_size);
        report.demotions += demote_pages(r.engine, r.by_id, &demote, fast);
        let high = r.high(fast);
        // The moves reads started for marked pages finish first (single
        // pages), counted and their failures kept.
        settle_read_promotions(rt, r.hints, true);
        // Earlier marks: those a read took (or a move cleared), or whose
        // page the policy let go since (unmarked now), are done.
        let held = &self.levels[0].held;
        self.marked
            .retain(|&p| still_marked(r.by_id, p, fast, held.contains(&p)));
        // Only where the fastest tier demotes straight to NVMe: with a
        // memory tier below it, a promoted page's later demotion lands
        // there, where its next reads are memory reads.
        let on_read = self.config.promote_on_read
            && matches!(fast, Tier::Host | Tier::Cxl)
            && rt.tiers.below(fast).first() == Some(&Tier::Nvme);
        // Candidates not in the fast tier yet, hottest first.
        let mut promote: Vec<u64> = want
            .iter()
            .filter(|&&(_, w)| w)
            .map(|&(p, _)| p)
            .filter(|&p| tier_of(r.by_id, p).is_some_and(|t| t != fast))
            .collect();
        r.hottest_first(&mut promote);
        promote.retain(|p| !self.marked.contains(p));
        // A buffer whose promotions have not been paying: only pages that
        // show reuse come up.
        let before = promote.len();
        promote.retain(|p| {
            let strict = self
                .payback
                .get(&((p >> 32) as u32))
                .is_some_and(|(_, g)| g.strict);
            !strict || r.reused.contains(p)
        });
        report.held_back += (before - promote.len()) as u64;
        // Room below the high watermark: strangers leave first. Marks hold
        // none: the read that takes one makes room for its move through the
        // engine, off the reader's thread. (Holding room for every mark not
        // read yet left DRAM a third to two-thirds empty on a shifting hot
        // set, the marks waiting for reads that mostly came late or never.)
        //
        // Candidates the free room holds come in; one beyond it displaces
        // a stranger, the highest-scored candidates against the coldest
        // strangers, only where it outscores its stranger by more than a
        // move's cost in accesses (`min_accesses`). A swap of equals moves
        // a page for no hits (PageRank's neighbour pages, each read through
        // once an iteration, traded for one another once a long round took
        // every one as a candidate). Strangers above the high watermark
        // leave whatever comes in.
        let over = r.used(fast).saturating_sub(high);
        let free = high.saturating_sub(r.used(fast));
        let need = promote.len().saturating_sub(free);
        if over + need > 0 {
            let margin = self.config.min_accesses as f32;
            let strangers = scored_strangers(r.tables, &self.levels[0].held, over + need, fast);
            let forced = over.min(strangers.len());
            // The candidates beyond the free room, highest score first.
            let first = free.min(promote.len());
            let mut tail: Vec<(f32, u64)> = promote[first..]
                .iter()
                .map(|&p| (score_of(r.by_id, p), p))
                .collect();
            tail.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let pays = tail
                .iter()
                .zip(&strangers[forced..])
                .take_while(|(c, s)| c.0 > s.0 + margin)
                .count();
            let leave: Vec<u64> = strangers[..forced + pays].iter().map(|x| x.1).collect();
            report.demotions += demote_pages(r.engine, r.by_id, &leave, fast);
            report.deferred += (need - pays) as u64;
            promote.truncate(first);
            promote.extend(tail[..pays].iter().map(|x| x.1));
        }
        let room = high.saturating_sub(r.used(fast));
        if promote.len() > room {
            report.deferred += (promote.len() - room) as u64;
            promote.truncate(room);
        }
        // The rate limit, on what fits.
        if self.config.rate_limit.is_some() {
            let affordable = (self.budget / r.page_size).max(0.0) as usize;
            if promote.len() > affordable {
                report.deferred += (promote.len() - affordable) as u64;
                promote.truncate(affordable);
            }
            self.budget -= promote.len() as f64 * r.page_size;
        }
        let mut promote = self.afford(r.by_id, promote, fast, r.page_size, &mut report.deferred);
        if on_read {
            promote.retain(|&p| {
                if !mark(r.by_id, p, fast) {
                    return true;
                }
                self.marked.insert(p);
                report.marked += 1;
                false
            });
        }
        report.promotions += move_pages(r.engine, r.by_id, &promote, fast, Source::Not(fast));
    }

    /// Lower level `k`: its tier's pages it dropped go below it; the pages
    /// it holds (and no faster level does) come up into it.
    fn balance_level(
        &mut self,
        r: &Round<'_>,
        k: usize,
        want: &[(u64, bool)],
        report: &mut BalanceReport,
    ) {
        let upper = self.levels[k].upper;
        let held_above = |p: &u64| self.levels[..k].iter().any(|l| l.held.contains(p));
        // A page a faster level holds but could not bring up (no room it
        // would pay for) is this level's to place.
        let there_above = |p: &u64| {
            self.levels[..k]
                .iter()
                .any(|l| l.held.contains(p) && tier_of(r.by_id, *p).is_some_and(|t| t <= l.upper))
        };
        // Never demoted while a faster level holds it (it may come up yet).
        let demote: Vec<u64> = want
            .iter()
            .filter(|&&(p, w)| !w && !held_above(&p))
            .map(|&(p, _)| p)
            .collect();
        let mut promote: Vec<u64> = want
            .iter()
            .filter(|&&(p, w)| w && !there_above(&p))
            .map(|&(p, _)| p)
            .filter(|&p| tier_of(r.by_id, p).is_some_and(|t| t > upper))
            .collect();
        let demote = self.afford_down(r.rt(), r.by_id, demote, upper, r.page_size);
        report.demotions_below += demote_pages(r.engine, r.by_id, &demote, upper);
        r.hottest_first(&mut promote);
        let high = r.high(upper);
        let mut short = (r.used(upper) + promote.len()).saturating_sub(high);
        if short > 0 {
            // Clean copies held in this tier (of pages promoted above it)
            // are its cheapest room: no I/O, nothing lost.
            short -= clean::drop_copies(r.engine.tables(), r.rt(), upper, short);
        }
        if short > 0 {
            let strangers = strangers(r.tables, &self.levels[k].held, short, upper);
            report.demotions_below += demote_pages(r.engine, r.by_id, &strangers, upper);
        }
        let room = high.saturating_sub(r.used(upper));
        if promote.len() > room {
            report.deferred += (promote.len() - room) as u64;
            promote.truncate(room);
        }
        let promote = self.afford(r.by_id, promote, upper, r.page_size, &mut report.deferred);
        report.promotions_below +=
            move_pages(r.engine, r.by_id, &promote, upper, Source::Below(upper));
    }

    /// Keeps the pages of `pages` in `tier` whose demotion to the first
    /// tier below it the link's budget affords; deducts them. Pages not in
    /// `tier` pass (they will not move).
    fn afford_down(
        &mut self,
        rt: &Shared,
        by_id: &ById<'_>,
        pages: Vec<u64>,
        tier: Tier,
        page_size: f64,
    ) -> Vec<u64> {
        let Some(&below) = rt.tiers.below(tier).first() else {
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
