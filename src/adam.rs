//! The Adam/AdamW arithmetic: hyper-parameters, the scalars of one step and
//! the element-wise update. A leaf: it imports nothing of the crate, so the
//! CPU path ([`crate::offload::optim`]) and the GPU path (`kernels/adam.cu`
//! through `device::cuda_adam`) share one definition.
//!
//! **The update** (the same order of operations for every element, so the
//! result is bitwise that of a plain loop; `t` counts steps from 1, `bc1 =
//! 1 − β1^t` and `bc2 = 1 − β2^t` computed in f64 then rounded to f32):
//!
//! ```text
//! m = β1·m + (1−β1)·g
//! v = β2·v + (1−β2)·(g·g)
//! w = w − lr·((m / bc1) / (sqrt(v / bc2) + ε) + wd·w)      (wd = 0: Adam)
//! ```
//!
//! The GPU kernel does the same fp32 operations in the same order (no FMA
//! contraction, IEEE division and square root), so both give bitwise the
//! same state.
#![forbid(unsafe_code)]

use serde::Serialize;

/// Adam hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay (AdamW); 0 for Adam.
    pub weight_decay: f32,
}

impl Default for AdamParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The scalars of step `t`.
#[derive(Debug, Clone, Copy)]
pub struct StepScalars {
    /// Hyper-parameters.
    pub p: AdamParams,
    /// 1 − β1^t.
    pub bc1: f32,
    /// 1 − β2^t.
    pub bc2: f32,
}

impl StepScalars {
    /// For step `t` (from 1).
    pub fn new(p: AdamParams, t: u64) -> Self {
        let t = t.min(i32::MAX as u64) as i32;
        Self {
            p,
            bc1: (1.0 - (p.beta1 as f64).powi(t)) as f32,
            bc2: (1.0 - (p.beta2 as f64).powi(t)) as f32,
        }
    }
}

/// The element-wise update over equal-length slices (see the module docs
/// for the exact formula). A plain loop the compiler vectorizes.
pub fn adam_update(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: &StepScalars) {
    let n = g.len();
    adam_update_with(w, m, v, n, |i| g[i], s);
}

/// As [`adam_update`], over the first `n` elements, element `i`'s
/// gradient `grad(i)`: a gradient widened from another type (and
/// unscaled) as the loop reads it, with no array of its own.
#[inline]
pub fn adam_update_with(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    n: usize,
    grad: impl Fn(usize) -> f32,
    s: &StepScalars,
) {
    let n = w.len().min(m.len()).min(v.len()).min(n);
    let (w, m, v) = (&mut w[..n], &mut m[..n], &mut v[..n]);
    let AdamParams {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    } = s.p;
    let (c1, c2) = (1.0 - beta1, 1.0 - beta2);
    for i in 0..n {
        let gi = grad(i);
        let mi = beta1 * m[i] + c1 * gi;
        let vi = beta2 * v[i] + c2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        w[i] -= lr * ((mi / s.bc1) / ((vi / s.bc2).sqrt() + eps) + weight_decay * w[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bias corrections of step 1 and the first update of a zero
    /// moment: m = (1−β1)·g, v = (1−β2)·g², so the step is lr·sign(g)
    /// (to within ε).
    #[test]
    fn the_first_step_moves_each_weight_by_the_learning_rate() {
        let p = AdamParams::default();
        let s = StepScalars::new(p, 1);
        assert_eq!(s.bc1, 1.0 - p.beta1);
        assert_eq!(s.bc2, (1.0 - p.beta2 as f64) as f32);
        let (mut w, mut m, mut v) = (vec![1.0f32; 3], vec![0.0; 3], vec![0.0; 3]);
        adam_update(&mut w, &mut m, &mut v, &[0.5, -2.0, 0.0], &s);
        assert!((w[0] - (1.0 - p.lr)).abs() < 1e-6, "{}", w[0]);
        assert!((w[1] - (1.0 + p.lr)).abs() < 1e-6, "{}", w[1]);
        assert_eq!(w[2], 1.0);
    }
}
