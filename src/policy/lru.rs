//! LRU, the Unified-Memory-like baseline: fault-driven, and evicting the
//! least recently used *group* of pages.
//!
//! CUDA Unified Memory migrates on a fault and evicts whole 2 MiB chunks, so
//! the baseline's unit of residency is a group of `group_pages` consecutive
//! pages (2 MiB / page size; one page in plain trace replay). A miss on any
//! page of a group loads the group, which takes `group_pages` of the
//! capacity; the group is the unit of eviction; a later access to another
//! page of a resident group is a hit. Recency is updated on every access the
//! policy sees (the UVM driver sees only faults, which makes its order closer
//! to FIFO; strata's access counters make hits visible, so the baseline is
//! the stronger, true LRU).
//!
//! O(1) per access: a hash map from group to a node of an intrusive list.

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

/// Least recently used groups of pages.
pub struct Lru {
    capacity: usize,
    group_pages: u64,
    /// How many groups fit.
    slots: usize,
    map: PageMap<u32>,
    arena: Arena,
    list: List,
}

impl Lru {
    /// LRU over single pages: `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        Self::with_group(capacity, 1)
    }

    /// LRU over groups of `group_pages` pages (page ids `g * group_pages ..
    /// (g + 1) * group_pages` form group `g`) in a cache of `capacity` pages,
    /// which holds `capacity / group_pages` groups.
    ///
    /// # Panics
    /// If `group_pages` is 0 or larger than `capacity`.
    pub fn with_group(capacity: usize, group_pages: u64) -> Self {
        assert!(
            group_pages >= 1 && group_pages <= capacity as u64,
            "a group of {group_pages} pages does not fit a cache of {capacity}"
        );
        let slots = capacity / group_pages as usize;
        Self {
            capacity,
            group_pages,
            slots,
            map: page_map(slots),
            arena: Arena::with_capacity(slots),
            list: List::default(),
        }
    }

    /// Pages per group.
    pub fn group_pages(&self) -> u64 {
        self.group_pages
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.list.len() * self.group_pages as usize
    }

    fn access(&mut self, page: u64) -> Outcome {
        let group = page / self.group_pages;
        if let Some(&i) = self.map.get(&group) {
            self.list.move_to_front(&mut self.arena, i);
            return Outcome::Hit;
        }
        let evicted = if self.list.len() == self.slots {
            let victim = self
                .list
                .pop_back(&mut self.arena)
                .expect("a full cache has a tail");
            let g = self.arena.get(victim).key;
            self.map.remove(&g);
            self.arena.release(victim);
            Some(g * self.group_pages)
        } else {
            None
        };
        let i = self.arena.alloc(group, 0);
        self.list.push_front(&mut self.arena, i);
        self.map.insert(group, i);
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used() {
        let mut p = Lru::new(2);
        assert_eq!(p.access(1), Outcome::Miss { evicted: None });
        assert_eq!(p.access(2), Outcome::Miss { evicted: None });
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.access(3), Outcome::Miss { evicted: Some(2) });
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn groups_load_and_leave_together() {
        // 8 pages hold two groups of 4.
        let mut p = Lru::with_group(8, 4);
        assert!(!p.access(1).is_hit());
        assert!(p.access(3).is_hit(), "same group as page 1");
        assert!(!p.access(4).is_hit());
        assert_eq!(p.len(), 8);
        assert_eq!(p.access(9), Outcome::Miss { evicted: Some(0) });
        assert!(!p.access(2).is_hit());
    }
}
