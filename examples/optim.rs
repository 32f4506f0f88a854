//! Adam with its fp32 master weights and moments in host memory, CXL
//! (emulated where there is none) or NVMe, fitting y = 3x − 1.
//!
//! `cargo run --example optim [host|cxl|nvme DIR]`

use strata::offload::optim::{OffloadedAdam, OptimConfig, StateTier};

fn main() -> strata::Result<()> {
    let mut args = std::env::args().skip(1);
    let tier = match args.next().as_deref() {
        None | Some("host") => StateTier::Host,
        Some("cxl") => StateTier::Cxl,
        Some("nvme") => StateTier::Nvme(args.next().unwrap_or_else(|| ".".into()).into()),
        Some(t) => return Err(strata::Error::invalid(format!("unknown tier {t}"))),
    };
    let mut cfg = OptimConfig::new(tier);
    cfg.chunk_bytes = 4096;
    cfg.adam.lr = 0.05;
    // Parameters: [slope, intercept].
    let mut opt = OffloadedAdam::new(&[0.0, 0.0], cfg)?;
    let xs: Vec<f32> = (0..32).map(|i| i as f32 / 16.0 - 1.0).collect();
    for step in 0..400 {
        let w = opt.weights()?;
        let mut g = [0.0f32; 2];
        let mut loss = 0.0;
        for &x in &xs {
            let e = w[0] * x + w[1] - (3.0 * x - 1.0);
            loss += e * e / xs.len() as f32;
            g[0] += 2.0 * e * x / xs.len() as f32;
            g[1] += 2.0 * e / xs.len() as f32;
        }
        opt.step(&g)?;
        if step % 100 == 0 {
            println!("step {step}: loss {loss:.5}");
        }
    }
    let w = opt.weights()?;
    println!("fitted y = {:.3}x + {:.3}", w[0], w[1]);
    Ok(())
}
