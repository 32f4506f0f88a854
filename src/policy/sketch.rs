//! A frequency sketch for TinyLFU admission: a count-min sketch of small
//! saturating counters behind a doorkeeper, aged by halving.
//!
//! - Four rows of counters, each page hashed to one counter per row; the
//!   estimate is the smallest of its four (collisions only ever add).
//!   Increments are conservative: only the counters equal to that minimum
//!   grow, which keeps collisions from inflating cold pages.
//! - The doorkeeper, a Bloom filter, absorbs each page's first access of a
//!   period, so one-hit pages (scans) never reach the counters.
//! - Every `period` recorded accesses all counters halve and the doorkeeper
//!   clears: the sketch forgets old popularity at a steady rate.

#![forbid(unsafe_code)]

use super::mix64;

pub(crate) struct Sketch {
    /// `ROWS` rows of `mask + 1` counters, row-major.
    counters: Vec<u8>,
    mask: u64,
    max: u8,
    doorkeeper: Vec<u64>,
    door_mask: u64,
    period: u64,
    recorded: u64,
}

const ROWS: usize = 4;

impl Sketch {
    /// `width` counters per row (rounded up to a power of two), counters
    /// saturating at `max`, halving every `period` recorded accesses.
    pub fn new(width: usize, max: u8, period: u64) -> Self {
        let width = width.max(64).next_power_of_two();
        // A doorkeeper of ~8 bits per counter of a row keeps its false
        // positives low for `width` distinct pages a period.
        let door_bits = (width * 8).max(512);
        Self {
            counters: vec![0; ROWS * width],
            mask: width as u64 - 1,
            max,
            doorkeeper: vec![0; door_bits / 64],
            door_mask: door_bits as u64 - 1,
            period: period.max(1),
            recorded: 0,
        }
    }

    #[inline]
    fn slots(&self, page: u64) -> [usize; ROWS] {
        let h = mix64(page);
        let h1 = h & 0xffff_ffff;
        let h2 = (h >> 32) | 1;
        let w = self.mask + 1;
        let mut s = [0; ROWS];
        for (r, slot) in s.iter_mut().enumerate() {
            let i = h1.wrapping_add(h2.wrapping_mul(r as u64)) & self.mask;
            *slot = (r as u64 * w + i) as usize;
        }
        s
    }

    #[inline]
    fn door_bits(&self, page: u64) -> [u64; 2] {
        let h = mix64(page ^ 0x9e37_79b9_7f4a_7c15);
        [h & self.door_mask, (h >> 32) & self.door_mask]
    }

    fn door_contains(&self, page: u64) -> bool {
        self.door_bits(page)
            .iter()
            .all(|&b| self.doorkeeper[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    /// Records one access to `page`.
    pub fn record(&mut self, page: u64) {
        self.recorded += 1;
        if self.recorded >= self.period {
            self.halve();
        }
        if !self.door_contains(page) {
            for b in self.door_bits(page) {
                self.doorkeeper[(b / 64) as usize] |= 1 << (b % 64);
            }
            return;
        }
        let slots = self.slots(page);
        let min = slots.iter().map(|&s| self.counters[s]).min().unwrap_or(0);
        if min < self.max {
            for s in slots {
                if self.counters[s] == min {
                    self.counters[s] += 1;
                }
            }
        }
    }

    /// The estimated number of accesses to `page` in the recent past.
    pub fn estimate(&self, page: u64) -> u32 {
        let min = self
            .slots(page)
            .iter()
            .map(|&s| self.counters[s])
            .min()
            .unwrap_or(0);
        u32::from(min) + u32::from(self.door_contains(page))
    }

    fn halve(&mut self) {
        self.recorded /= 2;
        for c in &mut self.counters {
            *c >>= 1;
        }
        self.doorkeeper.fill(0);
    }
}

/// Exact counts per page, halved every `period` recorded accesses (pages at
/// zero forgotten), saturating at `max`.
pub(crate) struct Counts {
    counts: super::PageMap<u32>,
    max: u32,
    period: u64,
    recorded: u64,
}

impl Counts {
    pub fn new(capacity: usize, max: u32, period: u64) -> Self {
        Self {
            counts: super::page_map(capacity * 2),
            max,
            period: period.max(1),
            recorded: 0,
        }
    }

    pub fn record(&mut self, page: u64) {
        self.recorded += 1;
        if self.recorded >= self.period {
            self.recorded = 0;
            self.counts.retain(|_, c| {
                *c >>= 1;
                *c > 0
            });
        }
        let c = self.counts.entry(page).or_insert(0);
        *c = (*c + 1).min(self.max);
    }

    pub fn estimate(&self, page: u64) -> u32 {
        self.counts.get(&page).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_saturate_and_halve() {
        let mut s = Sketch::new(64, 15, 1_000);
        assert_eq!(s.estimate(3), 0);
        s.record(3);
        assert_eq!(s.estimate(3), 1, "the doorkeeper holds the first access");
        for _ in 0..40 {
            s.record(3);
        }
        assert_eq!(s.estimate(3), 16);
        s.halve();
        assert_eq!(s.estimate(3), 7);
        assert_eq!(s.estimate(4), 0);
    }
}
