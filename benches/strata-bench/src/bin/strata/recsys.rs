//! `strata bench recsys`.

use std::path::PathBuf;

use clap::Args;

use strata::policy::PolicyKind;
use strata::size::{format_size, parse_size};
use strata::Error;
use strata_bench::bench::graph::Budget;
use strata_bench::bench::recsys::{self, RecsysParams, RecsysReport};

#[derive(Args)]
pub struct RecsysArgs {
    /// Embedding tables.
    #[arg(long, default_value_t = 8)]
    tables: usize,
    /// Rows per table.
    #[arg(long, default_value_t = 200_000)]
    rows: usize,
    /// f32 elements per row.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Rows summed per bag.
    #[arg(long, default_value_t = 20)]
    pooling: usize,
    /// Bags per table per batch.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Batches (a --dist file's lines are its batches).
    #[arg(long, default_value_t = 24)]
    batches: usize,
    /// zipf:ALPHA, uniform or file:PATH (one batch per line, `table:row`
    /// items, each table's at most --batch × --pooling, cycled to fill them).
    #[arg(long, default_value = "zipf:1.05")]
    dist: String,
    /// Device memory for the tables: bytes or a percentage. A budget above
    /// the tables' size is capped to it, and the run says so.
    #[arg(long, default_value = "20%")]
    device_budget: String,
    /// strata's policy: which rows its row cache keeps (and, in
    /// strata-pages, which pages the balancer places).
    #[arg(long, default_value = "default")]
    policy: String,
    /// Also run strata-pages (whole pages placed by the balancer),
    /// lru-cache, zero-copy and all-device.
    #[arg(long)]
    baselines: bool,
    /// Seed of the indices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Page size of the tiered tables.
    #[arg(long, default_value = "64k")]
    page_size: String,
    /// The modelled GPU: h200-sxm5, h100-pcie5, a100-pcie4 or v100-pcie3.
    #[arg(long, default_value = "h200-sxm5")]
    platform: String,
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

pub fn run(a: RecsysArgs) -> Result<(), Error> {
    let params = RecsysParams {
        tables: a.tables,
        rows: a.rows,
        dim: a.dim,
        pooling: a.pooling,
        batch: a.batch,
        batches: a.batches,
        dist: a.dist.parse().map_err(|e: Error| e.context("--dist"))?,
        device_budget: a
            .device_budget
            .parse::<Budget>()
            .map_err(|e| e.context("--device-budget"))?,
        policy: a
            .policy
            .parse::<PolicyKind>()
            .map_err(|e| e.context("--policy"))?,
        baselines: a.baselines,
        seed: a.seed,
        platform: a
            .platform
            .parse()
            .map_err(|e: Error| e.context("--platform"))?,
        page_size: parse_size(&a.page_size)
            .map_err(|e| e.context("--page-size"))?
            .try_into()
            .map_err(|_| Error::invalid("--page-size is too large"))?,
    };
    strata::size::check_page_size(params.page_size).map_err(|e| e.context("--page-size"))?;
    let dist_file = match &params.dist {
        strata_bench::workloads::recsys::Dist::File { path } => Some(path.as_path()),
        _ => None,
    };
    crate::cli::input_and_outputs(
        "--dist file:",
        dist_file,
        &[("--json", a.json.as_deref()), ("--plot", a.plot.as_deref())],
    )?;
    let json = crate::open_json(&a.json)?;
    let plot_file = crate::out::OutputPath::check_opt("--plot", &a.plot)?;
    let report = crate::with_progress(a.quiet, |progress| recsys::run(&params, progress))?;
    outln!(
        "{} tables × {} rows × {} f32 ({}), device budget {}; {} lookups per configuration",
        params.tables,
        params.rows,
        params.dim,
        format_size(report.table_bytes),
        format_size(report.budget_bytes),
        report.lookups
    );
    if let Some(asked) = report.budget_requested {
        outln!(
            "--device-budget {} is more than the tables need: capped to {} (every table fits)",
            format_size(asked),
            format_size(report.budget_bytes)
        );
    }
    outln!(
        "backend: simulated — lookups/s in modelled GPU time on {}; wall is this machine",
        report.model.platform
    );
    outln!(
        "{:<12} {:>14} {:>9} {:>10} {:>12} {:>9}",
        "config",
        "lookups/s",
        "hit rate",
        "moved",
        "modelled",
        "wall"
    );
    for r in &report.results {
        outln!(
            "{:<12} {:>14.3e} {:>8.1}% {:>10} {:>10.3}ms {:>8.2}s",
            r.config,
            r.lookups_per_sec,
            100.0 * r.hit_rate,
            format_size(r.bytes_moved),
            r.seconds * 1e3,
            r.wall_seconds
        );
    }
    for r in &report.results {
        if let Some(paid) = r.promotions_paid {
            crate::out::promotions_paid(r.config, paid)?;
        }
    }
    for o in &report.static_optimum {
        outln!(
            "{:<12} {:>14.3e} {:>8.1}%   (best fixed placement by {}, in hindsight, free)",
            "static-opt",
            o.lookups_per_sec,
            100.0 * o.hit_rate,
            o.granularity
        );
    }
    crate::write_json(json, &report)?;
    if let Some(out) = &plot_file {
        plot(&report, out)?;
    }
    Ok(())
}

fn plot(r: &RecsysReport, out: &crate::out::OutputPath) -> Result<(), Error> {
    crate::plot::bars(
        out,
        &[crate::plot::Panel {
            caption: "embedding bags (simulated device, modelled time)".into(),
            x_desc: "million lookups per modelled second (higher is better)",
            bars: r
                .results
                .iter()
                .map(|c| (c.config, c.lookups_per_sec / 1e6))
                .collect(),
        }],
    )
}
