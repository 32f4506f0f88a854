//! The default policy: W-TinyLFU whose window is sized by miniature
//! simulations, which also decide when ARC would do better.
//!
//! - A small LRU *window* takes every missing page.
//! - The *main* cache is a segmented LRU: pages enter its *probation*
//!   segment and move to *protected* on a hit there; protected overflow is
//!   demoted back to probation.
//! - When the window overflows, its least recent page is a candidate for
//!   main, and TinyLFU admission decides: it replaces main's next victim only
//!   if it was accessed more often recently (exact counts saturating at 31,
//!   halved every 40 × capacity accesses, re-references within 4% of the
//!   capacity counted once: see `counts.rs`; at 15 and 1%, the settings
//!   before, the counts of a stationary skewed law such as MoE experts'
//!   saturated and admission could not rank them). Scans and loops larger than the
//!   cache stay in the window and leave; frequent pages stay in main.
//! - The window's size decides between recency and frequency: a window of
//!   the whole cache is LRU, one of 1% is close to LFU with admission. A
//!   tuner replays a spatially sampled share of the accesses (pages picked by
//!   hash, at most 1024 pages' worth of cache) through small copies of the
//!   policy with windows of 1%, 4%, 12%, 30%, 60% and 100%, and moves the real
//!   window one step towards a copy that missed significantly less, over the
//!   recent past and over a longer one. Caffeine's hill climber, the usual
//!   choice, follows the real cache's own hit rate from sample to
//!   sample; in an earlier version measured on the same suite it cost 1–5%
//!   more misses than a fixed 1% window on stationary Zipf traces, moving on
//!   noise. The copies compare the candidate windows on the same accesses.
//! - A window that grows takes main's most recently used pages at once, so
//!   the cache's order is by recency across the move.
//! - One more copy runs ARC, a step past the whole-cache window: where it
//!   misses significantly less than the current window's copy (the same
//!   test as between windows), the real cache becomes ARC, its resident
//!   pages kept (protected's as ARC's frequent list, the rest as its recent
//!   one); where a window's copy later misses less, it becomes W-TinyLFU
//!   again with the whole-cache window, then steps on as before. On traces
//!   that read a few tables in turn, each with its own skew (embedding
//!   lookups), frequency matters across the turns and recency within one:
//!   no window of W-TinyLFU came within 5% of ARC's misses there, the limit
//!   of the default on the policy corpus's embedding traces at small
//!   capacities.
//! - Cost: the copies share one index of their sampled pages (one hash
//!   lookup per sampled access for all seven), every node caches its page's
//!   access count for admission (no count lookups on a miss), and at most
//!   half of the accesses are sampled (below 2048 pages of capacity the
//!   copies are half the cache's size). Sampling everything at small
//!   capacities cost seven caches' work per access and held replay under
//!   10 M accesses/s; sampling a quarter or less made the copies too small
//!   to choose well on the training corpus (both in `docs/perf-log.md`).
//!
//! O(1) per access, plus the copies' work in proportion to the sampled share
//! (seven copies at min(1/2, 1024 / capacity), all keyed by the one index
//! of sampled pages); a window move or a switch between W-TinyLFU and ARC
//! sorts the resident pages by last use (O(n log n)), which the tuner does
//! rarely.

#![forbid(unsafe_code)]

use super::arc::{Arc, ArcCache, Nodes};
use super::base::{mix64, page_map, Outcome, PageMap, Policy};
use super::counts::Counts;
use super::list::{Arena, List};

/// Knobs of [`DefaultPolicy`]; [`Config::default`] is what the runtime uses.
#[derive(Clone, Debug)]
pub struct Config {
    /// Initial window share of the capacity.
    pub window: f64,
    /// Protected share of main.
    pub protected: f64,
    /// Access counts saturate here.
    pub count_max: u8,
    /// Access counts halve every this many accesses per page of capacity.
    pub count_period: f64,
    /// An access is not counted when the page's previous one is fewer than
    /// this many accesses per page of capacity ago.
    pub count_gap: f64,
    /// Whether the tuner runs.
    pub tune: bool,
    /// Window shares the tuner simulates (ascending; the first 32).
    pub tune_windows: Vec<f64>,
    /// Whether the tuner also simulates ARC, a step past the last window,
    /// and runs the cache as ARC when that copy misses less.
    pub tune_arc: bool,
    /// Capacity of each simulated copy, in pages (the sampling rate is this
    /// over the capacity, at most 1).
    pub tune_pages: usize,
    /// The copies' miss counts decay by half over this many sampled
    /// accesses where some copy missed, per page of a copy's capacity.
    pub tune_half_life: f64,
    /// The tuner moves only towards a copy whose (decayed) misses are below
    /// the current one's by this share ...
    pub tune_margin: f64,
    /// ... and by this many standard deviations of the difference, on the
    /// recent horizon and on one this many times longer.
    pub tune_z: f64,
    /// The long horizon's half-life over the recent one's.
    pub tune_long: f64,
    /// At most this share of the accesses is sampled for the copies (their
    /// capacity shrinks with it below `tune_pages / tune_rate_max` pages),
    /// which bounds the tuner's cost at small capacities.
    pub tune_rate_max: f64,
}

impl std::default::Default for Config {
    fn default() -> Self {
        Self {
            window: 0.01,
            protected: 0.9,
            count_max: 31,
            count_period: 40.0,
            count_gap: 0.04,
            tune: true,
            tune_windows: vec![0.01, 0.04, 0.12, 0.3, 0.6, 1.0],
            tune_arc: true,
            tune_pages: 1024,
            tune_half_life: 8.0,
            tune_margin: 0.005,
            tune_z: 3.0,
            tune_long: 8.0,
            tune_rate_max: 0.5,
        }
    }
}

/// W-TinyLFU with a window sized by miniature simulations.
pub struct DefaultPolicy {
    /// Counts of every access, shared by the real cache and the copies (a
    /// sampled page's accesses are all sampled, so its count is the same).
    counts: Counts,
    real: Real,
    /// Protected share of main (for a W-TinyLFU rebuilt after ARC).
    protected: f64,
    tuner: Option<Tuner>,
}

/// The real cache: W-TinyLFU, or ARC where the tuner found it missing less.
/// One per policy, and W-TinyLFU the usual one: kept inline, not boxed,
/// on the access path.
#[allow(clippy::large_enum_variant)]
enum Real {
    Tiny(Core),
    Arc(Box<Arc>),
}

impl DefaultPolicy {
    /// A cache of `capacity` pages with the default configuration.
    pub fn new(capacity: usize) -> Self {
        Self::with_config(capacity, &Config::default())
    }

    /// A cache of `capacity` pages tuned by `config`.
    ///
    /// # Panics
    /// If `capacity` is 0 (here and in [`DefaultPolicy::new`]).
    pub fn with_config(capacity: usize, config: &Config) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        let window = (capacity as f64 * config.window) as usize;
        Self {
            counts: Counts::new(
                capacity,
                config.count_max,
                (capacity as f64 * config.count_period) as u64,
                (capacity as f64 * config.count_gap) as u32,
            ),
            real: Real::Tiny(Core::new(capacity, window, config.protected, true)),
            protected: config.protected,
            tuner: (config.tune && capacity >= 2 && !config.tune_windows.is_empty())
                .then(|| Tuner::new(capacity, config)),
        }
    }

    /// The window's current size limit, in pages (`None` while the cache
    /// runs as ARC).
    pub fn window_size(&self) -> Option<usize> {
        match &self.real {
            Real::Tiny(core) => Some(core.window_max),
            Real::Arc(_) => None,
        }
    }

    /// Sets the window's size limit, in pages (the tuner may move it again);
    /// a cache running as ARC becomes W-TinyLFU again.
    pub fn set_window_size(&mut self, pages: usize) {
        match &mut self.real {
            Real::Tiny(core) => core.set_window(pages),
            Real::Arc(arc) => {
                let (recent, frequent) = arc.resident();
                self.real = Real::Tiny(Core::with_resident(
                    arc.capacity(),
                    pages,
                    self.protected,
                    &recent,
                    &frequent,
                    &self.counts,
                ));
            }
        }
    }

    /// Runs the cache as ARC from now on, its resident pages kept.
    fn become_arc(&mut self) {
        if let Real::Tiny(core) = &self.real {
            let (recent, frequent) = core.resident();
            self.real = Real::Arc(Box::new(Arc::with_resident(
                core.capacity,
                &recent,
                &frequent,
            )));
        }
    }
}

impl Policy for DefaultPolicy {
    fn name(&self) -> &'static str {
        "default"
    }

    fn capacity(&self) -> usize {
        match &self.real {
            Real::Tiny(core) => core.capacity,
            Real::Arc(arc) => arc.capacity(),
        }
    }

    fn len(&self) -> usize {
        match &self.real {
            Real::Tiny(core) => core.map.len(),
            Real::Arc(arc) => arc.len(),
        }
    }

    fn access(&mut self, page: u64) -> Outcome {
        let count = self.counts.record(page);
        let halvings = self.counts.halvings();
        if let Some(t) = &mut self.tuner {
            match t.observe(page, count, halvings) {
                Some(Some(share)) => {
                    let w = (self.capacity() as f64 * share).round() as usize;
                    self.set_window_size(w);
                }
                Some(None) => self.become_arc(),
                None => {}
            }
        }
        match &mut self.real {
            Real::Tiny(core) => core.access(page, count, halvings),
            Real::Arc(arc) => arc.access(page),
        }
    }
}

/// Picks the window share by replaying sampled accesses through copies.
///
/// Over two horizons, a recent one and one `long` times longer, each copy
/// keeps a decayed count of its misses and each pair of copies a decayed
/// count of the accesses where exactly one of the two missed. The real
/// cache moves one step (to the next share in the list) towards the copy
/// that missed least, when on both horizons that copy missed fewer times
/// than the current one by `z` standard deviations of the difference (the
/// square root of the pair's disagreements, were they equally good) and by
/// `margin` of the current one's misses.
///
/// Why so careful: moving the window costs misses while the cache's
/// contents follow, and on traces with phases (graph traversals from one
/// root after another) a window that wins for one phase loses the next; a
/// move that both horizons back is one a persistent change (a drifting hot
/// set) asks for. One step at a time for the same reason.
///
/// The copies share one index of the sampled pages they hold (a *slot* per
/// page: which node it has in each copy, and its access count as of its
/// last access), so a sampled access costs one hash lookup for all copies
/// rather than a lookup, an insertion, a removal and two count lookups in
/// each: the copies' own lists are keyed by slot, and each node caches its
/// page's count for admission.
struct Tuner {
    /// Pages whose hash is at most this are sampled.
    threshold: u64,
    copies: Vec<Copy>,
    /// A copy run as ARC, the choice after the last window (keyed by slot,
    /// as the windows' copies).
    arc: Option<ArcCache<SlotNodes>>,
    slots: Slots,
    horizons: [Horizon; 2],
    current: usize,
    z: f64,
    margin: f64,
    /// Sampled accesses until the next decision.
    countdown: u32,
    every: u32,
}

struct Copy {
    share: f64,
    core: Core,
}

/// The sampled pages some copy holds: page → slot, and per slot the page,
/// its node in each copy (`NO_NODE` where absent) and how many copies hold
/// it.
struct Slots {
    index: PageMap<u32>,
    page: Vec<u64>,
    nodes: Vec<u32>,
    holders: Vec<u8>,
    free: Vec<u32>,
    copies: usize,
}

const NO_NODE: u32 = u32::MAX;

impl Slots {
    fn new(copies: usize, pages: usize) -> Self {
        Self {
            index: page_map(pages * 2),
            page: Vec::new(),
            nodes: Vec::new(),
            holders: Vec::new(),
            free: Vec::new(),
            copies,
        }
    }

    /// The slot of `page`, a new one if no copy holds it.
    fn get_or_add(&mut self, page: u64) -> usize {
        if let Some(&s) = self.index.get(&page) {
            return s as usize;
        }
        let s = match self.free.pop() {
            Some(s) => s as usize,
            None => {
                self.page.push(0);
                self.holders.push(0);
                self.nodes.extend(std::iter::repeat_n(NO_NODE, self.copies));
                self.page.len() - 1
            }
        };
        self.page[s] = page;
        self.index.insert(page, s as u32);
        s
    }

    /// Copy `j` no longer holds slot `s`'s page; forgets the slot when no
    /// copy does.
    fn drop_holder(&mut self, s: usize, j: usize) {
        self.nodes[s * self.copies + j] = NO_NODE;
        self.release(s);
    }

    /// One holder fewer of slot `s` (a window's copy, or the ARC copy,
    /// which keeps its nodes in [`SlotNodes`]); forgets the slot when none
    /// is left.
    fn release(&mut self, s: usize) {
        self.holders[s] -= 1;
        if self.holders[s] == 0 {
            self.index.remove(&self.page[s]);
            self.free.push(s as u32);
        }
    }
}

/// The ARC copy's nodes by slot, and the slots it took or let go of during
/// an access (the tuner counts them as holders in [`Slots`]).
#[derive(Default)]
struct SlotNodes {
    node: Vec<u32>,
    taken: Vec<u64>,
    left: Vec<u64>,
}

impl Nodes for SlotNodes {
    #[inline]
    fn find(&self, slot: u64) -> Option<u32> {
        self.node
            .get(slot as usize)
            .copied()
            .filter(|&n| n != NO_NODE)
    }

    #[inline]
    fn put(&mut self, slot: u64, node: u32) {
        let s = slot as usize;
        if s >= self.node.len() {
            self.node.resize(s + 1, NO_NODE);
        }
        self.node[s] = node;
        self.taken.push(slot);
    }

    #[inline]
    fn forget(&mut self, slot: u64) {
        self.node[slot as usize] = NO_NODE;
        self.left.push(slot);
    }
}

/// Decayed evidence about the copies over one horizon.
///
/// Decay is lazy: rather than every value shrinking by `decay` at each
/// event, each new event weighs `1 / decay` times the one before (`scale`),
/// and values are read divided by `scale`; everything is rescaled before
/// the weights overflow. An event then costs an addition per copy that
/// missed and per pair that disagreed, not a multiplication per value.
struct Horizon {
    decay: f64,
    /// The weight of the latest event.
    scale: f64,
    /// Per copy: decayed misses, times `scale`.
    misses: Vec<f64>,
    /// `disagree[i * k + j]` (`i < j`): decayed accesses where exactly one
    /// of copies `i` and `j` missed, times `scale`.
    disagree: Vec<f64>,
}

impl Horizon {
    fn new(k: usize, half_life: f64) -> Self {
        Self {
            decay: 0.5f64.powf(1.0 / half_life.max(16.0)),
            scale: 1.0,
            misses: vec![0.0; k],
            disagree: vec![0.0; k * k],
        }
    }

    /// Adds an event: bit `i` of `missed` says whether copy `i` missed.
    fn update(&mut self, missed: u64) {
        let k = self.misses.len();
        self.scale /= self.decay;
        if self.scale > 1e200 {
            let r = 1.0 / self.scale;
            self.misses.iter_mut().for_each(|m| *m *= r);
            self.disagree.iter_mut().for_each(|d| *d *= r);
            self.scale = 1.0;
        }
        let w = self.scale;
        let all = (1u64 << k) - 1;
        let mut m = missed;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            self.misses[i] += w;
        }
        // Pairs (i < j) with exactly one miss: j among the later copies
        // whose bit differs from i's.
        for i in 0..k {
            let mine = if missed >> i & 1 == 1 { all } else { 0 };
            let mut d = (missed ^ mine) & all & !((2u64 << i) - 1);
            while d != 0 {
                let j = d.trailing_zeros() as usize;
                d &= d - 1;
                self.disagree[i * k + j] += w;
            }
        }
    }

    /// How many fewer misses copy `j` had than copy `cur`, if significant.
    fn gain(&self, cur: usize, j: usize, z: f64, margin: f64) -> Option<f64> {
        let k = self.misses.len();
        let r = 1.0 / self.scale;
        let (mc, mj) = (self.misses[cur] * r, self.misses[j] * r);
        let gain = mc - mj;
        let n = self.disagree[cur.min(j) * k + cur.max(j)] * r;
        (gain > z * n.sqrt() && gain > margin * mc).then_some(gain)
    }
}

impl Tuner {
    fn new(capacity: usize, config: &Config) -> Self {
        let rate = (config.tune_pages as f64 / capacity as f64)
            .min(config.tune_rate_max)
            .min(1.0);
        let pages = ((capacity as f64 * rate).round() as usize).max(2);
        let copies: Vec<Copy> = config
            .tune_windows
            .iter()
            .take(32)
            .map(|&share| Copy {
                share,
                core: Core::new(
                    pages,
                    (pages as f64 * share).round() as usize,
                    config.protected,
                    false,
                ),
            })
            .collect();
        let k = copies.len() + usize::from(config.tune_arc);
        // Start from the copy nearest the initial window.
        let current = config
            .tune_windows
            .iter()
            .enumerate()
            .take(32)
            .min_by(|a, b| {
                (a.1 - config.window)
                    .abs()
                    .total_cmp(&(b.1 - config.window).abs())
            })
            .map_or(0, |(i, _)| i);
        let half_life = config.tune_half_life * pages as f64;
        let every = (pages / 8).max(1) as u32;
        let slots = Slots::new(copies.len(), pages);
        Self {
            threshold: if rate >= 1.0 {
                u64::MAX
            } else {
                (rate * u64::MAX as f64) as u64
            },
            copies,
            arc: config
                .tune_arc
                .then(|| ArcCache::with_nodes(pages, SlotNodes::default())),
            slots,
            horizons: [
                Horizon::new(k, half_life),
                Horizon::new(k, half_life * config.tune_long.max(1.0)),
            ],
            current,
            z: config.tune_z,
            margin: config.tune_margin,
            countdown: every,
            every,
        }
    }

    /// Feeds one access (the page's access count is `count` after it, with
    /// the counts halved `halvings` times so far); returns a new window
    /// share when it should change (`Some(None)`: run as ARC).
    fn observe(&mut self, page: u64, count: u32, halvings: u32) -> Option<Option<f64>> {
        if mix64(page ^ 0x2545_f491_4f6c_dd1d) > self.threshold {
            return None;
        }
        let s = self.slots.get_or_add(page);
        let k = self.copies.len();
        let mut missed = 0u64;
        for (j, c) in self.copies.iter_mut().enumerate() {
            let node = self.slots.nodes[s * k + j];
            if node != NO_NODE {
                c.core.hit(node, count, halvings);
                continue;
            }
            missed |= 1 << j;
            let (node, evicted) = c.core.insert(s as u64, count, halvings);
            self.slots.nodes[s * k + j] = node;
            self.slots.holders[s] += 1;
            if let Some(e) = evicted {
                self.slots.drop_holder(e as usize, j);
            }
        }
        let n = self.copies.len();
        if let Some(arc) = &mut self.arc {
            if !arc.access(s as u64).is_hit() {
                missed |= 1 << n;
            }
            let nodes = arc.nodes_mut();
            for t in nodes.taken.drain(..) {
                self.slots.holders[t as usize] += 1;
            }
            for t in nodes.left.drain(..) {
                self.slots.release(t as usize);
            }
        }
        // Time is counted in accesses where some copy missed: the evidence
        // the recent past holds is then the same at any miss rate.
        if missed != 0 {
            for h in &mut self.horizons {
                h.update(missed);
            }
        }
        self.countdown -= 1;
        if self.countdown > 0 {
            return None;
        }
        self.countdown = self.every;
        let cur = self.current;
        let [short, long] = &self.horizons;
        let best = (0..n + usize::from(self.arc.is_some()))
            .filter(|&j| j != cur)
            .filter_map(|j| {
                let g = short.gain(cur, j, self.z, self.margin)?;
                long.gain(cur, j, self.z, self.margin)?;
                Some((j, g))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        self.current = if best.0 > cur { cur + 1 } else { cur - 1 };
        Some(self.copies.get(self.current).map(|c| c.share))
    }
}

const WINDOW: u8 = 0;
const PROBATION: u8 = 1;
const PROTECTED: u8 = 2;

/// W-TinyLFU with a settable window; access counts are kept by the caller.
struct Core {
    capacity: usize,
    map: PageMap<u32>,
    arena: Arena,
    window: List,
    probation: List,
    protected: List,
    window_max: usize,
    protected_max: usize,
    protected_share: f64,
    /// Per node: when its page was last accessed.
    stamps: Vec<u64>,
    /// Per node: its page's access count as of that access, and how many
    /// halvings the counts had had then (the count now is that shifted
    /// right by the halvings since: counts change only by an access, which
    /// refreshes it, and by halving). Admission reads it without a lookup.
    counts: Vec<(u8, u32)>,
    /// Halvings of the counts so far.
    halvings: u32,
    now: u64,
}

impl Core {
    /// `indexed`: whether the core keeps its own index of pages (the
    /// tuner's copies share one).
    fn new(capacity: usize, window: usize, protected_share: f64, indexed: bool) -> Self {
        let mut c = Self {
            capacity,
            map: page_map(if indexed { capacity } else { 0 }),
            arena: Arena::with_capacity(capacity + 1),
            window: List::default(),
            probation: List::default(),
            protected: List::default(),
            window_max: 1,
            protected_max: 0,
            protected_share,
            stamps: Vec::new(),
            counts: Vec::new(),
            halvings: 0,
            now: 0,
        };
        c.set_window(window);
        c
    }

    fn set_window(&mut self, window_max: usize) {
        self.window_max = window_max.clamp(1, self.capacity.max(1));
        let main = self.capacity - self.window_max;
        self.protected_max = (main as f64 * self.protected_share) as usize;
        // A smaller window hands its oldest pages to main, unjudged; a
        // larger one takes main's most recently used pages at once (growing
        // it only as pages miss, main draining one page per miss, left the
        // cache worse than either window for a long while on graph traces).
        while self.window.len() > self.window_max {
            let i = self.window.pop_back(&mut self.arena).expect("non-empty");
            self.arena.get_mut(i).tag = PROBATION;
            self.probation.push_front(&mut self.arena, i);
        }
        if self.window.len() < self.window_max && self.len_total() > self.window.len() {
            self.grow_window();
        }
        self.demote();
    }

    /// Fills a larger window at once with the most recently used pages of
    /// main, so that the cache's order is by recency across the move.
    fn grow_window(&mut self) {
        let want = self.window_max - self.window.len();
        let mut main: Vec<(u64, u32)> = Vec::with_capacity(self.len_total());
        for list in [&self.probation, &self.protected] {
            let mut i = list.back();
            while let Some(n) = i {
                main.push((self.stamps[n as usize], n));
                i = List::prev_of(&self.arena, n);
            }
        }
        main.sort_unstable_by_key(|&(stamp, _)| std::cmp::Reverse(stamp));
        main.truncate(want);
        let mut window: Vec<(u64, u32)> = Vec::with_capacity(self.window_max);
        while let Some(n) = self.window.pop_back(&mut self.arena) {
            window.push((self.stamps[n as usize], n));
        }
        for &(_, n) in &main {
            match self.arena.get(n).tag {
                PROBATION => self.probation.remove(&mut self.arena, n),
                _ => self.protected.remove(&mut self.arena, n),
            }
            self.arena.get_mut(n).tag = WINDOW;
        }
        window.extend(main);
        window.sort_unstable_by_key(|&(s, _)| s);
        for (_, n) in window {
            self.window.push_front(&mut self.arena, n);
        }
    }

    /// The resident pages: the window's and probation's, and protected's,
    /// each least recently used first.
    fn resident(&self) -> (Vec<u64>, Vec<u64>) {
        let by_use = |lists: &[&List]| {
            let mut pages: Vec<(u64, u64)> = Vec::new();
            for list in lists {
                let mut i = list.back();
                while let Some(n) = i {
                    pages.push((self.stamps[n as usize], self.arena.get(n).key));
                    i = List::prev_of(&self.arena, n);
                }
            }
            pages.sort_unstable();
            pages
                .into_iter()
                .map(|(_, page)| page)
                .collect::<Vec<u64>>()
        };
        (
            by_use(&[&self.window, &self.probation]),
            by_use(&[&self.protected]),
        )
    }

    /// A cache (with its own index) holding `recent` in probation and
    /// `frequent` in protected, each least recently used first and all of
    /// `frequent` used after `recent`, with a window of `window` pages taken
    /// from the most recent.
    fn with_resident(
        capacity: usize,
        window: usize,
        protected_share: f64,
        recent: &[u64],
        frequent: &[u64],
        counts: &Counts,
    ) -> Self {
        let mut c = Self::new(capacity, capacity, protected_share, true);
        c.halvings = counts.halvings();
        for (tag, pages) in [(PROBATION, recent), (PROTECTED, frequent)] {
            for &page in pages {
                let i = c.arena.alloc(page, tag);
                c.stamp(i, counts.get(page));
                match tag {
                    PROBATION => c.probation.push_front(&mut c.arena, i),
                    _ => c.protected.push_front(&mut c.arena, i),
                }
                c.map.insert(page, i);
            }
        }
        c.set_window(window);
        c
    }

    /// Moves protected overflow back to probation.
    fn demote(&mut self) {
        while self.protected.len() > self.protected_max {
            let i = self.protected.pop_back(&mut self.arena).expect("non-empty");
            self.arena.get_mut(i).tag = PROBATION;
            self.probation.push_front(&mut self.arena, i);
        }
    }

    fn len_total(&self) -> usize {
        self.window.len() + self.probation.len() + self.protected.len()
    }

    /// Unlinks and frees node `i`; returns its key.
    fn remove(&mut self, i: u32) -> u64 {
        let n = *self.arena.get(i);
        match n.tag {
            WINDOW => self.window.remove(&mut self.arena, i),
            PROBATION => self.probation.remove(&mut self.arena, i),
            _ => self.protected.remove(&mut self.arena, i),
        }
        self.arena.release(i);
        n.key
    }

    /// Makes room after a miss grew the cache past its capacity; returns the
    /// key that left.
    fn evict(&mut self, candidate: Option<u32>) -> u64 {
        // Main's next victim: probation's least recent, else protected's.
        let victim = match self.probation.back() {
            Some(v) if Some(v) != candidate => Some(v),
            _ => self.protected.back(),
        };
        match (candidate, victim) {
            // TinyLFU admission: the candidate must have been accessed more
            // often; ties keep the victim, which is what holds a loop's
            // resident set still.
            (Some(c), Some(v)) => {
                if self.count(c) > self.count(v) {
                    self.remove(v)
                } else {
                    self.remove(c)
                }
            }
            (Some(c), None) => self.remove(c),
            (None, Some(v)) => self.remove(v),
            (None, None) => {
                let w = self.window.back().expect("a full cache has a page");
                self.remove(w)
            }
        }
    }

    #[inline]
    fn stamp(&mut self, i: u32, count: u32) {
        self.now += 1;
        let i = i as usize;
        if i >= self.stamps.len() {
            self.stamps.resize(i + 1, 0);
            self.counts.resize(i + 1, (0, 0));
        }
        self.stamps[i] = self.now;
        self.counts[i] = (count.min(255) as u8, self.halvings);
    }

    /// Node `i`'s page's access count now.
    #[inline]
    fn count(&self, i: u32) -> u32 {
        let (c, h) = self.counts[i as usize];
        let h = self.halvings.wrapping_sub(h);
        if h >= 8 {
            0
        } else {
            u32::from(c) >> h
        }
    }

    /// An access to the key of node `i`, which is in the cache; `count` is
    /// its access count after it, with the counts halved `halvings` times
    /// so far.
    #[inline]
    fn hit(&mut self, i: u32, count: u32, halvings: u32) {
        self.halvings = halvings;
        self.stamp(i, count);
        match self.arena.get(i).tag {
            WINDOW => self.window.move_to_front(&mut self.arena, i),
            PROBATION => {
                self.probation.remove(&mut self.arena, i);
                self.arena.get_mut(i).tag = PROTECTED;
                self.protected.push_front(&mut self.arena, i);
                self.demote();
            }
            _ => self.protected.move_to_front(&mut self.arena, i),
        }
    }

    /// An access to `key`, which is not in the cache: it enters the window.
    /// Returns its node and the key that left, if one did. The caller keeps
    /// the index; `count` and `halvings` as for [`hit`](Self::hit).
    #[inline]
    fn insert(&mut self, key: u64, count: u32, halvings: u32) -> (u32, Option<u64>) {
        self.halvings = halvings;
        let i = self.arena.alloc(key, WINDOW);
        self.stamp(i, count);
        self.window.push_front(&mut self.arena, i);
        let candidate = (self.window.len() > self.window_max).then(|| {
            let c = self.window.pop_back(&mut self.arena).expect("non-empty");
            self.arena.get_mut(c).tag = PROBATION;
            self.probation.push_front(&mut self.arena, c);
            c
        });
        let evicted = (self.len_total() > self.capacity).then(|| self.evict(candidate));
        (i, evicted)
    }

    /// An access to `page` through the cache's own index.
    fn access(&mut self, page: u64, count: u32, halvings: u32) -> Outcome {
        if let Some(&i) = self.map.get(&page) {
            self.hit(i, count, halvings);
            return Outcome::Hit;
        }
        let (i, evicted) = self.insert(page, count, halvings);
        self.map.insert(page, i);
        if let Some(e) = evicted {
            self.map.remove(&e);
        }
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit;
    use super::*;

    /// The default configuration with its tuner off.
    fn untuned() -> Config {
        Config {
            tune: false,
            ..Config::default()
        }
    }

    #[test]
    fn holds_at_most_its_capacity() {
        for cap in 1..6 {
            let mut p = DefaultPolicy::new(cap);
            for i in 0..500u64 {
                p.access(i * 7 % 13);
                assert!(p.len() <= cap);
            }
        }
    }

    #[test]
    fn frequent_pages_survive_a_scan() {
        let config = untuned();
        let mut p = DefaultPolicy::with_config(100, &config);
        for _ in 0..20 {
            for page in 0..90 {
                p.access(page);
            }
        }
        for page in 1000..1400 {
            p.access(page);
        }
        let hits = (0..90).filter(|&page| p.access(page).is_hit()).count();
        assert!(hits >= 85, "{hits}");
    }

    #[test]
    fn a_grown_window_orders_the_cache_by_recency() {
        let config = untuned();
        let mut p = DefaultPolicy::with_config(10, &config);
        for page in (0..10).chain(0..5) {
            p.access(page);
        }
        p.set_window_size(10);
        assert_eq!(p.len(), 10);
        // Pages 5..10 were used least recently, 5 first.
        for (new, old) in (100..105).zip(5..10) {
            assert_eq!(p.access(new), Outcome::Miss { evicted: Some(old) });
        }
        assert!((0..5).all(|page| p.access(page).is_hit()));
    }

    /// Tables read one after another, each with its own skew, over and
    /// over (the shape of embedding-bag lookups): frequency matters across
    /// the rounds, recency within a table's turn.
    fn tables_in_turn(capacity: usize) -> Vec<u64> {
        let alphas = [1.1, 0.9, 0.7, 0.5];
        let pages = 40 * capacity as u64;
        let mut t = Vec::new();
        for round in 0..40 {
            for (k, &alpha) in alphas.iter().enumerate() {
                let seed = round * 31 + k as u64;
                let draws = testkit::zipf(alpha, pages, 32 * capacity, seed);
                t.extend(draws.into_iter().map(|p| k as u64 * pages + p));
            }
        }
        t
    }

    #[test]
    fn runs_as_arc_where_arc_misses_less() {
        let cap = 64;
        let t = tables_in_turn(cap);
        let arc = testkit::misses(&mut super::super::arc::Arc::new(cap), &t) as f64;
        let without = Config {
            tune_arc: false,
            ..Config::default()
        };
        let windows_only = testkit::misses(&mut DefaultPolicy::with_config(cap, &without), &t);
        assert!(
            windows_only as f64 > 1.05 * arc,
            "the trace should favour ARC: {windows_only} against {arc}"
        );
        let mut p = DefaultPolicy::new(cap);
        let misses = testkit::misses(&mut p, &t) as f64;
        assert!(misses <= 1.02 * arc, "{misses} against ARC's {arc}");
        assert_eq!(p.window_size(), None, "the cache runs as ARC");
    }

    #[test]
    fn switching_to_arc_and_back_keeps_the_resident_pages() {
        let config = untuned();
        let mut p = DefaultPolicy::with_config(50, &config);
        testkit::check_residency(&mut p, &testkit::mixed(50, 1000, 7));
        let resident = |p: &DefaultPolicy| {
            let (a, b) = match &p.real {
                Real::Tiny(core) => core.resident(),
                Real::Arc(arc) => arc.resident(),
            };
            let mut all: Vec<u64> = a.into_iter().chain(b).collect();
            all.sort_unstable();
            all
        };
        let before = resident(&p);
        assert_eq!(before.len(), 50);
        p.become_arc();
        assert_eq!(p.window_size(), None);
        assert_eq!(resident(&p), before);
        assert!(before.iter().all(|&x| p.access(x).is_hit()));
        match p.access(1_000_000) {
            Outcome::Miss { evicted: Some(e) } => assert!(before.contains(&e)),
            other => panic!("{other:?}"),
        }
        let during = resident(&p);
        p.set_window_size(5);
        assert_eq!(p.window_size(), Some(5));
        assert_eq!(resident(&p), during);
        assert!(during.iter().all(|&x| p.access(x).is_hit()));
        assert_eq!(p.len(), 50);
    }

    #[test]
    fn a_switching_cache_reports_its_residency_truly() {
        let cap = 32;
        let mut p = DefaultPolicy::new(cap);
        let mut resident = std::collections::HashSet::new();
        testkit::check_residency_from(&mut p, &tables_in_turn(cap), &mut resident);
        assert_eq!(p.window_size(), None, "ARC after the tables");
        // Then a loop a little larger than the cache among frequent pages,
        // where small windows win.
        let t = testkit::zipf(0.9, 2000, 200_000, 5);
        testkit::check_residency_from(&mut p, &t, &mut resident);
        assert!(p.window_size().is_some(), "W-TinyLFU again");
    }

    #[test]
    fn a_full_window_is_lru() {
        let config = Config {
            window: 1.0,
            ..untuned()
        };
        let mut p = DefaultPolicy::with_config(3, &config);
        let mut lru = super::super::lru::Lru::new(3);
        for i in 0..2000u64 {
            let page = (i * i + i / 3) % 7;
            assert_eq!(p.access(page), lru.access(page), "access {i}");
        }
    }
}
