//! `strata bench moe`: token-by-token MoE decoding over an expert cache on
//! the simulated device — strata's [`ExpertCache`] (the reuse estimate's
//! eviction, or LRFU with `--lrfu`; one pool of slots; a layer's missing
//! experts read ahead together, each expert's share of the layer's compute
//! run as its read completes; lookahead prefetch from an activation-aware
//! predictor) beside a per-layer LRU cache without prefetch (the mixtral-offloading
//! design) and no cache at all. Stall and decode times are **modelled**:
//! the simulated device is opened on a platform preset's link ([`Platform`]:
//! its DMA rate and per-copy cost), and the cache's clock schedules the
//! transfers on that backend's own model ([`ExpertCache::link`]; demand
//! transfers ahead of queued prefetches, which cross a page at a time —
//! `--fifo-link` for one FIFO of whole transfers; `--link-gbps` for a
//! measured link in place of the preset's; `--host-experts N` keeps the
//! first N experts registered in host memory and the rest on an NVMe tier,
//! as `strata.moe` does under a memory limit, with `--nvme-gbps` the link a
//! move from NVMe is modelled on); per-layer compute is
//! [`GpuModel`] of the same preset (a launch plus reading the layer's
//! active experts from HBM), or `--layer-compute-us`. The report carries offline bounds on the same fetch
//! sequence ([`MoeBounds`]: Belady's MIN, the best fixed set of experts).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use serde::Serialize;

use crate::machine::{check_memory, product};
use crate::workloads::graph::model::Platform;
use crate::workloads::graph::tiered::GpuModel;
use crate::workloads::moe::SyntheticRouter;
use strata::error::{Error, Result};
use strata::offload::moe::{
    parse_routing, Eviction, ExpertCache, MoeConfig, TokenRoute, TransitionPredictor,
};

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
    /// Model the link as one FIFO of whole transfers (no demand priority,
    /// no page-sized prefetch chunks): the model before chunking, for
    /// comparison. Configurations without prefetch move the same.
    pub fifo_link: bool,
    /// The device: `sim` (modelled time), `cuda` (a GPU: real device slots,
    /// measured stall; each layer's compute is a spin of the modelled
    /// length) or `auto`.
    pub device: strata::device::DeviceChoice,
    /// The modelled GPU: the simulated device's link, HBM and compute (on a
    /// real GPU, the link of the bounds).
    #[serde(serialize_with = "platform_name")]
    pub platform: Platform,
    /// The link the experts cross, in place of the platform's host→device
    /// link: a measured one (the disk's bandwidth when the experts come
    /// from NVMe), for the model and the bounds.
    pub link: Option<strata::link::LinkModel>,
    /// Each layer's compute between fetches, seconds, in place of the
    /// platform's HBM model: a measured one (a CPU's).
    pub layer_compute: Option<f64>,
    /// Each layer's time before its experts are known (attention, norms,
    /// the router), seconds: only reads already started (the lookahead's)
    /// progress in it, while a layer's own reads start after it. `None`:
    /// none, all of a layer's time is `layer_compute`'s.
    pub layer_other: Option<f64>,
    /// strata's eviction: LRFU (the policy before the reuse estimate) in
    /// place of the reuse estimate, for comparison.
    pub lrfu: bool,
    /// strata's lookahead from the bench's predictor even where the trace
    /// records the lookahead its run made.
    pub predictor: bool,
    /// Fetches a prefetched expert not yet used is protected for (default:
    /// twice the most experts a token of the routing takes in a layer).
    pub protect_fetches: Option<u64>,
    /// A host tier of this many experts (those registered first, as
    /// `strata.moe` places them), the others on an NVMe tier in `path`;
    /// `None`: every expert in host memory.
    pub host_experts: Option<usize>,
    /// The link a move from NVMe is modelled on (the disk's measured read
    /// bandwidth), with `host_experts`; `None`: `link`'s.
    pub nvme_link: Option<strata::link::LinkModel>,
    /// The directory of the NVMe tier, with `host_experts`.
    pub path: PathBuf,
    /// The host tier caches the experts ([`MoeConfig::host_cache`])
    /// instead of keeping those registered in it.
    pub host_cache: bool,
    /// Experts in host memory are read there, taking no slot
    /// ([`MoeConfig::host_in_place`]; strata's configuration only).
    pub host_in_place: bool,
}

fn platform_name<S: serde::Serializer>(p: &Platform, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.name)
}

/// The platform's host→device link: the simulated device's, and what the
/// bounds are modelled on where the cache measures (a real GPU).
fn link_of(p: &MoeParams) -> strata::link::LinkModel {
    p.link.unwrap_or(strata::link::LinkModel {
        bandwidth: p.platform.dma_h2d,
        latency_ns: (p.platform.dma_latency * 1e9) as u64,
    })
}

/// One configuration's results.
#[derive(Debug, Clone, Serialize)]
pub struct MoeResult {
    /// `strata`, `lru` or `no-cache`.
    pub config: &'static str,
    /// Fetches that needed no transfer of their own: hits in device
    /// memory and reads in place from host memory (`host_in_place`).
    pub hit_rate: f64,
    /// Fetches that found the expert whole where it is read (hits less
    /// those that waited for a prefetch still in flight, and reads in
    /// place).
    pub ready_rate: f64,
    /// Modelled seconds `fetch` waited.
    pub stall_seconds: f64,
    /// Bytes moved into device memory.
    pub bytes_moved: u64,
    /// Bytes copied back out of device memory by evictions (the runtime's
    /// device→host link traffic) while decoding: 0 for unmodified
    /// experts, whose host (or NVMe) copies stay valid while they are on
    /// the device.
    #[serde(default)]
    pub bytes_written_back: u64,
    /// Prefetched and then used, over prefetched (0 without prefetch).
    pub prefetch_accuracy: f64,
    /// Experts moved into device memory (misses and prefetches).
    #[serde(default)]
    pub moves: u64,
    /// Of `moves`, those whose expert was fetched before it left.
    #[serde(default)]
    pub moves_paid: u64,
    /// Of `moves`, those of experts on NVMe (disk reads; 0 without a host
    /// tier of `host_experts`).
    #[serde(default)]
    pub moves_from_nvme: u64,
    /// Evictions that took the host slot of an expert worth less there.
    #[serde(default)]
    pub host_swaps: u64,
    /// Fetches read in place from host memory (`host_in_place`).
    #[serde(default)]
    pub served_in_place: u64,
    /// Prefetches started.
    pub prefetches: u64,
    /// Hits that still waited for a prefetch in flight.
    pub late_prefetch_hits: u64,
    /// Fetches.
    pub fetches: u64,
    /// Decode time of all tokens, seconds: modelled on the simulated
    /// device, measured (wall) on a GPU.
    pub modelled_seconds: f64,
    /// Whether stall and decode times are modelled (simulated device).
    pub modelled: bool,
    /// Tokens per modelled second.
    pub tokens_per_sec: f64,
    /// Fetches whose bytes were read back and checked.
    pub verified_fetches: u64,
    /// Wall seconds on this machine.
    pub wall_seconds: f64,
    /// Of `wall_seconds`, those spent inside the calls that start or drop
    /// moves (`read_ahead`, `prefetch`, `cancel_prefetches`) on the
    /// decoding thread: their submission only, room being made off it.
    #[serde(default)]
    pub call_seconds: f64,
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
    /// Modelled time per layer before its experts are known, seconds.
    pub layer_other_seconds: f64,
    /// strata's lookahead: `recorded` (the trace's `prefetched` lines, what
    /// the recorded run prefetched) or `predictor` (the bench's
    /// activation-aware predictor).
    pub lookahead: &'static str,
    /// The modelled GPU.
    pub model: GpuModel,
    /// The host→device link the stall times and bounds are modelled on: the
    /// simulated device's (the platform's for the bounds on a real GPU).
    pub link: strata::link::LinkModel,
    /// One entry per configuration.
    pub results: Vec<MoeResult>,
    /// What perfect caching reaches on the same fetch sequence.
    pub bounds: MoeBounds,
}

/// Offline bounds on the same fetch sequence and slot count (one pool of
/// slots), in the same model. With a host tier (`host_experts`) the pool
/// is every expert held in memory — the device slots and the host tier —
/// and a miss is a read from NVMe on the NVMe link.
///
/// No cache, with or without prefetch, moves fewer experts than Belady's
/// MIN misses (a prefetch is a transfer too). The link carries one expert
/// at a time and can overlap transfers only with compute, so decoding
/// takes at least `transfers × transfer_seconds`, and the stall is at least
/// that minus all compute time.
#[derive(Debug, Clone, Serialize)]
pub struct MoeBounds {
    /// Belady's MIN: the fewest transfers any cache can make, as hits.
    pub belady_hit_rate: f64,
    /// The best fixed set of `device_slots` experts, chosen from the whole
    /// run's counts and loaded before it starts: what a frequency policy
    /// approaches online when routing is close to independent draws.
    pub static_oracle_hit_rate: f64,
    /// Modelled link time of one expert.
    pub transfer_seconds: f64,
    /// Modelled compute of all layers of all tokens.
    pub compute_seconds: f64,
    /// Belady's misses as demand transfers (perfect caching, no prefetch).
    pub belady_stall_seconds: f64,
    /// Belady's misses with perfect prefetch: at least
    /// `max(0, misses × transfer − compute)`.
    pub belady_prefetch_stall_floor_seconds: f64,
    /// The static oracle's misses with perfect prefetch, likewise.
    pub static_oracle_prefetch_stall_floor_seconds: f64,
}

/// Belady and static-oracle figures of `routes` for `slots` slots.
fn bounds(
    routes: &[Vec<Vec<u32>>],
    experts: usize,
    slots: usize,
    expert_bytes: u64,
    compute_seconds: f64,
    link: strata::link::LinkModel,
) -> MoeBounds {
    use strata::policy::{belady::Belady, Policy};
    let trace: Vec<u64> = routes
        .iter()
        .flat_map(|tok| {
            tok.iter()
                .enumerate()
                .flat_map(move |(l, es)| es.iter().map(move |&e| (l * experts) as u64 + e as u64))
        })
        .collect();
    let n = trace.len().max(1) as f64;
    let mut min = Belady::new(slots, &trace);
    let belady_hits = trace.iter().filter(|&&x| min.access(x).is_hit()).count();
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for &x in &trace {
        *counts.entry(x).or_default() += 1;
    }
    let mut c: Vec<usize> = counts.into_values().collect();
    c.sort_unstable_by(|a, b| b.cmp(a));
    let static_hits: usize = c.iter().take(slots).sum();
    let transfer = link.time(expert_bytes as usize).as_secs_f64();
    let floor = |hits: usize| ((trace.len() - hits) as f64 * transfer - compute_seconds).max(0.0);
    MoeBounds {
        belady_hit_rate: belady_hits as f64 / n,
        static_oracle_hit_rate: static_hits as f64 / n,
        transfer_seconds: transfer,
        compute_seconds,
        belady_stall_seconds: (trace.len() - belady_hits) as f64 * transfer,
        belady_prefetch_stall_floor_seconds: floor(belady_hits),
        static_oracle_prefetch_stall_floor_seconds: floor(static_hits),
    }
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
/// LRFU half-life of a use, in passes over all experts' fetch counts
/// (16 × 1,024 fetches = 256 tokens at the defaults): popularity drifts
/// slowly, so a long memory (nearly LFU) keeps the hot set; 4 passes
/// moved 0.5 points fewer hits at the defaults.
const HALF_LIFE_PASSES: f64 = 16.0;
/// The reuse estimate's half-life, in visits of a layer.
const HALF_LIFE_VISITS: f64 = 256.0;
/// Every this many fetches, the expert's bytes are read back and checked.
const VERIFY_EVERY: u64 = 64;

fn pattern(layer: usize, expert: usize) -> u8 {
    (layer * 31 + expert * 7 + 1) as u8
}

/// Runs every configuration.
pub fn run(params: &MoeParams, progress: &mut dyn FnMut(&str, f64)) -> Result<MoeReport> {
    strata::size::check_page_size(params.page_size).map_err(|e| e.context("--page-size"))?;
    if params.expert_bytes == 0 || params.expert_bytes > 1 << 30 {
        return Err(Error::invalid("--expert-bytes must be 1 byte to 1 GiB"));
    }
    progress("routing", 0.0);
    // The lookahead a recorded run made (`prefetched` lines), where the
    // trace has it: strata's configuration then prefetches what the
    // library's router prediction did, not the bench's predictor.
    let mut recorded: Option<Vec<TokenRoute>> = None;
    let (routes, layers, experts) = match &params.routing {
        Routing::Zipf { alpha } => {
            let layers = params.layers.unwrap_or(16);
            let experts = params.experts.unwrap_or(64);
            if params.tokens == 0 {
                return Err(Error::invalid("--tokens must be at least 1"));
            }
            check_memory(
                format_args!(
                    "--tokens {} --layers {layers} --experts {experts}",
                    params.tokens
                ),
                "the routes and the router's tables",
                product(&[
                    params.tokens as u64,
                    layers as u64,
                    (params.top_k as u64).saturating_mul(8).saturating_add(24),
                ])
                .saturating_add(product(&[layers as u64, experts as u64, 16])),
            )?;
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
                .map_err(|e| crate::files::read_error("reading", path, e))?;
            let trace = parse_routing(&text, &path.display().to_string())?;
            let (t, l, e) = (trace.routes, trace.layers, trace.experts);
            if trace.has_prefetches && !params.predictor {
                recorded = Some(trace.prefetched);
            }
            let layers = params.layers.unwrap_or(l);
            let experts = params.experts.unwrap_or(e);
            if l > layers || e > experts {
                return Err(Error::invalid(format!(
                    "{}: the trace has {l} layers and {e} experts; --layers {layers} --experts {experts} are fewer",
                    path.display()
                )));
            }
            if layers > l {
                return Err(Error::invalid(format!(
                    "{}: the trace routes {l} layers; --layers {layers} names layers it never routes (leave --layers out)",
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
    if let Some(h) = params.host_experts {
        if h == 0 {
            return Err(Error::invalid(
                "--host-experts 0: a host tier holds at least one expert (leave it out for every expert in host memory)",
            ));
        }
        if h >= all {
            return Err(Error::invalid(format!(
                "--host-experts {h}: a host tier of all {all} experts leaves none on NVMe; leave it out"
            )));
        }
    } else if params.nvme_link.is_some() {
        return Err(Error::invalid(
            "--nvme-gbps models moves from NVMe: give --host-experts, the experts held in host memory",
        ));
    }
    let in_host = params.host_experts.unwrap_or(all);
    // The experts in the host tier, the device slots, the routes.
    let experts_bytes = product(&[in_host as u64, params.expert_bytes]);
    let memory = experts_bytes
        .saturating_add(product(&[slots as u64, params.expert_bytes]))
        .saturating_add(product(&[
            routes.len() as u64,
            layers as u64,
            (top_k as u64).saturating_mul(8).saturating_add(24),
        ]));
    check_memory(
        format_args!(
            "--layers {layers} --experts {experts} --expert-bytes {}",
            params.expert_bytes
        ),
        "the experts in host memory and the device slots",
        memory,
    )?;
    let model = GpuModel::from(&params.platform);
    let compute = params.layer_compute.unwrap_or(
        model.launch_seconds + (top_k as u64 * params.expert_bytes) as f64 / model.hbm_bandwidth,
    );
    let other = params.layer_other.unwrap_or(0.0);
    let mut configs = vec![Config::Strata];
    if params.baselines {
        configs.extend([Config::Lru, Config::NoCache]);
    }
    let mut results = Vec::new();
    let mut link = link_of(params);
    for (i, &c) in configs.iter().enumerate() {
        let base = i as f64 / configs.len() as f64;
        let step = 1.0 / configs.len() as f64;
        let (result, modelled_on) = run_config(
            params,
            c,
            &routes,
            recorded.as_deref(),
            Shape {
                layers,
                experts,
                slots,
                top_k,
            },
            compute,
            other,
            &mut |f| progress(c.name(), base + step * f),
        )?;
        results.push(result);
        link = modelled_on.unwrap_or(link);
    }
    // With a host tier, the pool is every expert held in memory and a miss
    // a read from NVMe.
    let (pool, miss_link) = match params.host_experts {
        Some(h) => (slots + h, params.nvme_link.unwrap_or(link)),
        None => (slots, link),
    };
    let bounds = bounds(
        &routes,
        experts,
        pool,
        params.expert_bytes,
        (routes.len() * layers) as f64 * (compute + other),
        miss_link,
    );
    progress("done", 1.0);
    let total = all as u64 * params.expert_bytes;
    let modelled = results.iter().all(|r| r.modelled);
    Ok(MoeReport {
        backend: if modelled { "simulated" } else { "cuda" },
        modelled,
        params: params.clone(),
        layers,
        experts,
        tokens: routes.len(),
        device_slots: slots,
        expert_bytes_total: total,
        device_fraction: slots as f64 / all as f64,
        layer_compute_seconds: compute,
        layer_other_seconds: other,
        lookahead: if recorded.is_some() {
            "recorded"
        } else {
            "predictor"
        },
        model,
        link,
        results,
        bounds,
    })
}

/// Bytes the cache's runtime copied out of device memory so far.
fn d2h_bytes(cache: &ExpertCache) -> u64 {
    cache
        .runtime()
        .stats()
        .device_links
        .map_or(0, |(_, d2h)| d2h.bytes)
}

/// `seconds` of compute: spun on a real GPU (while prefetches cross the
/// link), advanced on the simulated device's clock.
fn run_compute(cache: &ExpertCache, seconds: f64, measured: bool) -> Result<()> {
    if measured {
        let until = Instant::now() + std::time::Duration::from_secs_f64(seconds);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
    cache.advance(seconds)
}

/// The run's shape: layers, experts a layer, device slots, and the most
/// experts any token of the routing takes (not the first token's: a
/// replayed trace may start with fewer).
#[derive(Clone, Copy)]
struct Shape {
    layers: usize,
    experts: usize,
    slots: usize,
    top_k: usize,
}

#[allow(clippy::too_many_arguments)]
fn run_config(
    p: &MoeParams,
    config: Config,
    routes: &[Vec<Vec<u32>>],
    recorded: Option<&[TokenRoute]>,
    shape: Shape,
    compute: f64,
    other: f64,
    progress: &mut dyn FnMut(f64),
) -> Result<(MoeResult, Option<strata::link::LinkModel>)> {
    let Shape {
        layers,
        experts,
        slots,
        top_k,
    } = shape;
    let page = p.page_size as u64;
    let expert_pages = p.expert_bytes.div_ceil(page);
    let all = (layers * experts) as u64;
    let host = match p.host_experts {
        Some(h) => h as u64 * expert_pages * page,
        None => all * expert_pages * page + (4 << 20),
    };
    let mut cfg = MoeConfig::new(slots, p.expert_bytes, host);
    if let Some(h) = p.host_experts {
        // The experts beyond the host tier, and room to spare (the store
        // holds slots back for new copies). Reads land in the device
        // slots: one page of registered buffers.
        let capacity = ((all - h as u64) * expert_pages + 64) * page;
        cfg.nvme = Some(strata::NvmeConfig {
            pool_bytes: page,
            ..strata::NvmeConfig::new(&p.path, capacity, p.page_size)
        });
        cfg.sim_nvme_link = p.nvme_link;
        cfg.host_cache = p.host_cache;
    }
    cfg.host_in_place = p.host_in_place && config == Config::Strata;
    cfg.device = p.device;
    cfg.page_size = p.page_size;
    cfg.layers = layers;
    cfg.link_priority = !p.fifo_link;
    cfg.sim_link = link_of(p);
    cfg.protect_fetches = p.protect_fetches.unwrap_or(2 * top_k as u64);
    match config {
        Config::Strata => {
            cfg.eviction = if p.lrfu {
                // Half-life of a use, in fetches: passes over all experts.
                let half_life = HALF_LIFE_PASSES * (layers * experts) as f64;
                Eviction::Lrfu {
                    decay: 0.5f64.powf(1.0 / half_life),
                }
            } else {
                Eviction::Reuse {
                    decay: 0.5f64.powf(1.0 / HALF_LIFE_VISITS),
                }
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
    let mut pred = TransitionPredictor::new(layers, experts)?;
    let measured = cache.modelled_now().is_none();
    // Registration moved the experts beyond the host tier down through the
    // device (the fastest tier with room): not the decoding's traffic.
    let written_before = d2h_bytes(&cache);
    let start = Instant::now();
    let mut verified = 0u64;
    let mut n = 0u64;
    let mut call_seconds = 0.0;
    for (t, tok) in routes.iter().enumerate() {
        for l in 0..layers {
            // The layer's attention and router: only reads already on the
            // link progress meanwhile.
            if other > 0.0 {
                run_compute(&cache, other, measured)?;
            }
            let routed = &tok[l];
            // strata.moe's layer: the routed experts already resident are
            // pinned first (nothing below evicts them), the reads of the
            // others start at once, the next layer's lookahead queues
            // behind them, then each expert's share of the layer's compute
            // runs, the resident ones' first, each read one's as soon as
            // its read is in; the baselines fetch and wait one expert at a
            // time.
            let share = compute / routed.len().max(1) as f64;
            let mut held = Vec::new();
            let mut order = routed.clone();
            if config == Config::Strata {
                let (resident, missing): (Vec<u32>, Vec<u32>) = routed
                    .iter()
                    .partition(|&&e| cache.is_ready(l as u32, e).unwrap_or(false));
                for &e in &resident {
                    held.push(cache.fetch(l as u32, e)?);
                }
                order = [&resident[..], &missing[..]].concat();
                let guess = match (l + 1 < layers, recorded) {
                    (false, _) => None,
                    (true, Some(r)) => Some(r[t][l + 1].clone()),
                    (true, None) => Some(pred.predict(l, routed, top_k, MIN_CONFIDENCE)?),
                };
                let called = Instant::now();
                cache.read_ahead(l as u32, &missing)?;
                if let Some(guess) = guess {
                    cache.prefetch(l as u32 + 1, &guess)?;
                }
                call_seconds += called.elapsed().as_secs_f64();
            }
            let mut held = held.into_iter();
            for &e in &order {
                let pin = match held.next() {
                    Some(pin) => pin,
                    None => cache.fetch(l as u32, e)?,
                };
                n += 1;
                if n % VERIFY_EVERY == 0 {
                    let mut b = [0u8; 1];
                    pin.buffer().read(p.expert_bytes - 1, &mut b)?;
                    if b[0] != pattern(l, e as usize) {
                        return Err(Error::new(
                            strata::error::ErrorKind::Corrupted,
                            format!("expert ({l}, {e}) read back wrong bytes"),
                        ));
                    }
                    verified += 1;
                }
                drop(pin);
                if config == Config::Strata {
                    run_compute(&cache, share, measured)?;
                }
            }
            if config == Config::Strata {
                // Layer l has run: its prefetches still on the link came
                // too late or were wrong.
                let called = Instant::now();
                cache.cancel_prefetches(l as u32)?;
                call_seconds += called.elapsed().as_secs_f64();
            }
            pred.observe(l, (l > 0).then(|| &tok[l - 1][..]), routed)?;
            if config != Config::Strata {
                run_compute(&cache, compute, measured)?;
            }
        }
        if t % 16 == 0 {
            progress(t as f64 / routes.len() as f64);
        }
    }
    let s = cache.stats();
    // Decode time: modelled on the simulated device, measured on a GPU.
    let modelled = cache
        .modelled_now()
        .unwrap_or_else(|| start.elapsed().as_secs_f64());
    let result = MoeResult {
        config: config.name(),
        hit_rate: (s.hits + s.served_in_place) as f64 / s.fetches.max(1) as f64,
        ready_rate: (s.hits - s.late_prefetch_hits + s.served_in_place) as f64
            / s.fetches.max(1) as f64,
        stall_seconds: s.stall_seconds,
        bytes_moved: s.bytes_moved,
        // Less the byte each check read back out of device memory.
        bytes_written_back: (d2h_bytes(&cache) - written_before).saturating_sub(verified),
        prefetch_accuracy: s.prefetch_accuracy(),
        moves: s.moves(),
        moves_paid: s.moves_paid(),
        moves_from_nvme: s.moves_from_nvme,
        served_in_place: s.served_in_place,
        host_swaps: s.host_swaps,
        prefetches: s.prefetches,
        late_prefetch_hits: s.late_prefetch_hits,
        fetches: s.fetches,
        modelled_seconds: modelled,
        modelled: !measured,
        tokens_per_sec: if modelled > 0.0 {
            routes.len() as f64 / modelled
        } else {
            0.0
        },
        verified_fetches: verified,
        wall_seconds: start.elapsed().as_secs_f64(),
        call_seconds,
    };
    Ok((result, cache.link()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> MoeParams {
        MoeParams {
            layers: Some(4),
            experts: Some(16),
            top_k: 2,
            expert_bytes: 64 << 10,
            device_slots: Some(16),
            tokens: 96,
            routing: Routing::Zipf { alpha: 1.0 },
            baselines: true,
            seed: 3,
            page_size: 16 << 10,
            fifo_link: false,
            device: strata::device::DeviceChoice::Sim,
            platform: Platform::default(),
            link: None,
            layer_compute: None,
            layer_other: None,
            lrfu: false,
            predictor: false,
            protect_fetches: None,
            host_experts: None,
            nvme_link: None,
            path: PathBuf::from("."),
            host_cache: false,
            host_in_place: false,
        }
    }

    #[test]
    fn no_configuration_beats_the_bounds() {
        let r = run(&params(), &mut |_, _| {}).unwrap();
        let b = &r.bounds;
        assert!(b.belady_hit_rate >= b.static_oracle_hit_rate - 0.05);
        assert!(b.belady_prefetch_stall_floor_seconds <= b.belady_stall_seconds);
        for x in &r.results {
            // Every fetch that was not a hit moved its expert whole, and
            // every hit found it moved whole: at least MIN's transfers.
            let belady_misses = (x.fetches as f64 * (1.0 - b.belady_hit_rate)).round();
            assert!(
                x.bytes_moved as f64 >= belady_misses * (64 << 10) as f64,
                "{}: moved {} < MIN's misses {belady_misses}",
                x.config,
                x.bytes_moved
            );
            assert!(
                x.stall_seconds >= b.belady_prefetch_stall_floor_seconds - 1e-9,
                "{}: stall {} below the floor {}",
                x.config,
                x.stall_seconds,
                b.belady_prefetch_stall_floor_seconds
            );
            assert_eq!(x.fetches, (96 * 4 * 2) as u64);
            // The moves counted are the experts moved: whole ones, but
            // for a prefetch cancelled on its way.
            assert!(x.moves > 0 && x.moves_paid <= x.moves, "{}", x.config);
            assert!(x.bytes_moved <= x.moves * (64 << 10), "{}", x.config);
            if x.config != "strata" {
                // No prefetch: every move is a miss's, used by its fetch.
                assert_eq!(x.moves_paid, x.moves, "{}", x.config);
                assert_eq!(x.bytes_moved, x.moves * (64 << 10), "{}", x.config);
            }
        }
    }

    #[test]
    fn time_before_the_experts_is_charged_and_overlaps_only_reads_already_started() {
        // The same layer time, all of it the experts' compute, or half of it
        // before the experts are known (the attention).
        let mut p = params();
        p.baselines = true;
        p.layer_compute = Some(200e-6);
        let all_compute = run(&p, &mut |_, _| {}).unwrap();
        p.layer_compute = Some(100e-6);
        p.layer_other = Some(100e-6);
        let split = run(&p, &mut |_, _| {}).unwrap();
        assert_eq!(split.layer_other_seconds, 100e-6);
        for (a, b) in all_compute.results.iter().zip(&split.results) {
            // Every layer's time is charged.
            assert!(
                b.modelled_seconds >= (96 * 4) as f64 * 200e-6,
                "{}",
                b.config
            );
            if b.config == "strata" {
                assert!(a.stall_seconds > 0.0);
                // A layer's own reads start after its attention: they can
                // hide behind less of its time, so it stalls at least as
                // long as with all the time after the reads started.
                assert!(
                    b.stall_seconds >= a.stall_seconds - 1e-9,
                    "{} against {}",
                    b.stall_seconds,
                    a.stall_seconds
                );
            } else {
                // The baselines fetch before computing: where the time sits
                // in the layer changes nothing.
                assert!(
                    (b.stall_seconds - a.stall_seconds).abs() < 1e-9,
                    "{}",
                    b.config
                );
            }
        }
    }

    #[test]
    fn a_host_tier_sends_the_other_experts_to_nvme_at_the_disk_link() {
        let dir = tempfile::tempdir().unwrap();
        let with = |nvme_gbps: Option<f64>| {
            run(
                &MoeParams {
                    host_experts: Some(24),
                    nvme_link: nvme_gbps.map(|g| strata::link::LinkModel {
                        bandwidth: g * 1e9,
                        latency_ns: 0,
                    }),
                    path: dir.path().into(),
                    baselines: false,
                    ..params()
                },
                &mut |_, _| {},
            )
            .unwrap()
        };
        let alike = with(None);
        let disk = with(Some(0.5));
        let (a, d) = (&alike.results[0], &disk.results[0]);
        // Each move from NVMe is slower on the disk link (which prefetches
        // come too late, and are cancelled, follows the clock).
        for x in [a, d] {
            assert!(
                x.moves_from_nvme > 0 && x.moves_from_nvme < x.moves,
                "{x:?}"
            );
        }
        assert!(d.stall_seconds > 2.0 * a.stall_seconds, "{a:?} {d:?}");
        assert_eq!(d.bytes_written_back, 0, "unmodified experts stay clean");
        assert!(d.verified_fetches > 0);
        // Read in place, the host tier's experts take no slot: every move
        // reads the disk, and the verified reads still match.
        let in_place = run(
            &MoeParams {
                host_experts: Some(24),
                host_in_place: true,
                path: dir.path().into(),
                baselines: false,
                ..params()
            },
            &mut |_, _| {},
        )
        .unwrap();
        let x = &in_place.results[0];
        assert!(
            x.served_in_place > 0 && x.moves_from_nvme == x.moves,
            "{x:?}"
        );
        assert!(x.verified_fetches > 0 && x.bytes_written_back == 0);
        // Reads in place need no transfer: they count as hits, and no
        // online policy beats MIN over the slots and the host tier pooled.
        let hits = (x.hit_rate * x.fetches as f64).round() as u64;
        assert!(hits >= x.served_in_place, "{x:?}");
        assert!(
            x.hit_rate <= in_place.bounds.belady_hit_rate + 1e-9,
            "{x:?} {:?}",
            in_place.bounds
        );
        // The bounds pool the slots and the host tier, misses at the disk.
        let every = run(&params(), &mut |_, _| {}).unwrap();
        assert!(disk.bounds.belady_hit_rate > every.bounds.belady_hit_rate);
        assert!(disk.bounds.transfer_seconds > every.bounds.transfer_seconds);
        let bad = run(
            &MoeParams {
                host_experts: Some(64),
                path: dir.path().into(),
                ..params()
            },
            &mut |_, _| {},
        );
        assert!(
            bad.is_err(),
            "a host tier of every expert leaves none on NVMe"
        );
    }

    #[test]
    fn the_fifo_link_moves_the_baselines_the_same() {
        let a = run(&params(), &mut |_, _| {}).unwrap();
        let b = run(
            &MoeParams {
                fifo_link: true,
                ..params()
            },
            &mut |_, _| {},
        )
        .unwrap();
        for (x, y) in a.results.iter().zip(&b.results).skip(1) {
            assert_eq!(x.config, y.config);
            assert_eq!(x.stall_seconds, y.stall_seconds, "{}", x.config);
            assert_eq!(x.bytes_moved, y.bytes_moved, "{}", x.config);
        }
    }
}
