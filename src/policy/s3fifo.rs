//! S3-FIFO (J. Yang, Y. Zhang, Z. Qiu, Y. Yue and K. V. Rashmi, "FIFO
//! queues are all you need for cache eviction", SOSP 2023): three FIFO
//! queues and a 2-bit access counter per page.
//!
//! - A *small* FIFO takes 10% of the capacity (at least one page), a *main*
//!   FIFO the rest, and a *ghost* FIFO remembers the ids (no data) of as
//!   many pages as main holds.
//! - A hit adds one to the page's counter, capped at 3; nothing moves.
//! - A missing page goes to the head of small, unless its id is in the
//!   ghost: then the id leaves the ghost and the page goes straight to main.
//!   The ghost is looked up before making room, as the authors' reference
//!   implementation (libCacheSim's `S3FIFO.c`) does, so the eviction that
//!   follows cannot push the id out first.
//! - Making room: while small holds at least its 10%, its tail is judged:
//!   with a counter above 1 it moves to main's head with the counter
//!   cleared, and the next tail is judged; otherwise it leaves the cache and
//!   its id enters the ghost (the ghost's oldest id is forgotten when full).
//!   With small below its share, main evicts by FIFO-reinsertion: a tail
//!   with a counter above 0 goes back to the head with the counter less one,
//!   the first tail at 0 leaves (no ghost).
//!
//! The threshold "above 1" to move from small to main follows the authors'
//! code: the SOSP'23 artifact (Thesys-lab/sosp23-s3fifo, libCacheSim
//! `cache/eviction/S3FIFO.c`) and current libCacheSim (`S3FIFO.c`,
//! `S3FIFOv0.c`) all default to `move-to-main-threshold=2` and move when
//! `freq >= 2`, with `freq` counting hits since the page entered small. The
//! authors' description ("moved to M if it is accessed more than once")
//! reads the same when the miss that brought the page in is not counted.
//! A page hit once in small is thus still treated as a one-hit wonder;
//! some other implementations (a CacheLib pull request, #418, for one)
//! move on any hit. Clearing the counter on the move follows the same
//! description ("its access bits are cleared during the move"); libCacheSim
//! creates the page afresh in main.
//!
//! One eviction per miss. Small gives up pages while it holds at least its
//! share: a page moving from small to main leaves small below it, and the
//! page that leaves the cache then comes from main. The paper and
//! libCacheSim instead keep draining small until a page goes to the ghost
//! queue, main running over its 90% until later misses catch up; the two
//! differ by under 0.02% of the misses on shifting and looping traces
//! (compared with an implementation of the authors' loop). The cache never
//! holds more than its capacity, and [`Outcome::Miss`] names the one page
//! that left.
//!
//! Before the cache first fills, every new page goes to small, which may
//! then hold more than its share, as in the SOSP version (libCacheSim's
//! `S3FIFOv0.c`); its later `S3FIFO.c` sends them to main once small is
//! full.
//!
//! O(1) amortized per access: one hash map from page to a node of an
//! intrusive list, the three queues sharing one arena. A move to main
//! happens at most once per stay in the cache, and each reinsertion in main
//! spends one unit of a counter that a hit paid for.

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

/// Queue tags (the low two bits of a node's tag); the counter is in bits
/// 2 and 3.
const SMALL: u8 = 0;
const MAIN: u8 = 1;
const GHOST: u8 = 2;
const QUEUE: u8 = 0b11;
const FREQ_SHIFT: u8 = 2;
/// The counter's cap.
pub const MAX_FREQ: u8 = 3;
/// A page leaves small for main when its counter is above this.
pub const MOVE_ABOVE: u8 = 1;

/// S3-FIFO: small, main and ghost FIFO queues.
pub struct S3Fifo {
    capacity: usize,
    small_max: usize,
    ghost_max: usize,
    /// Page → node, for resident and ghost pages.
    map: PageMap<u32>,
    arena: Arena,
    small: List,
    main: List,
    ghost: List,
}

impl S3Fifo {
    /// An empty cache of `capacity` pages: small holds 10% of it (at least
    /// one page), main the rest; the ghost remembers as many ids as main's
    /// share.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        let small_max = (capacity / 10).max(1);
        let ghost_max = capacity - small_max;
        let nodes = capacity + ghost_max + 1;
        Self {
            capacity,
            small_max,
            ghost_max,
            map: page_map(nodes),
            arena: Arena::with_capacity(nodes),
            small: List::default(),
            main: List::default(),
            ghost: List::default(),
        }
    }

    /// How many pages small holds before it evicts (10% of the capacity).
    pub fn small_share(&self) -> usize {
        self.small_max
    }

    /// How many ids the ghost remembers.
    pub fn ghost_capacity(&self) -> usize {
        self.ghost_max
    }

    /// The lengths of small, main and the ghost.
    pub fn queue_lens(&self) -> [usize; 3] {
        [self.small.len(), self.main.len(), self.ghost.len()]
    }

    fn freq(&self, i: u32) -> u8 {
        self.arena.get(i).tag >> FREQ_SHIFT
    }

    fn set(&mut self, i: u32, queue: u8, freq: u8) {
        self.arena.get_mut(i).tag = queue | (freq << FREQ_SHIFT);
    }

    /// Makes room for one page; returns the page that left the cache.
    fn evict(&mut self) -> u64 {
        loop {
            if self.small.len() >= self.small_max {
                let t = self.small.pop_back(&mut self.arena).expect("non-empty");
                if self.freq(t) > MOVE_ABOVE {
                    self.set(t, MAIN, 0);
                    self.main.push_front(&mut self.arena, t);
                    continue;
                }
                let page = self.arena.get(t).key;
                self.set(t, GHOST, 0);
                self.ghost.push_front(&mut self.arena, t);
                if self.ghost.len() > self.ghost_max {
                    let g = self.ghost.pop_back(&mut self.arena).expect("non-empty");
                    let forgotten = self.arena.get(g).key;
                    self.map.remove(&forgotten);
                    self.arena.release(g);
                }
                return page;
            }
            // Small is below its share, so main holds the rest of a full
            // cache: at least one page.
            let t = self
                .main
                .pop_back(&mut self.arena)
                .expect("main is not empty");
            let f = self.freq(t);
            if f > 0 {
                self.set(t, MAIN, f - 1);
                self.main.push_front(&mut self.arena, t);
                continue;
            }
            let page = self.arena.get(t).key;
            self.map.remove(&page);
            self.arena.release(t);
            return page;
        }
    }

    /// Which queue holds `page`: "small", "main", "ghost" or none.
    #[cfg(test)]
    fn queue_of(&self, page: u64) -> Option<&'static str> {
        let &i = self.map.get(&page)?;
        Some(match self.arena.get(i).tag & QUEUE {
            SMALL => "small",
            MAIN => "main",
            _ => "ghost",
        })
    }
}

impl Policy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        let ghost = match self.map.get(&page) {
            Some(&i) => {
                let tag = self.arena.get(i).tag;
                let queue = tag & QUEUE;
                if queue != GHOST {
                    let f = (self.freq(i) + 1).min(MAX_FREQ);
                    self.set(i, queue, f);
                    return Outcome::Hit;
                }
                // The id leaves the ghost now; its node is reused for the
                // page in main.
                self.ghost.remove(&mut self.arena, i);
                Some(i)
            }
            None => None,
        };
        let evicted = (self.len() == self.capacity).then(|| self.evict());
        match ghost {
            Some(i) => {
                self.set(i, MAIN, 0);
                self.main.push_front(&mut self.arena, i);
            }
            None => {
                let i = self.arena.alloc(page, SMALL);
                self.small.push_front(&mut self.arena, i);
                self.map.insert(page, i);
            }
        }
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, miss};
    use super::*;

    #[test]
    fn shares_of_the_capacity() {
        for (cap, small, ghost) in [(1, 1, 0), (2, 1, 1), (10, 1, 9), (19, 1, 18), (100, 10, 90)] {
            let p = S3Fifo::new(cap);
            assert_eq!(
                (p.small_share(), p.ghost_capacity()),
                (small, ghost),
                "cap {cap}"
            );
        }
    }

    /// A cache of 2 pages (small 1, main 1, ghost 1 id), traced by hand.
    /// Queues are written head (newest) first.
    #[test]
    fn moves_filters_and_reinserts_by_hand() {
        let mut p = S3Fifo::new(2);
        let steps: [(u64, Outcome, [usize; 3]); 13] = [
            // Before the cache fills, both go to small: S = [2, 1].
            (1, miss(None), [1, 0, 0]),
            (2, miss(None), [2, 0, 0]),
            // Page 1's counter reaches 2.
            (1, Outcome::Hit, [2, 0, 0]),
            (1, Outcome::Hit, [2, 0, 0]),
            // Full. Small's tail 1 has counter 2 > 1: it moves to main
            // (counter cleared). The next tail, 2, was never hit: a one-hit
            // wonder, it leaves and its id enters the ghost. S = [3],
            // M = [1], G = [2].
            (3, miss(Some(2)), [1, 1, 1]),
            // In main: counter 1.
            (1, Outcome::Hit, [1, 1, 1]),
            // 2 is in the ghost: it goes straight to main. Room is made in
            // small (1 page, at its share): 3 (counter 0) leaves for the
            // ghost. S = [], M = [2, 1], G = [3].
            (2, miss(Some(3)), [0, 2, 1]),
            // Not in the ghost. Small is below its share, so main evicts:
            // tail 1 has counter 1, goes back to the head with 0; tail 2
            // has 0 and leaves. S = [4], M = [1].
            (4, miss(Some(2)), [1, 1, 1]),
            (1, Outcome::Hit, [1, 1, 1]),
            // 3 is in the ghost: to main; small's 4 leaves for the ghost.
            // M = [3, 1], G = [4].
            (3, miss(Some(4)), [0, 2, 1]),
            // Main evicts: 1 reinserted (counter 1 → 0), then 3 leaves,
            // with no ghost entry. S = [5], M = [1].
            (5, miss(Some(3)), [1, 1, 1]),
            // 3 left from main, so it is new again: it goes to small; 5
            // leaves small for the ghost, which forgets 4 (one id).
            (3, miss(Some(5)), [1, 1, 1]),
            // 4 was forgotten: to small again; 3 leaves for the ghost.
            (4, miss(Some(3)), [1, 1, 1]),
        ];
        for (n, (page, outcome, lens)) in steps.into_iter().enumerate() {
            assert_eq!(p.access(page), outcome, "step {n}: page {page}");
            assert_eq!(p.queue_lens(), lens, "step {n}");
        }
        assert_eq!(p.queue_of(1), Some("main"));
        assert_eq!(p.queue_of(4), Some("small"));
        assert_eq!(p.queue_of(3), Some("ghost"));
        assert_eq!(p.queue_of(5), None);
    }

    /// One hit in small is not enough to reach main (counter 1 is not above
    /// 1); the page goes to the ghost, and its next access is a miss that
    /// puts it straight into main.
    #[test]
    fn a_page_hit_once_in_small_goes_to_the_ghost() {
        let mut p = S3Fifo::new(10);
        for page in 1..=10 {
            assert_eq!(p.access(page), miss(None));
        }
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.access(2), Outcome::Hit);
        assert_eq!(p.access(2), Outcome::Hit);
        // Small's tail 1 has counter 1: out to the ghost.
        assert_eq!(p.access(11), miss(Some(1)));
        assert_eq!(p.queue_of(1), Some("ghost"));
        // Small's tail is now 2 with counter 2: it moves to main; 3 (never
        // hit) leaves for the ghost.
        assert_eq!(p.access(12), miss(Some(3)));
        assert_eq!(p.queue_of(2), Some("main"));
        // 1 comes back: straight into main, while small's tail 4 leaves.
        assert_eq!(p.access(1), miss(Some(4)));
        assert_eq!(p.queue_of(1), Some("main"));
        assert_eq!(p.queue_lens(), [8, 2, 2]);
    }

    #[test]
    fn residency_matches_the_reported_evictions() {
        testkit::check_residency_at_many_capacities(|c| Box::new(S3Fifo::new(c)));
    }

    #[test]
    fn capacity_one_works() {
        let mut p = S3Fifo::new(1);
        assert_eq!(p.access(1), miss(None));
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.access(1), Outcome::Hit);
        // 1 (counter 2) moves to main, small is empty, main evicts it.
        assert_eq!(p.access(2), miss(Some(1)));
        assert_eq!(p.access(2), Outcome::Hit);
        assert_eq!(p.access(3), miss(Some(2)));
        assert_eq!(p.len(), 1);
        // The ghost holds no ids at capacity 1.
        assert_eq!(p.queue_lens(), [1, 0, 0]);
    }

    /// A loop of c + 1 pages with a small queue of one page (c < 20),
    /// traced by hand at c = 10 (main 9, ghost 9) and the same at every
    /// such c. Pass 1 fills small (the cache was not full), then c evicts 0
    /// to the ghost. In pass 2 every page is a ghost hit and enters main
    /// while small's tail (1, 2, ..., c in turn) leaves for the ghost; the
    /// last, c, finds small empty and main evicts its oldest page, 0. From
    /// pass 3 on main keeps c - 1 of the c + 1 pages (each hit once per
    /// pass, so each survives main's reinsertion) and 0 and 1 alternate
    /// through small, the ghost and main: 2 misses per pass where LRU, ARC
    /// and SIEVE miss every access.
    #[test]
    fn a_loop_one_page_too_long_settles_to_two_misses_per_pass() {
        for cap in 2..20 {
            let n = cap as u64 + 1;
            let t = testkit::cyclic(cap, 8);
            let mut p = S3Fifo::new(cap);
            let o = testkit::outcomes(&mut p, &t);
            let pass = |k: usize| &o[k * (cap + 1)..(k + 1) * (cap + 1)];
            let mut first: Vec<Outcome> = (0..cap).map(|_| miss(None)).collect();
            first.push(miss(Some(0)));
            assert_eq!(pass(0), first, "cap {cap}");
            let second: Vec<Outcome> = (1..=n).map(|e| miss(Some(e % n))).collect();
            assert_eq!(pass(1), second, "cap {cap}");
            // From pass 3 on, 0 and 1 miss and evict each other's way: in
            // pass 3, 0 was evicted from main, so it is new and goes to small
            // while main evicts its oldest, 1; 1 then pushes 0 from small to
            // the ghost. In pass 4, 0 comes back from the ghost into main and
            // pushes 1 from small to the ghost; 1 comes back into main, which
            // reinserts 2..=c (each hit once) and evicts 0. Pass 5 is pass 3
            // again.
            let mut steady = vec![miss(Some(1)), miss(Some(0))];
            steady.extend((2..=cap).map(|_| Outcome::Hit));
            for k in 2..8 {
                assert_eq!(pass(k), steady, "cap {cap} pass {k}");
            }
        }
    }

    /// With a larger small queue the pages cycling through small and the
    /// ghost interact over several passes and the misses per pass vary
    /// (measured, not derived: 2 to 13 per pass of 101 at c = 100, 2 to 103
    /// per pass of 1001 at c = 1000). What holds is that main keeps most of
    /// the loop: fewer than a tenth of the accesses miss after two passes.
    #[test]
    fn a_long_loop_mostly_stays_in_main() {
        for cap in [100, 1000] {
            let t = testkit::cyclic(cap, 30);
            let mut p = S3Fifo::new(cap);
            let warm = 2 * (cap + 1);
            testkit::outcomes(&mut p, &t[..warm]);
            let misses = testkit::misses(&mut p, &t[warm..]);
            assert!(misses * 10 < t.len() - warm, "cap {cap}: {misses} misses");
        }
    }

    #[test]
    fn misses_no_more_than_lru_on_zipf() {
        for (s3, lru) in testkit::zipf_misses_vs_lru(|c| Box::new(S3Fifo::new(c))) {
            assert!(s3 <= lru, "s3fifo {s3} lru {lru}");
        }
    }
}
