//! Belady's MIN: the offline optimum every online policy is measured against.
//!
//! With the whole trace known, a miss in a full cache evicts the resident
//! page whose next use is farthest in the future — or, when the missing page
//! itself is used again later than every resident page, does not admit it
//! ([`Outcome::Bypass`]). Counting the demand miss either way, MIN with and
//! without bypass miss equally often, and that count is the minimum any
//! policy can reach (`benches/strata-bench/tests/policy.rs` checks it against exhaustive search).
//!
//! O(n log n): the next use of every position is computed once, and the
//! resident pages are a `BTreeSet` of their next-use positions (a page is
//! resident exactly when its pending next use is in the set).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use super::base::{next_uses, Outcome, Policy, NEVER};

/// Belady's MIN over a known trace. Its accesses must follow the trace.
pub struct Belady {
    capacity: usize,
    trace: Vec<u64>,
    next: Vec<usize>,
    pos: usize,
    /// Next-use keys of resident pages: a position, or `len + i` for a page
    /// last accessed at `i` and never again (unique, and after every real
    /// position).
    resident: BTreeSet<usize>,
}

impl Belady {
    /// MIN for a cache of `capacity` pages over `trace`.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize, trace: &[u64]) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self {
            capacity,
            next: next_uses(trace),
            trace: trace.to_vec(),
            pos: 0,
            resident: BTreeSet::new(),
        }
    }

    fn key(&self, i: usize) -> usize {
        match self.next[i] {
            NEVER => self.trace.len() + i,
            j => j,
        }
    }

    fn page_of(&self, key: usize) -> u64 {
        let n = self.trace.len();
        self.trace[if key >= n { key - n } else { key }]
    }
}

impl Policy for Belady {
    fn name(&self) -> &'static str {
        "belady"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    /// # Panics
    /// If `page` is not the next page of the trace.
    fn access(&mut self, page: u64) -> Outcome {
        let i = self.pos;
        assert!(
            self.trace.get(i) == Some(&page),
            "belady: access {i} to page {page} does not follow the trace"
        );
        self.pos += 1;
        let key = self.key(i);
        if self.resident.remove(&i) {
            self.resident.insert(key);
            return Outcome::Hit;
        }
        if self.resident.len() < self.capacity {
            self.resident.insert(key);
            return Outcome::Miss { evicted: None };
        }
        let farthest = *self.resident.last().expect("a full cache");
        if key > farthest {
            return Outcome::Bypass;
        }
        self.resident.pop_last();
        self.resident.insert(key);
        Outcome::Miss {
            evicted: Some(self.page_of(farthest)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_farthest_and_bypasses() {
        let t = [1, 2, 3, 1, 2, 4, 3, 1];
        let mut p = Belady::new(2, &t);
        let got: Vec<Outcome> = t.iter().map(|&x| p.access(x)).collect();
        use Outcome::*;
        assert_eq!(
            got,
            [
                Miss { evicted: None },
                Miss { evicted: None },
                Bypass, // 3 is used after both 1 and 2
                Hit,
                Hit,
                Bypass, // 4 is never used again, nor is 2: the newcomer stays out
                Bypass,
                Hit,
            ]
        );
    }

    #[test]
    fn evicts_a_page_never_used_again() {
        let t = [1, 2, 3, 3, 1];
        let mut p = Belady::new(2, &t);
        let got: Vec<Outcome> = t.iter().map(|&x| p.access(x)).collect();
        assert_eq!(got[2], Outcome::Miss { evicted: Some(2) });
        assert!(got[3].is_hit() && got[4].is_hit());
    }

    #[test]
    #[should_panic(expected = "does not follow the trace")]
    fn refuses_another_trace() {
        Belady::new(2, &[1, 2]).access(2);
    }
}
