//! `strata bench priority`.

use std::path::PathBuf;

use clap::Args;

use strata::size::format_size;
use strata::Error;
use strata_bench::bench::priority::{self, PriorityParams, PriorityReport};

#[derive(Args)]
pub struct PriorityArgs {
    /// Bytes written per busy phase: the background eviction's backlog.
    #[arg(long, default_value = "2G")]
    data: String,
    /// DRAM (strata's host tier; at least --data and the probe).
    #[arg(long)]
    dram: Option<String>,
    /// Page size.
    #[arg(long, default_value = "64k")]
    page_size: String,
    /// Directory on the disk measured (default: the configured NVMe path,
    /// then the current directory).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Probe ops per phase, at most (a busy phase ends when the backlog
    /// falls below half of --data).
    #[arg(long, default_value_t = 300)]
    ops: usize,
    /// Busy and idle phases each, interleaved.
    #[arg(long, default_value_t = 3)]
    trials: usize,
    /// Seed of the content and the probe's pages.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

pub fn run(a: PriorityArgs, config: Option<&std::path::Path>) -> Result<(), Error> {
    let data = crate::size_arg("--data", &a.data)?;
    let page_size = crate::page_size_arg("--page-size", &a.page_size)?;
    let dram = match &a.dram {
        Some(d) => crate::size_arg("--dram", d)?,
        // The data, the probe, and room to spare.
        None => data.saturating_add(data / 8).saturating_add(64 << 20),
    };
    let params = PriorityParams {
        data,
        dram,
        page_size,
        path: crate::nvme_path(a.path, config)?,
        ops: a.ops,
        trials: a.trials,
        seed: a.seed,
    };
    params.check()?;
    let json = crate::open_json(&a.json)?;
    let report = crate::with_progress(a.quiet, |progress| priority::run(&params, progress))?;
    print(&report)?;
    crate::write_json(json, &report)
}

fn print(r: &PriorityReport) -> Result<(), Error> {
    let p = &r.params;
    outln!(
        "{} materialized per busy phase in {} of DRAM (watermarks 1%/2%), {} pages, NVMe in {}",
        format_size(p.data),
        format_size(p.dram),
        format_size(p.page_size as u64),
        p.path.display()
    );
    outln!(
        "{:<5} {:>5} {:>6} {:>12} {:>12} {:>12} {:>12} {:>10} {:>8} {:>10}",
        "phase",
        "trial",
        "ops",
        "pin p50",
        "pin p99",
        "evict p50",
        "evict p99",
        "backlog",
        "reclaim",
        "dem. queue"
    );
    for x in &r.phases {
        outln!(
            "{:<5} {:>5} {:>6} {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>10.0}µs {:>10} {:>8} {:>8.0}µs",
            x.phase,
            x.trial,
            x.promote.n,
            x.promote.p50_us,
            x.promote.p99_us,
            x.demote.p50_us,
            x.demote.p99_us,
            format_size(x.backlog_bytes),
            x.reclaim_batches,
            x.demand_queued_us
        );
    }
    outln!(
        "busy / idle (median of trials): pin p50 {:.2}x, p99 {:.2}x; evict p50 {:.2}x, p99 {:.2}x",
        r.ratio_promote_p50,
        r.ratio_promote_p99,
        r.ratio_demote_p50,
        r.ratio_demote_p99
    );
    Ok(())
}
