//! LRFU (Lee et al., IEEE Transactions on Computers 2001): a page's score
//! is Σ decay^(t − tᵢ) over its past uses at times tᵢ, and the lowest score
//! leaves. `decay = 1` is LFU over all time; a decay near 0 is LRU. The
//! expert cache's default eviction ([`crate::offload::moe::Eviction`]).
//!
//! Between two uses every score decays by the same factor, so the order of
//! two pages never changes while time passes. A page is therefore keyed by
//! its score brought back to time 0, kept as a logarithm so it cannot
//! overflow: `K = ln s(t) − t·ln decay`. A use at time `t` adds 1 to the
//! score: `K ← logaddexp(K, −t·ln decay)`. Ordered by `K` (ties: the older
//! last use leaves first), the victim is the first of a B-tree, O(log n).
//!
//! Two interfaces: [`Lrfu`], a [`Policy`] that trace replay and the
//! balancer can run, and [`Ranking`], for a caller that chooses its own
//! victims under constraints a policy does not know (the expert cache:
//! pinned experts, prefetched experts not used yet, per-layer pools) — the
//! policy keeps the order, the caller takes the lowest-ranked candidate
//! that passes its filter ([`victim`]).

#![forbid(unsafe_code)]

use std::cmp::Ordering;
use std::collections::BTreeSet;

use super::base::{page_map, Outcome, PageMap, Policy};
use crate::error::{Error, Result};

/// Where an entry stands in a [`Ranking`]: lower leaves first. An entry
/// never used ranks lowest.
#[derive(Clone, Copy, Debug)]
pub struct Rank {
    key: f64,
    last: u64,
}

impl Rank {
    /// The rank of an entry never used.
    pub const UNUSED: Rank = Rank {
        key: f64::NEG_INFINITY,
        last: 0,
    };
}

impl PartialEq for Rank {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Rank {}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rank {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key
            .total_cmp(&other.key)
            .then(self.last.cmp(&other.last))
    }
}

/// An order of entries kept by a policy for a caller that picks its own
/// victims (see the module's documentation).
pub trait Ranking: Send {
    /// The policy's name.
    fn name(&self) -> &'static str;

    /// Records a use of `id` at time `now` (the caller's clock, which never
    /// goes back).
    fn touch(&mut self, id: u64, now: u64);

    /// Where `id` stands now; [`Rank::UNUSED`] if it was never used.
    fn rank(&self, id: u64) -> Rank;
}

/// The lowest-ranked of `candidates` (the first of them on a tie), or
/// `None` if there is none.
pub fn victim(ranking: &dyn Ranking, candidates: impl IntoIterator<Item = u64>) -> Option<u64> {
    candidates.into_iter().min_by_key(|&id| ranking.rank(id))
}

/// LRFU scores: each entry's decayed count of uses (see the module's
/// documentation). Remembers every entry it has seen.
#[derive(Debug, Clone)]
pub struct Scores {
    /// `−ln decay` (≥ 0).
    neg_ln_decay: f64,
    entries: PageMap<Rank>,
}

impl Scores {
    /// Scores whose past uses decay by `decay` per tick, 0 < decay ≤ 1.
    pub fn new(decay: f64) -> Result<Self> {
        if !(decay > 0.0 && decay <= 1.0) {
            return Err(Error::invalid(format!(
                "the LRFU decay must be in (0, 1], not {decay}"
            )));
        }
        Ok(Self {
            neg_ln_decay: -decay.ln(),
            entries: page_map(64),
        })
    }

    /// `id`'s score at time `now` (≥ its last use): Σ decay^(now − tᵢ).
    pub fn score(&self, id: u64, now: u64) -> f64 {
        match self.entries.get(&id) {
            Some(r) => (r.key - now as f64 * self.neg_ln_decay).exp(),
            None => 0.0,
        }
    }
}

/// `ln(eᵃ + eᵇ)` without overflow.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    hi + (lo - hi).exp().ln_1p()
}

impl Ranking for Scores {
    fn name(&self) -> &'static str {
        "lrfu"
    }

    fn touch(&mut self, id: u64, now: u64) {
        let add = now as f64 * self.neg_ln_decay;
        let r = self.entries.entry(id).or_insert(Rank::UNUSED);
        r.key = log_add_exp(r.key, add);
        r.last = now;
    }

    fn rank(&self, id: u64) -> Rank {
        self.entries.get(&id).copied().unwrap_or(Rank::UNUSED)
    }
}

/// Recency: the least recently used leaves first (the expert cache's
/// [`Eviction::Lru`](crate::offload::moe::Eviction::Lru)).
#[derive(Debug, Clone)]
pub struct Recency {
    last: PageMap<u64>,
}

impl Default for Recency {
    fn default() -> Self {
        Self { last: page_map(64) }
    }
}

impl Ranking for Recency {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn touch(&mut self, id: u64, now: u64) {
        self.last.insert(id, now);
    }

    fn rank(&self, id: u64) -> Rank {
        match self.last.get(&id) {
            Some(&last) => Rank { key: 0.0, last },
            None => Rank::UNUSED,
        }
    }
}

/// LRFU as a cache of `capacity` pages: every miss is admitted, the lowest
/// score leaves. Time counts accesses.
pub struct Lrfu {
    capacity: usize,
    scores: Scores,
    resident: BTreeSet<(Rank, u64)>,
    now: u64,
}

impl Lrfu {
    /// A cache of `capacity` pages (at least 1) whose uses decay by
    /// `decay` per access. It remembers every page it has seen.
    pub fn new(capacity: usize, decay: f64) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::invalid("the capacity must be at least 1 page"));
        }
        Ok(Self {
            capacity,
            scores: Scores::new(decay)?,
            resident: BTreeSet::new(),
            now: 0,
        })
    }

    /// The decay trace replay uses for a cache of `capacity` pages: a use
    /// weighs half as much after `8 × capacity` more accesses, so a page
    /// must be used again within a few turnovers of the cache to outrank a
    /// newcomer (0.9989 for 64 pages, near the expert cache's 0.999).
    pub fn default_decay(capacity: usize) -> f64 {
        0.5f64.powf(1.0 / (8.0 * capacity.max(1) as f64))
    }
}

impl Policy for Lrfu {
    fn name(&self) -> &'static str {
        "lrfu"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        self.now += 1;
        let before = self.scores.rank(page);
        let hit = self.resident.remove(&(before, page));
        self.scores.touch(page, self.now);
        let mut evicted = None;
        if !hit && self.resident.len() == self.capacity {
            let (_, v) = self
                .resident
                .pop_first()
                .expect("a full cache has a victim");
            evicted = Some(v);
        }
        self.resident.insert((self.scores.rank(page), page));
        if hit {
            Outcome::Hit
        } else {
            Outcome::Miss { evicted }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_decayed_counts() {
        let mut s = Scores::new(0.5).unwrap();
        s.touch(1, 1);
        s.touch(1, 3);
        // 0.5^(4-1) + 0.5^(4-3) = 0.125 + 0.5
        assert!((s.score(1, 4) - 0.625).abs() < 1e-12);
        assert_eq!(s.score(2, 4), 0.0);
        assert!(Scores::new(0.0).is_err() && Scores::new(1.5).is_err());
        assert!(Scores::new(f64::NAN).is_err());
        assert!(Lrfu::new(0, 0.5).is_err());
    }

    #[test]
    fn keys_do_not_overflow_over_long_runs() {
        let mut s = Scores::new(0.9).unwrap();
        s.touch(7, 10_000_000_000);
        s.touch(7, 10_000_000_001);
        assert!((s.score(7, 10_000_000_001) - 1.9).abs() < 1e-6);
        assert!(s.rank(7) > Rank::UNUSED);
    }

    #[test]
    fn ranks_order_by_score_then_age() {
        let mut s = Scores::new(0.5).unwrap();
        // 1: used at 1, 2 (score at 3: 0.25 + 0.5 = 0.75); 2: used at 3 (1.0).
        s.touch(1, 1);
        s.touch(1, 2);
        s.touch(2, 3);
        assert!(s.rank(1) < s.rank(2));
        assert_eq!(victim(&s, [2, 1, 9]), Some(9), "never used ranks lowest");
        assert_eq!(victim(&s, [2, 1]), Some(1));
        // With no decay it is LFU: two uses beat one however old.
        let mut lfu = Scores::new(1.0).unwrap();
        lfu.touch(1, 1);
        lfu.touch(1, 2);
        lfu.touch(2, 100);
        assert_eq!(victim(&lfu, [1, 2]), Some(2));
        // Equal scores: the older last use leaves first.
        lfu.touch(3, 50);
        assert_eq!(victim(&lfu, [2, 3]), Some(3));
        assert_eq!(victim(&lfu, []), None);
    }

    #[test]
    fn recency_is_lru() {
        let mut r = Recency::default();
        r.touch(1, 1);
        r.touch(2, 2);
        r.touch(1, 3);
        assert_eq!(victim(&r, [1, 2]), Some(2));
        assert_eq!(victim(&r, [1, 2, 3]), Some(3));
    }

    #[test]
    fn hand_worked_trace() {
        // Decay 0.5, two pages. t=1 a, t=2 b, t=3 a (hit; a: 0.5^2+1=1.25),
        // t=4 c: a is 0.625, b is 0.25 -> b leaves. t=5 b: a 0.3125, c 0.5
        // -> a leaves. t=6 c: hit.
        let mut p = Lrfu::new(2, 0.5).unwrap();
        assert_eq!(p.access(1), Outcome::Miss { evicted: None });
        assert_eq!(p.access(2), Outcome::Miss { evicted: None });
        assert_eq!(p.access(1), Outcome::Hit);
        assert_eq!(p.access(3), Outcome::Miss { evicted: Some(2) });
        assert_eq!(p.access(2), Outcome::Miss { evicted: Some(1) });
        assert_eq!(p.access(3), Outcome::Hit);
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn policy_matches_a_linear_scan_of_scores() {
        // The B-tree's order against recomputing every score at each miss.
        let mut x = 12345u64;
        let mut trace = Vec::new();
        for _ in 0..5000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (x >> 33) % 100;
            trace.push(if r < 60 { r % 8 } else { r });
        }
        let decay = 0.97;
        let mut p = Lrfu::new(10, decay).unwrap();
        let mut score = std::collections::HashMap::<u64, f64>::new();
        let mut resident = Vec::<u64>::new();
        for (t, &page) in trace.iter().enumerate() {
            for v in score.values_mut() {
                *v *= decay;
            }
            *score.entry(page).or_insert(0.0) += 1.0;
            let hit = resident.contains(&page);
            let mut evicted = None;
            if !hit {
                if resident.len() == 10 {
                    let (i, _) = resident
                        .iter()
                        .enumerate()
                        .min_by(|a, b| score[a.1].total_cmp(&score[b.1]))
                        .unwrap();
                    evicted = Some(resident.swap_remove(i));
                }
                resident.push(page);
            }
            let want = if hit {
                Outcome::Hit
            } else {
                Outcome::Miss { evicted }
            };
            assert_eq!(p.access(page), want, "access {t}");
        }
    }
}
