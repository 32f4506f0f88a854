//! ARC, the Adaptive Replacement Cache (N. Megiddo and D. S. Modha, "ARC: A
//! Self-Tuning, Low Overhead Replacement Cache", FAST 2003), as the paper's
//! pseudo-code (its Figure 4) has it.
//!
//! - Resident pages sit in two LRU lists: `T1` holds pages seen once
//!   recently, `T2` pages seen at least twice. A hit moves the page to the
//!   head of `T2` (case I).
//! - Two ghost lists remember the ids of pages that recently left: `B1`
//!   those that left `T1`, `B2` those that left `T2`. `|T1| + |B1| ≤ c` and
//!   `|T1| + |T2| + |B1| + |B2| ≤ 2c`.
//! - The target size `p` of `T1` adapts: a miss on a page in `B1` says `T1`
//!   was too small and raises `p` by `max(1, |B2| / |B1|)` (case II); one in
//!   `B2` lowers it by `max(1, |B1| / |B2|)` (case III). Both bring the page
//!   back into `T2`. `p` is real-valued, as in the paper (no rounding), and
//!   stays in `0..=c`.
//! - REPLACE frees a slot: it demotes the tail of `T1` to `B1` when `T1` is
//!   non-empty and longer than `p` (or exactly `p` long and the missing page
//!   is in `B2`), else the tail of `T2` to `B2`.
//! - A page seen for the first time (case IV) goes to the head of `T1`; when
//!   `L1 = T1 ∪ B1` already holds `c` pages, the tail of `B1` is forgotten
//!   (or, with `B1` empty, the tail of `T1` leaves without a ghost); when
//!   all four lists hold `2c`, the tail of `B2` is forgotten.
//!
//! Once the cache is full it stays full, and each miss evicts exactly one
//! page (REPLACE's demotion, or case IV's `T1` tail), which is the page the
//! [`Outcome`] reports; forgetting a ghost is not an eviction.
//!
//! O(1) per access: one hash map from page to a node of an intrusive list,
//! the four lists sharing one arena of at most `2c` nodes. `ArcCache` is
//! the same cache over an index its owner keeps instead of the hash map:
//! the default policy's tuner runs one over the slots of its sampled
//! pages, beside its W-TinyLFU copies.

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

const T1: u8 = 0;
const T2: u8 = 1;
const B1: u8 = 2;
const B2: u8 = 3;

/// The Adaptive Replacement Cache.
pub struct Arc(ArcCache<PageMap<u32>>);

/// Where an [`ArcCache`] finds the node of each page it knows, resident or
/// ghost: its own map, or an index its owner keeps (the default policy's
/// tuner keys its copies by slot).
pub(crate) trait Nodes: Send {
    fn find(&self, page: u64) -> Option<u32>;
    fn put(&mut self, page: u64, node: u32);
    fn forget(&mut self, page: u64);
}

impl Nodes for PageMap<u32> {
    #[inline]
    fn find(&self, page: u64) -> Option<u32> {
        self.get(&page).copied()
    }
    #[inline]
    fn put(&mut self, page: u64, node: u32) {
        self.insert(page, node);
    }
    #[inline]
    fn forget(&mut self, page: u64) {
        self.remove(&page);
    }
}

impl Arc {
    /// An empty cache of `capacity` pages (at least 1).
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        Self(ArcCache::with_nodes(
            capacity,
            page_map(capacity.saturating_mul(2)),
        ))
    }

    /// See [`ArcCache::with_resident`].
    pub(crate) fn with_resident(capacity: usize, recent: &[u64], frequent: &[u64]) -> Self {
        Self(ArcCache::with_resident(
            capacity,
            page_map(capacity.saturating_mul(2)),
            recent,
            frequent,
        ))
    }

    /// See [`ArcCache::resident`].
    pub(crate) fn resident(&self) -> (Vec<u64>, Vec<u64>) {
        self.0.resident()
    }

    /// The current target size of `T1`, in `0..=capacity`.
    pub fn target(&self) -> f64 {
        self.0.p
    }

    /// The lengths of `T1`, `T2`, `B1` and `B2`.
    pub fn list_lens(&self) -> [usize; 4] {
        self.0.lists.map(|l| l.len())
    }
}

impl Policy for Arc {
    fn name(&self) -> &'static str {
        "arc"
    }

    fn capacity(&self) -> usize {
        self.0.capacity
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        self.0.access(page)
    }
}

/// ARC over the page index `N`.
pub(crate) struct ArcCache<N> {
    capacity: usize,
    /// The target size of `T1`.
    p: f64,
    /// Page → node, for resident and ghost pages; the node's tag names its
    /// list.
    map: N,
    arena: Arena,
    /// `T1`, `T2`, `B1`, `B2`, most recent at the head.
    lists: [List; 4],
}

impl<N: Nodes> ArcCache<N> {
    /// An empty cache of `capacity` pages (at least 1) over `map`, which
    /// knows no page.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub(crate) fn with_nodes(capacity: usize, map: N) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self {
            capacity,
            p: 0.0,
            map,
            arena: Arena::with_capacity(capacity.saturating_mul(2)),
            lists: [List::default(); 4],
        }
    }

    /// A full or partly full cache of `capacity` pages that starts from a
    /// resident set another policy held: `recent` (seen once lately) in
    /// `T1`, `frequent` in `T2`, each least recent first; no ghosts, and
    /// `T1`'s target its length, so that ARC adapts from where it starts.
    ///
    /// # Panics
    /// If `capacity` is 0 or the pages do not fit.
    pub(crate) fn with_resident(capacity: usize, map: N, recent: &[u64], frequent: &[u64]) -> Self {
        assert!(
            recent.len() + frequent.len() <= capacity,
            "more pages than the capacity"
        );
        let mut a = Self::with_nodes(capacity, map);
        for (list, pages) in [(T1, recent), (T2, frequent)] {
            for &page in pages {
                let i = a.arena.alloc(page, list);
                a.lists[list as usize].push_front(&mut a.arena, i);
                a.map.put(page, i);
            }
        }
        a.p = recent.len() as f64;
        a
    }

    /// The resident pages: those of `T1` and those of `T2`, each least
    /// recent first.
    pub(crate) fn resident(&self) -> (Vec<u64>, Vec<u64>) {
        let pages = |list: u8| {
            let mut out = Vec::with_capacity(self.len_of(list));
            let mut i = self.lists[list as usize].back();
            while let Some(n) = i {
                out.push(self.arena.get(n).key);
                i = List::prev_of(&self.arena, n);
            }
            out
        };
        (pages(T1), pages(T2))
    }

    /// The index of pages.
    pub(crate) fn nodes_mut(&mut self) -> &mut N {
        &mut self.map
    }

    /// Resident pages.
    pub(crate) fn len(&self) -> usize {
        self.len_of(T1) + self.len_of(T2)
    }

    fn len_of(&self, list: u8) -> usize {
        self.lists[list as usize].len()
    }

    /// Moves node `i` from its list to the head of `to`.
    fn move_to(&mut self, i: u32, to: u8) {
        let from = self.arena.get(i).tag;
        self.lists[from as usize].remove(&mut self.arena, i);
        self.arena.get_mut(i).tag = to;
        self.lists[to as usize].push_front(&mut self.arena, i);
    }

    /// Unlinks the tail of `list`, forgets its page, and returns the page.
    fn drop_tail(&mut self, list: u8) -> u64 {
        let i = self.lists[list as usize]
            .pop_back(&mut self.arena)
            .expect("the list is not empty");
        let page = self.arena.get(i).key;
        self.map.forget(page);
        self.arena.release(i);
        page
    }

    /// The paper's REPLACE: demotes one resident page to its ghost list and
    /// returns it. `in_b2`: whether the missing page is in `B2`.
    fn replace(&mut self, in_b2: bool) -> u64 {
        let t1 = self.len_of(T1);
        let (from, to) = if t1 >= 1 && ((in_b2 && t1 as f64 == self.p) || t1 as f64 > self.p) {
            (T1, B1)
        } else {
            (T2, B2)
        };
        let i = self.lists[from as usize]
            .back()
            .expect("a full cache has a page to demote");
        self.move_to(i, to);
        self.arena.get(i).key
    }

    /// An access to `page`, as [`Policy::access`].
    pub(crate) fn access(&mut self, page: u64) -> Outcome {
        let c = self.capacity;
        if let Some(i) = self.map.find(page) {
            let evicted = match self.arena.get(i).tag {
                // Case I: a hit.
                T1 | T2 => {
                    self.move_to(i, T2);
                    return Outcome::Hit;
                }
                // Case II: `T1` was too small.
                B1 => {
                    let (b1, b2) = (self.len_of(B1), self.len_of(B2));
                    let delta = if b1 >= b2 { 1.0 } else { b2 as f64 / b1 as f64 };
                    self.p = (self.p + delta).min(c as f64);
                    self.replace(false)
                }
                // Case III: `T2` was too small.
                _ => {
                    let (b1, b2) = (self.len_of(B1), self.len_of(B2));
                    let delta = if b2 >= b1 { 1.0 } else { b1 as f64 / b2 as f64 };
                    self.p = (self.p - delta).max(0.0);
                    self.replace(true)
                }
            };
            self.move_to(i, T2);
            return Outcome::Miss {
                evicted: Some(evicted),
            };
        }
        // Case IV: not in any list.
        let l1 = self.len_of(T1) + self.len_of(B1);
        let total = l1 + self.len_of(T2) + self.len_of(B2);
        let evicted = if l1 == c {
            if self.len_of(T1) < c {
                self.drop_tail(B1);
                Some(self.replace(false))
            } else {
                Some(self.drop_tail(T1))
            }
        } else if total >= c {
            if total == 2 * c {
                self.drop_tail(B2);
            }
            Some(self.replace(false))
        } else {
            None
        };
        let i = self.arena.alloc(page, T1);
        self.lists[T1 as usize].push_front(&mut self.arena, i);
        self.map.put(page, i);
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, miss};
    use super::*;

    /// A cache of 3 pages, traced by hand from the paper's pseudo-code.
    /// Lists are written most recent first.
    #[test]
    fn follows_the_papers_cases_by_hand() {
        let mut p = Arc::new(3);
        let steps: [(u64, Outcome, f64, [usize; 4]); 10] = [
            // Case IV, cache not full: T1 = [1].
            (1, miss(None), 0.0, [1, 0, 0, 0]),
            (2, miss(None), 0.0, [2, 0, 0, 0]),
            (3, miss(None), 0.0, [3, 0, 0, 0]),
            // Case I: T1 = [3, 2], T2 = [1].
            (1, Outcome::Hit, 0.0, [2, 1, 0, 0]),
            // Case IV-B: |L1| = 2 < 3, total 3 ≥ 3; REPLACE with |T1| = 2
            // > p = 0 demotes T1's tail 2 to B1.
            (4, miss(Some(2)), 0.0, [2, 1, 1, 0]),
            // Case IV-A: |L1| = |T1| + |B1| = 3 = c with |T1| < c: forget
            // B1's tail 2, then REPLACE demotes T1's tail 3 to B1.
            (5, miss(Some(3)), 0.0, [2, 1, 1, 0]),
            // Case II: 3 is in B1; |B1| = 1 ≥ |B2| = 0 so p rises by 1 to 1.
            // REPLACE: |T1| = 2 > 1 demotes T1's tail 4. 3 joins T2 =
            // [3, 1]; T1 = [5], B1 = [4].
            (3, miss(Some(4)), 1.0, [1, 2, 1, 0]),
            // Case IV-B: REPLACE with |T1| = 1 = p (not above it, and 6 is
            // not in B2) takes T2's tail 1 to B2. With p still 0 it would
            // have taken 5 from T1: the ghost hit made T1 keep a page.
            (6, miss(Some(1)), 1.0, [2, 1, 1, 1]),
            // Case III: 1 is in B2; |B2| = 1 ≥ |B1| = 1 so p falls by 1 to
            // 0. REPLACE: |T1| = 2 > 0 demotes T1's tail 5 to B1; 1 joins
            // T2 = [1, 3]; T1 = [6], B1 = [5, 4], B2 = [].
            (1, miss(Some(5)), 0.0, [1, 2, 2, 0]),
            // Case II: 4 in B1, |B1| = 2 ≥ |B2| = 0: p = 1. REPLACE: |T1| =
            // 1 = p takes T2's tail 3 to B2; T2 = [4, 1], B1 = [5].
            (4, miss(Some(3)), 1.0, [1, 2, 1, 1]),
        ];
        for (n, (page, outcome, target, lens)) in steps.into_iter().enumerate() {
            assert_eq!(p.access(page), outcome, "step {n}: page {page}");
            assert_eq!(p.target(), target, "step {n}");
            assert_eq!(p.list_lens(), lens, "step {n}");
        }
    }

    /// A cache of 5 pages where the ghost lists' ratio moves `p` by a
    /// fraction: δ = |B2| / |B1| = 3 / 2 on a hit in `B1`, and δ = |B1| /
    /// |B2| = 3 / 2 on a hit in `B2`; REPLACE then compares |T1| with the
    /// real-valued p. Traced by hand; lists most recent first.
    #[test]
    fn moves_the_target_by_the_ghost_lists_ratio() {
        let mut p = Arc::new(5);
        for page in 1..=5 {
            assert_eq!(p.access(page), miss(None));
        }
        // T2 = [5, 4, 3, 2, 1].
        for page in 1..=5 {
            assert_eq!(p.access(page), Outcome::Hit);
        }
        let steps: [(u64, Outcome, f64, [usize; 4]); 12] = [
            // Case IV-B with T1 empty: REPLACE takes T2's tail 1 to B2.
            (6, miss(Some(1)), 0.0, [1, 4, 0, 1]),
            (6, Outcome::Hit, 0.0, [0, 5, 0, 1]),
            (7, miss(Some(2)), 0.0, [1, 4, 0, 2]),
            (7, Outcome::Hit, 0.0, [0, 5, 0, 2]),
            // B2 = [3, 2, 1]; T1 = [8], T2 = [7, 6, 5, 4].
            (8, miss(Some(3)), 0.0, [1, 4, 0, 3]),
            // |T1| = 1 > p = 0: T1's tail goes to B1, twice: B1 = [9, 8].
            (9, miss(Some(8)), 0.0, [1, 4, 1, 3]),
            (10, miss(Some(9)), 0.0, [1, 4, 2, 3]),
            // Case II with |B1| = 2 < |B2| = 3: p rises by 3/2. REPLACE:
            // |T1| = 1 is not above 1.5, so T2's tail 4 goes to B2.
            (8, miss(Some(4)), 1.5, [1, 4, 1, 4]),
            // Case IV-B at 2c: forget B2's tail 1; |T1| = 1 < 1.5: T2's
            // tail 5 to B2. T1 = [11, 10], T2 = [8, 7, 6].
            (11, miss(Some(5)), 1.5, [2, 3, 1, 4]),
            // Forget B2's tail 2; now |T1| = 2 > 1.5: T1's tail 10 to B1.
            // B1 = [10, 9], B2 = [5, 4, 3].
            (12, miss(Some(10)), 1.5, [2, 3, 2, 3]),
            // Case III with |B2| = 3 ≥ |B1| = 2: p falls by 1 to 0.5;
            // |T1| = 2 > 0.5: T1's tail 11 to B1; 3 joins T2.
            (3, miss(Some(11)), 0.5, [1, 4, 3, 2]),
            // Case III with |B1| = 3 > |B2| = 2: p would fall by 3/2 and
            // stops at 0; |T1| = 1 > 0: 12 to B1; 4 joins T2.
            (4, miss(Some(12)), 0.0, [0, 5, 4, 1]),
        ];
        for (n, (page, outcome, target, lens)) in steps.into_iter().enumerate() {
            assert_eq!(p.access(page), outcome, "step {n}: page {page}");
            assert_eq!(p.target(), target, "step {n}");
            assert_eq!(p.list_lens(), lens, "step {n}");
        }
    }

    #[test]
    fn residency_matches_the_reported_evictions() {
        testkit::check_residency_at_many_capacities(|c| Box::new(Arc::new(c)));
    }

    #[test]
    fn capacity_one_keeps_the_last_page() {
        let mut p = Arc::new(1);
        assert_eq!(p.access(1), miss(None));
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.access(2), miss(Some(1)));
        assert_eq!(p.access(2), Outcome::Hit);
        assert_eq!(p.access(1), miss(Some(2)));
        assert_eq!(p.len(), 1);
    }

    /// On a loop of c + 1 pages no page is seen twice while resident, so
    /// everything stays in T1 and case IV-A evicts T1's tail as LRU would:
    /// every access misses, evicting the page accessed next.
    #[test]
    fn a_loop_one_page_too_long_always_misses() {
        testkit::check_loop_always_misses(|c| Box::new(Arc::new(c)));
    }

    #[test]
    fn misses_no_more_than_lru_on_zipf() {
        for (arc, lru) in testkit::zipf_misses_vs_lru(|c| Box::new(Arc::new(c))) {
            assert!(arc <= lru, "arc {arc} lru {lru}");
        }
    }
}
