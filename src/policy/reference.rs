//! Reference policies for comparison only (replay, not the runtime's
//! choice): perfect LFU, and perfect LFU with admission, as
//! `benches/strata-bench/tests/policy.rs` defines them.
//!
//! Perfect LFU counts every access to every page ever seen, resident or not
//! (no decay, no bound on that history); a miss in a full cache evicts the
//! resident page of the lowest count, the least recently used among
//! equals. With admission, a missing page replaces that victim only if its
//! count (this access included) is higher; otherwise it is not admitted
//! ([`Outcome::Bypass`]). O(log n) per access (an ordered set), and memory
//! for every distinct page of the trace: fine for replaying traces, not for
//! a balancer.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use super::base::{page_map, Outcome, PageMap, Policy};

/// Perfect LFU, optionally with admission.
pub struct PerfectLfu {
    capacity: usize,
    admission: bool,
    now: u64,
    /// Accesses of every page seen.
    count: PageMap<u64>,
    /// Resident page → (count, stamp) as filed in `order`.
    resident: PageMap<(u64, u64)>,
    /// (count, last use, page) of the resident pages.
    order: BTreeSet<(u64, u64, u64)>,
}

impl PerfectLfu {
    /// Perfect LFU for `capacity` pages; `admission` turns on the
    /// admission test.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize, admission: bool) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self {
            capacity,
            admission,
            now: 0,
            count: page_map(capacity),
            resident: page_map(capacity),
            order: BTreeSet::new(),
        }
    }
}

impl Policy for PerfectLfu {
    fn name(&self) -> &'static str {
        if self.admission {
            "lfu-admission"
        } else {
            "perfect-lfu"
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        self.now += 1;
        let c = {
            let c = self.count.entry(page).or_insert(0);
            *c += 1;
            *c
        };
        if let Some(e) = self.resident.get_mut(&page) {
            self.order.remove(&(e.0, e.1, page));
            *e = (c, self.now);
            self.order.insert((c, self.now, page));
            return Outcome::Hit;
        }
        let mut evicted = None;
        if self.resident.len() == self.capacity {
            let &(vc, vs, victim) = self.order.first().expect("a full cache has a page");
            if self.admission && c <= vc {
                return Outcome::Bypass;
            }
            self.order.remove(&(vc, vs, victim));
            self.resident.remove(&victim);
            evicted = Some(victim);
        }
        self.order.insert((c, self.now, page));
        self.resident.insert(page, (c, self.now));
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_counted_and_admits_only_the_more_frequent() {
        let mut p = PerfectLfu::new(2, false);
        for x in [1, 1, 2] {
            p.access(x);
        }
        assert_eq!(p.access(3), Outcome::Miss { evicted: Some(2) });
        // Page 2 remembers its count: 2 now, above page 3's 1.
        assert_eq!(p.access(2), Outcome::Miss { evicted: Some(3) });
        let mut a = PerfectLfu::new(2, true);
        for x in [1, 1, 2, 2] {
            a.access(x);
        }
        assert_eq!(a.access(3), Outcome::Bypass);
        assert_eq!(a.access(3), Outcome::Bypass);
        // Counted 3 now, above both; page 1 is the less recent of the two.
        assert_eq!(a.access(3), Outcome::Miss { evicted: Some(1) });
        assert_eq!(a.len(), 2);
    }
}
