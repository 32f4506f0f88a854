//! `strata bench graph`: a GAP kernel over a CSR graph in tiered buffers,
//! under a device budget below the graph's size, beside the baselines on
//! the same graph, algorithm and budget.
//!
//! - On the simulated device (`--device sim`, the default) the kernels are
//!   the Rust ones of [`algo`]; times are **modelled** GPU time on a
//!   platform preset ([`Platform`], see [`crate::workloads::graph::model`]);
//!   wall time is reported too.
//! - On a GPU (`--device cuda`, built with the `cuda` feature) the kernels
//!   are `kernels/graph.cu` (`workloads::graph::cuda`); times are
//!   measured, and the baselines are real: `uvm` (Unified Memory, device
//!   memory beyond the budget held back), `zero-copy` (mapped host memory)
//!   and `all-device` (where the graph fits).

use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

use serde::Serialize;

use super::median;
use crate::workloads::graph::algo::{self, Mem};
use crate::workloads::graph::model::{Platform, UVM_BASIC_BLOCK};
use crate::workloads::graph::tiered::{Config, ResidentMem, RunCost, TieredGraph, TieredMem};
use crate::workloads::graph::{verify, Csr, GraphSpec};
use strata::device::DeviceChoice;
use strata::error::{Error, ErrorKind, Result};
use strata::policy::PolicyKind;
use strata::runtime::BalancerConfig;

/// The kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    /// Direction-optimizing BFS.
    Bfs,
    /// Delta-stepping SSSP.
    Sssp,
    /// Pull PageRank.
    Pr,
    /// Connected components.
    Cc,
}

impl std::str::FromStr for Algo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bfs" => Ok(Algo::Bfs),
            "sssp" => Ok(Algo::Sssp),
            "pr" => Ok(Algo::Pr),
            "cc" => Ok(Algo::Cc),
            _ => Err(Error::invalid(format!(
                "unknown algorithm {s:?} (use bfs, sssp, pr or cc)"
            ))),
        }
    }
}

/// The device budget: bytes, or a percentage of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    /// Bytes.
    Bytes(u64),
    /// Percent of the graph's footprint.
    Percent(f64),
}

impl std::str::FromStr for Budget {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(p) = s.strip_suffix('%') {
            let v: f64 = p
                .parse()
                .map_err(|_| Error::invalid(format!("device budget {s:?} is not a percentage")))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(Error::invalid(format!(
                    "device budget {s:?} must be in (0%, 100%]"
                )));
            }
            return Ok(Budget::Percent(v));
        }
        Ok(Budget::Bytes(strata::size::parse_size(s)?))
    }
}

/// Parameters of a run.
#[derive(Debug, Clone, Serialize)]
pub struct GraphParams {
    /// The kernel.
    pub algo: Algo,
    /// The graph.
    pub graph: GraphSpec,
    /// The device budget.
    pub device_budget: Budget,
    /// strata's policy.
    pub policy: PolicyKind,
    /// strata's balancer: accesses a page needs in a round to be a
    /// candidate for promotion (`None`: the page size, about four reads
    /// through a page of 4-byte elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_accesses: Option<u64>,
    /// Trials after the first start where the one before left off (a
    /// graph queried again and again): strata keeps its placement and its
    /// balancer's history, Unified Memory what it holds, all-device its
    /// upload. The first trial (cold) is reported apart
    /// ([`ConfigResult::cold_seconds`]) and left out of the medians.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub warm: bool,
    /// Trials per configuration (on the simulated device, one for a
    /// baseline whose trials share a source: its modelled run repeats).
    pub trials: u32,
    /// BFS/SSSP source (random per trial otherwise).
    pub source: Option<usize>,
    /// Seed of the generator and the sources.
    pub seed: u64,
    /// Check every trial's result.
    pub verify: bool,
    /// Run the baselines too.
    pub baselines: bool,
    /// Exactly these configurations (instead of strata and, with
    /// `baselines`, the baselines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub configs: Option<Vec<Config>>,
    /// The modelled GPU (simulated device).
    #[serde(serialize_with = "platform_name")]
    pub platform: Platform,
    /// Page size of the tiered buffers.
    pub page_size: usize,
    /// Where the kernels run: `sim` (modelled), `cuda`, or `auto` (cuda
    /// where a GPU is).
    pub device: DeviceChoice,
}

fn platform_name<S: serde::Serializer>(p: &Platform, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.name)
}

/// One trial.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    /// Modelled GPU seconds (simulated device) or measured seconds (GPU).
    pub seconds: f64,
    /// Wall seconds of the kernels on this machine.
    pub wall_seconds: f64,
    /// Traversed edges per modelled second (BFS, SSSP).
    pub teps: Option<f64>,
    /// Bytes migrated between host and device (`None`: not measured, as
    /// Unified Memory's migrations on a GPU).
    pub bytes_moved: Option<u64>,
    /// Share of memory transactions served by device memory (on a GPU:
    /// of the sampled accesses for strata; `None` for Unified Memory).
    pub hit_rate: Option<f64>,
    /// The source (BFS, SSSP).
    pub source: Option<usize>,
    /// Iterations (PageRank).
    pub iterations: Option<u32>,
    /// Whether the result verified (with `--verify`).
    pub verified: Option<bool>,
    /// What the modelled time is made of (simulated device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<TrialCost>,
    /// The first trial of a warm run (`--warm`): it starts cold, and the
    /// medians leave it out.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cold: bool,
}

/// A modelled trial's time by mechanism, seconds.
#[derive(Debug, Clone, Serialize)]
pub struct TrialCost {
    /// The kernels (reads from L2, HBM and over the link; launches).
    pub kernels: f64,
    /// Moving data in before the kernels (all-device's upload; strata's
    /// initial placement is in `migrations`).
    pub upload: f64,
    /// strata's migrations (initial placement included), at the link's DMA
    /// rate.
    pub migrations: f64,
    /// strata's balancer rounds (measured CPU time).
    pub balancer: f64,
    /// strata's device maps to the device and access counters back, at
    /// each launch over them (modelled; see `RunCost::maps_seconds`).
    pub maps: f64,
    /// Unified Memory's fault service, evictions and prefetch.
    pub uvm: f64,
    /// What the run read and what the driver did.
    pub detail: RunCost,
}

/// One configuration's results.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigResult {
    /// `strata`, `uvm`, `uvm-advised`, `zero-copy`, `all-device`,
    /// `static-optimum` or `resident` (on a GPU: `strata`, `uvm`,
    /// `zero-copy`, `all-device`).
    pub config: &'static str,
    /// The kernel.
    pub algo: Algo,
    /// Median seconds (modelled on the simulated device); of the warm
    /// trials in a warm run.
    pub seconds: f64,
    /// A warm run's first trial's seconds: the same work from a cold
    /// start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_seconds: Option<f64>,
    /// Median wall seconds.
    pub wall_seconds: f64,
    /// Median TEPS (BFS, SSSP).
    pub teps: Option<f64>,
    /// Median bytes moved per trial.
    pub bytes_moved: Option<u64>,
    /// Median device hit rate.
    pub hit_rate: Option<f64>,
    /// strata (simulated device): of its promotions into device memory over
    /// every trial, (those whose page was accessed there before it left,
    /// those that were not); settled at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub promotions_paid: Option<(u64, u64)>,
    /// Every trial.
    pub trials: Vec<Trial>,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct GraphReport {
    /// "simulated" or "cuda".
    pub backend: &'static str,
    /// The GPU (cuda).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// Whether `seconds` are modelled (on the simulated device) rather
    /// than measured (on a GPU).
    pub modelled: bool,
    /// The parameters.
    pub params: GraphParams,
    /// Vertices.
    pub vertices: usize,
    /// Directed edges (an undirected edge counts twice).
    pub edges: u64,
    /// Bytes of the arrays the kernel reads.
    pub graph_bytes: u64,
    /// The device budget in bytes.
    pub budget_bytes: u64,
    /// Only where the budget asked for was more than the graph needs: that
    /// budget (`budget_bytes` is then the graph's size, all of it on the
    /// device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_requested: Option<u64>,
    /// The modelled GPU (simulated device): every figure of the preset.
    pub model: Option<Platform>,
    /// One entry per configuration.
    pub results: Vec<ConfigResult>,
    /// Configurations left out, and why (on a GPU: all-device where the
    /// graph does not fit).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// A per-vertex result, for `--dump`.
#[derive(Debug, Clone)]
pub enum Dump {
    /// BFS depth (−1 unreachable), and the BFS tree's parents.
    Depth(Vec<i32>, Vec<u32>),
    /// SSSP distance (`u64::MAX` unreachable).
    Distance(Vec<u64>),
    /// PageRank score.
    Score(Vec<f32>),
    /// CC label.
    Label(Vec<u32>),
}

impl Dump {
    /// Writes one `vertex value` line per vertex.
    pub fn write(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(out);
        match self {
            Dump::Depth(d, _) => d
                .iter()
                .enumerate()
                .try_for_each(|(v, x)| writeln!(w, "{v} {x}")),
            Dump::Distance(d) => d.iter().enumerate().try_for_each(|(v, &x)| {
                if x == u64::MAX {
                    writeln!(w, "{v} inf")
                } else {
                    writeln!(w, "{v} {x}")
                }
            }),
            Dump::Score(d) => d
                .iter()
                .enumerate()
                .try_for_each(|(v, x)| writeln!(w, "{v} {x:e}")),
            Dump::Label(d) => d
                .iter()
                .enumerate()
                .try_for_each(|(v, x)| writeln!(w, "{v} {x}")),
        }?;
        w.flush()
    }
}

const PR_TOLERANCE: f64 = 1e-4;
const PR_MAX_ITERATIONS: u32 = 100;
/// Delta-stepping bucket width for weights in 1..=255 (GAP's default is of
/// this order for its weight range).
const SSSP_DELTA: u64 = 32;

/// Runs every configuration; `progress(config, done_fraction)`.
pub fn run(
    params: &GraphParams,
    progress: &mut dyn FnMut(&str, f64),
) -> Result<(GraphReport, Dump)> {
    if params.trials == 0 {
        return Err(Error::invalid("--trials must be at least 1"));
    }
    strata::size::check_page_size(params.page_size)?;
    progress("generating the graph", 0.0);
    let g = Csr::load(&params.graph, params.seed)?;
    run_on(&g, params, progress)
}

/// [`run`] on a graph already loaded (several kernels over one graph).
pub fn run_on(
    g: &Csr,
    params: &GraphParams,
    progress: &mut dyn FnMut(&str, f64),
) -> Result<(GraphReport, Dump)> {
    if params.trials == 0 {
        return Err(Error::invalid("--trials must be at least 1"));
    }
    strata::size::check_page_size(params.page_size)?;
    let n = g.vertices();
    if let Some(s) = params.source {
        if s >= n {
            return Err(Error::invalid(format!(
                "source {s} is not a vertex (the graph has {n})"
            )));
        }
    }
    let weights = params.algo == Algo::Sssp;
    let footprint = TieredGraph::footprint(g, weights);
    let budget = match params.device_budget {
        Budget::Bytes(b) => b,
        // At least one page: a percentage of a tiny graph still means some
        // device memory.
        // Of the arrays rounded up to whole pages, so that 100% holds them.
        Budget::Percent(p) => {
            let paged = TieredGraph::paged_footprint(g, weights, params.page_size);
            ((paged as f64 * p / 100.0) as u64).max(params.page_size as u64)
        }
    };
    // A budget above what the graph needs holds all of it: it is capped
    // there, rather than mapping device memory nothing would use (a 1T
    // budget is a 1 TiB arena). Counted in whole Unified Memory blocks
    // too, so that every configuration holds the whole graph.
    let whole =
        TieredGraph::paged_footprint(g, weights, params.page_size.max(UVM_BASIC_BLOCK as usize));
    let (budget, budget_requested) = if budget > whole {
        (whole, Some(budget))
    } else {
        (budget, None)
    };
    // Sources, the same for every configuration.
    let sources: Vec<Option<usize>> = (0..params.trials)
        .map(|t| match params.algo {
            Algo::Bfs | Algo::Sssp => Some(params.source.unwrap_or_else(|| {
                let mut s = strata::hotness::mix(params.seed ^ (t as u64 + 1) << 20);
                // Random vertices first; the first with an edge otherwise
                // (there is one: edgeless graphs are refused on loading).
                (0..64)
                    .map(|_| {
                        s = strata::hotness::mix(s);
                        (s % n as u64) as usize
                    })
                    .find(|&v| g.degree(v) > 0)
                    .unwrap_or_else(|| (0..n).find(|&v| g.degree(v) > 0).unwrap_or(0))
            })),
            _ => None,
        })
        .collect();
    if resolve(params.device)? == DeviceChoice::Cuda {
        let (mut report, dump) = run_cuda(g, params, budget, footprint, &sources, progress)?;
        report.budget_requested = budget_requested;
        return Ok((report, dump));
    }
    let platform = params.platform;
    let configs = sim_configs(params);
    if configs.contains(&Config::Resident) {
        // Timed on the wall: each trial's working arrays from a warm heap.
        crate::sys::keep_freed_heap();
    }
    let mut references: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut pr_reference: Option<Vec<f64>> = None;
    let mut results = Vec::new();
    let mut dump = None;
    // A baseline's modelled run depends only on its source (and, within
    // half a percent, on how the kernel's threads interleave): where
    // every trial has the same source (PageRank and CC have none, or
    // --source fixes it), its trials would repeat one run, and it runs
    // once. strata's balancer rounds follow measured CPU time and the
    // resident kernels are timed on the wall: they run every trial.
    let same_source = sources.windows(2).all(|w| w[0] == w[1]);
    let runs = |config: Config| {
        // A warm run's trials differ from its first: every one runs.
        if same_source && !params.warm && !matches!(config, Config::Strata | Config::Resident) {
            1
        } else {
            sources.len()
        }
    };
    let steps = configs.iter().map(|&c| runs(c)).sum::<usize>() as f64;
    let mut done = 0;
    let balancer = sim_balancer(params);
    for &config in &configs {
        let tg = TieredGraph::build(g, config, budget, params.page_size, weights)?;
        let mut trials = Vec::new();
        // Unified Memory's residency, carried from trial to trial (warm).
        let mut uvm = None;
        for (t, &source) in sources.iter().enumerate().take(runs(config)) {
            progress(config.name(), done as f64 / steps);
            done += 1;
            // Every trial starts cold, in every configuration; in a warm
            // run only the first does (the static optimum's placement is
            // each trial's own hindsight, made afresh).
            let resume = params.warm && t > 0;
            if !resume || config == Config::StaticOptimum {
                tg.reset(balancer)?;
            }
            if config == Config::StaticOptimum {
                // The same trial once with every page in host memory,
                // recording what each page sent over the link; the budget
                // then holds the pages that sent the most.
                let maps = tg.maps()?;
                let mut mem = TieredMem::new(&tg, &maps, &platform, budget, true)?;
                run_kernel(&mut mem, params.algo, source);
                let weights = mem.weights().expect("profiling");
                drop(mem);
                drop(maps);
                tg.place_pages(&hottest(&weights, budget / tg.page_size() as u64))?;
            }
            let before = tg.rt.stats().device_links.unwrap_or_default();
            if config == Config::Strata && !resume {
                tg.place_initial(budget)?;
            }
            let maps = tg.maps()?;
            let (result, edges, iterations, wall_seconds, run) = if config == Config::Resident {
                let mut mem = ResidentMem::new(&tg, &maps)?;
                let wall = Instant::now();
                let (result, iterations) = run_kernel(&mut mem, params.algo, source);
                let wall_seconds = wall.elapsed().as_secs_f64();
                let edges = traversed(g, &result);
                (result, edges, iterations, wall_seconds, RunCost::default())
            } else {
                let carried = if resume { uvm.take() } else { None };
                let mut mem = TieredMem::resuming(&tg, &maps, &platform, budget, false, carried)?;
                let wall = Instant::now();
                let (result, iterations) = run_kernel(&mut mem, params.algo, source);
                let wall_seconds = wall.elapsed().as_secs_f64();
                let edges = traversed(g, &result);
                if let Some(e) = mem.errors.pop() {
                    return Err(e.context(format!("{} trial {t}", config.name())));
                }
                let cost = mem.finish();
                uvm = mem.take_uvm();
                (result, edges, iterations, wall_seconds, cost)
            };
            drop(maps);
            let after = tg.rt.stats().device_links.unwrap_or_default();
            let h2d = (after.0.bytes - before.0.bytes, after.0.ops - before.0.ops);
            let d2h = (after.1.bytes - before.1.bytes, after.1.ops - before.1.ops);
            let arrays = tg.buffers().iter().flatten().count() as u64;
            let (cost, bytes_moved) =
                charge(config, &platform, run, h2d, d2h, footprint, arrays, !resume);
            let seconds =
                cost.kernels + cost.upload + cost.migrations + cost.balancer + cost.maps + cost.uvm;
            let tr = &run.traffic;
            let faults = run.uvm.map_or(0, |u| u.faults);
            let hit_rate =
                1.0 - (tr.host_requests + faults) as f64 / tr.graph_requests.max(1) as f64;
            let verified = params
                .verify
                .then(|| check(g, &result, source, &mut references, &mut pr_reference))
                .transpose()
                .map_err(|why| {
                    Error::new(
                        ErrorKind::Corrupted,
                        format!(
                            "{} trial {t}: the {:?} result does not verify: {why}",
                            config.name(),
                            params.algo
                        ),
                    )
                })?;
            let modelled = config != Config::Resident;
            trials.push(Trial {
                seconds: if modelled { seconds } else { wall_seconds },
                wall_seconds,
                teps: edges
                    .map(|e| e as f64 / if modelled { seconds } else { wall_seconds }.max(1e-12)),
                bytes_moved: modelled.then_some(bytes_moved),
                hit_rate: modelled.then_some(hit_rate.clamp(0.0, 1.0)),
                source,
                iterations,
                verified,
                cost: modelled.then_some(cost),
                cold: params.warm && t == 0,
            });
            if dump.is_none() || config == Config::Strata {
                dump = Some(result);
            }
        }
        let mut result = summarize(config, params.algo, trials);
        if config == Config::Strata {
            // The pages still in device memory leave (uncharged), so every
            // promotion is settled.
            for b in tg.buffers().iter().flatten() {
                b.evict(0..b.len(), strata::Tier::Host)?;
            }
            let s = tg.rt.stats();
            result.promotions_paid = Some((s.promotions_paid, s.promotions_unpaid));
        }
        results.push(result);
    }
    progress("done", 1.0);
    Ok((
        GraphReport {
            backend: "simulated",
            gpu: None,
            modelled: true,
            params: params.clone(),
            vertices: n,
            edges: g.edges(),
            graph_bytes: footprint,
            budget_bytes: budget,
            budget_requested,
            model: Some(platform),
            results,
            skipped: Vec::new(),
        },
        dump.expect("at least one configuration runs"),
    ))
}

/// strata's balancer (simulated runs and GPU runs alike). Tuned on kron:19 at 25% and
/// 50% budgets (the training graphs; reports use others): promote only
/// pages read through at least four times a round (4-byte neighbours):
/// a move costs a page over the link and a page's reads come back at HBM
/// speed only if it stays hot; and one policy access per touched page a
/// round (the count already says how hot it is; each access costs CPU time
/// the model charges).
fn sim_balancer(params: &GraphParams) -> BalancerConfig {
    BalancerConfig::default()
        .with_policy(params.policy)
        .with_min_accesses(params.min_accesses.unwrap_or(params.page_size as u64))
        .with_repeat(1)
}

/// The configurations a simulated run compares.
fn sim_configs(params: &GraphParams) -> Vec<Config> {
    if let Some(c) = &params.configs {
        return c.clone();
    }
    let mut configs = vec![Config::Strata];
    if params.baselines {
        configs.extend([
            Config::Uvm,
            Config::UvmAdvised,
            Config::ZeroCopy,
            Config::AllDevice,
            Config::StaticOptimum,
        ]);
    }
    configs
}

/// The `pages` pages ((array, page)) that sent the most bytes over the
/// link in a profile.
fn hottest(weights: &[Vec<u64>], pages: u64) -> Vec<(usize, usize)> {
    let mut all: Vec<(u64, usize, usize)> = weights
        .iter()
        .enumerate()
        .flat_map(|(a, w)| w.iter().enumerate().map(move |(p, &x)| (x, a, p)))
        .filter(|&(x, _, _)| x > 0)
        .collect();
    all.sort_unstable_by(|x, y| y.cmp(x));
    all.truncate(pages as usize);
    all.into_iter().map(|(_, a, p)| (a, p)).collect()
}

/// A run's modelled time by mechanism, and the bytes it migrated;
/// `first`: all-device uploads the graph (a warm run's later trials find
/// it there).
#[allow(clippy::too_many_arguments)]
fn charge(
    config: Config,
    p: &Platform,
    run: RunCost,
    h2d: (u64, u64),
    d2h: (u64, u64),
    footprint: u64,
    arrays: u64,
    first: bool,
) -> (TrialCost, u64) {
    let mut cost = TrialCost {
        kernels: run.kernel_seconds,
        upload: 0.0,
        migrations: 0.0,
        balancer: 0.0,
        maps: 0.0,
        uvm: run.uvm_seconds,
        detail: run,
    };
    let moved = match config {
        Config::Strata => {
            cost.migrations = p.h2d(h2d.0, h2d.1) + p.d2h(d2h.0, d2h.1);
            cost.balancer = run.balancer_seconds;
            cost.maps = run.maps_seconds;
            h2d.0 + d2h.0
        }
        Config::AllDevice if first => {
            // The arrays uploaded in one batch each.
            cost.upload = p.h2d(footprint, arrays);
            footprint
        }
        Config::AllDevice => 0,
        Config::Uvm | Config::UvmAdvised => run
            .uvm
            .map_or(0, |u| u.bytes_in + u.bytes_out + u.advised_bytes),
        Config::ZeroCopy | Config::StaticOptimum | Config::Resident => 0,
    };
    (cost, moved)
}

/// The medians of a configuration's trials (of a warm run's warm ones:
/// the cold first trial apart).
fn summarize(config: Config, algo: Algo, trials: Vec<Trial>) -> ConfigResult {
    let cold_seconds = trials.iter().find(|t| t.cold).map(|t| t.seconds);
    let counted: Vec<&Trial> = if trials.iter().any(|t| !t.cold) {
        trials.iter().filter(|t| !t.cold).collect()
    } else {
        trials.iter().collect()
    };
    let med =
        |f: &dyn Fn(&Trial) -> f64| median(&mut counted.iter().map(|t| f(t)).collect::<Vec<_>>());
    let med_of = |f: &dyn Fn(&Trial) -> Option<f64>| {
        let mut v: Vec<f64> = counted.iter().filter_map(|t| f(t)).collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    ConfigResult {
        config: config.name(),
        algo,
        cold_seconds,
        seconds: med(&|t| t.seconds),
        wall_seconds: med(&|t| t.wall_seconds),
        teps: med_of(&|t| t.teps),
        bytes_moved: med_of(&|t| t.bytes_moved.map(|b| b as f64)).map(|b| b as u64),
        hit_rate: med_of(&|t| t.hit_rate),
        promotions_paid: None,
        trials,
    }
}

/// `auto` as the device it means here: cuda where a GPU is, else sim.
fn resolve(device: DeviceChoice) -> Result<DeviceChoice> {
    match device {
        DeviceChoice::Sim => Ok(DeviceChoice::Sim),
        DeviceChoice::Cuda => {
            strata::device::probe_gpus()?;
            Ok(DeviceChoice::Cuda)
        }
        DeviceChoice::Auto => Ok(match strata::device::probe_gpus() {
            Ok(_) => DeviceChoice::Cuda,
            Err(_) => DeviceChoice::Sim,
        }),
    }
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _g: &Csr,
    _params: &GraphParams,
    _budget: u64,
    _footprint: u64,
    _sources: &[Option<usize>],
    _progress: &mut dyn FnMut(&str, f64),
) -> Result<(GraphReport, Dump)> {
    Err(Error::new(
        ErrorKind::NoDevice,
        "strata was built without the cuda feature",
    ))
}

/// [`run_on`] on a GPU: the CUDA kernels, measured.
#[cfg(feature = "cuda")]
fn run_cuda(
    g: &Csr,
    params: &GraphParams,
    budget: u64,
    footprint: u64,
    sources: &[Option<usize>],
    progress: &mut dyn FnMut(&str, f64),
) -> Result<(GraphReport, Dump)> {
    use crate::workloads::graph::cuda::{self, Flavour, PlainGpu, PlainKind, StrataGpu};

    let weights = params.algo == Algo::Sssp;
    let ctx = cuda::context()?;
    let gpu = strata::device::probe_gpus()?
        .into_iter()
        .next()
        .map(|i| format!("GPU {} ({}, {} bytes)", i.ordinal, i.name, i.memory_bytes));
    // Unified Memory last: oversubscribed managed memory is the one
    // configuration that can stall a GPU.
    let configs = match &params.configs {
        Some(c) => {
            if let Some(x) = c.iter().find(|x| {
                !matches!(
                    x,
                    Config::Strata | Config::Uvm | Config::ZeroCopy | Config::AllDevice
                )
            }) {
                return Err(Error::invalid(format!(
                    "--configs {}: on a GPU the configurations are strata, uvm, zero-copy and all-device",
                    x.name()
                )));
            }
            c.clone()
        }
        None if params.baselines => vec![
            Config::Strata,
            Config::ZeroCopy,
            Config::AllDevice,
            Config::Uvm,
        ],
        None => vec![Config::Strata],
    };
    let mut references: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut pr_reference: Option<Vec<f64>> = None;
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    let mut dump = None;
    let steps = (configs.len() * params.trials as usize) as f64;
    let balancer = sim_balancer(params);
    for (ci, &config) in configs.iter().enumerate() {
        // What each trial needs: strata's tiered graph, or a baseline's
        // plain arrays.
        let tiered = match config {
            Config::Strata => Some(TieredGraph::build_on(
                g,
                config,
                budget,
                params.page_size,
                weights,
                DeviceChoice::Cuda,
            )?),
            _ => None,
        };
        let mut plain = match config {
            Config::Strata => None,
            Config::Uvm => {
                let mut p = PlainGpu::new(&ctx, g, PlainKind::Managed, weights)?;
                // Unified Memory gets the budget, as strata's device tier,
                // beside the kernels' working memory. Where HBM cannot be
                // held back to that, this configuration is skipped, with
                // the reason, rather than the whole run.
                match p.hold_back(&ctx, budget + cuda::working_bytes(g.vertices())) {
                    Ok(_) => Some(p),
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                        skipped.push(format!(
                            "{}: device memory could not be held back to the budget ({e})",
                            config.name()
                        ));
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            Config::ZeroCopy => Some(PlainGpu::new(&ctx, g, PlainKind::HostMapped, weights)?),
            _ => match PlainGpu::new(&ctx, g, PlainKind::Device, weights) {
                Ok(p) => Some(p),
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                    skipped.push(format!("{}: the graph does not fit ({e})", config.name()));
                    continue;
                }
                Err(e) => return Err(e),
            },
        };
        let kernels = match &tiered {
            Some(_) => Some(cuda::GraphKernels::for_context(&ctx, Flavour::Mapped)?),
            None => None,
        };
        let mut trials = Vec::new();
        for (t, &source) in sources.iter().enumerate() {
            progress(
                config.name(),
                (ci * params.trials as usize + t) as f64 / steps,
            );
            // A warm run's later trials start where the one before left off.
            let resume = params.warm && t > 0;
            let (result, edges, iterations, seconds, bytes_moved, hit_rate) =
                match (&tiered, &mut plain) {
                    (Some(tg), _) => {
                        if !resume {
                            tg.reset(balancer)?;
                        }
                        let before = tg.rt.stats().device_links.unwrap_or_default();
                        // The budget placed as the simulated runs place it
                        // (the arrays in order), its time part of the trial's.
                        let placing = Instant::now();
                        if !resume {
                            tg.place_initial(budget)?;
                        }
                        let placed = placing.elapsed().as_secs_f64();
                        let kernels = kernels.clone().expect("made with the tiered graph");
                        let mut run = StrataGpu::new(tg, kernels)?;
                        let wall = Instant::now();
                        let (r, i) = run_gpu_kernel(&mut run, params.algo, source)?;
                        let seconds = placed + wall.elapsed().as_secs_f64();
                        let e = traversed(g, &r);
                        let hit = run.hit_rate();
                        drop(run);
                        let after = tg.rt.stats().device_links.unwrap_or_default();
                        let moved =
                            (after.0.bytes - before.0.bytes) + (after.1.bytes - before.1.bytes);
                        (r, e, i, seconds, Some(moved), Some(hit))
                    }
                    (None, Some(p)) => {
                        if !resume {
                            p.reset()?;
                        }
                        let wall = Instant::now();
                        let (r, i) = run_gpu_kernel(p, params.algo, source)?;
                        let seconds = wall.elapsed().as_secs_f64();
                        let e = traversed(g, &r);
                        let (moved, hit) = match config {
                            Config::ZeroCopy => (Some(0), Some(0.0)),
                            Config::AllDevice => (Some(0), Some(1.0)),
                            _ => (None, None),
                        };
                        (r, e, i, seconds, moved, hit)
                    }
                    (None, None) => unreachable!("every configuration has its arrays"),
                };
            let verified = params
                .verify
                .then(|| check(g, &result, source, &mut references, &mut pr_reference))
                .transpose()
                .map_err(|why| {
                    Error::new(
                        ErrorKind::Corrupted,
                        format!(
                            "{} trial {t} (cuda): the {:?} result does not verify: {why}",
                            config.name(),
                            params.algo
                        ),
                    )
                })?;
            trials.push(Trial {
                seconds,
                wall_seconds: seconds,
                teps: edges.map(|e| e as f64 / seconds.max(1e-12)),
                bytes_moved,
                hit_rate,
                source,
                iterations,
                verified,
                cost: None,
                cold: params.warm && t == 0,
            });
            if config == Config::Strata {
                dump = Some(result);
            }
        }
        results.push(summarize(config, params.algo, trials));
    }
    progress("done", 1.0);
    Ok((
        GraphReport {
            backend: "cuda",
            gpu,
            modelled: false,
            params: params.clone(),
            vertices: g.vertices(),
            edges: g.edges(),
            graph_bytes: footprint,
            budget_bytes: budget,
            budget_requested: None,
            model: None,
            results,
            skipped,
        },
        dump.expect("strata always runs"),
    ))
}

/// [`run_kernel`] with the CUDA kernels.
#[cfg(feature = "cuda")]
fn run_gpu_kernel(
    gpu: &mut dyn crate::workloads::graph::cuda::GpuGraph,
    algo: Algo,
    source: Option<usize>,
) -> Result<(Dump, Option<u32>)> {
    use crate::workloads::graph::cuda;
    Ok(match algo {
        Algo::Bfs => {
            let r = cuda::bfs(gpu, source.expect("bfs has a source"))?;
            (Dump::Depth(r.depth, r.parent), None)
        }
        Algo::Sssp => {
            let r = cuda::sssp(gpu, source.expect("sssp has a source"), SSSP_DELTA)?;
            (Dump::Distance(r.dist), None)
        }
        Algo::Pr => {
            let r = cuda::pagerank(gpu, PR_TOLERANCE, PR_MAX_ITERATIONS)?;
            let it = r.iterations;
            (Dump::Score(r.scores), Some(it))
        }
        Algo::Cc => (Dump::Label(cuda::cc(gpu)?), None),
    })
}

/// The edges a BFS or SSSP result traversed (those of the vertices it
/// reached), for TEPS; counted after the timed run.
fn traversed(g: &Csr, result: &Dump) -> Option<u64> {
    match result {
        Dump::Depth(depth, _) => Some(reached_edges(g, &|v| depth[v] >= 0)),
        Dump::Distance(dist) => Some(reached_edges(g, &|v| dist[v] != u64::MAX)),
        Dump::Score(_) | Dump::Label(_) => None,
    }
}

/// The edges of the reached vertices, for TEPS (Graph500 counts an
/// undirected edge once).
fn reached_edges(g: &Csr, reached: &dyn Fn(usize) -> bool) -> u64 {
    let directed: u64 = (0..g.vertices())
        .filter(|&v| reached(v))
        .map(|v| g.degree(v))
        .sum();
    if g.directed() {
        directed
    } else {
        directed / 2
    }
}

/// Runs the kernel; returns its result and its iterations (PR).
fn run_kernel<M: Mem>(mem: &mut M, algo: Algo, source: Option<usize>) -> (Dump, Option<u32>) {
    match algo {
        Algo::Bfs => {
            let r = algo::bfs(mem, source.expect("bfs has a source"));
            (Dump::Depth(r.depth, r.parent), None)
        }
        Algo::Sssp => {
            let r = algo::sssp(mem, source.expect("sssp has a source"), SSSP_DELTA);
            (Dump::Distance(r.dist), None)
        }
        Algo::Pr => {
            let r = algo::pagerank(mem, PR_TOLERANCE, PR_MAX_ITERATIONS);
            let it = r.iterations;
            (Dump::Score(r.scores), Some(it))
        }
        Algo::Cc => (Dump::Label(algo::cc(mem)), None),
    }
}

fn check(
    g: &Csr,
    result: &Dump,
    source: Option<usize>,
    references: &mut HashMap<usize, Vec<u64>>,
    pr_reference: &mut Option<Vec<f64>>,
) -> std::result::Result<bool, String> {
    match result {
        Dump::Depth(depth, parent) => {
            let r = algo::BfsResult {
                depth: depth.clone(),
                parent: parent.clone(),
                edges: 0,
            };
            verify::bfs(g, source.expect("bfs has a source"), &r)?;
        }
        Dump::Distance(dist) => {
            let s = source.expect("sssp has a source");
            let reference = references
                .entry(s)
                .or_insert_with(|| verify::dijkstra(g, s));
            verify::sssp_against(
                reference,
                &algo::SsspResult {
                    dist: dist.clone(),
                    edges: 0,
                },
            )?;
        }
        Dump::Score(scores) => {
            verify::pagerank_residual(g, PR_TOLERANCE, scores)?;
            let reference = pr_reference.get_or_insert_with(|| {
                verify::pagerank_reference(g, PR_TOLERANCE, PR_MAX_ITERATIONS)
            });
            verify::pagerank_against(
                reference,
                &algo::PrResult {
                    scores: scores.clone(),
                    iterations: 0,
                },
            )?;
        }
        Dump::Label(labels) => verify::cc(g, labels)?,
    }
    Ok(true)
}
