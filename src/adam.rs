//! The Adam/AdamW arithmetic: hyper-parameters, the scalars of one step and
//! the element-wise update. A leaf: it imports nothing of the crate, so the
//! CPU path ([`crate::offload::optim`]) and the GPU path (`kernels/adam.cu`
//! through `device::cuda_adam`) share one definition.
//!
//! **The update** (the same order of operations for every element, so the
//! result is bitwise that of a plain loop; `t` counts steps from 1; the
//! step's scalars `step = lr / (1 − β1^t)`, `rs = 1 / sqrt(1 − β2^t)` and
//! `decay = lr·wd` computed in f64, then rounded to f32):
//!
//! ```text
//! m = β1·m + (1−β1)·g
//! v = β2·v + (1−β2)·(g·g)
//! w = w − (step·(m / (sqrt(v)·rs + ε)) + decay·w)      (wd = 0: Adam)
//! ```
//!
//! One division and one square root an element (the bias corrections are
//! folded into the scalars, as torch and DeepSpeed fold them): at AVX-512
//! width the loop then keeps up with the memory it streams. The GPU kernel
//! does the same fp32 operations in the same order (no FMA contraction,
//! IEEE division and square root), so both give bitwise the same state.
#![deny(unsafe_code)]

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

impl AdamParams {
    /// An error unless a step can take these: lr, eps and weight decay
    /// finite and non-negative, each beta in [0, 1) (a beta of 1 makes the
    /// bias correction 0, and every weight infinite or NaN).
    pub fn check(&self) -> crate::error::Result<()> {
        let ok = |x: f32| x.is_finite() && x >= 0.0;
        if !ok(self.lr) || !ok(self.eps) || !ok(self.weight_decay) {
            return Err(crate::error::Error::invalid(format!(
                "lr {}, eps {} and weight_decay {} must be finite and non-negative",
                self.lr, self.eps, self.weight_decay
            )));
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return Err(crate::error::Error::invalid(format!(
                "betas ({}, {}) must each be in [0, 1)",
                self.beta1, self.beta2
            )));
        }
        Ok(())
    }
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
    /// lr / (1 − β1^t).
    pub step_size: f32,
    /// 1 / sqrt(1 − β2^t).
    pub bc2_rsqrt: f32,
    /// lr · weight_decay.
    pub decay: f32,
}

impl StepScalars {
    /// For step `t` (from 1).
    pub fn new(p: AdamParams, t: u64) -> Self {
        let t = t.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - (p.beta1 as f64).powi(t);
        let bc2 = 1.0 - (p.beta2 as f64).powi(t);
        Self {
            p,
            bc1: bc1 as f32,
            bc2: bc2 as f32,
            step_size: (p.lr as f64 / bc1) as f32,
            bc2_rsqrt: (1.0 / bc2.sqrt()) as f32,
            decay: (p.lr as f64 * p.weight_decay as f64) as f32,
        }
    }
}

/// The element-wise update (see the module docs for the exact formula)
/// of the first `n` elements, `n` the shortest of the four slices' lengths
/// (the optimizer's chunks pass state slices of a whole page beside a
/// shorter tail of gradients); elements past `n` are left as they are. A
/// plain loop the compiler vectorizes, at the widest vectors the CPU has
/// (chosen at run time).
pub fn adam_update(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: &StepScalars) {
    adam_update_with(w, m, v, g, |x| x, s);
}

/// As [`adam_update`], each gradient `widen(g[i])`: gradients of another
/// type (bf16, fp16) widened, and unscaled, as the loop reads them, with
/// no fp32 array of their own.
#[inline]
pub fn adam_update_with<G: Copy>(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    widen: impl Fn(G) -> f32,
    s: &StepScalars,
) {
    adam_update_into(w, m, v, g, widen, &mut [] as &mut [f32], |x| x, s)
}

/// As [`adam_update_with`], also writing each new weight `narrow(w[i])`
/// into `out[i]` for `i < out.len()` in the same pass (a bf16 or fp16
/// parameter rounded from its fp32 master while the value is in a
/// register).
#[inline]
#[allow(clippy::too_many_arguments)]
pub fn adam_update_into<G: Copy, W: Copy>(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    widen: impl Fn(G) -> f32,
    out: &mut [W],
    narrow: impl Fn(f32) -> W,
    s: &StepScalars,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return wide::avx512(w, m, v, g, widen, out, narrow, s);
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return wide::avx2(w, m, v, g, widen, out, narrow, s);
        }
    }
    update_loop(w, m, v, g, widen, out, narrow, s)
}

/// The loop itself, inlined into each of the variants that the CPU's
/// features select.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_loop<G: Copy, W: Copy>(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    widen: impl Fn(G) -> f32,
    out: &mut [W],
    narrow: impl Fn(f32) -> W,
    s: &StepScalars,
) {
    let n = w.len().min(m.len()).min(v.len()).min(g.len());
    let (w, m, v, g) = (&mut w[..n], &mut m[..n], &mut v[..n], &g[..n]);
    if out.len() >= n {
        // One pass: the parameter written as its master is.
        let out = &mut out[..n];
        each_update(w, m, v, g, widen, s, |i, x| out[i] = narrow(x));
        return;
    }
    each_update(w, m, v, g, widen, s, |_, _| {});
    let k = out.len();
    for (o, &x) in out.iter_mut().zip(&w[..k]) {
        *o = narrow(x);
    }
}

/// The update of every element, each new weight handed to `put`.
#[inline(always)]
fn each_update<G: Copy>(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    widen: impl Fn(G) -> f32,
    s: &StepScalars,
    mut put: impl FnMut(usize, f32),
) {
    let n = w.len();
    let AdamParams {
        beta1, beta2, eps, ..
    } = s.p;
    let (c1, c2) = (1.0 - beta1, 1.0 - beta2);
    let (step, rs, decay) = (s.step_size, s.bc2_rsqrt, s.decay);
    for i in 0..n {
        let gi = widen(g[i]);
        let mi = beta1 * m[i] + c1 * gi;
        let vi = beta2 * v[i] + c2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        let wi = w[i] - (step * (mi / (vi.sqrt() * rs + eps)) + decay * w[i]);
        w[i] = wi;
        put(i, wi);
    }
}

/// The loop compiled for AVX2 and for AVX-512 (x86-64), called only where
/// the CPU has them. The same operations in the same order: vector
/// division and square root are IEEE (correctly rounded) like the scalar
/// ones, and nothing is contracted into FMA, so every variant gives
/// bitwise the same result.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod wide {
    use super::{update_loop, StepScalars};

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx512_loop<G: Copy, W: Copy>(
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        widen: impl Fn(G) -> f32,
        out: &mut [W],
        narrow: impl Fn(f32) -> W,
        s: &StepScalars,
    ) {
        update_loop(w, m, v, g, widen, out, narrow, s)
    }

    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx2_loop<G: Copy, W: Copy>(
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        widen: impl Fn(G) -> f32,
        out: &mut [W],
        narrow: impl Fn(f32) -> W,
        s: &StepScalars,
    ) {
        update_loop(w, m, v, g, widen, out, narrow, s)
    }

    /// The caller has checked that the CPU has AVX-512F.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn avx512<G: Copy, W: Copy>(
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        widen: impl Fn(G) -> f32,
        out: &mut [W],
        narrow: impl Fn(f32) -> W,
        s: &StepScalars,
    ) {
        debug_assert!(std::arch::is_x86_feature_detected!("avx512f"));
        // SAFETY: only called after is_x86_feature_detected!("avx512f")
        // (adam_update_with), so the instructions it was compiled with
        // exist on this CPU; the body is safe code.
        unsafe { avx512_loop(w, m, v, g, widen, out, narrow, s) }
    }

    /// The caller has checked that the CPU has AVX2.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn avx2<G: Copy, W: Copy>(
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        widen: impl Fn(G) -> f32,
        out: &mut [W],
        narrow: impl Fn(f32) -> W,
        s: &StepScalars,
    ) {
        debug_assert!(std::arch::is_x86_feature_detected!("avx2"));
        // SAFETY: only called after is_x86_feature_detected!("avx2")
        // (adam_update_with), so the instructions it was compiled with
        // exist on this CPU; the body is safe code.
        unsafe { avx2_loop(w, m, v, g, widen, out, narrow, s) }
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

    /// Every variant the CPU's features may select gives bitwise the
    /// baseline loop's result (the GPU kernel's too, by the same order of
    /// operations), for fp32 and widened gradients alike.
    #[test]
    fn the_vector_variants_agree_bitwise_with_the_baseline_loop() {
        let n = 10_007;
        let s = StepScalars::new(
            AdamParams {
                weight_decay: 0.1,
                ..AdamParams::default()
            },
            3,
        );
        let seq = |k: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2654435761) ^ k) % 20011) as f32 / 20011.0 - 0.5)
                .collect()
        };
        let (w0, m0, v0, g) = (
            seq(1),
            seq(2),
            seq(3).iter().map(|x| x.abs()).collect::<Vec<_>>(),
            seq(4),
        );
        type Update<'a> = &'a dyn Fn(&mut [f32], &mut [f32], &mut [f32]);
        let run = |f: Update<'_>| {
            let (mut w, mut m, mut v) = (w0.clone(), m0.clone(), v0.clone());
            f(&mut w, &mut m, &mut v);
            [w, m, v].map(|a| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        let base =
            run(&|w, m, v| update_loop(w, m, v, &g, |x| x, &mut [] as &mut [f32], |x| x, &s));
        assert_eq!(run(&|w, m, v| adam_update(w, m, v, &g, &s)), base);
        let halves: Vec<u16> = g.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let widen = |h: u16| f32::from_bits((h as u32) << 16);
        let base_h =
            run(&|w, m, v| update_loop(w, m, v, &halves, widen, &mut [] as &mut [f32], |x| x, &s));
        assert_eq!(
            run(&|w, m, v| adam_update_with(w, m, v, &halves, widen, &s)),
            base_h
        );
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                assert_eq!(
                    run(&|w, m, v| wide::avx2(
                        w,
                        m,
                        v,
                        &g,
                        |x| x,
                        &mut [] as &mut [f32],
                        |x| x,
                        &s
                    )),
                    base
                );
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                assert_eq!(
                    run(&|w, m, v| wide::avx512(
                        w,
                        m,
                        v,
                        &g,
                        |x| x,
                        &mut [] as &mut [f32],
                        |x| x,
                        &s
                    )),
                    base
                );
            }
        }
    }
}
