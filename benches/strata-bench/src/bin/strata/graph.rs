//! `strata bench graph`.

use std::path::PathBuf;

use clap::Args;

use strata::device::DeviceChoice;
use strata::policy::PolicyKind;
use strata::size::{format_size, parse_size};
use strata::Error;
use strata_bench::bench::graph::{self, Algo, Budget, GraphParams, GraphReport};
use strata_bench::workloads::graph::model::Platform;
use strata_bench::workloads::graph::tiered::Config;
use strata_bench::workloads::graph::GraphSpec;

use crate::out::OutputPath;

#[derive(Args)]
pub struct GraphArgs {
    /// bfs, sssp, pr or cc; several comma-separated run one after the other
    /// on the same graph.
    #[arg(long, default_value = "bfs,pr")]
    algo: String,
    /// kron:SCALE[:EDGEFACTOR], urand:SCALE[:EDGEFACTOR] or file:PATH (.el or .wel).
    #[arg(long, default_value = "kron:20")]
    graph: String,
    /// With file:PATH, add the reverse of every edge.
    #[arg(long)]
    undirected: bool,
    /// Device memory for the graph: bytes (e.g. 64M) or a percentage (25%).
    /// A budget above the graph's size is capped to it (the whole graph on
    /// the device), and the report says so.
    #[arg(long, default_value = "25%")]
    device_budget: String,
    /// strata's placement policy (default: the default policy).
    #[arg(long, default_value = "default")]
    policy: String,
    /// strata's balancer: accesses a page needs in a round (between
    /// kernel launches) to be a candidate for promotion (default: the page
    /// size, about four reads through a page of 4-byte elements).
    #[arg(long)]
    min_accesses: Option<u64>,
    /// Trials after the first start where the one before left off: a
    /// graph queried again and again. strata keeps its placement and its
    /// balancer's history, Unified Memory what it holds, all-device its
    /// upload (zero-copy and the static optimum are as in any trial). The
    /// first trial, cold, is shown apart and left out of the medians;
    /// needs --trials 2 or more
    #[arg(long)]
    warm: bool,
    /// Trials per configuration (the median is reported). A baseline
    /// whose trials share one source (PageRank and CC have none, or
    /// --source fixes it) runs once on the simulated device: its modelled
    /// run would repeat
    #[arg(long, default_value_t = 3)]
    trials: u32,
    /// BFS/SSSP source vertex (otherwise random per trial).
    #[arg(long)]
    source: Option<usize>,
    /// Seed of the generator and of the sources.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Check every trial's result.
    #[arg(long)]
    verify: bool,
    /// Write the last strata trial's per-vertex result here.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// Also run the baselines on the same graph: uvm, uvm-advised,
    /// zero-copy, all-device and static-optimum (on a GPU: uvm, zero-copy,
    /// all-device).
    #[arg(long)]
    baselines: bool,
    /// Exactly these configurations, comma-separated: strata, uvm,
    /// uvm-advised, zero-copy, all-device, static-optimum, resident (every
    /// page in the fastest tier, no model: wall time); on a GPU strata,
    /// uvm, zero-copy and all-device.
    #[arg(long, conflicts_with = "baselines")]
    configs: Option<String>,
    /// The modelled GPU on the simulated device: h200-sxm5, h100-pcie5,
    /// a100-pcie4 or v100-pcie3.
    #[arg(long, default_value = "h200-sxm5")]
    platform: String,
    /// Page size of the tiered buffers.
    #[arg(long, default_value = "64k")]
    page_size: String,
    /// Where the kernels run: sim (the simulated device, modelled times),
    /// cuda (the CUDA kernels on GPU 0, measured; needs the cuda feature),
    /// or auto (cuda where a GPU is).
    #[arg(long, default_value = "sim")]
    device: String,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the comparison as SVG to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

pub fn run(a: GraphArgs) -> Result<(), Error> {
    let mut spec: GraphSpec = a.graph.parse().map_err(|e: Error| e.context("--graph"))?;
    if let GraphSpec::File { path, .. } = &spec {
        crate::cli::input_file("--graph file:", path)?;
    }
    if let GraphSpec::File { undirected, .. } = &mut spec {
        *undirected = a.undirected;
    } else if a.undirected {
        return Err(Error::invalid(
            "--undirected applies to file: graphs (generated graphs are undirected)",
        ));
    }
    let algos = a
        .algo
        .split(',')
        .map(|x| x.trim().parse::<Algo>().map_err(|e| e.context("--algo")))
        .collect::<Result<Vec<_>, _>>()?;
    crate::cli::no_repeats("--algo", &algos, |x| format!("{x:?}").to_lowercase())?;
    if a.source.is_some() && !algos.iter().any(|x| matches!(x, Algo::Bfs | Algo::Sssp)) {
        return Err(Error::invalid(
            "--source is BFS's and SSSP's, and --algo names neither",
        ));
    }
    let page_size: usize = parse_size(&a.page_size)
        .map_err(|e| e.context("--page-size"))?
        .try_into()
        .map_err(|_| Error::invalid("--page-size is too large"))?;
    let budget: Budget = a
        .device_budget
        .parse()
        .map_err(|e: Error| e.context("--device-budget"))?;
    if let Budget::Bytes(bytes) = budget {
        if bytes < page_size as u64 {
            return Err(Error::invalid(format!(
                "--device-budget {} holds no {page_size}-byte page (--page-size)",
                a.device_budget
            )));
        }
    }
    let policy: PolicyKind = a.policy.parse().map_err(|e: Error| e.context("--policy"))?;
    let device: DeviceChoice = a.device.parse().map_err(|e: Error| e.context("--device"))?;
    let platform: Platform = a
        .platform
        .parse()
        .map_err(|e: Error| e.context("--platform"))?;
    let configs = a
        .configs
        .as_deref()
        .map(|list| {
            list.split(',')
                .map(|c| {
                    c.trim()
                        .parse::<Config>()
                        .map_err(|e| e.context("--configs"))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    if configs.as_ref().is_some_and(|c| c.is_empty()) {
        return Err(Error::invalid("--configs names no configuration"));
    }
    if let Some(c) = &configs {
        crate::cli::no_repeats("--configs", c, |x| x.name().to_string())?;
        if a.dump.is_some() && !c.contains(&Config::Strata) {
            return Err(Error::invalid(
                "--dump writes strata's result, and --configs does not run strata",
            ));
        }
        // A setting of strata's balancer would be silently ignored.
        let strata_only = [
            ("--policy", policy != PolicyKind::Default),
            ("--min-accesses", a.min_accesses.is_some()),
        ];
        if let Some((flag, _)) = strata_only.iter().find(|(_, given)| *given) {
            if !c.contains(&Config::Strata) {
                return Err(Error::invalid(format!(
                    "{flag} is strata's balancer's, and --configs does not run strata"
                )));
            }
        }
    }

    if device == DeviceChoice::Cuda {
        // Before generating the graph: no GPU is one line, at once.
        strata::device::probe_gpus().map_err(|e| e.context("--device cuda"))?;
    }
    let params = |algo| GraphParams {
        algo,
        graph: spec.clone(),
        device_budget: budget,
        policy,
        min_accesses: a.min_accesses,
        warm: a.warm,
        trials: a.trials,
        source: a.source,
        seed: a.seed,
        verify: a.verify,
        baselines: a.baselines,
        configs: configs.clone(),
        platform,
        page_size,
        device,
    };
    if a.trials == 0 {
        return Err(Error::invalid("--trials must be at least 1"));
    }
    if a.warm && a.trials < 2 {
        return Err(Error::invalid(
            "--warm needs --trials 2 or more: the first trial is the cold one",
        ));
    }
    strata::size::check_page_size(page_size).map_err(|e| e.context("--page-size"))?;
    // Output files open before the run: a bad path fails at once.
    let input = match &spec {
        GraphSpec::File { path, .. } => Some(path.as_path()),
        _ => None,
    };
    crate::out::distinct_files(&[
        ("--graph file:", input),
        ("--json", a.json.as_deref()),
        ("--dump", a.dump.as_deref()),
        ("--plot", a.plot.as_deref()),
    ])?;
    let json = crate::open_json(&a.json)?;
    let dump_file = OutputPath::check_opt("--dump", &a.dump)?;
    let plot_file = OutputPath::check_opt("--plot", &a.plot)?;
    let (reports, dump) = crate::with_progress(a.quiet, |progress| {
        progress("graph", 0.0);
        let g = strata_bench::workloads::graph::Csr::load(&spec, a.seed)?;
        let mut reports = Vec::new();
        let mut last = None;
        for (i, &algo) in algos.iter().enumerate() {
            let share = 1.0 / algos.len() as f64;
            let (r, d) = graph::run_on(&g, &params(algo), &mut |phase, f| {
                progress(phase, (i as f64 + f) * share)
            })?;
            reports.push(r);
            last = Some(d);
        }
        Ok::<_, Error>((reports, last.expect("at least one algorithm")))
    })?;
    for r in &reports {
        print_table(r)?;
    }
    if let Some(f) = dump_file {
        f.write_with(|w| dump.write(w))?;
    }
    if reports.len() == 1 {
        crate::write_json(json, &reports[0])?;
    } else {
        crate::write_json(
            json,
            &Combined {
                backend: reports[0].backend,
                modelled: reports[0].modelled,
                results: reports.iter().flat_map(|r| r.results.clone()).collect(),
                reports: &reports,
            },
        )?;
    }
    if let Some(out) = &plot_file {
        plot(&reports, out)?;
    }
    Ok(())
}

/// The JSON of several kernels over one graph: every configuration's
/// results in one list (each names its `algo`), and each kernel's report.
#[derive(serde::Serialize)]
struct Combined<'a> {
    backend: &'static str,
    modelled: bool,
    results: Vec<graph::ConfigResult>,
    reports: &'a [GraphReport],
}

fn print_table(r: &GraphReport) -> Result<(), Error> {
    outln!(
        "\n{:?}: {} vertices, {} edges, {} read by the kernel; device budget {} ({:.0}%)",
        r.params.algo,
        r.vertices,
        r.edges,
        format_size(r.graph_bytes),
        format_size(r.budget_bytes),
        100.0 * r.budget_bytes as f64 / r.graph_bytes.max(1) as f64
    );
    if let Some(asked) = r.budget_requested {
        outln!(
            "--device-budget {} is more than the graph needs: capped to {} (the whole graph fits)",
            format_size(asked),
            format_size(r.budget_bytes)
        );
    }
    match &r.model {
        Some(m) => outln!(
            "backend: simulated — times are modelled GPU time on {} (link {:.0} GB/s DMA, L2 {}); wall is this machine",
            m.name,
            m.dma_h2d / 1e9,
            format_size(m.l2_bytes)
        ),
        None => outln!(
            "backend: cuda, {} — times are measured; strata's hit rate is of sampled accesses",
            r.gpu.as_deref().unwrap_or("GPU")
        ),
    }
    let warm = r.params.warm;
    if warm {
        outln!("warm: each trial after the first starts where the one before left off; the medians are of those, the first (cold) trial apart");
    }
    outln!(
        "{:<14} {:>12} {:>10} {:>12} {:>12} {:>9}{}",
        "config",
        if r.modelled { "modelled" } else { "measured" },
        "wall",
        "GTEPS",
        "moved",
        "hit rate",
        if warm { "         cold" } else { "" }
    );
    for c in &r.results {
        outln!(
            "{:<14} {:>10.3}ms {:>9.3}s {:>12} {:>12} {:>9}{}",
            c.config,
            c.seconds * 1e3,
            c.wall_seconds,
            c.teps.map_or("-".into(), |t| format!("{:.2}", t / 1e9)),
            c.bytes_moved.map_or("-".into(), format_size),
            c.hit_rate
                .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
            c.cold_seconds
                .map_or(String::new(), |s| format!(" {:>10.3}ms", s * 1e3))
        );
    }
    for c in &r.results {
        if let Some(paid) = c.promotions_paid {
            crate::out::promotions_paid(c.config, paid)?;
        }
    }
    for s in &r.skipped {
        outln!("skipped {s}");
    }
    if let Some(v) = r.results[0].trials[0].verified {
        outln!("verified: {}", if v { "every trial" } else { "no" });
    }
    Ok(())
}

fn plot(reports: &[GraphReport], out: &OutputPath) -> Result<(), Error> {
    let panels: Vec<crate::plot::Panel<'_>> = reports
        .iter()
        .map(|r| crate::plot::Panel {
            caption: format!(
                "{:?}, {} vertices, device budget {} ({})",
                r.params.algo,
                r.vertices,
                format_size(r.budget_bytes),
                if r.modelled {
                    "simulated device, modelled time"
                } else {
                    "GPU, measured time"
                }
            ),
            x_desc: if r.modelled {
                "modelled milliseconds (lower is better)"
            } else {
                "milliseconds (lower is better)"
            },
            bars: r
                .results
                .iter()
                .map(|c| (c.config, c.seconds * 1e3))
                .collect(),
        })
        .collect();
    crate::plot::bars(out, &panels)
}
