//! SIEVE (Y. Zhang, J. Yang, Y. Yue, Y. Vigfusson and K. V. Rashmi, "SIEVE
//! is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for Web
//! Caches", NSDI 2024): one FIFO queue, a visited bit per page and a moving
//! hand.
//!
//! - A new page goes to the head of the queue, unvisited.
//! - A hit sets the page's visited bit; nothing moves.
//! - To make room, the hand (starting at the tail the first time, and
//!   whenever it has run off the head) walks from the tail towards the
//!   head: a visited page has its bit cleared and stays where it is; the
//!   first unvisited page is evicted, and the hand stays at the position
//!   after it (towards the head). A hand that passes the head wraps to the
//!   tail.
//!
//! Unlike CLOCK (FIFO-reinsertion), a retained page keeps its place, so
//! pages that survived a pass sit behind (towards the tail of) the pages
//! inserted since, and the hand sifts new pages quickly. Same as the
//! paper's pseudo-code and libCacheSim's `Sieve.c`.
//!
//! O(1) amortized per access: a hash map from page to a node of an
//! intrusive list; each step of the hand past a visited page clears a bit
//! that a hit set.

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

const VISITED: u8 = 1;

/// SIEVE: a FIFO queue sifted by a hand.
pub struct Sieve {
    capacity: usize,
    map: PageMap<u32>,
    arena: Arena,
    /// Newest at the head.
    queue: List,
    /// The next page the hand examines; `None`: start at the tail.
    hand: Option<u32>,
}

impl Sieve {
    /// An empty cache of `capacity` pages.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self {
            capacity,
            map: page_map(capacity),
            arena: Arena::with_capacity(capacity),
            queue: List::default(),
            hand: None,
        }
    }

    /// The page the hand examines next, `None` when it starts at the tail.
    pub fn hand(&self) -> Option<u64> {
        self.hand.map(|i| self.arena.get(i).key)
    }

    /// Evicts the first unvisited page from the hand on; returns it.
    fn evict(&mut self) -> u64 {
        let tail = self.queue.back().expect("a full cache has a tail");
        let mut o = self.hand.unwrap_or(tail);
        while self.arena.get(o).tag == VISITED {
            self.arena.get_mut(o).tag = 0;
            o = List::prev_of(&self.arena, o).unwrap_or(tail);
        }
        self.hand = List::prev_of(&self.arena, o);
        self.queue.remove(&mut self.arena, o);
        let page = self.arena.get(o).key;
        self.map.remove(&page);
        self.arena.release(o);
        page
    }

    /// Pages from head to tail, each with its visited bit.
    #[cfg(test)]
    fn pages(&self) -> Vec<(u64, bool)> {
        let mut v = Vec::new();
        let mut i = self.queue.front();
        while let Some(n) = i {
            let node = self.arena.get(n);
            v.push((node.key, node.tag == VISITED));
            i = List::next_of(&self.arena, n);
        }
        v
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        if let Some(&i) = self.map.get(&page) {
            self.arena.get_mut(i).tag = VISITED;
            return Outcome::Hit;
        }
        let evicted = (self.queue.len() == self.capacity).then(|| self.evict());
        let i = self.arena.alloc(page, 0);
        self.queue.push_front(&mut self.arena, i);
        self.map.insert(page, i);
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, miss};
    use super::*;

    /// A cache of 3 pages, traced by hand: the hand's first pass clears
    /// every bit and wraps, a retained page keeps its place, and a hand
    /// that evicts the head runs off it and restarts at the tail. Queues
    /// head (newest) first, `*` marking visited pages.
    #[test]
    fn sifts_by_hand() {
        let mut p = Sieve::new(3);
        let steps: [(u64, Outcome, Option<u64>); 14] = [
            (1, miss(None), None),
            (2, miss(None), None),
            (3, miss(None), None),
            // 3* 2* 1*
            (1, Outcome::Hit, None),
            (2, Outcome::Hit, None),
            (3, Outcome::Hit, None),
            // The hand starts at the tail: clears 1, 2, 3, runs off the head,
            // wraps to the tail and evicts 1 (unvisited now). It stays at 2.
            // 4 3 2
            (4, miss(Some(1)), Some(2)),
            // 2 is unvisited: evicted; the hand moves on to 3. 5 4 3
            (5, miss(Some(2)), Some(3)),
            // 5 4* 3*
            (3, Outcome::Hit, Some(3)),
            (4, Outcome::Hit, Some(3)),
            // Clears 3 and 4, evicts 5, the head: the hand runs off it.
            // 6 4 3
            (6, miss(Some(5)), None),
            // From the tail: 3 is unvisited. The hand moves to 4. 7 6 4
            (7, miss(Some(3)), Some(4)),
            // 7 6 4*
            (4, Outcome::Hit, Some(4)),
            // Clears 4, evicts 6, which was newer: 4 stays behind 7. 8 7 4
            (8, miss(Some(6)), Some(7)),
        ];
        for (n, (page, outcome, hand)) in steps.into_iter().enumerate() {
            assert_eq!(p.access(page), outcome, "step {n}: page {page}");
            assert_eq!(p.hand(), hand, "step {n}");
        }
        assert_eq!(p.pages(), [(8, false), (7, false), (4, false)]);
    }

    #[test]
    fn residency_matches_the_reported_evictions() {
        testkit::check_residency_at_many_capacities(|c| Box::new(Sieve::new(c)));
    }

    #[test]
    fn capacity_one_works() {
        let mut p = Sieve::new(1);
        assert_eq!(p.access(1), miss(None));
        assert_eq!(p.access(1), Outcome::Hit);
        // The hand clears 1, wraps onto it again and evicts it.
        assert_eq!(p.access(2), miss(Some(1)));
        assert_eq!(p.hand(), None);
        assert_eq!(p.access(3), miss(Some(2)));
        assert_eq!(p.len(), 1);
    }

    /// On a loop of c + 1 pages nothing is hit while resident, so no bit is
    /// ever set and SIEVE is FIFO: every access misses, evicting the page
    /// accessed next.
    #[test]
    fn a_loop_one_page_too_long_always_misses() {
        testkit::check_loop_always_misses(|c| Box::new(Sieve::new(c)));
    }

    #[test]
    fn misses_no_more_than_lru_on_zipf() {
        for (sieve, lru) in testkit::zipf_misses_vs_lru(|c| Box::new(Sieve::new(c))) {
            assert!(sieve <= lru, "sieve {sieve} lru {lru}");
        }
    }
}
