//! Reuse-predicting admission, the GMT idea: not every page evicted from HBM
//! deserves DRAM. GMT (GPU-orchestrated memory tiering) sends a page evicted
//! from the GPU to host memory only when its predicted reuse distance says it
//! will be needed again while still there, and straight to the SSD otherwise.
//!
//! Model for one cache in front of one slower tier: the cache plays the part
//! of the tier that is worth a copy, and a page predicted not to be reused
//! soon is not admitted ([`Outcome::Bypass`]: served from the slower tier in
//! place). Concretely:
//! - every page remembers when it was last accessed and a predicted reuse
//!   distance, the mean of its observed reuse distances (in accesses) with
//!   the newest weighing half;
//! - "soon" is the cache's *horizon*: how long an unused page survives in it,
//!   measured as the running mean age (accesses since last use) of the pages
//!   it evicted;
//! - a miss is admitted while the cache has room, or when the page's
//!   predicted reuse distance is within the horizon or within the age of
//!   the least recently used resident page (a page has survived unused at
//!   least that long: without it, a cache that stopped admitting would
//!   stop evicting, and a horizon learned in an earlier phase would keep
//!   out every page of the next one for good); a page seen for the first
//!   time in a full cache has no prediction and is not admitted;
//! - resident pages are evicted least recently used first.
//!
//! A one-pass scan or a loop longer than the cache is therefore kept out
//! instead of flushing the cache, while pages reused within the cache's
//! lifetime get in on their second access. O(1) per access; the history of
//! predictions covers every page seen.

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

/// Reuse-distance admission in front of LRU.
pub struct Gmt {
    capacity: usize,
    now: u64,
    /// Mean age of evicted pages; infinite until the first eviction.
    horizon: f64,
    history: PageMap<History>,
    arena: Arena,
    lru: List,
}

#[derive(Clone, Copy)]
struct History {
    last: u64,
    /// Predicted reuse distance; infinite until a reuse is seen.
    predicted: f64,
    /// The node in `lru` while resident, else `NOT_RESIDENT`.
    node: u32,
}

const NOT_RESIDENT: u32 = u32::MAX;

/// Weight of the newest sample in the running means.
const NEWEST: f64 = 0.5;

impl Gmt {
    /// A cache of `capacity` pages.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self {
            capacity,
            now: 0,
            horizon: f64::INFINITY,
            history: page_map(capacity),
            arena: Arena::with_capacity(capacity),
            lru: List::default(),
        }
    }

    /// The current horizon, in accesses.
    pub fn horizon(&self) -> f64 {
        self.horizon
    }

    /// Accesses since the least recently used resident page's last use.
    fn tail_age(&self) -> f64 {
        self.lru.back().map_or(0.0, |node| {
            let page = self.arena.get(node).key;
            self.history
                .get(&page)
                .map_or(0.0, |h| (self.now - h.last) as f64)
        })
    }

    fn evict(&mut self) -> u64 {
        let node = self.lru.pop_back(&mut self.arena).expect("a full cache");
        let page = self.arena.get(node).key;
        self.arena.release(node);
        let h = self
            .history
            .get_mut(&page)
            .expect("resident pages have a history");
        h.node = NOT_RESIDENT;
        let age = (self.now - h.last) as f64;
        self.horizon = if self.horizon.is_finite() {
            self.horizon + NEWEST * (age - self.horizon)
        } else {
            age
        };
        page
    }
}

impl Policy for Gmt {
    fn name(&self) -> &'static str {
        "gmt"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.lru.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        self.now += 1;
        let now = self.now;
        let h = self.history.entry(page).or_insert(History {
            last: now,
            predicted: f64::INFINITY,
            node: NOT_RESIDENT,
        });
        if h.last != now {
            let d = (now - h.last) as f64;
            h.predicted = if h.predicted.is_finite() {
                h.predicted + NEWEST * (d - h.predicted)
            } else {
                d
            };
            h.last = now;
        }
        if h.node != NOT_RESIDENT {
            let node = h.node;
            self.lru.move_to_front(&mut self.arena, node);
            return Outcome::Hit;
        }
        let full = self.lru.len() == self.capacity;
        // A page with no observed reuse (infinite prediction) never gets in
        // a full cache, even while the horizon is still infinite.
        let predicted = h.predicted;
        if full
            && (predicted.is_infinite()
                || (predicted > self.horizon && predicted > self.tail_age()))
        {
            return Outcome::Bypass;
        }
        let evicted = full.then(|| self.evict());
        let node = self.arena.alloc(page, 0);
        self.lru.push_front(&mut self.arena, node);
        self.history.get_mut(&page).expect("just inserted").node = node;
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_loop_longer_than_the_cache_out() {
        let mut p = Gmt::new(4);
        let mut hits = 0;
        for round in 0..10 {
            for page in 0..8 {
                if p.access(page).is_hit() && round > 0 {
                    hits += 1;
                }
            }
        }
        // LRU would hit nothing; the optimum is 3 of 8 per round.
        assert!(hits >= 9 * 2, "{hits}");
    }

    #[test]
    fn a_horizon_from_an_earlier_phase_does_not_keep_the_next_out() {
        let mut p = Gmt::new(4);
        // A phase that teaches a short horizon ...
        for _ in 0..3 {
            for page in 0..4 {
                p.access(page);
            }
        }
        p.access(10);
        p.access(10);
        assert!(p.horizon() <= 5.0, "{}", p.horizon());
        // ... then one page reused every 9 accesses, the old ones idle.
        let mut hits = 0;
        for _ in 0..1000 {
            if p.access(50).is_hit() {
                hits += 1;
            }
            for _ in 0..8 {
                p.access(3);
            }
        }
        assert!(hits >= 990, "{hits} of 1000 (LRU: 999)");
    }

    #[test]
    fn a_one_pass_scan_does_not_flush_the_hot_pages() {
        let mut p = Gmt::new(4);
        for _ in 0..5 {
            for page in 0..4 {
                p.access(page);
            }
        }
        for page in 100..200 {
            assert_eq!(p.access(page), Outcome::Bypass);
        }
        assert!((0..4).all(|page| p.access(page).is_hit()));
    }
}
