//! Random numbers for the synthetic data: one generator (SplitMix64,
//! fixed forever, so every trace and workload is reproducible for a seed on
//! every platform and release), a Zipf sampler and a scramble of ranks.

#![forbid(unsafe_code)]

use strata::{Error, Result};

/// SplitMix64: small, fast, and fixed forever, so traces are reproducible.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Fills `bytes` with random bytes.
    pub fn fill(&mut self, bytes: &mut [u8]) {
        let mut chunks = bytes.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    /// Shuffles `items` uniformly (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// Zipf(α) over ranks `1..=n` by rejection-inversion (Hörmann and
/// Derflinger, 1996): O(1) per sample and no table, for any α > 0.
#[derive(Clone, Debug)]
pub struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    cut: f64,
}

impl Zipf {
    /// Ranks `1..=n` with P(k) ∝ k^-alpha.
    pub fn new(n: u64, alpha: f64) -> Result<Self> {
        if n == 0 {
            return Err(Error::invalid("zipf needs at least 1 page"));
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(Error::invalid(format!(
                "zipf exponent {alpha} must be a positive number"
            )));
        }
        let mut z = Self {
            n: n as f64,
            s: alpha,
            h_x1: 0.0,
            h_n: 0.0,
            cut: 0.0,
        };
        z.h_x1 = z.h_integral(1.5) - 1.0;
        z.h_n = z.h_integral(n as f64 + 0.5);
        z.cut = 2.0 - z.h_integral_inv(z.h_integral(2.5) - z.h(2.0));
        Ok(z)
    }

    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    fn h_integral(&self, x: f64) -> f64 {
        let lx = x.ln();
        helper2((1.0 - self.s) * lx) * lx
    }

    fn h_integral_inv(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.s)).max(-1.0);
        (helper1(t) * x).exp()
    }

    /// A rank in `1..=n`.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        loop {
            let u = self.h_n + rng.unit() * (self.h_x1 - self.h_n);
            let x = self.h_integral_inv(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.cut || u >= self.h_integral(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }
}

/// `ln(1 + x) / x`, accurate near 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, accurate near 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

/// A bijection of `0..n` that spreads neighbouring ranks far apart:
/// `r ↦ (a·r + b) mod n` with `a` near `n / φ` and coprime to `n`.
#[derive(Clone, Copy, Debug)]
pub struct Scramble {
    n: u64,
    a: u64,
    b: u64,
}

impl Scramble {
    /// A scramble of `0..n` (offset chosen by `rng`).
    pub fn new(n: u64, rng: &mut Rng) -> Self {
        let mut a = ((n as f64 * 0.618_033_988_749_895) as u64).max(1);
        while gcd(a, n) != 1 {
            a += 1;
        }
        Self {
            n,
            a,
            b: rng.below(n.max(1)),
        }
    }

    /// The image of `r` (`r < n`).
    pub fn apply(&self, r: u64) -> u64 {
        ((u128::from(r) * u128::from(self.a) + u128::from(self.b)) % u128::from(self.n)) as u64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
