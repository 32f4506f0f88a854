//! `strata bench moe` and `strata bench optim` (the offloading modules).

use std::path::PathBuf;

use clap::Args;

use strata::offload::optim::Importance;
use strata::size::{format_rate, format_size, parse_size};
use strata::Error;
use strata_bench::bench::moe::{self, MoeParams};
use strata_bench::bench::optim::{self, OptimParams};

#[derive(Args)]
pub struct MoeArgs {
    /// MoE layers (default 16; a trace file's own count).
    #[arg(long)]
    layers: Option<usize>,
    /// Experts per layer (default 64; a trace file's own count).
    #[arg(long)]
    experts: Option<usize>,
    /// Experts per token per layer (synthetic routing).
    #[arg(long, default_value_t = 4)]
    top_k: usize,
    /// Bytes per expert.
    #[arg(long, default_value = "256k")]
    expert_bytes: String,
    /// Experts the device holds (default: 25% of all experts).
    #[arg(long)]
    device_slots: Option<usize>,
    /// Tokens decoded (synthetic routing).
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// zipf:ALPHA (the synthetic router) or file:PATH (`token layer expert` lines).
    #[arg(long, default_value = "zipf:1.0")]
    routing: String,
    /// Also run the lru (per-layer, no prefetch) and no-cache baselines.
    #[arg(long)]
    baselines: bool,
    /// Seed of the synthetic router.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runtime page size.
    #[arg(long, default_value = "64k")]
    page_size: String,
    /// Model the link as one FIFO of whole transfers (no demand priority or
    /// page-sized prefetch chunks), for comparison.
    #[arg(long)]
    fifo_link: bool,
    /// The modelled GPU on the simulated device (its link, HBM and
    /// compute): h200-sxm5, h100-pcie5, a100-pcie4
    /// or v100-pcie3.
    #[arg(long, default_value = "h200-sxm5")]
    platform: String,
    /// The link the experts cross, GB/s, in place of the platform's
    /// host→device link (the disk's measured bandwidth when the experts
    /// come from NVMe): the model and the bounds use it.
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Latency of each transfer on --link-gbps's link, µs.
    #[arg(long, default_value_t = 0.0, requires = "link_gbps")]
    link_latency_us: f64,
    /// Each layer's compute between fetches, µs (up to 1e6), in place of the
    /// platform's model (a CPU's measured time, say).
    #[arg(long)]
    layer_compute_us: Option<f64>,
    /// Each layer's time before its experts are known (attention, norms,
    /// the router), µs: only reads already started progress in it, and the
    /// layer's own reads start after it (default 0).
    #[arg(long)]
    layer_other_us: Option<f64>,
    /// strata's cache evicts by LRFU (decayed use counts) instead of the
    /// reuse estimate, for comparison.
    #[arg(long)]
    lrfu: bool,
    /// strata's lookahead from the bench's predictor even where a
    /// --routing file records the lookahead its run made (`token layer
    /// expert prefetched` lines, which strata.moe writes)
    #[arg(long)]
    predictor: bool,
    /// A prefetched expert not yet used is protected for this many fetches
    /// (default: twice the most experts a token routes per layer; give
    /// the library's setting when replaying a strata.moe trace of whole
    /// steps, where a step routes more than a token: strata.moe's default
    /// is twice the router's top-k)
    #[arg(long)]
    protect_fetches: Option<u64>,
    /// A host tier of this many experts (those registered first, as
    /// strata.moe places them), the others on an NVMe tier in --path; the
    /// bounds then pool the device slots and the host tier, and a miss
    /// reads from NVMe (default: every expert in host memory)
    #[arg(long)]
    host_experts: Option<usize>,
    /// The disk's read bandwidth, GB/s: a move of an expert on NVMe is
    /// modelled on it (with --host-experts; --link-gbps stays the link of
    /// a move from host memory)
    #[arg(long, requires = "host_experts")]
    nvme_gbps: Option<f64>,
    /// The directory of the NVMe tier with --host-experts (default: the
    /// configured NVMe path, else the current directory)
    #[arg(long)]
    path: Option<PathBuf>,
    /// With --host-experts, the host tier caches the experts (strata.moe's
    /// host_cache=True) instead of keeping those registered in it
    #[arg(long, requires = "host_experts")]
    host_cache: bool,
    /// strata reads the experts in host memory where they are, taking no
    /// device slot (strata.moe's host_in_place=True, its default on a CPU)
    #[arg(long)]
    host_in_place: bool,
    /// The device: sim (modelled time), cuda (a GPU: real device slots,
    /// measured stall) or auto.
    #[arg(long, default_value = "sim")]
    device: String,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn size_arg(s: &str, flag: &str) -> Result<u64, Error> {
    parse_size(s).map_err(|e| e.context(flag))
}

pub fn run_moe(a: MoeArgs, config: Option<&std::path::Path>) -> Result<(), Error> {
    let link = match a.link_gbps {
        Some(g) => {
            let l = strata::link::LinkModel {
                bandwidth: g * 1e9,
                latency_ns: if a.link_latency_us.is_finite() && a.link_latency_us >= 0.0 {
                    (a.link_latency_us * 1e3) as u64
                } else {
                    return Err(Error::invalid(format!(
                        "--link-latency-us {}: not a duration",
                        a.link_latency_us
                    )));
                },
            };
            l.check().map_err(|e| {
                let flag = if e.message().contains("latency") {
                    "--link-latency-us"
                } else {
                    "--link-gbps"
                };
                e.context(flag)
            })?;
            Some(l)
        }
        None => None,
    };
    let nvme_link = match a.nvme_gbps {
        Some(g) => {
            let l = strata::link::LinkModel {
                bandwidth: g * 1e9,
                latency_ns: 0,
            };
            l.check().map_err(|e| e.context("--nvme-gbps"))?;
            Some(l)
        }
        None => None,
    };
    let path = match (a.host_experts, a.path) {
        (Some(_), p) => crate::nvme_path(p, config)?,
        (None, Some(_)) => {
            return Err(Error::invalid(
                "--path is the NVMe tier's directory: give --host-experts too",
            ))
        }
        (None, None) => PathBuf::from("."),
    };
    // A layer's time: up to a second (a run spins or sleeps through it).
    let duration = |us: Option<f64>, flag: &str| match us {
        Some(us) if us.is_finite() && (0.0..=1e6).contains(&us) => Ok(Some(us * 1e-6)),
        Some(us) => Err(Error::invalid(format!(
            "{flag} {us:e}: not a duration of 0 to 1e6 µs"
        ))),
        None => Ok(None),
    };
    let layer_compute = duration(a.layer_compute_us, "--layer-compute-us")?;
    let layer_other = duration(a.layer_other_us, "--layer-other-us")?;
    let params = MoeParams {
        layers: a.layers,
        experts: a.experts,
        top_k: a.top_k,
        expert_bytes: size_arg(&a.expert_bytes, "--expert-bytes")?,
        device_slots: a.device_slots,
        tokens: a.tokens,
        routing: a
            .routing
            .parse()
            .map_err(|e: Error| e.context("--routing"))?,
        baselines: a.baselines,
        seed: a.seed,
        page_size: size_arg(&a.page_size, "--page-size")?
            .try_into()
            .map_err(|_| Error::invalid("--page-size is too large"))?,
        fifo_link: a.fifo_link,
        device: a.device.parse().map_err(|e: Error| e.context("--device"))?,
        platform: a
            .platform
            .parse()
            .map_err(|e: Error| e.context("--platform"))?,
        link,
        layer_compute,
        layer_other,
        lrfu: a.lrfu,
        predictor: a.predictor,
        protect_fetches: a.protect_fetches,
        host_experts: a.host_experts,
        nvme_link,
        path,
        host_cache: a.host_cache,
        host_in_place: a.host_in_place,
    };
    let routing_file = match &params.routing {
        moe::Routing::File { path } => Some(path.as_path()),
        _ => None,
    };
    crate::cli::input_and_outputs(
        "--routing file:",
        routing_file,
        &[("--json", a.json.as_deref())],
    )?;
    let json = crate::open_json(&a.json)?;
    let r = crate::with_progress(a.quiet, |progress| moe::run(&params, progress)).map_err(|e| {
        if e.kind() == strata::ErrorKind::NoDevice {
            e.context(format!("--device {}", a.device))
        } else {
            e
        }
    })?;
    outln!(
        "{} layers × {} experts of {} ({} in all), {} device slots ({:.0}%), {} tokens",
        r.layers,
        r.experts,
        format_size(params.expert_bytes),
        format_size(r.expert_bytes_total),
        r.device_slots,
        100.0 * r.device_fraction,
        r.tokens
    );
    if r.modelled {
        outln!(
            "backend: simulated — stall and decode times are modelled on {} over {} ({:.2} GB/s, {:.1} µs a copy); wall is this machine",
            params.platform.name,
            if params.link.is_some() {
                "the link given (--link-gbps)"
            } else {
                "the simulated device's link"
            },
            r.link.bandwidth / 1e9,
            r.link.latency_ns as f64 / 1e3
        );
    } else {
        outln!("backend: cuda — stall and decode times measured on the GPU (each layer's compute a {:.1} µs spin); bounds below modelled", r.layer_compute_seconds * 1e6);
    }
    if let Some(h) = params.host_experts {
        outln!(
            "a host tier of {h} experts ({}), {} on NVMe in {}; a move from NVMe modelled at {}",
            match (params.host_cache, params.host_in_place) {
                (true, false) => "a cache of them all",
                (true, true) => "a cache of them all, strata reading them in place",
                (false, false) => "those registered first, kept",
                (false, true) => "those registered first, kept, strata reading them in place",
            },
            r.layers * r.experts - h,
            params.path.display(),
            match params.nvme_link {
                Some(l) => format!("{:.2} GB/s (--nvme-gbps)", l.bandwidth / 1e9),
                None => "the link above".into(),
            }
        );
    }
    outln!(
        "strata's lookahead: {}",
        if r.lookahead == "recorded" {
            "the one the trace records (its `prefetched` lines)"
        } else {
            "the bench's activation-aware predictor"
        }
    );
    let lru = r.results.iter().find(|x| x.config == "lru");
    let vs_lru = |stall: f64| match lru {
        Some(l) if l.stall_seconds > 0.0 => format!("{:.3}×", stall / l.stall_seconds),
        _ => "—".into(),
    };
    outln!(
        "{:<9} {:>9} {:>9} {:>12} {:>8} {:>10} {:>11} {:>10} {:>11} {:>8}",
        "config",
        "hit rate",
        "ready",
        "stall",
        "÷lru",
        "moved",
        "written back",
        "prefetch",
        "tokens/s",
        "wall"
    );
    for x in &r.results {
        outln!(
            "{:<9} {:>8.1}% {:>8.1}% {:>10.3}ms {:>8} {:>10} {:>11} {:>9.1}% {:>11.1} {:>7.2}s",
            x.config,
            100.0 * x.hit_rate,
            100.0 * x.ready_rate,
            x.stall_seconds * 1e3,
            vs_lru(x.stall_seconds),
            format_size(x.bytes_moved),
            format_size(x.bytes_written_back),
            100.0 * x.prefetch_accuracy,
            x.tokens_per_sec,
            x.wall_seconds
        );
    }
    for x in &r.results {
        outln!(
            "{}: {} of {} moves into device memory paid (the expert was fetched before it left){}",
            x.config,
            x.moves_paid,
            x.moves,
            if params.host_experts.is_some() {
                format!(
                    "; {} from NVMe, {} host-tier swaps, {} fetches read in place from host memory",
                    x.moves_from_nvme, x.host_swaps, x.served_in_place
                )
            } else {
                String::new()
            }
        );
    }
    if let Some(x) = r.results.iter().find(|x| x.config == "strata") {
        outln!(
            "strata's read-ahead, prefetch and cancel calls: {:.1} ms of {:.2} s of wall on the decoding thread ({:.2}%: submission only)",
            x.call_seconds * 1e3,
            x.wall_seconds,
            100.0 * x.call_seconds / x.wall_seconds.max(1e-12)
        );
    }
    let b = &r.bounds;
    outln!(
        "bounds, same fetches and {} slots in one pool{} (modelled; a transfer {:.1} µs, all compute {:.1} ms):",
        r.device_slots + params.host_experts.unwrap_or(0),
        if params.host_experts.is_some() {
            ": the device slots and the host tier, a miss read from NVMe"
        } else {
            ""
        },
        b.transfer_seconds * 1e6,
        b.compute_seconds * 1e3
    );
    outln!(
        "  belady        {:>8.1}% {:>10.3}ms {:>8}   demand transfers only",
        100.0 * b.belady_hit_rate,
        b.belady_stall_seconds * 1e3,
        vs_lru(b.belady_stall_seconds)
    );
    outln!(
        "  belady        {:>8.1}% ≥{:>9.3}ms {:>8}   with perfect prefetch",
        100.0 * b.belady_hit_rate,
        b.belady_prefetch_stall_floor_seconds * 1e3,
        vs_lru(b.belady_prefetch_stall_floor_seconds)
    );
    outln!(
        "  best fixed set{:>8.1}% ≥{:>9.3}ms {:>8}   with perfect prefetch",
        100.0 * b.static_oracle_hit_rate,
        b.static_oracle_prefetch_stall_floor_seconds * 1e3,
        vs_lru(b.static_oracle_prefetch_stall_floor_seconds)
    );
    crate::write_json(json, &r)?;
    Ok(())
}

#[derive(Args)]
pub struct OptimArgs {
    /// Parameters (fp32).
    #[arg(long, default_value_t = 16 << 20)]
    params: usize,
    /// Where the states live: host, cxl or nvme.
    #[arg(long, default_value = "host")]
    tier: String,
    /// Chunk bytes per state array (a power of two, 4k..2M).
    #[arg(long, default_value = "1M")]
    chunk: String,
    /// Directory for the NVMe tier, a disk, not tmpfs (default: the
    /// configured NVMe path, then the current directory); with --tier nvme
    /// only.
    #[arg(long)]
    path: Option<PathBuf>,
    /// Timed steps (after one untimed).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Where the update runs: cpu, or cuda (a GPU; needs the cuda feature).
    #[arg(long, default_value = "cpu")]
    update: String,
    /// Importance-aware mode, FRACTION:EVERY (e.g. 0.1:4): per chunk the
    /// FRACTION of largest gradients stays resident and updates every step,
    /// the rest every EVERY steps.
    #[arg(long)]
    importance: Option<String>,
    /// The states in a strata runtime's tier (`OffloadedAdam::on`, the
    /// runtime shared with a user's buffers; pages of --chunk) rather than
    /// the optimizer's private runtime (the same step path either way).
    #[arg(long)]
    shared: bool,
    /// The parameters' and gradients' type: f32, bf16 or f16 (the fp32
    /// masters and moments are in the tier either way).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Also measure the memory-bandwidth roofline (a STREAM-style triad
    /// over arrays the size of the states) and the step's fraction of it.
    #[arg(long)]
    roofline: bool,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn parse_importance(s: &str) -> Result<Importance, Error> {
    let bad = || {
        Error::invalid(format!(
            "--importance {s:?}: use FRACTION:EVERY, e.g. 0.1:4"
        ))
    };
    let (f, e) = s.split_once(':').ok_or_else(bad)?;
    let fraction: f64 = f.parse().map_err(|_| bad())?;
    let every: u64 = e.parse().map_err(|_| bad())?;
    if !(fraction > 0.0 && fraction <= 1.0) || every == 0 {
        return Err(Error::invalid(format!(
            "--importance {s:?}: FRACTION must be in (0, 1] and EVERY at least 1"
        )));
    }
    Ok(Importance { fraction, every })
}

pub fn run_optim(a: OptimArgs, config: Option<&std::path::Path>) -> Result<(), Error> {
    // Only the NVMe tier places anything there (and warns about tmpfs).
    let path = if a.tier == "nvme" {
        crate::nvme_path(a.path.clone(), config)?
    } else if a.path.is_some() && matches!(a.tier.as_str(), "host" | "cxl") {
        // (A tier of another name is refused as such.)
        return Err(Error::invalid(format!(
            "--path is the NVMe tier's: --tier {} places nothing there",
            a.tier
        )));
    } else {
        PathBuf::from(".")
    };
    let params = OptimParams {
        params: a.params,
        tier: a.tier.clone(),
        chunk: size_arg(&a.chunk, "--chunk")?
            .try_into()
            .map_err(|_| Error::invalid("--chunk is too large"))?,
        path,
        steps: a.steps,
        update: a.update.parse().map_err(|e: Error| e.context("--update"))?,
        importance: a.importance.as_deref().map(parse_importance).transpose()?,
        shared: a.shared,
        dtype: a.dtype.clone(),
        roofline: a.roofline,
    };
    let json = crate::open_json(&a.json)?;
    let r = crate::with_progress(a.quiet, |progress| optim::run(&params, progress))?;
    let on = match &r.gpu {
        Some(gpu) => format!("on {gpu}, cuda"),
        None => format!("on the CPU ({} threads)", r.threads),
    };
    outln!(
        "{} {} parameters, states {} in {}{}{}, chunks of {}; update {on}",
        params.params,
        r.dtype,
        format_size(r.state_bytes),
        if params.shared {
            "a shared runtime's "
        } else {
            ""
        },
        r.tier,
        if r.emulated { " (emulated)" } else { "" },
        format_size(params.chunk as u64),
    );
    if let Some(imp) = &params.importance {
        outln!(
            "importance-aware: {:.0}% of each chunk resident, the rest every {} steps; {} timed steps, {} of state moved per step",
            imp.fraction * 100.0,
            imp.every,
            r.timed_steps,
            format_size(r.state_bytes_per_step as u64)
        );
    }
    outln!(
        "step {:.3}s, {} (read + written), waited on I/O {:.3}s per step",
        r.step_seconds,
        format_rate(r.bytes_per_sec),
        r.io_wait_seconds
    );
    outln!(
        "memcpy on one thread {} (a reference, not a bound) → {:.2}×",
        format_rate(r.memcpy_bytes_per_sec),
        r.ratio_to_memcpy
    );
    if let (Some(rd), Some(wr), Some(bound), Some(x)) = (
        r.nvme_seq_read_bytes_per_sec,
        r.nvme_seq_write_bytes_per_sec,
        r.nvme_bound_seconds,
        r.nvme_fraction,
    ) {
        outln!(
            "nvme sequential read {}, write {}: the step's reads and writes at those rates, one after the other, take {:.3}s → {:.2}× of that (above 1: the disk overlapped them)",
            format_rate(rd),
            format_rate(wr),
            bound,
            x
        );
    }
    if let Some(rf) = &r.roofline {
        outln!(
            "roofline: triad {} ({} threads); a step must move {} B a parameter (this one moves {}): {:.3}s → {:.2}× of the roofline",
            format_rate(rf.triad_bytes_per_sec),
            r.threads,
            rf.bytes_per_param,
            rf.moved_per_param,
            rf.bound_seconds,
            rf.fraction
        );
    }
    crate::write_json(json, &r)?;
    Ok(())
}
