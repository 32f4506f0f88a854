//! Trace replay: feed a trace to a policy and count what happened.

#![forbid(unsafe_code)]

use std::time::Instant;

use serde::Serialize;

use super::base::{Outcome, Policy};

/// The outcome of replaying a trace against one policy. A bypass (a miss
/// not admitted) counts as a miss.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The policy's name.
    pub policy: String,
    /// Accesses replayed.
    pub accesses: u64,
    /// Accesses to a resident page.
    pub hits: u64,
    /// Accesses to a page that was not resident.
    pub misses: u64,
    /// `hits / accesses` (0 for an empty trace).
    pub hit_rate: f64,
    /// Wall time of the replay itself.
    pub seconds: f64,
}

/// Replays `trace` against `policy` from its current state.
pub fn replay(policy: &mut dyn Policy, trace: &[u64]) -> ReplayReport {
    replay_with_progress(policy, trace, &mut |_| {})
}

/// [`replay`], telling `progress` the fraction of the trace done every
/// million accesses or so (a long replay's progress bar). The calls are in
/// the timed part, and cost one call per million accesses.
pub fn replay_with_progress(
    policy: &mut dyn Policy,
    trace: &[u64],
    progress: &mut dyn FnMut(f64),
) -> ReplayReport {
    const CHUNK: usize = 1 << 20;
    let start = Instant::now();
    let mut hits = 0u64;
    for (i, chunk) in trace.chunks(CHUNK).enumerate() {
        for &page in chunk {
            if let Outcome::Hit = policy.access(page) {
                hits += 1;
            }
        }
        progress(((i + 1) * CHUNK).min(trace.len()) as f64 / trace.len() as f64);
    }
    let seconds = start.elapsed().as_secs_f64();
    let accesses = trace.len() as u64;
    ReplayReport {
        policy: policy.name().to_string(),
        accesses,
        hits,
        misses: accesses - hits,
        hit_rate: if accesses == 0 {
            0.0
        } else {
            hits as f64 / accesses as f64
        },
        seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::lru::Lru;

    #[test]
    fn counts_hits_and_misses() {
        let r = replay(&mut Lru::new(2), &[1, 2, 1, 3, 2, 1]);
        assert_eq!((r.accesses, r.hits, r.misses), (6, 1, 5));
        assert_eq!(r.policy, "lru");
        assert!((r.hit_rate - 1.0 / 6.0).abs() < 1e-12);
        assert_eq!(replay(&mut Lru::new(2), &[]).hit_rate, 0.0);
    }

    #[test]
    fn progress_rises_to_the_whole_trace_and_changes_no_count() {
        let trace: Vec<u64> = (0..(5u64 << 19)).map(|i| i * 7919 % 1000).collect();
        let mut seen = Vec::new();
        let r = replay_with_progress(&mut Lru::new(100), &trace, &mut |f| seen.push(f));
        assert_eq!(seen, [0.4, 0.8, 1.0]);
        let plain = replay(&mut Lru::new(100), &trace);
        assert_eq!((r.hits, r.misses), (plain.hits, plain.misses));
    }
}
