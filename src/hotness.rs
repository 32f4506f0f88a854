//! Page hotness: per-page access counters, folded at each harvest into
//! decayed scores, and the two short lists the balancer needs — the K
//! hottest pages *not* in device memory and the K coldest pages *in* it.
//!
//! These are the reference semantics. The CUDA side
//! (`include/strata_device.cuh`, `kernels/hotness.cu`) computes the same
//! thing on the GPU so that only the lists cross PCIe; the simulated device
//! runs this code. Both follow these rules exactly, so shared test vectors
//! give identical lists:
//!
//! - **Sampling.** Each accessor (a kernel thread, a host thread) counts
//!   one access in 2^shift on average: after each counted access it skips a
//!   random number of accesses, drawn uniformly from 0..2^(shift+1)−1 by a
//!   hash-based generator ([`Sampler`]), so the sample is unbiased across
//!   pages and costs a decrement per access. A new accessor's first gap is
//!   the smaller of two such draws: what remains of a gap met at a random
//!   point (a first gap drawn like the others counted a short-lived
//!   accessor's accesses at about half the rate). A counted access adds 1;
//!   the harvest scales by 2^shift.
//! - **Saturation.** A counter never wraps: increments stop once it reaches
//!   [`COUNT_CEILING`] (2^32 − 2^20; concurrent increments may pass it by
//!   their number, never by 2^20), and counts added in bulk (a launch's
//!   device counts coming back) stop there too.
//! - **Fold.** `score ← fma(score, decay, count · 2^shift)` in `f32` (one
//!   rounding, as CUDA's `fmaf`), then `count ← 0`.
//! - **Lists.** Hot: pages not resident with score > 0, by score
//!   descending, ties by page ascending, the first K. Cold: resident pages
//!   by score ascending, ties by page ascending, the first K.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

/// Where per-page counters stop counting single accesses (see the module
/// docs); the same constant as `STRATA_COUNT_CEILING` in
/// `include/strata_device.cuh`.
pub const COUNT_CEILING: u32 = 0xFFF0_0000;

/// Counts one access in `counter`, unless it has reached [`COUNT_CEILING`].
#[inline]
pub(crate) fn count_one(counter: &AtomicU32) {
    if counter.load(Ordering::Relaxed) < COUNT_CEILING {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Adds `n` accesses to `counter`, saturating at [`COUNT_CEILING`] (the
/// 2^20 above it stay for single increments racing the check in
/// [`count_one`], so the counter never wraps).
#[inline]
pub(crate) fn count_many(counter: &AtomicU32, n: u32) {
    if n != 0 {
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
            Some(c.max(c.saturating_add(n).min(COUNT_CEILING)))
        });
    }
}

/// A splitmix64 step: the sampler's random gaps.
#[inline]
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One accessor's sampling state (a kernel thread's, in registers on a
/// GPU): the accesses left until the next counted one. Gaps are drawn
/// uniformly from 1..2^(shift+1) (mean 2^shift), the first as the smaller
/// of two draws (the rest of a gap met at a random point), so every page's
/// accesses are sampled at the same rate whatever the pattern and however
/// few accesses the accessor makes, and the common case costs a decrement
/// and a branch.
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    left: u32,
    state: u64,
}

impl Sampler {
    /// A sampler seeded with `seed` (different accessors, different seeds).
    pub fn new(seed: u64) -> Self {
        Self {
            // 0: the first gap is drawn on first use.
            left: 0,
            state: mix(seed),
        }
    }

    /// Whether this access counts, sampling 1 in 2^`shift` (a shift above
    /// 31 samples as 31 does: a gap is 32 bits, as in a GPU thread's
    /// register, and no harvest takes counts sampled more sparsely).
    #[inline]
    pub fn hit(&mut self, shift: u32) -> bool {
        if shift == 0 {
            return true;
        }
        // Below 31 every gap fits the u32 it is kept in; a wider shift
        // would truncate gaps (or overflow the span) instead.
        let span = (2u64 << shift.min(31)) - 1;
        // A first gap: the rest of a gap met at a random point.
        if self.left == 0 {
            self.state = mix(self.state);
            let a = 1 + self.state % span;
            self.state = mix(self.state);
            let b = 1 + self.state % span;
            self.left = a.min(b) as u32;
        }
        self.left -= 1;
        if self.left != 0 {
            return false;
        }
        self.state = mix(self.state);
        self.left = 1 + (self.state % span) as u32;
        true
    }
}

thread_local! {
    /// The sampler of runtime-side accesses on this thread, and the shift
    /// it last sampled at (runtimes of different shifts may share the
    /// thread: a gap drawn at another shift is drawn again).
    static SAMPLER: std::cell::Cell<(Sampler, u32)> = std::cell::Cell::new((Sampler::new({
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }), 0));
}

/// Records an access to `page` on this thread's sampler: bumps its counter
/// if the access is sampled; `shift` `None` counts nothing.
#[inline]
pub fn touch(counters: &[AtomicU32], page: usize, shift: Option<u32>) {
    let Some(shift) = shift else { return };
    let hit = SAMPLER.with(|s| {
        let (mut sampler, last) = s.get();
        if last != shift {
            sampler.left = 0;
        }
        let hit = sampler.hit(shift);
        s.set((sampler, shift));
        hit
    });
    if hit {
        count_one(&counters[page]);
    }
}

/// Harvest parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HarvestParams {
    /// Scores are multiplied by this at every harvest (0 < decay ≤ 1).
    pub decay: f32,
    /// Pages per list.
    pub k: usize,
    /// Counts were sampled 1 in 2^shift.
    pub shift: u32,
}

impl HarvestParams {
    /// An error unless a harvest can take these: decay in (0, 1], shift
    /// below 32 (a count is 32 bits).
    pub fn check(&self) -> crate::error::Result<()> {
        if !(self.decay > 0.0 && self.decay <= 1.0) {
            return Err(crate::error::Error::invalid(format!(
                "decay {} is not in (0, 1]",
                self.decay
            )));
        }
        if self.shift >= 32 {
            return Err(crate::error::Error::invalid(format!(
                "sampling shift {} is not below 32",
                self.shift
            )));
        }
        Ok(())
    }
}

impl Default for HarvestParams {
    fn default() -> Self {
        Self {
            decay: 0.5,
            k: 256,
            shift: 0,
        }
    }
}

/// What a harvest returns: `(page, score)` pairs in list order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Harvest {
    /// The hottest pages not in device memory.
    pub hot: Vec<(u64, f32)>,
    /// The coldest pages in device memory.
    pub cold: Vec<(u64, f32)>,
}

/// Folds `counts` into `scores` (clearing the counts) and selects the
/// lists; `resident(page)` says whether a page is in device memory.
/// `InvalidArgument` for parameters [`HarvestParams::check`] refuses or
/// slices of different lengths (one score per counter), and nothing is
/// changed.
pub fn harvest(
    counts: &[AtomicU32],
    scores: &mut [f32],
    resident: &dyn Fn(usize) -> bool,
    params: HarvestParams,
) -> crate::error::Result<Harvest> {
    params.check()?;
    if counts.len() != scores.len() {
        return Err(crate::error::Error::invalid(format!(
            "{} counters and {} scores: one score per counter",
            counts.len(),
            scores.len()
        )));
    }
    Ok(harvest_touched(
        counts,
        scores,
        resident,
        params,
        &mut |_, _| {},
    ))
}

/// [`harvest`] on slices of one length, also reporting every page counted
/// since the last harvest with its (unscaled) count, in page order.
pub(crate) fn harvest_touched(
    counts: &[AtomicU32],
    scores: &mut [f32],
    resident: &dyn Fn(usize) -> bool,
    params: HarvestParams,
    touched: &mut dyn FnMut(u64, u32),
) -> Harvest {
    debug_assert_eq!(counts.len(), scores.len(), "one score per counter");
    let scale = (1u64 << params.shift) as f32;
    let mut hot: Vec<(u64, f32)> = Vec::new();
    let mut cold: Vec<(u64, f32)> = Vec::new();
    for (p, (count, score)) in counts.iter().zip(scores.iter_mut()).enumerate() {
        // Untouched pages cost a load, not a store.
        let c = match count.load(Ordering::Relaxed) {
            0 => 0,
            _ => count.swap(0, Ordering::Relaxed),
        };
        if c > 0 {
            touched(p as u64, c);
        }
        *score = score.mul_add(params.decay, c as f32 * scale);
        if resident(p) {
            cold.push((p as u64, *score));
        } else if *score > 0.0 {
            hot.push((p as u64, *score));
        }
    }
    let hot_order = |a: &(u64, f32), b: &(u64, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let cold_order = |a: &(u64, f32), b: &(u64, f32)| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0));
    Harvest {
        hot: first_k(hot, params.k, hot_order),
        cold: first_k(cold, params.k, cold_order),
    }
}

/// The first `k` of `v` in `order`, sorted: O(n + k log k).
fn first_k(
    mut v: Vec<(u64, f32)>,
    k: usize,
    order: impl Fn(&(u64, f32), &(u64, f32)) -> std::cmp::Ordering,
) -> Vec<(u64, f32)> {
    if k == 0 {
        return Vec::new();
    }
    if v.len() > k {
        v.select_nth_unstable_by(k - 1, &order);
        v.truncate(k);
    }
    v.sort_unstable_by(order);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(v: &[u32]) -> Vec<AtomicU32> {
        v.iter().map(|&c| AtomicU32::new(c)).collect()
    }

    #[test]
    fn counters_saturate_instead_of_wrapping() {
        assert_eq!(u64::from(COUNT_CEILING), (1u64 << 32) - (1 << 20));
        let header = include_str!("../include/strata_device.cuh");
        assert!(
            header.contains(
                &format!("#define STRATA_COUNT_CEILING {COUNT_CEILING:#X}u").replace("0X", "0x")
            ),
            "the device header's ceiling differs"
        );
        let c = counts(&[COUNT_CEILING - 2, u32::MAX - 5, 7]);
        for _ in 0..10 {
            touch(&c, 0, Some(0));
        }
        assert_eq!(c[0].load(Ordering::Relaxed), COUNT_CEILING);
        // Above the ceiling already (single increments raced past it):
        // neither a bulk add nor an increment moves it, and it never wraps.
        count_many(&c[1], 100);
        assert_eq!(c[1].load(Ordering::Relaxed), u32::MAX - 5);
        touch(&c, 1, Some(0));
        assert_eq!(c[1].load(Ordering::Relaxed), u32::MAX - 5);
        count_many(&c[2], 3);
        assert_eq!(c[2].load(Ordering::Relaxed), 10);
    }

    #[test]
    fn folds_decays_and_selects_both_lists() {
        let c = counts(&[5, 0, 9, 9, 1, 0, 3, 7]);
        let mut s = vec![0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0];
        let resident = |p: usize| p >= 4;
        let p = HarvestParams {
            decay: 0.5,
            k: 2,
            shift: 0,
        };
        let h = harvest(&c, &mut s, &resident, p).unwrap();
        assert_eq!(s, vec![5.0, 2.0, 9.0, 9.0, 1.0, 0.0, 4.0, 7.0]);
        assert!(c.iter().all(|x| x.load(Ordering::Relaxed) == 0));
        // Ties (9, 9) by page ascending.
        assert_eq!(h.hot, vec![(2, 9.0), (3, 9.0)]);
        assert_eq!(h.cold, vec![(5, 0.0), (4, 1.0)]);
        // Next round: nothing counted, scores halve.
        let h = harvest(&c, &mut s, &resident, p).unwrap();
        assert_eq!(h.hot, vec![(2, 4.5), (3, 4.5)]);
    }

    #[test]
    fn sampling_keeps_about_one_in_two_to_the_k_for_every_page() {
        // Four pages accessed round-robin (a pattern a fixed stride would
        // alias with): each keeps about 1 in 16 of its accesses.
        let mut s = Sampler::new(7);
        let mut kept = [0u32; 4];
        for i in 0..256_000usize {
            if s.hit(4) {
                kept[i % 4] += 1;
            }
        }
        for k in kept {
            // 4000 expected.
            assert!((3600..4400).contains(&k), "{kept:?}");
        }
        assert!((0..100).all(|_| s.hit(0)));
    }

    #[test]
    fn short_lived_accessors_are_sampled_at_the_same_rate() {
        // Many accessors of a few accesses each (kernel threads, readers):
        // together they keep about 1 in 16 of their accesses, whichever of
        // its accesses an accessor makes.
        for accesses in [1usize, 4, 16] {
            let (mut kept, mut made) = (0u64, 0u64);
            for seed in 0..200_000u64 {
                let mut s = Sampler::new(seed);
                for _ in 0..accesses {
                    kept += u64::from(s.hit(4));
                    made += 1;
                }
            }
            let rate = kept as f64 * 16.0 / made as f64;
            assert!(
                (0.95..1.05).contains(&rate),
                "{accesses} accesses each: {rate}"
            );
        }
        // This thread's sampler, left mid-gap at a coarse shift, samples
        // at the fine one.
        let c = counts(&[0]);
        touch(&c, 0, Some(16));
        for _ in 0..10_000 {
            touch(&c, 0, Some(1));
        }
        let kept = c[0].load(Ordering::Relaxed);
        assert!((4_500..5_500).contains(&kept), "{kept}");
    }

    #[test]
    fn shifts_beyond_a_counts_width_sample_as_the_widest_gap() {
        // A gap is a u32 (a GPU thread's register): shifts of 32 and more
        // sample as 31 does, and never overflow.
        for shift in [32, 40, 63, 64, u32::MAX] {
            let mut s = Sampler::new(3);
            assert!((0..1000).all(|_| !s.hit(shift)), "shift {shift}");
            let c = counts(&[0]);
            for _ in 0..1000 {
                touch(&c, 0, Some(shift));
            }
            assert_eq!(c[0].load(Ordering::Relaxed), 0, "shift {shift}");
        }
    }

    #[test]
    fn counts_added_in_bulk_stop_at_the_ceiling() {
        let c = AtomicU32::new(COUNT_CEILING - 5);
        count_many(&c, 100);
        assert_eq!(c.load(Ordering::Relaxed), COUNT_CEILING);
        count_one(&c);
        assert_eq!(c.load(Ordering::Relaxed), COUNT_CEILING);
        let c = AtomicU32::new(7);
        count_many(&c, 3);
        assert_eq!(c.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn only_pages_with_a_score_are_hot() {
        let c = counts(&[0, 0, 1]);
        let mut s = vec![0.0; 3];
        let h = harvest(&c, &mut s, &|_| false, HarvestParams::default()).unwrap();
        assert_eq!(h.hot, vec![(2, 1.0)]);
        assert!(h.cold.is_empty());
    }

    #[test]
    fn slices_of_other_lengths_are_refused_and_the_counts_kept() {
        let c = counts(&[4, 0, 1, 2]);
        let mut s = vec![0.0; 3];
        let err = harvest(&c, &mut s, &|_| false, HarvestParams::default()).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("one score per counter"), "{err}");
        assert_eq!(c[0].load(Ordering::Relaxed), 4);
        assert_eq!(s, vec![0.0; 3]);
    }
}
