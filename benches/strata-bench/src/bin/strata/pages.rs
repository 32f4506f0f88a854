//! `strata bench pages`, and the hidden child that runs its page cache
//! baseline.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::Args;

use strata::size::format_size;
use strata::{Error, ErrorKind};
use strata_bench::bench::pages::{self, ChildSpec, PagesParams, PagesReport, PagesResult};

#[derive(Args)]
pub struct PagesArgs {
    /// Bytes of data read (a whole number of pages), e.g. 4G.
    #[arg(long)]
    data: String,
    /// DRAM for them: strata's fastest tier, the page cache's cgroup limit,
    /// foyer's memory.
    #[arg(long)]
    dram: String,
    /// Emulated CXL memory between DRAM and NVMe (strata only).
    #[arg(long)]
    cxl: Option<String>,
    /// Page size (strata's pages, foyer's entries).
    #[arg(long, default_value = "64k")]
    page_size: String,
    /// Directory on the disk measured (default: the configured NVMe path,
    /// then the current directory).
    #[arg(long)]
    path: Option<PathBuf>,
    /// zipf:ALPHA, shift:ALPHA:PERIOD (the hot set re-drawn every PERIOD
    /// reads) or file:PATH (one page id per line, `#` comments).
    #[arg(long, default_value = "zipf:0.99")]
    access: String,
    /// Reads per configuration.
    #[arg(long, default_value_t = 1_000_000)]
    ops: u64,
    /// Threads reading.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Bytes per read.
    #[arg(long, default_value = "4k")]
    read_bytes: String,
    /// Also run the page cache (mmap under a cgroup memory limit, with and
    /// without MADV_RANDOM) and, built with the foyer feature, foyer.
    #[arg(long)]
    baselines: bool,
    /// Only these configurations, comma-separated: strata, os, os-random,
    /// foyer, and strata-background / strata-on-read (strata with its
    /// promotions from NVMe moved in the background, or left to the pages'
    /// next reads) (default: strata, and with --baselines strata and the
    /// peers).
    #[arg(long)]
    configs: Option<String>,
    /// strata's balancer: accesses a round before a page may be promoted
    /// (default: the balancer's own, 0).
    #[arg(long)]
    min_accesses: Option<u64>,
    /// strata's balancer: its placement policy.
    #[arg(long, default_value = "default")]
    policy: String,
    /// strata's balancer: balance the pairs of tiers below DRAM too (a
    /// policy for DRAM + CXL: NVMe pages promoted into CXL), not only DRAM.
    #[arg(long)]
    lower_levels: bool,
    /// Rounds of every configuration, interleaved.
    #[arg(long, default_value_t = 1)]
    trials: usize,
    /// Seed of the content and the reads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

pub fn run(a: PagesArgs, config: Option<&std::path::Path>) -> Result<(), Error> {
    let size = |flag: &str, v: &str| crate::size_arg(flag, v);
    let params = PagesParams {
        data: size("--data", &a.data)?,
        dram: size("--dram", &a.dram)?,
        cxl: a.cxl.as_deref().map(|c| size("--cxl", c)).transpose()?,
        page_size: crate::page_size_arg("--page-size", &a.page_size)?,
        path: crate::nvme_path(a.path, config)?,
        access: a.access.parse().map_err(|e: Error| e.context("--access"))?,
        ops: a.ops,
        threads: a.threads,
        read_bytes: usize::try_from(size("--read-bytes", &a.read_bytes)?)
            .map_err(|_| Error::invalid("--read-bytes is too large"))?,
        baselines: a.baselines,
        configs: a
            .configs
            .map(|c| c.split(',').map(|x| x.trim().to_string()).collect()),
        min_accesses: a.min_accesses,
        policy: a
            .policy
            .parse()
            .map_err(|e: strata::Error| e.context("--policy"))?,
        lower_levels: a.lower_levels,
        trials: a.trials,
        seed: a.seed,
    };
    params.check()?;
    let access_file = match &params.access {
        pages::Access::File { path } => Some(path.as_path()),
        _ => None,
    };
    crate::cli::input_and_outputs(
        "--access file:",
        access_file,
        &[("--json", a.json.as_deref())],
    )?;
    let json = crate::open_json(&a.json)?;
    let report = crate::with_progress(a.quiet, |progress| {
        pages::run(&params, &spawn_child, progress)
    })?;
    print(&report)?;
    crate::write_json(json, &report)
}

/// Runs a page cache baseline in a new process: this binary, `bench
/// pages-child`, the spec as JSON on its command line, the result as JSON
/// on its stdout.
fn spawn_child(spec: &ChildSpec) -> Result<PagesResult, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata binary", e))?;
    let text = serde_json::to_string(spec).map_err(|e| Error::invalid(format!("encoding: {e}")))?;
    let out = Command::new(exe)
        .args(["bench", "pages-child", &text])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| Error::io("starting the page cache baseline's process", e))?;
    if !out.status.success() {
        return Err(Error::new(
            ErrorKind::Io,
            format!(
                "the {} baseline's process failed ({})",
                spec.config, out.status
            ),
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("the {} baseline's report: {e}", spec.config),
        )
    })
}

/// The child: `strata bench pages-child SPEC`.
pub fn child(spec: &str) -> Result<(), Error> {
    let spec: ChildSpec =
        serde_json::from_str(spec).map_err(|e| Error::invalid(format!("pages-child spec: {e}")))?;
    let r = pages::run_os_child(&spec)?;
    outln!(
        "{}",
        serde_json::to_string(&r).map_err(|e| Error::invalid(format!("encoding: {e}")))?
    );
    Ok(())
}

fn print(r: &PagesReport) -> Result<(), Error> {
    let p = &r.params;
    outln!(
        "{} of data ({} pages of {}), {} of DRAM ({} pages){}; {} reads of {} on {} threads, {}",
        format_size(p.data),
        r.data_pages,
        format_size(p.page_size as u64),
        format_size(p.dram),
        r.dram_pages,
        p.cxl
            .map(|c| format!(", {} of emulated CXL", format_size(c)))
            .unwrap_or_default(),
        r.ops,
        format_size(p.read_bytes as u64),
        p.threads,
        p.access
    );
    outln!("real DRAM and disk ({}); no device tier", p.path.display());
    outln!(
        "{:<10} {:>5} {:>12} {:>9} {:>9} {:>11} {:>11} {:>9} {:>6} {:>5}",
        "config",
        "trial",
        "ops/s",
        "p50",
        "p99",
        "disk read",
        "disk write",
        "DRAM hit",
        "wrong",
        "lost"
    );
    for x in &r.results {
        outln!(
            "{:<10} {:>5} {:>12.0} {:>7.1}µs {:>7.1}µs {:>11} {:>11} {:>8.1}% {:>6} {:>5}",
            x.config,
            x.trial,
            x.ops_per_sec,
            x.p50_us,
            x.p99_us,
            format_size(x.disk_bytes_read),
            format_size(x.disk_bytes_written),
            100.0 * x.fast_tier_hit_rate,
            x.wrong_reads,
            x.lost
        );
    }
    let b = &r.bound;
    let belady_hit = 1.0 - b.belady_misses as f64 / r.ops.max(1) as f64;
    outln!(
        "bounds: Belady (MIN, {} pages) {:.1}% DRAM hits ({} misses); best fixed placement in hindsight {:.1}%",
        r.dram_pages,
        100.0 * belady_hit,
        b.belady_misses,
        100.0 * b.static_optimum_hit_rate
    );
    outln!(
        "online references replayed per read ({} pages), misses: {}; best {}",
        r.dram_pages,
        b.references
            .iter()
            .map(|(name, m)| format!("{name} {m}"))
            .collect::<Vec<_>>()
            .join(", "),
        b.best_reference.0
    );
    for x in r.results.iter().filter(|x| x.config.starts_with("strata")) {
        let misses = ((1.0 - x.fast_tier_hit_rate) * r.ops as f64).round();
        outln!(
            "{} trial {}: DRAM misses {:.3}x Belady's, {:.3}x the best online reference's ({}); \
             DRAM share {:.3}x the best fixed placement's",
            x.config,
            x.trial,
            misses / b.belady_misses.max(1) as f64,
            misses / b.best_reference.1.max(1) as f64,
            b.best_reference.0,
            x.fast_tier_hit_rate / b.static_optimum_hit_rate.max(1e-12)
        );
    }
    for c in &r.comparisons {
        outln!(
            "{} / {} over {} trials: ops/s {:.2}x by the medians (pairs {:.2}-{:.2}x); p99 {:.1} against {:.1} µs \
             (medians; lower in {} of {} pairs); disk read {}",
            c.config,
            c.peer,
            c.pairs,
            c.ops_ratio,
            c.ops_ratio_pairs.0,
            c.ops_ratio_pairs.1,
            c.p99_us.0,
            c.p99_us.1,
            c.p99_lower_pairs,
            c.pairs,
            c.disk_read_ratio
                .map_or("— (the peer read nothing)".to_string(), |r| format!("{r:.2}x"))
        );
    }
    for s in &r.skipped {
        outln!("skipped: {s}");
    }
    Ok(())
}
