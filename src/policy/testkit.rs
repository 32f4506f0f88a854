//! Test helpers shared by the policies' unit tests: a deterministic random
//! source, a Zipf trace generator (independent of `crate::trace`, so these
//! tests pin the policies alone), and checks every policy must pass.

#![forbid(unsafe_code)]

use std::collections::HashSet;

use super::base::{Outcome, Policy};
use super::PolicyKind;

/// SplitMix64: small, fast, deterministic.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        super::base::mix64(self.0)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n` accesses over `pages` pages, page `k` drawn with probability
/// proportional to `1 / (k + 1)^alpha` (inverse CDF by binary search).
pub(crate) fn zipf(alpha: f64, pages: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut cdf = Vec::with_capacity(pages as usize);
    let mut total = 0.0;
    for k in 0..pages {
        total += 1.0 / ((k + 1) as f64).powf(alpha);
        cdf.push(total);
    }
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let u = rng.unit() * total;
            cdf.partition_point(|&c| c <= u).min(pages as usize - 1) as u64
        })
        .collect()
}

/// A trace mixing uniform accesses, skewed ones and short scans over about
/// `3 × capacity` pages.
pub(crate) fn mixed(capacity: usize, n: usize, seed: u64) -> Vec<u64> {
    let pages = 3 * capacity as u64 + 2;
    let mut rng = Rng(seed);
    let mut t = Vec::with_capacity(n);
    while t.len() < n {
        match rng.below(10) {
            0 => {
                let start = rng.below(1000) * 7;
                t.extend((start..start + capacity as u64 + 1).take(n - t.len()));
            }
            1..=4 => t.push(rng.below(pages)),
            _ => t.push(rng.below(pages).min(rng.below(pages))),
        }
    }
    t
}

/// `passes` passes over the `capacity + 1` pages `0..=capacity`.
pub(crate) fn cyclic(capacity: usize, passes: usize) -> Vec<u64> {
    (0..passes).flat_map(|_| 0..=capacity as u64).collect()
}

/// The outcomes of `trace` in order.
/// A miss that evicted `evicted` (hand-traced expectations read better so).
pub(crate) const fn miss(evicted: Option<u64>) -> Outcome {
    Outcome::Miss { evicted }
}

/// On a loop of `capacity + 1` pages, a policy that never sees a page twice
/// while it is resident misses every access, evicting the page accessed
/// next (LRU, and FIFO-like policies such as ARC's T1 and SIEVE).
pub(crate) fn check_loop_always_misses(build: fn(usize) -> Box<dyn Policy>) {
    for cap in [1, 2, 5, 64] {
        let t = cyclic(cap, 5);
        let mut p = build(cap);
        for (i, o) in outcomes(&mut *p, &t).into_iter().enumerate() {
            let expected = (i >= cap).then(|| (i as u64 + 1) % (cap as u64 + 1));
            assert_eq!(o, miss(expected), "cap {cap} access {i}");
        }
    }
}

pub(crate) fn outcomes(p: &mut dyn Policy, trace: &[u64]) -> Vec<Outcome> {
    trace.iter().map(|&x| p.access(x)).collect()
}

/// How many accesses of `trace` missed.
pub(crate) fn misses(p: &mut dyn Policy, trace: &[u64]) -> usize {
    trace.iter().filter(|&&x| !p.access(x).is_hit()).count()
}

/// Replays `trace` and checks every outcome against a residency set kept
/// from the reported evictions alone: a hit iff the page is resident, an
/// eviction names a resident page other than the one that missed, a page
/// leaves only when the cache is full and then always, and the policy's
/// `len` is the set's size, never above the capacity. These policies admit
/// every miss, so a bypass is an error.
pub(crate) fn check_residency(p: &mut dyn Policy, trace: &[u64]) {
    check_residency_from(p, trace, &mut HashSet::new());
}

/// [`check_residency`] for a cache that holds `resident` already (a
/// previous check's set, which it leaves as the cache holds it after).
pub(crate) fn check_residency_from(p: &mut dyn Policy, trace: &[u64], resident: &mut HashSet<u64>) {
    let cap = p.capacity();
    let name = p.name();
    for (i, &x) in trace.iter().enumerate() {
        let was = resident.contains(&x);
        match p.access(x) {
            Outcome::Hit => assert!(was, "{name} cap {cap} access {i}: hit on {x}, not resident"),
            Outcome::Miss { evicted } => {
                assert!(!was, "{name} cap {cap} access {i}: miss on resident {x}");
                match evicted {
                    Some(e) => {
                        assert_ne!(e, x, "{name} cap {cap} access {i}");
                        assert!(
                            resident.remove(&e),
                            "{name} cap {cap} access {i}: evicted {e}, not resident"
                        );
                        assert_eq!(resident.len() + 1, cap, "{name}: evicted while not full");
                    }
                    None => assert!(resident.len() < cap, "{name}: full, nothing evicted"),
                }
                resident.insert(x);
            }
            Outcome::Bypass => panic!("{name} cap {cap} access {i}: bypass"),
        }
        assert_eq!(p.len(), resident.len(), "{name} cap {cap} access {i}");
        assert!(p.len() <= cap, "{name} cap {cap} access {i}");
    }
}

/// The residency check over mixed traces at several capacities, 1 included.
pub(crate) fn check_residency_at_many_capacities(build: fn(usize) -> Box<dyn Policy>) {
    for (seed, cap) in [1, 2, 3, 5, 8, 10, 13, 20, 64].into_iter().enumerate() {
        let t = mixed(cap, 4000, seed as u64 + 1);
        check_residency(build(cap).as_mut(), &t);
    }
}

/// Misses of `build` and of LRU on Zipf traces at moderate skew.
pub(crate) fn zipf_misses_vs_lru(build: fn(usize) -> Box<dyn Policy>) -> Vec<(usize, usize)> {
    let t = zipf(0.9, 20_000, 200_000, 17);
    [200, 1000, 4000]
        .into_iter()
        .map(|cap| {
            let mine = misses(build(cap).as_mut(), &t);
            let lru = misses(&mut super::lru::Lru::new(cap), &t);
            (mine, lru)
        })
        .collect()
}

/// Replay speed of the reference policies and LRU on a 1 M-access
/// Zipf(0.99) trace over 100 k pages at a capacity of 10 k pages. Run in
/// release mode:
/// `cargo test -p strata --lib --release policy::testkit -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, run in release mode"]
fn replay_speed() {
    use std::time::Instant;
    let t = zipf(0.99, 100_000, 1_000_000, 99);
    let cap = 10_000;
    let kinds = [
        PolicyKind::Lru,
        PolicyKind::Arc,
        PolicyKind::S3Fifo,
        PolicyKind::Sieve,
    ];
    for kind in kinds {
        // Best of three runs, each on a fresh policy.
        let mut best = f64::MAX;
        let mut hits = 0;
        for _ in 0..3 {
            let mut p = super::build(kind, cap, None).unwrap();
            let start = Instant::now();
            hits = t.iter().filter(|&&x| p.access(x).is_hit()).count();
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{:>6}: {:6.1} M accesses/s, hit rate {:.4}",
            kind.name(),
            t.len() as f64 / best / 1e6,
            hits as f64 / t.len() as f64
        );
    }
}
