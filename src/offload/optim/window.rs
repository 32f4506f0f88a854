//! Importance-aware mode's window (ZenFlow's idea; see the module docs of
//! [`super`]): the elements each chunk keeps resident between flushes, the
//! gradients the others accumulate, and what a flush does to a chunk.
#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::ops::Range;

use super::precision::Element;
use crate::error::{Error, Result};

/// Importance-aware mode's window between two flushes: what a checkpoint
/// needs besides the state arrays to resume exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportanceWindow {
    /// Steps since the last flush.
    pub deferred_steps: u64,
    /// Per parameter, the gradients accumulated since the last flush (0
    /// for resident elements).
    pub accumulated: Vec<f32>,
    /// The parameters updated every step in this window, ascending.
    pub resident: Vec<u64>,
    /// Whether a first flush has chosen them (before it, none is).
    pub started: bool,
}

impl ImportanceWindow {
    /// Whether the window fits an optimizer of `params` parameters in
    /// windows of `every` steps.
    pub(super) fn check(&self, params: usize, every: u64) -> Result<()> {
        if self.accumulated.len() != params {
            return Err(Error::invalid(format!(
                "an importance window of {} gradient sums for {params} parameters",
                self.accumulated.len()
            )));
        }
        if self.deferred_steps >= every {
            return Err(Error::invalid(format!(
                "an importance window {} steps in, of windows of {every}",
                self.deferred_steps
            )));
        }
        if self.started == self.resident.is_empty() {
            return Err(Error::invalid(
                "an importance window that has started has resident elements (and only then)",
            ));
        }
        if self.resident.windows(2).any(|p| p[0] >= p[1])
            || self.resident.last().is_some_and(|&i| i >= params as u64)
        {
            return Err(Error::invalid(
                "an importance window's resident elements must be ascending parameter indices",
            ));
        }
        Ok(())
    }

    /// Per chunk of `chunk` elements, the resident sets of a window that
    /// has started, their values taken from `state` (weights, first and
    /// second moment, one value per parameter each).
    pub(super) fn residents(
        &self,
        state: &[Vec<f32>],
        chunk: usize,
        chunks: usize,
    ) -> Vec<Resident> {
        let mut resident = vec![Resident::default(); chunks];
        for &i in &self.resident {
            let i = i as usize;
            let r = &mut resident[i / chunk];
            r.idx.push((i % chunk) as u32);
            r.w.push(state[0][i]);
            r.m.push(state[1][i]);
            r.v.push(state[2][i]);
        }
        resident
    }
}

/// One chunk's resident elements (their indices in the chunk, ascending)
/// and their weights and moments, the truth between flushes.
#[derive(Debug, Default, Clone)]
pub(super) struct Resident {
    pub(super) idx: Vec<u32>,
    pub(super) w: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) v: Vec<f32>,
}

impl Resident {
    /// Puts the resident values back into the chunk's state.
    fn scatter(&self, w: &mut [f32], m: &mut [f32], v: &mut [f32]) {
        for (j, &i) in self.idx.iter().enumerate() {
            let i = i as usize;
            (w[i], m[i], v[i]) = (self.w[j], self.m[j], self.v[j]);
        }
    }

    /// Chooses the next window's resident elements by this step's |g| and
    /// copies their state out of the chunk.
    fn choose(g: &[f32], fraction: f64, w: &[f32], m: &[f32], v: &[f32]) -> Self {
        let idx = most_important(g, fraction);
        let pick = |a: &[f32]| idx.iter().map(|&i| a[i as usize]).collect();
        Self {
            w: pick(w),
            m: pick(m),
            v: pick(v),
            idx,
        }
    }

    /// The resident values of state `which` (0 weights, 1 first moment, 2
    /// second moment) over the chunk's values `dst`.
    pub(super) fn merge_into<W: Element>(&self, which: usize, dst: &mut [W]) {
        let src = [&self.w, &self.m, &self.v][which];
        for (j, &i) in self.idx.iter().enumerate() {
            dst[i as usize] = W::from_f32(src[j]);
        }
    }

    /// Takes state `which`'s new values for the resident elements from the
    /// chunk's values `src`.
    pub(super) fn take_from(&mut self, which: usize, src: &[f32]) {
        let dst = [&mut self.w, &mut self.m, &mut self.v][which].iter_mut();
        for (d, &i) in dst.zip(&self.idx) {
            *d = src[i as usize];
        }
    }
}

/// What a streamed step does to each chunk, whichever updater runs it.
#[derive(Clone, Copy)]
pub(super) struct StepPlan {
    pub(super) chunk: usize,
    pub(super) params: usize,
    /// Importance mode's flush: the share of elements to keep resident,
    /// and the steps the accumulators cover.
    pub(super) flush: Option<(f64, u64)>,
}

impl StepPlan {
    /// Chunk `c`'s elements of the parameter vector.
    pub(super) fn range(&self, c: usize) -> Range<usize> {
        c * self.chunk..((c + 1) * self.chunk).min(self.params)
    }

    /// Before chunk `c`'s update: the gradient each element updates with.
    /// Plain: this step's. A flush: the resident values go back into the
    /// chunk, resident elements take this step's gradient and the others
    /// the mean of their accumulated ones (this step's added); the
    /// accumulators are cleared.
    /// `g` is this step's gradient of the chunk (fp32).
    pub(super) fn gradient<'g>(
        &self,
        g: Cow<'g, [f32]>,
        state: [&mut [f32]; 3],
        acc: &mut [f32],
        resident: Option<&Resident>,
    ) -> Cow<'g, [f32]> {
        let Some((_, deferred)) = self.flush else {
            return g;
        };
        let [w, m, v] = state;
        let n = g.len();
        let mut eff: Vec<f32> = (0..n).map(|i| (acc[i] + g[i]) / deferred as f32).collect();
        if let Some(r) = resident {
            r.scatter(w, m, v);
            for &i in &r.idx {
                eff[i as usize] = g[i as usize];
            }
        }
        acc[..n].fill(0.0);
        eff.into()
    }

    /// After chunk `c`'s update on a flush: its next resident set.
    /// `g` is this step's gradient of the chunk (fp32).
    pub(super) fn choose(&self, g: &[f32], w: &[f32], m: &[f32], v: &[f32]) -> Option<Resident> {
        let (fraction, _) = self.flush?;
        let n = g.len();
        Some(Resident::choose(g, fraction, &w[..n], &m[..n], &v[..n]))
    }
}

/// The indices (ascending) of the `fraction` of `g`'s elements with the
/// largest |g|: exactly that many (at least one), whatever the ties — a
/// chunk whose gradient is all zeros keeps `fraction` of it, not all of it
/// — ties going to the lower index, a NaN ranked above every number.
/// Flushes choose resident elements with it.
fn most_important(g: &[f32], fraction: f64) -> Vec<u32> {
    let n = g.len();
    let keep = ((n as f64 * fraction).ceil() as usize).clamp(1, n.max(1));
    let mut idx: Vec<u32> = (0..n as u32).collect();
    if keep >= n {
        return idx;
    }
    let rank = |&a: &u32, &b: &u32| {
        g[a as usize]
            .abs()
            .total_cmp(&g[b as usize].abs())
            .then_with(|| b.cmp(&a))
    };
    idx.select_nth_unstable_by(n - keep, rank);
    idx.drain(..n - keep);
    idx.sort_unstable();
    idx
}

/// Inside a window the elements not resident add this step's gradients
/// to their accumulators; a resident element's accumulator stays 0.
pub(super) fn accumulate(accum: &mut [f32], grads: &[f32], chunk: usize, resident: &[Resident]) {
    use rayon::prelude::*;
    accum
        .par_chunks_mut(chunk)
        .zip(grads.par_chunks(chunk))
        .zip(resident.par_iter())
        .for_each(|((acc, g), r)| {
            for (a, x) in acc.iter_mut().zip(g) {
                *a += x;
            }
            for &i in &r.idx {
                acc[i as usize] = 0.0;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::most_important;

    #[test]
    fn keeps_exactly_the_fraction_whatever_the_ties() {
        // A chunk with no gradient keeps 5% of it, not all of it.
        assert_eq!(most_important(&[0.0; 1000], 0.05).len(), 50);
        // Tied magnitudes go to the lower index; the largest are kept.
        let g = [1.0, -3.0, 2.0, 2.0, -2.0, 0.5];
        assert_eq!(most_important(&g, 0.5), vec![1, 2, 3]);
        // A NaN ranks above every number; at least one element is kept.
        assert_eq!(most_important(&[1.0, f32::NAN, 5.0], 0.1), vec![1]);
        assert_eq!(most_important(&[0.0, 0.0], 1.0), vec![0, 1]);
    }
}
