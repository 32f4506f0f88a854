//! What every policy is and shares: the [`Policy`] trait and its
//! [`Outcome`]s, the page-id hash maps the policies keep their state in,
//! and next-use positions for the policies that read a whole trace. The
//! policies' files use this one; `mod.rs` names and builds them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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
    fn next_uses_point_forward() {
        assert_eq!(next_uses(&[5, 6, 5, 5]), [2, NEVER, 3, NEVER]);
    }
}
