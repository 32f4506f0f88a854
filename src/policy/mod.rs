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
//! | `default` | [`default`] | W-TinyLFU with an adaptive window, or ARC where its simulations find ARC missing less; what the runtime uses when none is named |

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

pub mod arc;
mod base;
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

pub use base::{Outcome, Policy};
pub use replay::{replay, replay_with_progress, ReplayReport};

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

    /// Names as [`PolicyKind::name`] spells them, in any case, spaces
    /// around them ignored (as the other names of the configuration).
    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase();
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown policy {s:?} (choose lru, lfu, gmt, lookahead, arc, s3fifo, \
                     sieve, lrfu, perfect-lfu, lfu-admission or default; belady replays \
                     traces only)"
                ))
            })
    }
}

/// Heap a policy takes per page of its capacity, about (its maps, lists
/// and counters: the default policy's, the largest, 100-120 bytes).
const BYTES_PER_PAGE: usize = 128;

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
    // A capacity whose bookkeeping the allocator cannot give is an error,
    // not an abort in the middle of building the maps: asked for up front.
    let bytes = capacity.saturating_mul(BYTES_PER_PAGE);
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes).map_err(|_| {
        Error::new(
            crate::error::ErrorKind::OutOfCapacity,
            format!(
                "a policy over {capacity} pages needs about {bytes} bytes of memory for its bookkeeping, more than this process can get"
            ),
        )
    })?;
    drop(probe);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        let e = "mru".parse::<PolicyKind>().unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidArgument);
        assert!(e.message().contains("\"mru\"") && e.message().contains("belady"));
        assert!(e.message().contains("s3fifo") && e.message().contains("sieve"));
    }

    #[test]
    fn build_checks_its_arguments() {
        assert!(build(PolicyKind::Lru, 0, None).is_err());
        assert!(build(PolicyKind::Belady, 4, None).is_err());
        // Bookkeeping the allocator cannot give is an error, not an abort.
        for k in [PolicyKind::Default, PolicyKind::Arc, PolicyKind::Lru] {
            let e = build(k, usize::MAX / 64, None).err().expect("refused");
            assert_eq!(e.kind(), crate::error::ErrorKind::OutOfCapacity, "{k}: {e}");
        }
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
}
