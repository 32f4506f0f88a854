//! LFU with decay: every page has a score, `score ← ⌊score · decay⌋ + count`
//! at the end of each interval of accesses (with `count` the accesses of the
//! interval, folded in as they happen); a miss evicts the resident page of
//! the lowest score, the least recently used among equals.
//!
//! Scores of pages that left the cache are kept and decay with the others
//! (the runtime keeps access counters for every page, resident or not); a
//! score that decays to zero is forgotten, which bounds that history to the
//! pages of the last few intervals.
//!
//! O(1) per access: resident pages sit in one LRU list per score (scores
//! saturate at [`MAX_SCORE`]) and a two-level bitmap finds the lowest
//! non-empty score. Decay rebuilds the lists once per interval (O(n log n)
//! per `interval` accesses, with the interval at least the capacity).

#![forbid(unsafe_code)]

use super::base::{page_map, Outcome, PageMap, Policy};
use super::list::{Arena, List};

/// Scores saturate here (a page this hot is never the victim anyway).
pub const MAX_SCORE: u32 = u16::MAX as u32;

/// Decayed least-frequently-used.
pub struct Lfu {
    capacity: usize,
    decay: f64,
    interval: u64,
    now: u64,
    next_decay: u64,
    /// Resident page → node; the node's key is the page.
    map: PageMap<Node>,
    arena: Arena,
    /// One list per score, most recent at the head.
    buckets: Vec<List>,
    nonempty: Bitmap,
    /// Scores of pages that are not resident.
    history: PageMap<u32>,
}

#[derive(Clone, Copy)]
struct Node {
    index: u32,
    score: u32,
    stamp: u64,
}

impl Lfu {
    /// Halves scores every `8 × capacity` accesses.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self::with_decay(capacity, 0.5, 8 * capacity as u64)
    }

    /// Multiplies scores by `decay` (in `0..=1`) every `interval` accesses
    /// (at least `capacity`).
    pub fn with_decay(capacity: usize, decay: f64, interval: u64) -> Self {
        assert!(
            (0.0..=1.0).contains(&decay),
            "decay {decay} is not in 0..=1"
        );
        let interval = interval.max(capacity as u64).max(1);
        Self {
            capacity,
            decay,
            interval,
            now: 0,
            next_decay: interval,
            map: page_map(capacity),
            arena: Arena::with_capacity(capacity),
            buckets: Vec::new(),
            nonempty: Bitmap::default(),
            history: page_map(capacity),
        }
    }

    /// The current score of `page` (resident or remembered), 0 if unknown.
    pub fn score(&self, page: u64) -> u32 {
        match self.map.get(&page) {
            Some(n) => n.score,
            None => self.history.get(&page).copied().unwrap_or(0),
        }
    }

    fn link(&mut self, index: u32, score: u32) {
        let s = score as usize;
        if s >= self.buckets.len() {
            self.buckets.resize(s + 1, List::default());
        }
        self.buckets[s].push_front(&mut self.arena, index);
        self.nonempty.set(s);
    }

    fn unlink(&mut self, index: u32, score: u32) {
        let s = score as usize;
        self.buckets[s].remove(&mut self.arena, index);
        if self.buckets[s].len() == 0 {
            self.nonempty.clear(s);
        }
    }

    fn decay_all(&mut self) {
        let decay = self.decay;
        let scale = |s: u32| (f64::from(s) * decay) as u32;
        self.history.retain(|_, s| {
            *s = scale(*s);
            *s > 0
        });
        // Relink every resident page under its new score, oldest first, so
        // each list stays in recency order.
        let mut nodes: Vec<(u64, u64)> = self.map.iter().map(|(&p, n)| (n.stamp, p)).collect();
        nodes.sort_unstable();
        for (_, page) in nodes {
            let n = self.map[&page];
            self.unlink(n.index, n.score);
            let score = scale(n.score);
            self.map.get_mut(&page).expect("resident").score = score;
            self.link(n.index, score);
        }
    }
}

impl Policy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn access(&mut self, page: u64) -> Outcome {
        self.now += 1;
        if self.now >= self.next_decay {
            self.next_decay += self.interval;
            self.decay_all();
        }
        let stamp = self.now;
        if let Some(n) = self.map.get_mut(&page) {
            let old = *n;
            n.score = (old.score + 1).min(MAX_SCORE);
            n.stamp = stamp;
            let new = n.score;
            self.unlink(old.index, old.score);
            self.link(old.index, new);
            return Outcome::Hit;
        }
        let evicted = if self.map.len() == self.capacity {
            let s = self.nonempty.first().expect("a full cache has a bucket");
            let victim = self.buckets[s].back().expect("non-empty bucket");
            let key = self.arena.get(victim).key;
            self.unlink(victim, s as u32);
            self.arena.release(victim);
            self.map.remove(&key);
            self.history.insert(key, s as u32);
            Some(key)
        } else {
            None
        };
        let score = (self.history.remove(&page).unwrap_or(0) + 1).min(MAX_SCORE);
        let index = self.arena.alloc(page, 0);
        self.link(index, score);
        self.map.insert(
            page,
            Node {
                index,
                score,
                stamp,
            },
        );
        Outcome::Miss { evicted }
    }
}

/// Which scores have a non-empty list: a bit per score and a bit per word.
#[derive(Default)]
struct Bitmap {
    words: Vec<u64>,
    summary: Vec<u64>,
}

impl Bitmap {
    fn set(&mut self, i: usize) {
        let w = i / 64;
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
            self.summary.resize(w / 64 + 1, 0);
        }
        self.words[w] |= 1 << (i % 64);
        self.summary[w / 64] |= 1 << (w % 64);
    }

    fn clear(&mut self, i: usize) {
        let w = i / 64;
        self.words[w] &= !(1 << (i % 64));
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// The lowest set bit.
    fn first(&self) -> Option<usize> {
        let (s, sw) = self.summary.iter().enumerate().find(|(_, &sw)| sw != 0)?;
        let w = s * 64 + sw.trailing_zeros() as usize;
        Some(w * 64 + self.words[w].trailing_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_frequent_then_least_recent() {
        let mut p = Lfu::new(2);
        p.access(1);
        p.access(1);
        p.access(2);
        assert_eq!(p.access(3), Outcome::Miss { evicted: Some(2) });
        assert_eq!(p.access(4), Outcome::Miss { evicted: Some(3) });
        assert!(p.access(1).is_hit());
        // Page 2 comes back with its remembered score of 1 plus this access.
        assert_eq!(p.access(2), Outcome::Miss { evicted: Some(4) });
        assert_eq!(p.score(2), 2);
    }

    #[test]
    fn scores_decay() {
        let mut p = Lfu::with_decay(2, 0.5, 4);
        for _ in 0..3 {
            p.access(7);
        }
        assert_eq!(p.score(7), 3);
        p.access(8); // the 4th access ends the interval before it counts
        assert_eq!(p.score(7), 1);
        assert_eq!(p.score(8), 1);
    }

    #[test]
    fn bitmap_finds_the_lowest() {
        let mut b = Bitmap::default();
        assert_eq!(b.first(), None);
        b.set(70_000);
        b.set(130);
        assert_eq!(b.first(), Some(130));
        b.clear(130);
        assert_eq!(b.first(), Some(70_000));
    }
}
