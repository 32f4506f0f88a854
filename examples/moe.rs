//! An MoE expert cache on the simulated device: register experts, prefetch
//! the next layer's predicted experts, fetch the routed ones.
//!
//! `cargo run --example moe`

use strata::offload::moe::{ExpertCache, MoeConfig, TransitionPredictor};

fn main() -> strata::Result<()> {
    let (layers, experts, top_k, bytes) = (4usize, 16usize, 2usize, 64 << 10);
    // 25% of the experts fit in device memory at once.
    let mut cfg = MoeConfig::new(layers * experts / 4, bytes as u64, 16 << 20);
    cfg.layers = layers;
    let mut cache = ExpertCache::new(cfg)?;
    for l in 0..layers as u32 {
        for e in 0..experts as u32 {
            cache.register(l, e, &vec![e as u8; bytes])?;
        }
    }
    let mut router = Router {
        state: 42,
        experts,
        top_k,
    };
    let mut predictor = TransitionPredictor::new(layers, experts)?;
    for _token in 0..200 {
        let routing: Vec<Vec<u32>> = (0..layers).map(|_| router.layer()).collect();
        for l in 0..layers {
            for &e in &routing[l] {
                let pinned = cache.fetch(l as u32, e)?;
                // A kernel would read the expert at these device addresses.
                assert!(!pinned.addresses().is_empty());
            }
            if l + 1 < layers {
                let guess = predictor.predict(l, &routing[l], top_k, 0.6)?;
                cache.prefetch(l as u32 + 1, &guess)?;
            }
            predictor.observe(l, (l > 0).then(|| &routing[l - 1][..]), &routing[l])?;
            // 10 µs of modelled compute per layer.
            cache.advance(10e-6)?;
        }
    }
    let s = cache.stats();
    println!(
        "hit rate {:.1}%, prefetch accuracy {:.1}%, {} bytes moved, stall {:.3} ms ({})",
        100.0 * s.hit_rate(),
        100.0 * s.prefetch_accuracy(),
        s.bytes_moved,
        s.stall_seconds * 1e3,
        if s.stall_modelled {
            "modelled"
        } else {
            "measured"
        }
    );
    Ok(())
}

/// A toy router: skewed towards low expert ids (u² of a uniform u), top-k
/// distinct. (`strata bench moe` has a fuller synthetic router.)
struct Router {
    state: u64,
    experts: usize,
    top_k: usize,
}

impl Router {
    fn layer(&mut self) -> Vec<u32> {
        let mut chosen = Vec::with_capacity(self.top_k);
        while chosen.len() < self.top_k {
            self.state = self
                .state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (self.state >> 11) as f64 / (1u64 << 53) as f64;
            let e = (u * u * self.experts as f64) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        chosen
    }
}
