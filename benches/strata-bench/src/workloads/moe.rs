//! Synthetic MoE routing for `strata bench moe`.
//!
//! The synthetic router of `strata bench moe`:
//! each layer has its own popularity order over its experts, and a token's
//! expert at rank r is drawn from Zipf(α) over ranks (top-k distinct
//! experts by rejection). *Drift*: before each token, each layer swaps two
//! adjacent ranks with probability `drift` (0.05 by default), so the
//! popular set changes slowly over a run. *Cross-layer correlation*: with
//! probability `correlation` (0.5) a token's j-th expert at layer l+1 is
//! π_l(its j-th expert at layer l), for a fixed random permutation π_l per
//! layer boundary, instead of a fresh Zipf draw — the structure that lets
//! an activation-aware predictor ([`TransitionPredictor`](strata::offload::moe::TransitionPredictor), counting which
//! experts follow which across layers, as MoE-Infinity does) look ahead.
#![forbid(unsafe_code)]

use strata::offload::moe::TokenRoute;
use strata::{Error, Result};

use crate::random::{Rng, Zipf};

/// The synthetic router of `strata bench moe`; see the module docs.
pub struct SyntheticRouter {
    layers: usize,
    experts: usize,
    top_k: usize,
    /// Zipf over ranks; `None` for α = 0 (uniform).
    zipf: Option<Zipf>,
    alpha: f64,
    /// `[layer][rank]` → expert.
    order: Vec<Vec<u32>>,
    /// `[layer boundary][expert]` → expert.
    next: Vec<Vec<u32>>,
    correlation: f64,
    drift: f64,
    rng: Rng,
}

impl std::fmt::Debug for SyntheticRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyntheticRouter")
            .field("layers", &self.layers)
            .field("experts", &self.experts)
            .field("top_k", &self.top_k)
            .field("correlation", &self.correlation)
            .field("drift", &self.drift)
            .finish()
    }
}

impl SyntheticRouter {
    /// Zipf(`alpha`) popularity, correlation 0.5, drift 0.05.
    pub fn new(layers: usize, experts: usize, top_k: usize, alpha: f64, seed: u64) -> Result<Self> {
        if layers == 0 || experts == 0 || top_k == 0 || top_k > experts {
            return Err(Error::invalid(format!(
                "a router needs layers ≥ 1 and 1 ≤ top-k ≤ experts (layers {layers}, experts {experts}, top-k {top_k})"
            )));
        }
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(Error::invalid(format!("zipf alpha {alpha} must be ≥ 0")));
        }
        let mut rng = Rng::new(seed);
        let perm = |rng: &mut Rng| {
            let mut p: Vec<u32> = (0..experts as u32).collect();
            rng.shuffle(&mut p);
            p
        };
        let order = (0..layers).map(|_| perm(&mut rng)).collect();
        let next = (1..layers).map(|_| perm(&mut rng)).collect();
        Ok(Self {
            layers,
            experts,
            top_k,
            zipf: (alpha > 0.0)
                .then(|| Zipf::new(experts as u64, alpha))
                .transpose()?,
            alpha,
            order,
            next,
            correlation: 0.5,
            drift: 0.05,
            rng,
        })
    }

    /// Sets the cross-layer correlation and the per-token drift probability.
    pub fn with_model(mut self, correlation: f64, drift: f64) -> Self {
        self.correlation = correlation.clamp(0.0, 1.0);
        self.drift = drift.clamp(0.0, 1.0);
        self
    }

    /// An expert of layer `l` not in `chosen`, by rank from the Zipf law
    /// (or uniformly), redrawn while it is taken. A law so steep that the
    /// redraws keep landing on taken ranks (α of 30 and more: nearly all
    /// its weight on rank 1) draws among the free ranks by their weights
    /// instead, so a token never waits on it.
    fn draw(&mut self, l: usize, chosen: &[u32]) -> u32 {
        for _ in 0..1024 {
            let r = match &self.zipf {
                Some(z) => z.sample(&mut self.rng) as usize - 1,
                None => self.rng.below(self.experts as u64) as usize,
            };
            let x = self.order[l][r];
            if !chosen.contains(&x) {
                return x;
            }
        }
        let free: Vec<(usize, f64)> = (0..self.experts)
            .filter(|&r| !chosen.contains(&self.order[l][r]))
            .map(|r| (r, ((r + 1) as f64).powf(-self.alpha)))
            .collect();
        // Relative to the first free rank's weight, which is the largest:
        // no underflow to a sum of zero.
        let top = free[0].1;
        let total: f64 = free.iter().map(|(_, w)| w / top).sum();
        let mut u = self.rng.unit() * total;
        for &(r, w) in &free {
            u -= w / top;
            if u <= 0.0 {
                return self.order[l][r];
            }
        }
        self.order[l][free[free.len() - 1].0]
    }

    /// One token: its top-k experts at every layer.
    pub fn token(&mut self) -> TokenRoute {
        for l in 0..self.layers {
            if self.experts > 1 && self.rng.unit() < self.drift {
                let r = self.rng.below(self.experts as u64 - 1) as usize;
                self.order[l].swap(r, r + 1);
            }
        }
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(self.layers);
        for l in 0..self.layers {
            let mut chosen = Vec::with_capacity(self.top_k);
            let prev: Option<&Vec<u32>> = l.checked_sub(1).map(|p| &out[p]);
            for j in 0..self.top_k {
                let mut pick = None;
                if let Some(prev) = prev.filter(|_| self.rng.unit() < self.correlation) {
                    let x = self.next[l - 1][prev[j] as usize];
                    if !chosen.contains(&x) {
                        pick = Some(x);
                    }
                }
                let x = match pick {
                    Some(x) => x,
                    None => self.draw(l, &chosen),
                };
                chosen.push(x);
            }
            out.push(chosen);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_is_skewed_and_deterministic() {
        let mut a = SyntheticRouter::new(4, 16, 2, 1.2, 7).unwrap();
        let mut b = SyntheticRouter::new(4, 16, 2, 1.2, 7).unwrap();
        let mut counts = [0u32; 16];
        for _ in 0..500 {
            let t = a.token();
            assert_eq!(t, b.token());
            assert_eq!(t.len(), 4);
            for l in &t {
                assert_eq!(l.len(), 2);
                assert_ne!(l[0], l[1]);
            }
            for &e in &t[0] {
                counts[e as usize] += 1;
            }
        }
        counts.sort_unstable();
        assert!(counts[15] > 4 * counts[8].max(1), "{counts:?}");
    }

    #[test]
    fn uniform_routing_when_alpha_is_zero() {
        let mut r = SyntheticRouter::new(2, 8, 2, 0.0, 1).unwrap();
        let mut seen = [false; 8];
        for _ in 0..200 {
            for &e in &r.token()[0] {
                seen[e as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert!(SyntheticRouter::new(2, 8, 9, 1.0, 1).is_err());
        assert!(SyntheticRouter::new(2, 8, 2, -1.0, 1).is_err());
    }
}
