//! The offloading modules: the optimizer against a plain reference Adam on
//! every tier, importance-aware convergence, the expert cache's contract.

use strata::link::LinkModel;
use strata::offload::moe::{
    parse_routing, parse_trace, Eviction, ExpertCache, MoeConfig, TransitionPredictor,
    MAX_MODELLED_SECONDS, MAX_ROUTING_CELLS,
};
use strata::offload::optim::{
    AdamParams, Importance, OffloadedAdam, OptimConfig, StateTier, Updater,
};
use strata::ErrorKind;

/// Reference Adam/AdamW: the documented formula as a plain loop.
fn reference_step(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: AdamParams, t: i32) {
    let bc1 = 1.0 - (p.beta1 as f64).powi(t);
    let bc2 = 1.0 - (p.beta2 as f64).powi(t);
    let step = (p.lr as f64 / bc1) as f32;
    let rs = (1.0 / bc2.sqrt()) as f32;
    let decay = (p.lr as f64 * p.weight_decay as f64) as f32;
    for i in 0..w.len() {
        m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g[i];
        v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * (g[i] * g[i]);
        let denom = v[i].sqrt() * rs + p.eps;
        w[i] -= step * (m[i] / denom) + decay * w[i];
    }
}

fn grads(n: usize, step: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u64).wrapping_mul(2654435761).wrapping_add(step * 97) % 10007;
            (x as f32 / 10007.0 - 0.5) * 0.1
        })
        .collect()
}

fn exact_on(tier: StateTier) {
    // Not a multiple of the chunk: the last chunk is partial.
    let n = 3 * 4096 + 123;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let p = AdamParams {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamParams::default()
    };
    let mut cfg = OptimConfig::new(tier);
    cfg.chunk_bytes = 16 << 10;
    cfg.adam = p;
    let mut opt = OffloadedAdam::new(&w0, cfg).unwrap();
    let (mut w, mut m, mut v) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for t in 1..=5u64 {
        let g = grads(n, t);
        // Odd steps leave the new weights in the caller's array too.
        let mut out = vec![f32::NAN; n];
        let s = if t % 2 == 1 {
            opt.step_into(&g, Some(&mut out)).unwrap()
        } else {
            opt.step(&g).unwrap()
        };
        assert_eq!(s.bytes_read, s.bytes_written);
        reference_step(&mut w, &mut m, &mut v, &g, p, t as i32);
        if t % 2 == 1 {
            assert_eq!(bits(&out), bits(&w), "weights out of step {t}");
        }
    }
    assert_eq!(bits(&opt.weights().unwrap()), bits(&w), "weights");
    assert_eq!(bits(&opt.read_state(1).unwrap()), bits(&m), "first moment");
    assert_eq!(bits(&opt.read_state(2).unwrap()), bits(&v), "second moment");
}

#[test]
fn plain_mode_is_bitwise_the_reference_on_host() {
    exact_on(StateTier::Host);
}

#[test]
fn plain_mode_is_bitwise_the_reference_on_cxl() {
    exact_on(StateTier::Cxl);
}

#[test]
fn plain_mode_is_bitwise_the_reference_on_nvme() {
    let dir = tempfile::tempdir().unwrap();
    exact_on(StateTier::Nvme(dir.path().to_path_buf()));
}

#[test]
fn wrong_gradient_count_is_refused() {
    let mut opt = OffloadedAdam::new(&[1.0; 10], OptimConfig::new(StateTier::Host)).unwrap();
    let e = opt.step(&[0.0; 9]).unwrap_err();
    assert!(
        e.to_string().contains("9 gradients for 10 parameters"),
        "{e}"
    );
}

/// Least squares y = X·w*, loss = mean((Xw − y)²), full-batch gradients.
struct Regression {
    x: Vec<f32>,
    y: Vec<f32>,
    rows: usize,
    dim: usize,
}

impl Regression {
    fn new(rows: usize, dim: usize) -> Self {
        let mut s = 12345u64;
        let mut rnd = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let x: Vec<f32> = (0..rows * dim).map(|_| rnd()).collect();
        let truth: Vec<f32> = (0..dim).map(|j| ((j % 7) as f32 - 3.0) * 0.5).collect();
        let y = (0..rows)
            .map(|r| (0..dim).map(|j| x[r * dim + j] * truth[j]).sum())
            .collect();
        Self { x, y, rows, dim }
    }
    fn loss_grad(&self, w: &[f32]) -> (f64, Vec<f32>) {
        let mut g = vec![0f32; self.dim];
        let mut loss = 0.0f64;
        for r in 0..self.rows {
            let row = &self.x[r * self.dim..(r + 1) * self.dim];
            let e: f32 = row.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() - self.y[r];
            loss += (e * e) as f64;
            for j in 0..self.dim {
                g[j] += 2.0 * e * row[j] / self.rows as f32;
            }
        }
        (loss / self.rows as f64, g)
    }
}

/// Importance-aware mode as documented, element by element: windows of
/// `every` steps; a flush (the first step, then every `every`-th) updates
/// every element once — resident ones with this step's gradient, the rest
/// with the mean of what they accumulated — and chooses each chunk's next
/// resident set by this step's |g|; inside a window only resident elements
/// update and the rest accumulate.
struct ImportanceReference {
    w: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    acc: Vec<f32>,
    resident: Option<Vec<bool>>,
    deferred: u64,
    t: i32,
    p: AdamParams,
    imp: Importance,
    chunk: usize,
}

impl ImportanceReference {
    fn update(&mut self, i: usize, g: f32) {
        let (w, m, v) = (&mut self.w[i..=i], &mut self.m[i..=i], &mut self.v[i..=i]);
        reference_step(w, m, v, &[g], self.p, self.t);
    }

    /// Returns whether the step was a flush.
    fn step(&mut self, g: &[f32]) -> bool {
        self.t += 1;
        self.deferred += 1;
        let flush = self.resident.is_none() || self.deferred >= self.imp.every;
        let resident = self.resident.take().unwrap_or_else(|| vec![false; g.len()]);
        for i in 0..g.len() {
            if resident[i] {
                self.update(i, g[i]);
            } else if flush {
                let mean = (self.acc[i] + g[i]) / self.deferred as f32;
                self.update(i, mean);
                self.acc[i] = 0.0;
            } else {
                self.acc[i] += g[i];
            }
        }
        if !flush {
            self.resident = Some(resident);
            return false;
        }
        // Each chunk's top `fraction` by |g|: exactly that many (at least
        // one), ties to the lower index.
        let mut next = vec![false; g.len()];
        for (c, gc) in g.chunks(self.chunk).enumerate() {
            let keep = ((gc.len() as f64 * self.imp.fraction).ceil() as usize).clamp(1, gc.len());
            let mut order: Vec<usize> = (0..gc.len()).collect();
            order.sort_by(|&a, &b| gc[b].abs().total_cmp(&gc[a].abs()).then(a.cmp(&b)));
            for &k in &order[..keep] {
                next[c * self.chunk + k] = true;
            }
        }
        self.resident = Some(next);
        self.deferred = 0;
        true
    }
}

fn importance_exact_on(tier: StateTier) {
    let n = 3 * 4096 + 123;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let p = AdamParams {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamParams::default()
    };
    let imp = Importance {
        fraction: 0.1,
        every: 3,
    };
    let mut cfg = OptimConfig::new(tier.clone());
    cfg.chunk_bytes = 16 << 10;
    cfg.adam = p;
    cfg.importance = Some(imp);
    let mut opt = OffloadedAdam::new(&w0, cfg).unwrap();
    let mut reference = ImportanceReference {
        w: w0.clone(),
        m: vec![0.0; n],
        v: vec![0.0; n],
        acc: vec![0.0; n],
        resident: None,
        deferred: 0,
        t: 0,
        p,
        imp,
        chunk: 4096,
    };
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    // Four chunks (the last partial) × three arrays × 16 KiB.
    let state_bytes = 4 * 3 * (16u64 << 10);
    for t in 1..=8u64 {
        let g = grads(n, t);
        let s = opt.step(&g).unwrap();
        let flush = reference.step(&g);
        // Flushes at steps 1, 4 and 7 stream the state; the others do not.
        assert_eq!(flush, t % 3 == 1, "step {t}");
        let moved = if flush { state_bytes } else { 0 };
        assert_eq!((s.bytes_read, s.bytes_written), (moved, moved), "step {t}");
        let what = format!("{} step {t}", tier.name());
        assert_eq!(
            bits(&opt.weights().unwrap()),
            bits(&reference.w),
            "{what}: weights"
        );
        assert_eq!(
            bits(&opt.read_state(1).unwrap()),
            bits(&reference.m),
            "{what}: m"
        );
        assert_eq!(
            bits(&opt.read_state(2).unwrap()),
            bits(&reference.v),
            "{what}: v"
        );
    }
}

#[test]
fn importance_mode_is_bitwise_its_definition_and_skips_the_tier_inside_a_window() {
    let dir = tempfile::tempdir().unwrap();
    importance_exact_on(StateTier::Host);
    importance_exact_on(StateTier::Cxl);
    importance_exact_on(StateTier::Nvme(dir.path().to_path_buf()));
}

#[test]
fn importance_mode_with_windows_of_one_step_is_plain_adam() {
    let n = 2 * 4096 + 7;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let build = |importance| {
        let mut cfg = OptimConfig::new(StateTier::Host);
        cfg.chunk_bytes = 16 << 10;
        cfg.importance = importance;
        OffloadedAdam::new(&w0, cfg).unwrap()
    };
    let mut plain = build(None);
    let mut windows = build(Some(Importance {
        fraction: 0.3,
        every: 1,
    }));
    for t in 1..=4 {
        let g = grads(n, t);
        plain.step(&g).unwrap();
        windows.step(&g).unwrap();
    }
    for k in 0..3 {
        let (a, b) = (plain.read_state(k).unwrap(), windows.read_state(k).unwrap());
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "state {k}"
        );
    }
}

fn train(importance: Option<Importance>, steps: usize) -> f64 {
    let prob = Regression::new(256, 64);
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = 4096;
    cfg.adam.lr = 0.02;
    cfg.importance = importance;
    let mut opt = OffloadedAdam::new(&[0.0; 64], cfg).unwrap();
    for _ in 0..steps {
        let w = opt.weights().unwrap();
        let (_, g) = prob.loss_grad(&w);
        opt.step(&g).unwrap();
    }
    prob.loss_grad(&opt.weights().unwrap()).0
}

#[test]
fn importance_mode_converges_to_the_loss_of_full_adam() {
    let start = Regression::new(256, 64).loss_grad(&[0.0; 64]).0;
    let full = train(None, 1500);
    let important = train(
        Some(Importance {
            fraction: 0.1,
            every: 4,
        }),
        1500,
    );
    // Stated tolerance: both reach a loss below 1e-4 of the starting loss
    // (the problem has an exact solution, loss 0), within 1e-4 absolute.
    eprintln!("start {start}, full {full}, importance-aware {important}");
    assert!(full < start * 1e-4, "full Adam: {full} from {start}");
    assert!(
        (important - full).abs() < 1e-4 * start.max(1.0),
        "importance-aware {important} vs full {full} (start {start})"
    );
}

/// `Updater::Cuda` works where there is a GPU and is a typed "no CUDA
/// device" everywhere else (also without the cuda feature).
#[test]
fn the_cuda_updater_is_a_gpu_or_no_device() {
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.updater = Updater::Cuda;
    match OffloadedAdam::new(&[1.0; 10], cfg) {
        Ok(opt) => assert_eq!(opt.updater(), Updater::Cuda),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::NoDevice, "{e}");
            assert!(e.to_string().contains("no CUDA device"), "{e}");
        }
    }
    assert_eq!("cuda".parse::<Updater>().unwrap(), Updater::Cuda);
    assert_eq!("CPU".parse::<Updater>().unwrap(), Updater::Cpu);
    assert!("gpu".parse::<Updater>().is_err());
}

/// The CUDA update (`kernels/adam.cu`) against the CPU update: bitwise the
/// same weights and moments after several steps, plain and importance-aware
/// (with flushes), on every tier, with chunks of several tiles and a
/// partial last chunk. Skipped with a printed reason where there is no GPU,
/// a failure with STRATA_REQUIRE_GPU=1.
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_update_is_bitwise_the_cpu_update() {
    // Skipped only where there is no GPU; any other failure of the CUDA
    // updater, on any tier, fails the test.
    if let Err(e) = strata::device::probe_gpus() {
        assert_eq!(e.kind(), strata::ErrorKind::NoDevice, "{e}");
        assert!(
            std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
            "STRATA_REQUIRE_GPU is set but no GPU opened: {e}"
        );
        eprintln!("skipping the cuda update: {e}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tiers = [
        StateTier::Host,
        StateTier::Cxl,
        StateTier::Nvme(dir.path().to_path_buf()),
    ];
    let modes = [
        None,
        Some(Importance {
            fraction: 0.1,
            every: 3,
        }),
    ];
    // 1 MiB chunks are four 64 Ki-element tiles; 16 KiB chunks are many
    // chunks of one short tile each.
    for (chunk_bytes, n) in [
        (1usize << 20, 2 * (1 << 18) + 1000),
        (16 << 10, 3 * 4096 + 123),
    ] {
        let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        for tier in &tiers {
            for importance in modes {
                let build = |updater| {
                    let mut cfg = OptimConfig::new(tier.clone());
                    cfg.chunk_bytes = chunk_bytes;
                    cfg.adam.lr = 1e-2;
                    cfg.adam.weight_decay = 0.01;
                    cfg.importance = importance;
                    cfg.updater = updater;
                    OffloadedAdam::new(&w0, cfg)
                };
                let mut gpu = build(Updater::Cuda)
                    .unwrap_or_else(|e| panic!("the CUDA updater on {tier:?}: {e}"));
                let mut cpu = build(Updater::Cpu).unwrap();
                for t in 1..=7u64 {
                    let g = grads(n, t);
                    cpu.step(&g).unwrap();
                    gpu.step(&g).unwrap();
                }
                let what = format!("{} chunks of {chunk_bytes}, {importance:?}", tier.name());
                for (k, state) in ["weights", "first moment", "second moment"]
                    .iter()
                    .enumerate()
                {
                    let (c, g) = (cpu.read_state(k).unwrap(), gpu.read_state(k).unwrap());
                    let differ = c
                        .iter()
                        .zip(&g)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(
                        differ.is_none(),
                        "{what}: {state} differ first at {differ:?}: cpu {:?} gpu {:?}",
                        differ.map(|i| c[i]),
                        differ.map(|i| g[i])
                    );
                }
            }
        }
    }
}

fn cache(slots: usize, eviction: Eviction) -> ExpertCache {
    let mut cfg = MoeConfig::new(slots, 64 << 10, 8 << 20);
    cfg.eviction = eviction;
    cfg.layers = 2;
    let mut c = ExpertCache::new(cfg).unwrap();
    for l in 0..2u32 {
        for e in 0..4u32 {
            c.register(l, e, &vec![(l * 16 + e) as u8; 64 << 10])
                .unwrap();
        }
    }
    c
}

/// A configuration a caller got wrong is an error, never a panic or an
/// allocation the size of an id: a page size that is not one, more layers
/// than a cache holds, a layer id beyond them.
#[test]
fn an_expert_cache_refuses_sizes_and_ids_out_of_range() {
    for page in [0usize, 3000, 4 << 20] {
        let mut cfg = MoeConfig::new(2, 64 << 10, 8 << 20);
        cfg.page_size = page;
        let e = ExpertCache::new(cfg).expect_err("refused");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "page {page}: {e}");
        assert!(e.to_string().contains("page_size"), "{e}");
    }
    let mut cfg = MoeConfig::new(2, 64 << 10, 8 << 20);
    cfg.layers = 1 << 40;
    let e = ExpertCache::new(cfg).expect_err("refused");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut c = ExpertCache::new(MoeConfig::new(2, 64 << 10, 8 << 20)).unwrap();
    let e = c.register(u32::MAX, 0, &[1u8; 4096]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("layer"), "{e}");
    // The highest id allowed works.
    c.register(strata::offload::moe::MAX_LAYERS - 1, 0, &[1u8; 4096])
        .unwrap();
    // A prediction naming an unknown expert starts no move at all.
    c.register(0, 0, &[1u8; 4096]).unwrap();
    for call in [ExpertCache::prefetch, ExpertCache::read_ahead] {
        let e = call(&c, 0, &[0, 99]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        let s = c.stats();
        assert_eq!((s.prefetches, s.reads_ahead, s.bytes_moved), (0, 0, 0));
    }
}

/// One pool of slots (the default) takes experts of any layer, whatever
/// `layers` says (it sizes per-layer slots only): fetch, prefetch and
/// eviction across layers work (a C client, which has no `layers` field,
/// found these panicking).
#[test]
fn one_pool_takes_experts_of_any_layer() {
    let mut c = ExpertCache::new(MoeConfig::new(2, 64 << 10, 8 << 20)).unwrap();
    for l in 0..3u32 {
        c.register(l, 0, &vec![l as u8 + 1; 64 << 10]).unwrap();
    }
    assert_eq!(c.prefetch(2, &[0]).unwrap(), 1);
    for l in [0u32, 1, 2, 0] {
        let pin = c.fetch(l, 0).unwrap();
        let mut got = vec![0u8; 64 << 10];
        pin.buffer().read(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == l as u8 + 1), "layer {l}");
    }
    assert!(c.stats().evictions >= 1);
}

#[test]
fn fetch_returns_device_pages_holding_the_expert() {
    let c = cache(2, Eviction::Lrfu { decay: 0.99 });
    let p = c.fetch(1, 3).unwrap();
    assert_eq!(p.addresses().len(), 1);
    assert_eq!(p.buffer().tier_of(0).unwrap(), Some(strata::Tier::Device));
    let mut b = [0u8; 4];
    p.buffer().read(100, &mut b).unwrap();
    assert_eq!(b, [19; 4]);
    drop(p);
    let s = c.stats();
    assert_eq!((s.fetches, s.hits), (1, 0));
    assert!(s.stall_modelled && s.stall_seconds > 0.0);
    // Again: a hit, no stall added, nothing moved.
    let before = s.stall_seconds;
    drop(c.fetch(1, 3).unwrap());
    let s = c.stats();
    assert_eq!((s.fetches, s.hits, s.bytes_moved), (2, 1, 64 << 10));
    assert_eq!(s.stall_seconds, before);
    assert!(c.fetch(5, 0).is_err());
}

#[test]
fn frequent_experts_survive_a_scan() {
    let c = cache(2, Eviction::Lrfu { decay: 0.99 });
    for _ in 0..5 {
        drop(c.fetch(0, 0).unwrap());
    }
    for e in 1..4 {
        drop(c.fetch(0, e).unwrap());
    }
    assert!(c.is_resident(0, 0).unwrap(), "the hot expert stayed");
    // LRU loses it.
    let c = cache(2, Eviction::Lru);
    for _ in 0..5 {
        drop(c.fetch(0, 0).unwrap());
    }
    for e in 1..4 {
        drop(c.fetch(0, e).unwrap());
    }
    assert!(!c.is_resident(0, 0).unwrap());
}

#[test]
fn prefetched_experts_are_protected_until_used_and_count_for_accuracy() {
    let c = cache(2, Eviction::Lrfu { decay: 0.99 });
    assert_eq!(c.prefetch(1, &[0, 1]).unwrap(), 2);
    // Both slots hold unused prefetches: a third prediction is dropped.
    assert_eq!(c.prefetch(1, &[2]).unwrap(), 0);
    let p = c.fetch(1, 0).unwrap();
    assert_eq!(p.buffer().tier_of(0).unwrap(), Some(strata::Tier::Device));
    drop(p);
    let s = c.stats();
    assert_eq!(
        (s.prefetches, s.prefetches_used, s.prefetches_dropped),
        (2, 1, 1)
    );
    assert_eq!(s.hits, 1);
    assert!((s.prefetch_accuracy() - 0.5).abs() < 1e-12);
}

/// The simulated device's slots are this process's memory: slots beyond
/// what the machine has available are refused before they are backed.
#[test]
fn simulated_slots_beyond_the_available_memory_are_refused() {
    let available = strata::sys::mem_available_bytes().unwrap();
    let slot = 2u64 << 20;
    let slots = (available / slot + 1) as usize;
    let mut cfg = MoeConfig::new(slots, slot, 8 << 20);
    cfg.page_size = 2 << 20;
    let err = ExpertCache::new(cfg).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfCapacity, "{err}");
    assert!(err.to_string().contains("simulated device"), "{err}");
}

/// The activation predictor learns which experts follow which, and takes
/// no layer or expert beyond its own (an error, nothing recorded), nor a
/// size whose tables would not fit.
#[test]
fn the_transition_predictor_learns_and_refuses_ids_beyond_its_own() {
    let mut p = TransitionPredictor::new(3, 4).unwrap();
    for _ in 0..8 {
        p.observe(0, None, &[1]).unwrap();
        p.observe(1, Some(&[1]), &[3]).unwrap();
    }
    assert_eq!(p.predict(0, &[1], 2, 0.5).unwrap(), vec![3]);
    assert_eq!(p.predict(2, &[1], 2, 0.5).unwrap(), Vec::<u32>::new());
    let kind = |r: strata::Result<()>| r.unwrap_err().kind();
    assert_eq!(kind(p.observe(3, None, &[0])), ErrorKind::InvalidArgument);
    assert_eq!(kind(p.observe(1, None, &[4])), ErrorKind::InvalidArgument);
    assert_eq!(
        kind(p.observe(1, Some(&[9]), &[0])),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        p.predict(0, &[7], 2, 0.5).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // The refused observations left the counts as they were.
    assert_eq!(p.predict(0, &[1], 2, 0.5).unwrap(), vec![3]);
    for (layers, experts) in [(2, 1 << 32), (1 << 20, 1 << 10), (usize::MAX, 2)] {
        assert_eq!(
            TransitionPredictor::new(layers, experts)
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidArgument
        );
    }
}

#[test]
fn pinned_experts_are_never_evicted() {
    let c = cache(1, Eviction::Lru);
    let p = c.fetch(0, 0).unwrap();
    let e = c.fetch(0, 1).err().expect("no slot free");
    assert!(e.to_string().contains("pinned"), "{e}");
    drop(p);
    drop(c.fetch(0, 1).unwrap());
}

#[test]
fn no_cache_moves_every_fetch() {
    let c = cache(2, Eviction::NoCache);
    for _ in 0..3 {
        drop(c.fetch(0, 0).unwrap());
    }
    let s = c.stats();
    assert_eq!((s.hits, s.bytes_moved), (0, 3 * (64 << 10)));
}

#[test]
fn trace_errors_name_the_line() {
    let (t, l, e) = parse_trace("# c\n0 0 1\n0 1 2\n1 0 3\n", "t").unwrap();
    assert_eq!((t.len(), l, e), (2, 2, 4));
    let err = parse_trace("0 0 1\n0 x 2\n", "trace.txt").unwrap_err();
    assert!(err.to_string().contains("trace.txt:2"), "{err}");
    let err = parse_trace("1 0 1\n0 0 2\n", "t").unwrap_err();
    assert!(err.to_string().contains("t:2"), "{err}");
    let err = parse_trace("0 0 1 fetched\n", "t").unwrap_err();
    assert!(err.to_string().contains("t:1"), "{err}");
}

#[test]
fn a_trace_asking_for_more_routing_lists_than_it_may_hold_is_refused_while_read() {
    // 9 000 one-line tokens, then one naming layer 4 000: 36 M lists of
    // mostly nothing, refused at that line rather than allocated.
    let mut text: String = (0..9000).map(|t| format!("{t} 0 1\n")).collect();
    text.push_str("9000 4000 1\n");
    let err = parse_routing(&text, "big.txt").unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("big.txt:9001") && msg.contains("routing lists"),
        "{msg}"
    );
    assert!(msg.contains(&MAX_ROUTING_CELLS.to_string()), "{msg}");
    // The same shape within the bound reads.
    let ok: String = (0..1000).map(|t| format!("{t} 3 1\n")).collect();
    let t = parse_routing(&ok, "ok.txt").unwrap();
    assert_eq!((t.routes.len(), t.layers), (1000, 4));
}

#[test]
fn a_trace_keeps_the_recorded_lookahead_apart_from_the_routing() {
    // Step 0: layer 0 routes 1 and 2, the lookahead guesses 3 for layer 1
    // (recorded while layer 0 ran), layer 1 routes 3. Step 1: a guess
    // first, then the routing.
    let text = "0 0 1\n0 0 2\n0 1 3 prefetched\n0 1 3\n1 1 0 prefetched\n1 0 0\n1 1 2\n";
    let t = parse_routing(text, "t").unwrap();
    assert!(t.has_prefetches);
    assert_eq!((t.layers, t.experts), (2, 4));
    assert_eq!(
        t.routes,
        vec![vec![vec![1, 2], vec![3]], vec![vec![0], vec![2]]]
    );
    assert_eq!(
        t.prefetched,
        vec![vec![vec![], vec![3]], vec![vec![], vec![0]]]
    );
    // The routing alone, as before.
    let (routes, l, e) = parse_trace(text, "t").unwrap();
    assert_eq!((routes, l, e), (t.routes.clone(), 2, 4));
    let plain = parse_routing("0 0 1\n", "t").unwrap();
    assert!(!plain.has_prefetches);
    assert_eq!(plain.prefetched, vec![vec![Vec::<u32>::new()]]);
}

/// Two layers of four 256 KiB experts (four 64 KiB pages each), byte
/// `16 × layer + expert` throughout.
fn paged_cache(slots: usize, link_priority: bool) -> ExpertCache {
    let mut cfg = MoeConfig::new(slots, 256 << 10, 8 << 20);
    cfg.layers = 2;
    cfg.link_priority = link_priority;
    let mut c = ExpertCache::new(cfg).unwrap();
    for l in 0..2u32 {
        for e in 0..4u32 {
            c.register(l, e, &vec![(l * 16 + e) as u8; 256 << 10])
                .unwrap();
        }
    }
    c
}

/// Modelled link seconds of `bytes` crossing as one transfer.
fn link_seconds(bytes: usize) -> f64 {
    strata::device::sim::PCIE_GEN4_X16.time(bytes).as_secs_f64()
}

/// The cache's clock runs on the link its simulated device models: the
/// one [`MoeConfig::sim_link`] opens it on, which the runtime reports.
#[test]
fn the_modelled_clock_is_the_simulated_devices_link() {
    let slow = strata::link::LinkModel {
        bandwidth: 1e9,
        latency_ns: 40_000,
    };
    let mut cfg = MoeConfig::new(2, 256 << 10, 8 << 20);
    cfg.sim_link = slow;
    let mut c = ExpertCache::new(cfg).unwrap();
    assert_eq!(c.link(), Some(slow));
    assert_eq!(c.runtime().device_link_model(), Some(slow));
    c.register(0, 0, &vec![7u8; 256 << 10]).unwrap();
    drop(c.fetch(0, 0).unwrap());
    let stall = c.stats().stall_seconds;
    let want = slow.time(256 << 10).as_secs_f64();
    assert!((stall - want).abs() < 1e-9, "stall {stall} vs {want}");
    // The default is the simulation's own.
    assert_eq!(
        paged_cache(2, true).link(),
        Some(strata::device::sim::PCIE_GEN4_X16)
    );
}

/// The caller's compute time is a duration: anything else, or one that
/// would take the clock where its times lose their precision, is refused
/// and leaves the clock where it was.
#[test]
fn the_modelled_clock_takes_only_durations() {
    let c = paged_cache(2, true);
    c.advance(0.5).unwrap();
    let now = c.modelled_now().unwrap();
    for bad in [-1.0, f64::NAN, f64::INFINITY, MAX_MODELLED_SECONDS, 1.7e308] {
        let err = c.advance(bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{bad}: {err}");
        assert_eq!(c.modelled_now(), Some(now), "{bad}");
    }
    c.advance(MAX_MODELLED_SECONDS - 1.0).unwrap();
    drop(c.fetch(0, 1).unwrap());
    assert!(c.stats().stall_seconds.is_finite());
}

#[test]
fn a_demand_fetch_overtakes_queued_prefetches() {
    let expert = link_seconds(256 << 10);
    let page = link_seconds(64 << 10);
    for priority in [true, false] {
        let c = paged_cache(4, priority);
        assert_eq!(c.prefetch(1, &[0, 1]).unwrap(), 2);
        // The first prefetch's first page is on the wire when the demand
        // fetch comes.
        c.advance(1e-6).unwrap();
        drop(c.fetch(0, 2).unwrap());
        let stall = c.stats().stall_seconds;
        if priority {
            // It waits for that page, not for the two queued experts.
            let bound = page - 1e-6 + expert;
            assert!(
                (stall - bound).abs() < 1e-9,
                "stall {stall} vs one page then the expert {bound}"
            );
        } else {
            // One FIFO: both prefetches cross whole first.
            let fifo = 3.0 * expert - 1e-6;
            assert!((stall - fifo).abs() < 1e-9, "stall {stall} vs {fifo}");
        }
        // The prefetches still arrive and hold the right bytes.
        let p = c.fetch(1, 1).unwrap();
        let mut b = [0u8; 4];
        p.buffer().read((256 << 10) - 4, &mut b).unwrap();
        assert_eq!(b, [17; 4]);
    }
}

#[test]
fn a_fetch_of_a_prefetch_in_flight_waits_only_for_its_rest() {
    let expert = link_seconds(256 << 10);
    let c = paged_cache(4, true);
    assert_eq!(c.prefetch(1, &[0]).unwrap(), 1);
    // Halfway through its modelled transfer.
    c.advance(expert / 2.0).unwrap();
    drop(c.fetch(1, 0).unwrap());
    let s = c.stats();
    assert_eq!((s.hits, s.late_prefetch_hits, s.prefetches_used), (1, 1, 1));
    assert!(
        s.stall_seconds > 0.0 && s.stall_seconds <= expert / 2.0 + 1e-9,
        "stall {} for half an expert of {expert}",
        s.stall_seconds
    );
}

#[test]
fn a_cancelled_prefetch_frees_its_slot_and_never_returns_stale_data() {
    let c = paged_cache(2, true);
    assert_eq!(c.prefetch(1, &[0, 1]).unwrap(), 2);
    // Both slots hold unused prefetches: another prediction is dropped.
    assert_eq!(c.prefetch(1, &[2]).unwrap(), 0);
    assert_eq!(c.cancel_prefetches(1).unwrap(), 2);
    assert!(!c.is_resident(1, 0).unwrap() && !c.is_resident(1, 1).unwrap());
    let s = c.stats();
    assert_eq!((s.prefetches_cancelled, s.bytes_moved), (2, 0));
    // The slots are free again.
    assert_eq!(c.prefetch(1, &[2, 3]).unwrap(), 2);
    // A cancelled expert is a miss that moves it whole, from the host copy.
    let before = c.stats();
    for e in [0u32, 1] {
        let p = c.fetch(1, e).unwrap();
        assert_eq!(p.buffer().tier_of(0).unwrap(), Some(strata::Tier::Device));
        for page in 0..4u64 {
            let mut b = [0u8; 2];
            p.buffer().read(page * (64 << 10) + 7, &mut b).unwrap();
            assert_eq!(b, [16 + e as u8; 2], "page {page} of expert (1, {e})");
        }
    }
    let s = c.stats();
    assert_eq!(s.hits, before.hits, "cancelled prefetches are not hits");
}

#[test]
fn the_routers_picks_keep_their_prefetches_when_the_rest_are_cancelled() {
    let c = paged_cache(2, true);
    assert_eq!(c.prefetch(1, &[0, 1]).unwrap(), 2);
    // The layer's router picked 1 (and 3, never prefetched): 0 was wrong.
    assert_eq!(c.cancel_prefetches_except(1, &[1, 3]).unwrap(), 1);
    assert!(!c.is_resident(1, 0).unwrap() && c.is_resident(1, 1).unwrap());
    let before = c.stats();
    drop(c.fetch(1, 1).unwrap());
    let s = c.stats();
    assert_eq!((s.hits - before.hits, s.prefetches_cancelled), (1, 1));
}

#[test]
fn a_finished_prefetch_no_fetch_used_is_unprotected_when_its_layer_cancels() {
    let c = paged_cache(2, true);
    assert_eq!(c.prefetch(1, &[0, 1]).unwrap(), 2);
    c.advance(1.0).unwrap();
    // Both arrived: nothing to cancel, and the slots still hold them.
    assert_eq!(c.cancel_prefetches(1).unwrap(), 0);
    assert!(c.is_resident(1, 0).unwrap() && c.is_resident(1, 1).unwrap());
    // No longer protected: another prediction may take a slot (while they
    // were, it was dropped: see the test above).
    assert_eq!(c.prefetch(0, &[0]).unwrap(), 1);
    assert!(c.is_resident(0, 0).unwrap());
    assert_eq!(
        [0, 1]
            .iter()
            .filter(|&&e| c.is_resident(1, e).unwrap())
            .count(),
        1
    );
}

#[test]
fn a_finished_prefetch_is_not_cancelled() {
    let c = paged_cache(2, true);
    assert_eq!(c.prefetch(1, &[3]).unwrap(), 1);
    c.advance(1e-3).unwrap();
    assert_eq!(c.cancel_prefetches(1).unwrap(), 0);
    let before = c.stats().stall_seconds;
    drop(c.fetch(1, 3).unwrap());
    let s = c.stats();
    assert_eq!((s.hits, s.late_prefetch_hits), (1, 0));
    assert_eq!(s.stall_seconds, before);
    assert_eq!(s.bytes_moved, 256 << 10);
}

#[test]
fn states_read_into_a_callers_array() {
    // 4 KiB chunks (1024 values): three whole chunks and a short one.
    let n = 3 * 1024 + 77;
    let w0: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = 4096;
    let p = cfg.adam;
    let mut opt = OffloadedAdam::new(&w0, cfg).unwrap();
    let g = grads(n, 1);
    opt.step(&g).unwrap();
    let (mut w, mut m, mut v) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
    reference_step(&mut w, &mut m, &mut v, &g, p, 1);
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (which, expect) in [(0, &w), (1, &m), (2, &v)] {
        // Filled with NaN first: every value must come from the tier.
        let mut out = vec![f32::NAN; n];
        opt.read_state_into(which, &mut out).unwrap();
        assert_eq!(bits(&out), bits(expect), "state {which}");
    }
    let mut short = vec![0.0; n - 1];
    let e = opt.read_state_into(0, &mut short).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(short.iter().all(|&x| x == 0.0), "refused before writing");
    assert!(opt.read_state_into(3, &mut vec![0.0; n]).is_err());
}

#[test]
fn step_into_refuses_a_wrong_length_and_follows_importance_windows() {
    let n = 2 * 4096 + 7;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = 16 << 10;
    cfg.importance = Some(Importance {
        fraction: 0.3,
        every: 3,
    });
    let mut opt = OffloadedAdam::new(&w0, cfg).unwrap();
    let mut short = vec![0.0; n - 1];
    let e = opt.step_into(&grads(n, 1), Some(&mut short)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(opt.steps(), 0, "refused before the step");
    // Flushes and steps inside a window alike leave what read_state says.
    for t in 1..=7 {
        let mut out = vec![f32::NAN; n];
        opt.step_into(&grads(n, t), Some(&mut out)).unwrap();
        assert_eq!(out, opt.read_state(0).unwrap(), "step {t}");
    }
}

/// An expert cache on a runtime the caller shares: the experts' pages
/// count against the same host budget as the caller's buffers, the
/// caller's own device pages and the cache's slots share the device tier
/// (a fetch makes room by demoting the caller's unpinned pages), and an
/// expert the runtime moved away between fetches is found gone, counted
/// and brought back, its bytes intact.
#[test]
fn an_expert_cache_shares_a_runtime_with_user_buffers() {
    use strata::{runtime::Placement, Runtime, Tier};
    const P: usize = 64 << 10;
    let rt = Runtime::builder()
        .page_size(P)
        .device(strata::device::DeviceChoice::Sim, 6 * P as u64)
        .host(32 * P as u64)
        .background_eviction(false)
        .build()
        .unwrap();
    // The caller's buffer fills the device tier.
    let mine = rt
        .alloc_with(6 * P as u64, Placement::Prefer(Tier::Device))
        .unwrap();
    mine.write(0, &vec![7u8; 6 * P]).unwrap();
    let host_before = rt.stats().tiers[1].used_pages;
    let mut c = ExpertCache::on(&rt, MoeConfig::new(2, P as u64, 0)).unwrap();
    for e in 0..4u32 {
        c.register(0, e, &vec![e as u8 + 1; P]).unwrap();
    }
    assert_eq!(
        rt.stats().tiers[1].used_pages,
        host_before + 4,
        "the experts live in the shared host tier"
    );
    let c = std::sync::Arc::new(c);
    let pin = c.fetch_owned(0, 2).unwrap();
    assert_eq!(pin.buffer().tier_of(0).unwrap(), Some(Tier::Device));
    let mut got = vec![0u8; P];
    pin.buffer().read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 3));
    // Room was made by demoting one of the caller's pages; its bytes stay.
    let mut all = vec![0u8; 6 * P];
    mine.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 7));
    assert!(mine.residency().in_tier(Tier::Device) < 6);
    // The runtime (here: the caller) moves the unpinned expert away.
    let expert = pin.buffer().clone();
    drop(pin);
    expert.evict(0..expert.len(), Tier::Host).unwrap();
    let pin = c.fetch(0, 2).unwrap();
    assert_eq!(pin.buffer().tier_of(0).unwrap(), Some(Tier::Device));
    pin.buffer().read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 3));
    drop(pin);
    let s = c.stats();
    assert_eq!((s.fetches, s.hits, s.displaced), (2, 0, 1), "{s:?}");
    // A hit now.
    drop(c.fetch(0, 2).unwrap());
    assert_eq!(c.stats().hits, 1);
}

#[test]
fn a_shared_expert_cache_needs_a_device_tier_that_holds_its_slots() {
    use strata::Runtime;
    let rt = Runtime::builder().host(1 << 20).build().unwrap();
    let e = ExpertCache::on(&rt, MoeConfig::new(1, 64 << 10, 0)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let rt = Runtime::builder()
        .device(strata::device::DeviceChoice::Sim, 2 << 16)
        .host(1 << 20)
        .build()
        .unwrap();
    let e = ExpertCache::on(&rt, MoeConfig::new(3, 64 << 10, 0)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
}

/// The optimizer on a runtime shared with the caller's buffers: bitwise
/// the reference Adam with its states in each tier of that runtime, the
/// states counted in the runtime's tiers beside the caller's own buffer,
/// whose bytes stay as written.
#[test]
fn the_optimizer_on_a_shared_runtime_is_bitwise_the_reference_in_every_tier() {
    use strata::runtime::Runtime;
    use strata::tier::{CxlConfig, CxlMode, NvmeConfig};
    use strata::Tier;
    const P: usize = 16 << 10;
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(P)
        .host(64 * P as u64)
        .cxl(CxlConfig::new(CxlMode::Emulated, 64 * P as u64, P))
        .nvme(NvmeConfig::new(dir.path(), 256 * P as u64, P))
        .background_eviction(false)
        .build()
        .unwrap();
    let mine = rt.alloc(8 * P as u64).unwrap();
    mine.write(0, &vec![4u8; 8 * P]).unwrap();
    let n = 3 * 4096 + 123;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos()).collect();
    let p = AdamParams {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamParams::default()
    };
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (tier, home) in [
        (StateTier::Host, Tier::Host),
        (StateTier::Cxl, Tier::Cxl),
        (StateTier::Nvme(dir.path().into()), Tier::Nvme),
    ] {
        let used = |t: Tier| {
            rt.stats()
                .tiers
                .iter()
                .find(|s| s.tier == t)
                .unwrap()
                .used_pages
        };
        let before = used(home);
        let mut cfg = OptimConfig::new(tier);
        cfg.chunk_bytes = P;
        cfg.adam = p;
        let mut opt = OffloadedAdam::on(&rt, &w0, cfg).unwrap();
        // Four chunks of three pages, in the runtime's tier.
        assert_eq!(used(home), before + 12, "{home}");
        let (mut w, mut m, mut v) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
        for t in 1..=4u64 {
            let g = grads(n, t);
            let mut out = vec![f32::NAN; n];
            let s = opt.step_into(&g, Some(&mut out)).unwrap();
            assert_eq!(s.bytes_read, 12 * P as u64);
            reference_step(&mut w, &mut m, &mut v, &g, p, t as i32);
            assert_eq!(bits(&out), bits(&w), "{home}: weights out of step {t}");
        }
        assert_eq!(bits(&opt.read_state(1).unwrap()), bits(&m), "{home}");
        assert_eq!(bits(&opt.read_state(2).unwrap()), bits(&v), "{home}");
        // A checkpoint's restore: the states written back, read again.
        opt.write_state(1, &w0).unwrap();
        assert_eq!(bits(&opt.read_state(1).unwrap()), bits(&w0), "{home}");
        drop(opt);
        assert_eq!(used(home), before, "{home}: the states' pages came back");
    }
    let mut back = vec![0u8; 8 * P];
    mine.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 4));
}

#[test]
fn the_optimizer_on_a_shared_runtime_refuses_what_it_cannot_do() {
    use strata::runtime::Runtime;
    let rt = Runtime::builder()
        .page_size(16 << 10)
        .host(1 << 20)
        .build()
        .unwrap();
    let w = vec![0.5f32; 100];
    let mut cfg = OptimConfig::new(StateTier::Host);
    let e = OffloadedAdam::on(&rt, &w, cfg.clone()).unwrap_err();
    assert!(e.to_string().contains("page size"), "{e}");
    cfg.chunk_bytes = 16 << 10;
    let mut cxl = cfg.clone();
    cxl.tier = StateTier::Cxl;
    let e = OffloadedAdam::on(&rt, &w, cxl).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("cxl"), "{e}");
    let mut gpu = cfg.clone();
    gpu.updater = Updater::Cuda;
    let e = OffloadedAdam::on(&rt, &w, gpu).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(OffloadedAdam::on(&rt, &[], cfg.clone()).is_err());
    assert!(OffloadedAdam::on(&rt, &w, cfg).is_ok());
}

/// On a shared runtime a prefetch can find the device tier full of the
/// caller's pinned pages; once they are unpinned, a fetch of that expert
/// still works (the failed prefetch is a miss, not an error).
#[test]
fn a_failed_prefetch_on_a_shared_runtime_is_a_miss_not_an_error() {
    use strata::{runtime::Placement, Runtime, Tier};
    const P: usize = 64 << 10;
    let rt = Runtime::builder()
        .page_size(P)
        .device(strata::device::DeviceChoice::Sim, 4 * P as u64)
        .host(32 * P as u64)
        .background_eviction(false)
        .build()
        .unwrap();
    let mine = rt
        .alloc_with(4 * P as u64, Placement::Prefer(Tier::Device))
        .unwrap();
    mine.write(0, &vec![7u8; 4 * P]).unwrap();
    let mut c = ExpertCache::on(&rt, MoeConfig::new(2, P as u64, 0)).unwrap();
    for e in 0..2u32 {
        c.register(0, e, &vec![e as u8 + 1; P]).unwrap();
    }
    let pinned = mine.pin(0..mine.len(), Tier::Device).unwrap();
    assert_eq!(c.prefetch(0, &[1]).unwrap(), 1);
    // The prefetch ends (refused: no room) before the pages are unpinned.
    let start = std::time::Instant::now();
    while rt.stats().in_flight_moves > 0 {
        assert!(start.elapsed() < std::time::Duration::from_secs(30));
        std::thread::yield_now();
    }
    drop(pinned);
    let pin = c.fetch(0, 1).unwrap();
    let mut got = vec![0u8; P];
    pin.buffer().read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 2));
    drop(pin);
    let s = c.stats();
    assert_eq!((s.fetches, s.hits, s.displaced), (1, 0, 1), "{s:?}");
}

/// Bytes the cache's runtime has written to its NVMe tier.
fn nvme_written(c: &ExpertCache) -> u64 {
    c.runtime()
        .stats()
        .links
        .iter()
        .filter(|l| l.to == strata::Tier::Nvme)
        .map(|l| l.stats.bytes)
        .sum()
}

/// `slots` device slots of one 64 KiB page, a one-expert host tier, the
/// rest on an NVMe tier in `dir`; the reuse estimate over `layers` layers.
fn one_page_experts(dir: &std::path::Path, slots: usize, layers: usize) -> MoeConfig {
    const P: usize = 64 << 10;
    let mut cfg = MoeConfig::new(slots, P as u64, P as u64);
    cfg.page_size = P;
    cfg.layers = layers;
    cfg.eviction = Eviction::Reuse { decay: 0.9 };
    cfg.nvme = Some(strata::NvmeConfig::new(dir, 16 * P as u64, P));
    cfg
}

/// Experts that live on NVMe beyond a one-expert host budget, read ahead
/// of their fetch and prefetched, are read back intact on every fetch and
/// never written back: each eviction drops the device copy onto the clean
/// copy it came from. Reads ahead count as misses, not hits.
#[test]
fn experts_on_nvme_are_read_ahead_and_never_written_back() {
    const P: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let expert = 3 * P as u64;
    let mut cfg = MoeConfig::new(3, expert, expert + P as u64);
    cfg.page_size = P;
    cfg.nvme = Some(strata::NvmeConfig::new(dir.path(), 16 * expert, P));
    let mut c = ExpertCache::new(cfg).unwrap();
    let weights = |e: u32| -> Vec<u8> {
        (0..expert as usize)
            .map(|i| (i as u32 * 7 + e * 31) as u8)
            .collect()
    };
    for e in 0..8u32 {
        c.register(0, e, &weights(e)).unwrap();
    }
    let after_register = nvme_written(&c);
    let mut misses = 0;
    for round in 0..4u32 {
        for e0 in (0..8u32).step_by(2) {
            let layer_experts = [e0, (e0 + 1) % 8];
            let missing: Vec<u32> = layer_experts
                .iter()
                .copied()
                .filter(|&e| !c.is_resident(0, e).unwrap())
                .collect();
            assert_eq!(c.read_ahead(0, &missing).unwrap(), missing.len());
            misses += missing.len() as u64;
            c.prefetch(0, &[(e0 + 2 + round) % 8]).unwrap();
            for e in layer_experts {
                let pin = c.fetch(0, e).unwrap();
                let mut got = vec![0u8; expert as usize];
                pin.buffer().read(0, &mut got).unwrap();
                assert!(got == weights(e), "expert {e} in round {round}");
            }
            c.cancel_prefetches(0).unwrap();
        }
    }
    assert_eq!(
        nvme_written(&c),
        after_register,
        "evictions wrote experts back"
    );
    let s = c.stats();
    assert!(misses > 0);
    assert_eq!((s.fetches, s.reads_ahead), (32, misses));
    assert_eq!(
        s.hits,
        s.fetches - misses,
        "reads ahead are misses, the rest hits"
    );
    assert!(c.runtime().stats().clean_demotions > 0);
}

/// On a decoder's cycle through its layers the reuse estimate keeps the
/// experts of the layers about to run and evicts those of the layer just
/// run, where LRU does the opposite: over 10 passes through 4 layers of
/// one expert each with 3 slots, LRU misses every fetch; reuse misses as
/// Belady's MIN does on a cycle one longer than the slots, once every 3
/// fetches after the 4 cold misses: 4 + 36 / 3 = 16.
#[test]
fn the_reuse_estimate_beats_lru_on_the_layer_cycle() {
    let misses = |eviction: Eviction| {
        let mut cfg = MoeConfig::new(3, 64 << 10, 8 << 20);
        cfg.eviction = eviction;
        cfg.layers = 4;
        let mut c = ExpertCache::new(cfg).unwrap();
        for l in 0..4u32 {
            c.register(l, 0, &vec![l as u8; 64 << 10]).unwrap();
        }
        for _ in 0..10 {
            for l in 0..4u32 {
                drop(c.fetch(l, 0).unwrap());
            }
        }
        let s = c.stats();
        s.fetches - s.hits
    };
    let reuse = misses(Eviction::Reuse { decay: 0.9 });
    let lru = misses(Eviction::Lru);
    assert_eq!(lru, 40, "LRU evicts the expert needed next");
    assert!(reuse <= 16, "reuse: {reuse} misses");
}

/// A prediction whose only victim is worth more than it is declined
/// (counted), and the victim stays.
#[test]
fn the_reuse_estimate_declines_prefetches_worth_less_than_their_victim() {
    let mut cfg = MoeConfig::new(1, 64 << 10, 8 << 20);
    cfg.eviction = Eviction::Reuse { decay: 0.9 };
    cfg.layers = 2;
    let mut c = ExpertCache::new(cfg).unwrap();
    for l in 0..2u32 {
        for e in 0..2u32 {
            c.register(l, e, &vec![1; 64 << 10]).unwrap();
        }
    }
    // Layer 1's expert 0 is used every visit; layer 0's expert 1 never.
    for _ in 0..4 {
        drop(c.fetch(0, 0).unwrap());
        drop(c.fetch(1, 0).unwrap());
    }
    // At layer 1, the one slot holds (1, 0), used every visit, next needed
    // two layers from now: worth 1/2. A prediction for layer 0 (the next
    // to run, worth 1) takes its slot...
    assert_eq!(c.prefetch(0, &[0]).unwrap(), 1);
    drop(c.fetch(0, 0).unwrap());
    drop(c.fetch(1, 0).unwrap());
    // ...but at layer 1 a prediction for layer 1 itself (a whole cycle
    // away, worth 1/2 at best) does not take the slot of (1, 0).
    let before = c.stats().prefetches_declined;
    assert_eq!(c.prefetch(1, &[1]).unwrap(), 0);
    assert_eq!(c.stats().prefetches_declined, before + 1);
    assert!(c.is_resident(1, 0).unwrap());
}

/// A victim's loss is its reuse value times its miss's cost: an expert
/// whose copy is in host memory comes back with a copy, one on NVMe with a
/// read from the disk. Between an expert of the next layer kept in host
/// memory and one of the layer being visited kept on NVMe (worth half as
/// much by reuse alone), weighing every miss alike evicts the NVMe one; at
/// the default cost of an NVMe miss the host one goes, its copy in host
/// memory untouched.
#[test]
fn a_victim_kept_in_host_memory_is_cheaper_to_evict_than_one_on_nvme() {
    const P: usize = 64 << 10;
    let evicted = |nvme_miss_cost: f64| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = one_page_experts(dir.path(), 2, 2);
        cfg.nvme_miss_cost = nvme_miss_cost;
        let mut c = ExpertCache::new(cfg).unwrap();
        // (0, 0) fills the one-expert host tier; the others go to NVMe.
        for (l, e) in [(0, 0), (1, 0), (1, 1)] {
            c.register(l, e, &vec![(l * 2 + e) as u8 + 1; P]).unwrap();
        }
        for _ in 0..4 {
            drop(c.fetch(0, 0).unwrap());
            drop(c.fetch(1, 0).unwrap());
        }
        let pin = c.fetch(1, 1).unwrap();
        let mut got = vec![0u8; P];
        pin.buffer().read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 4));
        drop(pin);
        let gone: Vec<(u32, u32)> = [(0, 0), (1, 0)]
            .into_iter()
            .filter(|&(l, e)| !c.is_resident(l, e).unwrap())
            .collect();
        assert_eq!(gone.len(), 1, "one victim for one slot");
        // The victim comes back intact from wherever it was kept.
        let mut back = vec![0u8; P];
        let pin = c.fetch(gone[0].0, gone[0].1).unwrap();
        pin.buffer().read(0, &mut back).unwrap();
        assert!(back
            .iter()
            .all(|&x| x == (gone[0].0 * 2 + gone[0].1) as u8 + 1));
        // The disk reads: (1, 0) and (1, 1) once each, and the victim again
        // if it was (1, 0).
        (gone[0], c.stats().moves_from_nvme)
    };
    assert_eq!(evicted(1.0), ((1, 0), 3), "by reuse alone");
    assert_eq!(
        evicted(4.0),
        ((0, 0), 2),
        "its host copy is cheap to bring back"
    );
    let mut bad = MoeConfig::new(2, P as u64, P as u64);
    bad.nvme_miss_cost = f64::NAN;
    let e = ExpertCache::new(bad).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// On the simulated device a move from NVMe is modelled on the NVMe link
/// where one is given: a fetch of an expert on the disk stalls for the
/// disk's time, one of an expert in host memory for the device link's.
#[test]
fn a_move_from_nvme_is_modelled_on_the_disk_link() {
    const P: usize = 64 << 10;
    let stalls = |nvme_link: Option<LinkModel>| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = MoeConfig::new(2, P as u64, P as u64);
        cfg.page_size = P;
        cfg.layers = 2;
        cfg.eviction = Eviction::Lru;
        cfg.nvme = Some(strata::NvmeConfig::new(dir.path(), 16 * P as u64, P));
        cfg.sim_link = LinkModel {
            bandwidth: 64.0 * P as f64,
            latency_ns: 0,
        };
        cfg.sim_nvme_link = nvme_link;
        let mut c = ExpertCache::new(cfg).unwrap();
        // (0, 0) fills the one-expert host tier; (1, 0) goes to NVMe.
        c.register(0, 0, &vec![1; P]).unwrap();
        c.register(1, 0, &vec![2; P]).unwrap();
        let mut out = Vec::new();
        for (l, e) in [(0, 0), (1, 0)] {
            let before = c.stats().stall_seconds;
            let pin = c.fetch(l, e).unwrap();
            let mut got = vec![0u8; P];
            pin.buffer().read(0, &mut got).unwrap();
            assert!(got.iter().all(|&x| x == l as u8 + 1));
            out.push(c.stats().stall_seconds - before);
        }
        out
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let alike = stalls(None);
    assert!(
        close(alike[0], 1.0 / 64.0) && close(alike[1], 1.0 / 64.0),
        "{alike:?}"
    );
    let disk = stalls(Some(LinkModel {
        bandwidth: 16.0 * P as f64,
        latency_ns: 0,
    }));
    assert!(
        close(disk[0], 1.0 / 64.0) && close(disk[1], 1.0 / 16.0),
        "{disk:?}"
    );
    let mut bad = MoeConfig::new(2, P as u64, P as u64);
    bad.sim_nvme_link = Some(LinkModel {
        bandwidth: 0.0,
        latency_ns: 0,
    });
    let e = ExpertCache::new(bad).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// Once the host tier cannot hold every expert it caches them: an expert
/// never used gives its host slot to one that is, a fetch then copies that
/// one from host memory instead of reading the disk, and nothing is written
/// after registration.
#[test]
fn the_host_tier_caches_the_experts_worth_keeping() {
    const P: usize = 64 << 10;
    let run = |host_cache: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = one_page_experts(dir.path(), 1, 3);
        cfg.host_cache = host_cache;
        let mut c = ExpertCache::new(cfg).unwrap();
        // (2, 0), never used, fills the one-expert host tier; (0, 0) and
        // (1, 0) go to NVMe.
        for l in [2u32, 0, 1] {
            c.register(l, 0, &vec![l as u8 + 1; P]).unwrap();
        }
        let written = nvme_written(&c);
        for _ in 0..8 {
            for l in [0u32, 1] {
                let pin = c.fetch(l, 0).unwrap();
                let mut got = vec![0u8; P];
                pin.buffer().read(0, &mut got).unwrap();
                assert!(got.iter().all(|&x| x == l as u8 + 1), "layer {l}");
            }
        }
        assert_eq!(
            nvme_written(&c),
            written,
            "nothing written after registration"
        );
        // The expert swapped out of host memory comes back intact.
        let pin = c.fetch(2, 0).unwrap();
        let mut got = vec![0u8; P];
        pin.buffer().read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 3));
        drop(pin);
        let s = c.stats();
        (s.moves_from_nvme, s.host_swaps)
    };
    // Kept: every fetch of the two experts in use reads the disk.
    assert_eq!(run(false), (16, 0));
    // Cached: after the first pass one of them is in host memory at a time.
    let (reads, swaps) = run(true);
    assert_eq!(swaps, 1, "the unused expert's slot, once");
    assert_eq!(reads, 2 + 7 + 1, "one disk read a pass after the first");
}

/// An expert the host tier took only part of at registration has no NVMe
/// copy of its pages in host memory: once whole in host memory it is never
/// the one swapped back to NVMe, where that would write it. Every fetch
/// reads the expert intact, and nothing is written after registration.
#[test]
fn an_expert_split_between_host_and_nvme_is_never_written_back() {
    const P: usize = 64 << 10;
    for in_place in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let expert = 2 * P;
        let mut cfg = MoeConfig::new(1, expert as u64, 3 * P as u64);
        cfg.page_size = P;
        cfg.layers = 3;
        cfg.eviction = Eviction::Reuse { decay: 0.9 };
        cfg.host_cache = true;
        cfg.host_in_place = in_place;
        cfg.nvme = Some(strata::NvmeConfig::new(dir.path(), 32 * P as u64, P));
        let mut c = ExpertCache::new(cfg).unwrap();
        let weights =
            |l: u32| -> Vec<u8> { (0..expert).map(|i| (i as u32 * 3 + l) as u8).collect() };
        // Layer 0's expert fits the host tier whole, layer 1's only half
        // of it, layer 2's goes to NVMe.
        for l in 0..3u32 {
            c.register(l, 0, &weights(l)).unwrap();
        }
        let written = nvme_written(&c);
        for pass in 0..6 {
            for l in [1u32, 2, 1, 0, 2, 1] {
                let pin = c.fetch(l, 0).unwrap();
                let mut got = vec![0u8; expert];
                pin.buffer().read(0, &mut got).unwrap();
                assert!(
                    got == weights(l),
                    "layer {l}, pass {pass}, in place {in_place}"
                );
            }
        }
        assert_eq!(
            nvme_written(&c),
            written,
            "written after registration (in place {in_place}): {:?}",
            c.stats()
        );
    }
}

/// An expert read in place whose pages someone still pins after the
/// cache's pin has gone (a tensor over them) stays in host memory: it is
/// not the one swapped out to make room, and every later fetch of it, and
/// of the others, reads the expert intact.
#[test]
fn an_expert_pinned_outside_the_cache_is_not_swapped_out_of_host_memory() {
    const P: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = one_page_experts(dir.path(), 1, 3);
    cfg.host_cache = true;
    cfg.host_in_place = true;
    let c = std::sync::Arc::new({
        let mut c = ExpertCache::new(cfg).unwrap();
        // (0, 0) fills the one-expert host tier; (1, 0) and (2, 0) go to
        // NVMe.
        for l in 0..3u32 {
            c.register(l, 0, &vec![l as u8 + 1; P]).unwrap();
        }
        c
    });
    let pin = c.clone().fetch_owned(0, 0).unwrap();
    assert_eq!(pin.tier(), strata::Tier::Host);
    let held = pin
        .buffer()
        .pin_read_owned(0..P as u64, strata::Tier::Host)
        .unwrap();
    drop(pin);
    let check = |l: u32| {
        let pin = c.fetch(l, 0).unwrap();
        let mut got = vec![0u8; P];
        pin.buffer().read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == l as u8 + 1), "layer {l}");
    };
    // Layers 1 and 2 take turns in the one slot, each evicted with the
    // host tier full; layer 1 is used most.
    for _ in 0..4 {
        for l in [1u32, 1, 2, 1, 0] {
            check(l);
        }
    }
    assert_eq!(c.stats().host_swaps, 0, "{:?}", c.stats());
    drop(held);
    for l in [1u32, 2, 0, 1, 0] {
        check(l);
    }
}

/// With `host_in_place`, an expert in host memory is read where it is: no
/// slot, no move, no eviction; the one device slot keeps the expert read
/// from NVMe, which then hits every time, and nothing is written.
#[test]
fn host_experts_are_read_in_place_and_leave_the_slots_to_experts_from_nvme() {
    const P: usize = 64 << 10;
    let run = |in_place: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = one_page_experts(dir.path(), 1, 2);
        cfg.host_in_place = in_place;
        let mut c = ExpertCache::new(cfg).unwrap();
        // (0, 0) fills the one-expert host tier; (1, 0) goes to NVMe.
        for l in [0u32, 1] {
            c.register(l, 0, &vec![l as u8 + 1; P]).unwrap();
        }
        let before = nvme_written(&c);
        assert_eq!(c.is_ready(0, 0).unwrap(), in_place);
        assert!(!c.is_resident(0, 0).unwrap());
        for _ in 0..8 {
            for l in [0u32, 1] {
                let pin = c.fetch(l, 0).unwrap();
                let want = if in_place && l == 0 {
                    strata::Tier::Host
                } else {
                    strata::Tier::Device
                };
                assert_eq!(pin.tier(), want, "layer {l}");
                assert_eq!(pin.buffer().tier_of(0).unwrap(), Some(want));
                let mut got = vec![0u8; P];
                pin.buffer().read(0, &mut got).unwrap();
                assert!(got.iter().all(|&x| x == l as u8 + 1), "layer {l}");
            }
            // Nothing to read ahead for an expert read in place.
            assert_eq!(c.read_ahead(0, &[0]).unwrap(), usize::from(!in_place));
            c.cancel_prefetches(0).unwrap();
        }
        assert_eq!(
            nvme_written(&c),
            before,
            "nothing written after registration"
        );
        c.stats()
    };
    let s = run(true);
    assert_eq!(
        (s.served_in_place, s.hits, s.moves_from_nvme, s.evictions),
        (8, 7, 1, 0)
    );
    assert_eq!(s.misses(), 1);
    assert_eq!(s.moves(), 1);
    // Without: the two share the slot, and the NVMe expert is read again.
    let s = run(false);
    assert_eq!(s.served_in_place, 0);
    assert!(s.moves_from_nvme > 1, "{s:?}");
}

/// A register that fails registers nothing: here the host tier, full,
/// turns into a cache and finds no room on NVMe for its experts' copies.
/// The experts registered before are fetched as before, the failed one is
/// unknown (not half there: its fetch once panicked), and a retry fails
/// the same way.
#[test]
fn a_failed_register_leaves_the_cache_as_it_was() {
    const P: usize = 4096;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = MoeConfig::new(1, P as u64, 2 * P as u64);
    cfg.page_size = P;
    cfg.host_cache = true;
    // Two pages, one held back for copy-then-commit writes.
    cfg.nvme = Some(strata::NvmeConfig::new(dir.path(), 2 * P as u64, P));
    let mut c = ExpertCache::new(cfg).unwrap();
    c.register(0, 0, &[1u8; P]).unwrap();
    c.register(1, 0, &[2u8; P]).unwrap();
    for _ in 0..2 {
        let e = c.register(2, 0, &[3u8; P]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
    }
    assert_eq!(
        c.fetch(2, 0).err().map(|e| e.kind()),
        Some(ErrorKind::NotFound)
    );
    for (layer, byte) in [(0u32, 1u8), (1, 2), (0, 1)] {
        let pin = c.fetch(layer, 0).unwrap();
        let mut got = vec![0u8; P];
        pin.buffer().read(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == byte), "layer {layer}");
    }
}

/// A pin taken through an expert's buffer outlives its fetch (a view kept
/// by the caller, as a DLPack tensor from Python can be): the expert keeps
/// its slot, and the cache evicts another, so that what it counts resident
/// is what is in device memory.
#[test]
fn an_expert_pinned_through_its_buffer_is_no_victim() {
    use strata::tier::Tier;
    const P: usize = 64 << 10;
    let mut c = ExpertCache::new(MoeConfig::new(2, P as u64, 8 * P as u64)).unwrap();
    for e in 0..3u32 {
        c.register(0, e, &vec![e as u8 + 1; P]).unwrap();
    }
    let c = std::sync::Arc::new(c);
    let kept = {
        let pin = c.fetch_owned(0, 0).unwrap();
        pin.buffer()
            .pin_read_owned(0..P as u64, Tier::Device)
            .unwrap()
    };
    drop(c.fetch(0, 1).unwrap());
    drop(c.fetch(0, 2).unwrap());
    let tier = |e: u32| {
        let pin = c.fetch_owned(0, e).unwrap();
        pin.buffer().tier_of(0).unwrap()
    };
    assert!(
        c.is_resident(0, 0).unwrap(),
        "the pinned expert keeps its slot"
    );
    assert!(!c.is_resident(0, 1).unwrap(), "the other one made the room");
    assert!(c.is_resident(0, 2).unwrap());
    let before = c.stats();
    assert_eq!(tier(0), Some(Tier::Device));
    assert_eq!(c.stats().hits, before.hits + 1);
    drop(kept);
}
