//! Placement policies: pure decision code (no I/O, no `unsafe`) for a cache
//! of N pages in front of an unbounded slower tier.
//!
//! The same [`Policy`] trait serves trace replay ([`replay`](mod@replay)) now and the
//! runtime's balancer later: the caller reports each access and learns
//! whether it hit, missed (and which page, if any, left to make room), or
//! missed without being admitted ([`Outcome::Bypass`], served from the slower
//! tier in place — zero-copy from host memory on a GPU).
//!
//! | policy | file | idea |
//! |---|---|---|
//! | `lru` | [`lru`] | the Unified-Memory-like baseline: fault-driven, evicts the least recently used group of pages (2 MiB in UVM) |
//! | `lfu` | [`lfu`] | decayed access counts, evicts the lowest score |
//! | `gmt` | [`gmt`] | reuse-distance prediction decides admission (the GMT idea) |
//! | `lookahead` | [`lookahead`] | prefetch hints and a window of the known future; LRU otherwise |
//! | `belady` | [`belady`] | Belady's MIN over a whole trace: the offline optimum |
//! | `arc` | [`arc`] | ARC (Megiddo & Modha, FAST 2003): recency and frequency lists with ghosts, an adaptive split |
//! | `s3fifo` | [`s3fifo`] | S3-FIFO (Yang et al., SOSP 2023): small, main and ghost FIFOs, 2-bit counters |
//! | `sieve` | [`sieve`] | SIEVE (Zhang et al., NSDI 2024): one FIFO, a visited bit, a sifting hand |
//! | `lrfu` | [`lrfu`] | LRFU (Lee et al., 2001): decayed counts of uses; the expert cache's eviction, also as a [`lrfu::Ranking`] for callers that filter victims |
//! | `perfect-lfu` | [`reference`](mod@reference) | reference only: exact counts of every page ever seen, evicts the lowest |
//! | `lfu-admission` | [`reference`](mod@reference) | reference only: perfect LFU that admits a page only if it is counted more than the victim |
//! | `default` | [`default`] | W-TinyLFU with an adaptive window; what the runtime uses when none is named |

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;

use crate::error::{Error, Result};

pub mod arc;
pub mod belady;
mod counts;
pub mod default;
pub mod gmt;
pub mod lfu;
pub(crate) mod list;
pub mod lookahead;
pub mod lrfu;
pub mod lru;
pub mod reference;
pub mod replay;
pub mod s3fifo;
pub mod sieve;
#[cfg(test)]
mod testkit;

pub use replay::{replay, ReplayReport};

/// What one access did to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The page was resident.
    Hit,
    /// The page was not resident and is now; `evicted` left to make room
    /// (for a policy that evicts groups of pages, the first page of the
    /// group).
    Miss {
        /// The page that left, if the cache was full.
        evicted: Option<u64>,
    },
    /// The page was not resident and was not admitted: it is served from
    /// the slower tier and nothing moves. Counts as a miss.
    Bypass,
}

impl Outcome {
    /// Whether the page was resident.
    pub fn is_hit(self) -> bool {
        matches!(self, Outcome::Hit)
    }
}

/// A placement policy for a cache of [`capacity`](Policy::capacity) pages.
pub trait Policy: Send {
    /// The policy's name as the command line spells it.
    fn name(&self) -> &'static str;

    /// How many pages the cache holds.
    fn capacity(&self) -> usize;

    /// How many pages are resident now.
    fn len(&self) -> usize;

    /// Whether no page is resident.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records an access to `page` and decides what moves.
    fn access(&mut self, page: u64) -> Outcome;

    /// A hint that `page` will be accessed soon (a prefetch request, e.g.
    /// the experts the router of an earlier layer chose). A policy that
    /// honours hints may load the page now ([`Outcome::Miss`], with what it
    /// evicted), report it already resident ([`Outcome::Hit`]) or decline
    /// ([`Outcome::Bypass`], the default). A hint is not an access: it does
    /// not count as a hit or a miss.
    fn hint(&mut self, page: u64) -> Outcome {
        let _ = page;
        Outcome::Bypass
    }
}

/// The policies by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// [`lru::Lru`].
    Lru,
    /// [`lfu::Lfu`].
    Lfu,
    /// [`gmt::Gmt`].
    Gmt,
    /// [`lookahead::Lookahead`].
    Lookahead,
    /// [`arc::Arc`].
    Arc,
    /// [`s3fifo::S3Fifo`].
    S3Fifo,
    /// [`sieve::Sieve`].
    Sieve,
    /// [`lrfu::Lrfu`] with [`lrfu::Lrfu::default_decay`].
    Lrfu,
    /// [`reference::PerfectLfu`] without admission (a reference, for
    /// comparison).
    PerfectLfu,
    /// [`reference::PerfectLfu`] with admission (a reference, for
    /// comparison).
    LfuAdmission,
    /// [`belady::Belady`] (offline: needs the whole trace).
    Belady,
    /// [`default::DefaultPolicy`], the policy used when none is named.
    Default,
}

impl PolicyKind {
    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 12] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Gmt,
        PolicyKind::Lookahead,
        PolicyKind::Arc,
        PolicyKind::S3Fifo,
        PolicyKind::Sieve,
        PolicyKind::Lrfu,
        PolicyKind::PerfectLfu,
        PolicyKind::LfuAdmission,
        PolicyKind::Default,
        PolicyKind::Belady,
    ];

    /// The name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Gmt => "gmt",
            PolicyKind::Lookahead => "lookahead",
            PolicyKind::Arc => "arc",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::Sieve => "sieve",
            PolicyKind::Lrfu => "lrfu",
            PolicyKind::PerfectLfu => "perfect-lfu",
            PolicyKind::LfuAdmission => "lfu-admission",
            PolicyKind::Belady => "belady",
            PolicyKind::Default => "default",
        }
    }

    /// Whether the policy needs the future (the whole trace) to run.
    pub fn needs_trace(self) -> bool {
        matches!(self, PolicyKind::Belady)
    }
}

/// Reports spell a policy by its name.
impl serde::Serialize for PolicyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown policy {s:?} (choose lru, lfu, gmt, lookahead, arc, s3fifo, \
                     sieve, lrfu, perfect-lfu, lfu-admission, belady or default)"
                ))
            })
    }
}

/// Builds a policy of `kind` for a cache of `capacity` pages.
///
/// `trace` is the future: the whole sequence of accesses that will follow,
/// in order. Belady's MIN needs it; lookahead uses a window of it when given
/// (and hints alone otherwise); the other policies ignore it. LRU evicts
/// single pages here; see [`lru::Lru::with_group`] for 2 MiB groups.
pub fn build(kind: PolicyKind, capacity: usize, trace: Option<&[u64]>) -> Result<Box<dyn Policy>> {
    if capacity == 0 {
        return Err(Error::invalid("the capacity must be at least 1 page"));
    }
    Ok(match kind {
        PolicyKind::Lru => Box::new(lru::Lru::new(capacity)),
        PolicyKind::Lfu => Box::new(lfu::Lfu::new(capacity)),
        PolicyKind::Gmt => Box::new(gmt::Gmt::new(capacity)),
        PolicyKind::Lookahead => Box::new(match trace {
            Some(t) => {
                lookahead::Lookahead::with_future(capacity, t, lookahead::default_window(capacity))
            }
            None => lookahead::Lookahead::new(capacity),
        }),
        PolicyKind::Belady => Box::new(belady::Belady::new(
            capacity,
            trace.ok_or_else(|| Error::invalid("belady needs the whole trace in advance"))?,
        )),
        PolicyKind::Arc => Box::new(arc::Arc::new(capacity)),
        PolicyKind::S3Fifo => Box::new(s3fifo::S3Fifo::new(capacity)),
        PolicyKind::Sieve => Box::new(sieve::Sieve::new(capacity)),
        PolicyKind::Lrfu => Box::new(lrfu::Lrfu::new(
            capacity,
            lrfu::Lrfu::default_decay(capacity),
        )?),
        PolicyKind::PerfectLfu => Box::new(reference::PerfectLfu::new(capacity, false)),
        PolicyKind::LfuAdmission => Box::new(reference::PerfectLfu::new(capacity, true)),
        PolicyKind::Default => Box::new(default::DefaultPolicy::new(capacity)),
    })
}

/// A fast hash for page ids. Page ids are often multiples of a stride or
/// dense runs, so both halves of the id are folded into every output bit
/// that `HashMap` uses (its bucket index takes low bits, its tag high bits).
#[derive(Default, Clone, Copy)]
pub(crate) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b) ^ self.0.rotate_left(8));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = mix64(x);
    }
}

/// A cheap 64-bit mixer (two rounds of xor-shift-multiply).
#[inline]
pub(crate) fn mix64(x: u64) -> u64 {
    let mut h = x ^ (x >> 32);
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^= h >> 32;
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^ (h >> 32)
}

/// `HashMap` keyed by page id with [`PageHasher`].
pub(crate) type PageMap<V> = HashMap<u64, V, BuildHasherDefault<PageHasher>>;

/// A new empty [`PageMap`] with room for `n` entries.
pub(crate) fn page_map<V>(n: usize) -> PageMap<V> {
    PageMap::with_capacity_and_hasher(n, BuildHasherDefault::default())
}

/// For every position `i` of `trace`, the position of the next access to the
/// same page, or `NEVER` when there is none.
pub(crate) fn next_uses(trace: &[u64]) -> Vec<usize> {
    let mut next = vec![NEVER; trace.len()];
    let mut last: PageMap<usize> = page_map(1024);
    for (i, &p) in trace.iter().enumerate().rev() {
        if let Some(j) = last.insert(p, i) {
            next[i] = j;
        }
    }
    next
}

/// "Not accessed again" in [`next_uses`].
pub(crate) const NEVER: usize = usize::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        let e = "mru".parse::<PolicyKind>().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("\"mru\"") && e.message().contains("belady"));
        assert!(e.message().contains("s3fifo") && e.message().contains("sieve"));
    }

    #[test]
    fn build_checks_its_arguments() {
        assert!(build(PolicyKind::Lru, 0, None).is_err());
        assert!(build(PolicyKind::Belady, 4, None).is_err());
        for k in PolicyKind::ALL {
            let t = [1, 2, 3, 1];
            let mut p = build(k, 2, Some(&t)).unwrap();
            assert_eq!(p.name(), k.name());
            assert_eq!(p.capacity(), 2);
            let hits = t.iter().filter(|&&x| p.access(x).is_hit()).count();
            assert!(hits <= 1, "{k}");
            assert!(p.len() <= 2);
        }
    }

    #[test]
    fn next_uses_point_forward() {
        assert_eq!(next_uses(&[5, 6, 5, 5]), [2, NEVER, 3, NEVER]);
    }
}
