//! `strata bench moe`: token-by-token MoE decoding over an expert cache on
//! the simulated device — strata's [`ExpertCache`] (LRFU eviction, one
//! pool of slots, lookahead prefetch from an activation-aware predictor)
//! beside a per-layer LRU cache without prefetch (the mixtral-offloading
//! design) and no cache at all. Stall and decode times are **modelled**:
//! transfers on the simulated PCIe link (25 GB/s, 5 µs each), per-layer
//! compute as the graph benchmark's [`GpuModel`] (a launch plus reading the
//! layer's active experts from HBM).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::offload::moe::{
    parse_trace, Eviction, ExpertCache, MoeConfig, SyntheticRouter, TransitionPredictor,
};
use crate::workloads::graph::tiered::GpuModel;

/// Where the routing comes from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Routing {
    /// The synthetic router with Zipf(α) popularity.
    Zipf {
        /// Skew.
        alpha: f64,
    },
    /// A trace file of `token layer expert` lines.
    File {
        /// The file.
        path: PathBuf,
    },
}

impl FromStr for Routing {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(a) = s.strip_prefix("zipf:") {
            let alpha: f64 = a.parse().map_err(|_| {
                Error::invalid(format!("--routing {s:?}: not a number after zipf:"))
            })?;
            if !(alpha.is_finite() && alpha >= 0.0) {
                return Err(Error::invalid(format!(
                    "--routing {s:?}: alpha must be ≥ 0"
                )));
            }
            return Ok(Routing::Zipf { alpha });
        }
        if let Some(p) = s.strip_prefix("file:") {
            return Ok(Routing::File { path: p.into() });
        }
        Err(Error::invalid(format!(
            "--routing {s:?}: use zipf:ALPHA or file:PATH"
        )))
    }
}

/// Parameters.
#[derive(Debug, Clone, Serialize)]
pub struct MoeParams {
    /// MoE layers (from the trace file when `None` there).
    pub layers: Option<usize>,
    /// Experts per layer (likewise).
    pub experts: Option<usize>,
    /// Experts per token per layer (synthetic routing).
    pub top_k: usize,
    /// Bytes per expert.
    pub expert_bytes: u64,
    /// Device slots; `None`: 25% of all experts.
    pub device_slots: Option<usize>,
    /// Tokens decoded (synthetic routing; a trace has its own).
    pub tokens: usize,
    /// Routing.
    pub routing: Routing,
    /// Also run `lru` and `no-cache`.
    pub baselines: bool,
    /// Seed of the synthetic router.
    pub seed: u64,
    /// Runtime page size.
    pub page_size: usize,
}

/// One configuration's results.
#[derive(Debug, Clone, Serialize)]
pub struct MoeResult {
    /// `strata`, `lru` or `no-cache`.
    pub config: &'static str,
    /// Fetches that needed no transfer of their own.
    pub hit_rate: f64,
    /// Modelled seconds `fetch` waited.
    pub stall_seconds: f64,
    /// Bytes moved into device memory.
    pub bytes_moved: u64,
    /// Prefetched and then used, over prefetched (0 without prefetch).
    pub prefetch_accuracy: f64,
    /// Prefetches started.
    pub prefetches: u64,
    /// Hits that still waited for a prefetch in flight.
    pub late_prefetch_hits: u64,
    /// Fetches.
    pub fetches: u64,
    /// Modelled decode time of all tokens, seconds.
    pub modelled_seconds: f64,
    /// Tokens per modelled second.
    pub tokens_per_sec: f64,
    /// Fetches whose bytes were read back and checked.
    pub verified_fetches: u64,
    /// Wall seconds on this machine.
    pub wall_seconds: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct MoeReport {
    /// "simulated".
    pub backend: &'static str,
    /// Stall and decode times are modelled.
    pub modelled: bool,
    /// Parameters as given.
    pub params: MoeParams,
    /// Layers and experts used.
    pub layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Tokens decoded.
    pub tokens: usize,
    /// Device slots used.
    pub device_slots: usize,
    /// Bytes of all experts.
    pub expert_bytes_total: u64,
    /// Device slots' share of all experts' bytes.
    pub device_fraction: f64,
    /// Modelled compute per layer, seconds.
    pub layer_compute_seconds: f64,
    /// The modelled GPU.
    pub model: GpuModel,
    /// One entry per configuration.
    pub results: Vec<MoeResult>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Config {
    Strata,
    Lru,
    NoCache,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Strata => "strata",
            Config::Lru => "lru",
            Config::NoCache => "no-cache",
        }
    }
}

/// A prediction is prefetched only above this estimated probability.
const MIN_CONFIDENCE: f32 = 0.6;
/// Every this many fetches, the expert's bytes are read back and checked.
const VERIFY_EVERY: u64 = 64;

fn pattern(layer: usize, expert: usize) -> u8 {
    (layer * 31 + expert * 7 + 1) as u8
}

/// Runs every configuration.
pub fn run(params: &MoeParams, progress: &mut dyn FnMut(&str, f64)) -> Result<MoeReport> {
    crate::size::check_page_size(params.page_size).map_err(|e| e.context("--page-size"))?;
    if params.expert_bytes == 0 || params.expert_bytes > 1 << 30 {
        return Err(Error::invalid("--expert-bytes must be 1 byte to 1 GiB"));
    }
    progress("routing", 0.0);
    let (routes, layers, experts) = match &params.routing {
        Routing::Zipf { alpha } => {
            let layers = params.layers.unwrap_or(16);
            let experts = params.experts.unwrap_or(64);
            if params.tokens == 0 {
                return Err(Error::invalid("--tokens must be at least 1"));
            }
            let mut r = SyntheticRouter::new(layers, experts, params.top_k, *alpha, params.seed)
                .map_err(|e| e.context("--layers/--experts/--top-k"))?;
            (
                (0..params.tokens).map(|_| r.token()).collect::<Vec<_>>(),
                layers,
                experts,
            )
        }
        Routing::File { path } => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            let (t, l, e) = parse_trace(&text, &path.display().to_string())?;
            let layers = params.layers.unwrap_or(l);
            let experts = params.experts.unwrap_or(e);
            if l > layers || e > experts {
                return Err(Error::invalid(format!(
                    "{}: the trace has {l} layers and {e} experts; --layers {layers} --experts {experts} are fewer",
                    path.display()
                )));
            }
            (t, layers, experts)
        }
    };
    let all = layers * experts;
    let slots = params.device_slots.unwrap_or((all / 4).max(1));
    if slots == 0 || slots > all {
        return Err(Error::invalid(format!(
            "--device-slots {slots} must be 1 to the {all} experts"
        )));
    }
    let top_k = routes
        .iter()
        .flat_map(|t| t.iter().map(Vec::len))
        .max()
        .unwrap_or(1)
        .max(1);
    if slots < layers.max(top_k) {
        return Err(Error::invalid(format!(
            "--device-slots {slots}: the per-layer baseline needs a slot per layer and a token's {top_k} experts must fit ({layers} layers)"
        )));
    }
    let model = GpuModel::default();
    let compute =
        model.launch_seconds + (top_k as u64 * params.expert_bytes) as f64 / model.hbm_bandwidth;
    let mut configs = vec![Config::Strata];
    if params.baselines {
        configs.extend([Config::Lru, Config::NoCache]);
    }
    let mut results = Vec::new();
    for (i, &c) in configs.iter().enumerate() {
        let base = i as f64 / configs.len() as f64;
        let step = 1.0 / configs.len() as f64;
        results.push(run_config(
            params,
            c,
            &routes,
            layers,
            experts,
            slots,
            compute,
            &mut |f| progress(c.name(), base + step * f),
        )?);
    }
    progress("done", 1.0);
    let total = all as u64 * params.expert_bytes;
    Ok(MoeReport {
        backend: "simulated",
        modelled: true,
        params: params.clone(),
        layers,
        experts,
        tokens: routes.len(),
        device_slots: slots,
        expert_bytes_total: total,
        device_fraction: slots as f64 / all as f64,
        layer_compute_seconds: compute,
        model,
        results,
    })
}

#[allow(clippy::too_many_arguments)]
fn run_config(
    p: &MoeParams,
    config: Config,
    routes: &[Vec<Vec<u32>>],
    layers: usize,
    experts: usize,
    slots: usize,
    compute: f64,
    progress: &mut dyn FnMut(f64),
) -> Result<MoeResult> {
    let page = p.page_size as u64;
    let host = (layers * experts) as u64 * p.expert_bytes.div_ceil(page) * page + (4 << 20);
    let mut cfg = MoeConfig::new(slots, p.expert_bytes, host);
    cfg.page_size = p.page_size;
    cfg.layers = layers;
    let top_k = routes[0].iter().map(Vec::len).max().unwrap_or(1).max(1);
    cfg.protect_fetches = 2 * top_k as u64;
    match config {
        Config::Strata => {
            // Half-life of a use: four passes over all experts' fetch share.
            let half_life = 4.0 * (layers * experts) as f64;
            cfg.eviction = Eviction::Lrfu {
                decay: 0.5f64.powf(1.0 / half_life),
            };
        }
        Config::Lru => {
            cfg.eviction = Eviction::Lru;
            cfg.per_layer = true;
        }
        Config::NoCache => cfg.eviction = Eviction::NoCache,
    }
    let mut cache = ExpertCache::new(cfg)?;
    let mut w = vec![0u8; p.expert_bytes as usize];
    for l in 0..layers {
        for e in 0..experts {
            w.fill(pattern(l, e));
            cache.register(l as u32, e as u32, &w)?;
        }
    }
    let mut pred = TransitionPredictor::new(layers, experts);
    let start = Instant::now();
    let mut verified = 0u64;
    let mut n = 0u64;
    for (t, tok) in routes.iter().enumerate() {
        for l in 0..layers {
            let routed = &tok[l];
            for &e in routed {
                let pin = cache.fetch(l as u32, e)?;
                n += 1;
                if n % VERIFY_EVERY == 0 {
                    let mut b = [0u8; 1];
                    pin.buffer().read(p.expert_bytes - 1, &mut b)?;
                    if b[0] != pattern(l, e as usize) {
                        return Err(Error::new(
                            crate::error::ErrorKind::Corrupted,
                            format!("expert ({l}, {e}) read back wrong bytes"),
                        ));
                    }
                    verified += 1;
                }
            }
            // Prefetch only while the link would drain within this layer's
            // compute: a prefetch queued behind a backlog delays the next
            // layer's demand fetches more than it can hide.
            let idle = cache.link_backlog().is_none_or(|b| b <= compute);
            if config == Config::Strata && l + 1 < layers && idle {
                let guess = pred.predict(l, routed, top_k, MIN_CONFIDENCE);
                cache.prefetch(l as u32 + 1, &guess)?;
            }
            pred.observe(l, (l > 0).then(|| &tok[l - 1][..]), routed);
            cache.advance(compute);
        }
        if t % 16 == 0 {
            progress(t as f64 / routes.len() as f64);
        }
    }
    let s = cache.stats();
    let modelled = cache.modelled_now().unwrap_or(0.0);
    Ok(MoeResult {
        config: config.name(),
        hit_rate: s.hit_rate(),
        stall_seconds: s.stall_seconds,
        bytes_moved: s.bytes_moved,
        prefetch_accuracy: s.prefetch_accuracy(),
        prefetches: s.prefetches,
        late_prefetch_hits: s.late_prefetch_hits,
        fetches: s.fetches,
        modelled_seconds: modelled,
        tokens_per_sec: if modelled > 0.0 {
            routes.len() as f64 / modelled
        } else {
            0.0
        },
        verified_fetches: verified,
        wall_seconds: start.elapsed().as_secs_f64(),
    })
}
