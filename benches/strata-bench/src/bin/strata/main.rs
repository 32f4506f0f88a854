//! The `strata` command-line tool: `strata info`, `strata bench …`,
//! `strata trace …`.
//!
//! Exit status: 0 on success, 2 on bad arguments or input (one line on
//! stderr saying what is wrong), 1 when the work itself failed or its
//! output could not be written (see `out`); a closed stdout ends nothing.

/// `println!` that reports a failed write (`?`: the enclosing function
/// returns `Result<_, strata::Error>`) instead of panicking.
macro_rules! outln {
    () => {
        $crate::out::line(format_args!(""))?
    };
    ($($t:tt)*) => {
        $crate::out::line(format_args!($($t)*))?
    };
}

mod cli;
mod graph;
mod offload;
mod out;
mod pages;
mod plot;
mod priority;
mod recsys;
mod trace;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use indicatif::{ProgressBar, ProgressStyle};
use out::OutputPath;
use serde::Serialize;

use strata::io::EngineChoice;
use strata::size::{check_page_size, format_rate, format_size, parse_size};
use strata::tier::CxlMode;
use strata::{Error, ErrorKind};
use strata_bench::bench;

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Memory tiering for GPU programs: HBM, DRAM, CXL and NVMe"
)]
struct Cli {
    /// TOML config file (default: $STRATA_CONFIG, then built-in defaults):
    /// checked by every command; `info` shows it, and the benches that open
    /// an NVMe tier take its path from it (the others use their own flags).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// What this machine offers: NUMA nodes, memory tiers, GPU, io_uring, configured tiers.
    Info {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Page-access traces: replay against placement policies, generate.
    #[command(subcommand)]
    Trace(trace::TraceCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// The NVMe store measured the way fio measures a disk.
    Io(IoArgs),
    /// Page copies DRAM→DRAM and DRAM↔CXL beside memcpy.
    Copy(CopyArgs),
    /// Page migration through the runtime per link, beside the raw link.
    Migrate(MigrateArgs),
    /// Graph kernels over a tiered CSR graph beside UVM-like and zero-copy baselines.
    Graph(graph::GraphArgs),
    /// Embedding-bag lookups over tiered tables beside an LRU row cache and zero-copy.
    Recsys(recsys::RecsysArgs),
    /// MoE decoding over an expert cache beside per-layer LRU and no cache (simulated device).
    Moe(offload::MoeArgs),
    /// Adam steps with states in host, CXL or NVMe beside memcpy and NVMe read bandwidth.
    Optim(offload::OptimArgs),
    /// Small reads over data 4x DRAM on real DRAM and disk, beside the OS page cache and foyer.
    Pages(pages::PagesArgs),
    /// A demand move's latency while background eviction has gigabytes queued, beside idle.
    Priority(priority::PriorityArgs),
    /// The page cache baseline of `bench pages`, in its own process.
    #[command(hide = true)]
    PagesChild {
        /// The run, as JSON.
        spec: String,
    },
}

#[derive(Args)]
struct MigrateArgs {
    /// Device backend: auto, cuda or sim.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Page sizes, comma-separated.
    #[arg(long, default_value = "4k,16k,64k,256k,1M,2M")]
    page_sizes: String,
    /// Bytes migrated per case.
    #[arg(long, default_value = "64M")]
    size: String,
    /// Directory for the NVMe tier, a disk, not tmpfs (default: the
    /// configured NVMe path, then the current directory).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct IoArgs {
    /// Directory, new file name or block device to run on (default: the
    /// configured NVMe path, then the current directory).
    #[arg(long)]
    path: Option<PathBuf>,
    /// File size (e.g. 1G).
    #[arg(long, default_value = "1G")]
    size: String,
    /// randread, randwrite, read or write.
    #[arg(long, default_value = "randread")]
    pattern: String,
    /// Block size (a power of two, 4k..2M).
    #[arg(long, default_value = "4k")]
    bs: String,
    /// Operations in flight: at most the file's blocks (--size over --bs,
    /// less the store's reserve), which the report's qd shows.
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Length of the timed phase.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// uring, psync or auto.
    #[arg(long, default_value = "auto")]
    engine: String,
    /// Seed of the random pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct CopyArgs {
    /// Bytes copied per round.
    #[arg(long, default_value = "256M")]
    size: String,
    /// Page sizes, comma-separated.
    #[arg(long, default_value = "4k,16k,64k,256k,1M,2M")]
    page_sizes: String,
    /// Rounds per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Emulate CXL even where a CPU-less NUMA node exists.
    #[arg(long)]
    emulate_cxl: bool,
    /// Emulated CXL bandwidth in bytes/s, a size with binary suffixes as
    /// every size here (20G: 20 GiB/s, 21.47 GB/s); default half of local
    /// memcpy.
    #[arg(long)]
    cxl_bandwidth: Option<String>,
    /// Emulated CXL added latency per transfer, ns.
    #[arg(long, default_value_t = strata::tier::CXL_DEFAULT_LATENCY_NS)]
    cxl_latency_ns: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = match cli::parse::<Cli>() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match run(cli).and_then(|()| out::flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out::warn(format_args!(
                "strata: {}",
                out::without_os_error_codes(&e.to_string())
            ));
            ExitCode::from(exit_status(&e))
        }
    }
}

/// Bad input (including a size the disk cannot hold, a path that is a
/// directory where a file belongs, or asking for a GPU where there is
/// none) is 2; a failure of the work itself (I/O errors, corruption, an
/// output that could not be written) is 1.
fn exit_status(e: &Error) -> u8 {
    if matches!(
        e.raw_os_error(),
        Some(libc::EISDIR | libc::ENOTDIR | libc::ENAMETOOLONG | libc::ELOOP)
    ) {
        return 2;
    }
    match e.kind() {
        ErrorKind::InvalidArgument
        | ErrorKind::NoDevice
        | ErrorKind::NotFound
        | ErrorKind::Unsupported
        | ErrorKind::PermissionDenied
        | ErrorKind::NoSpace => 2,
        _ => 1,
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    let config = cli.config.as_deref();
    if !matches!(cli.command, Command::Bench(BenchCommand::PagesChild { .. })) {
        cli::check_named_config(config)?;
    }
    match cli.command {
        Command::Info { json } => {
            let config = cli::load_config(config)?;
            let info = strata::info::gather(&config);
            if json {
                outln!("{}", to_json(&info)?);
            } else {
                print_info(&info)?;
            }
            // A configured tier this machine cannot provide is bad input:
            // the report above shows every problem, the status says so.
            match info
                .tiers
                .iter()
                .find_map(|t| Some((t.tier, t.problem.as_ref()?)))
            {
                Some((tier, p)) => Err(Error::invalid(format!("the {tier} tier: {p}"))),
                None => Ok(()),
            }
        }
        Command::Bench(BenchCommand::Io(a)) => bench_io(a, config),
        Command::Bench(BenchCommand::Copy(a)) => bench_copy(a),
        Command::Bench(BenchCommand::Migrate(a)) => bench_migrate(a, config),
        Command::Bench(BenchCommand::Graph(a)) => graph::run(a),
        Command::Bench(BenchCommand::Recsys(a)) => recsys::run(a),
        Command::Bench(BenchCommand::Moe(a)) => offload::run_moe(a, config),
        Command::Bench(BenchCommand::Optim(a)) => offload::run_optim(a, config),
        Command::Bench(BenchCommand::Pages(a)) => pages::run(a, config),
        Command::Bench(BenchCommand::Priority(a)) => priority::run(a, config),
        Command::Bench(BenchCommand::PagesChild { spec }) => pages::child(&spec),
        Command::Trace(c) => trace::run(c),
    }
}

fn to_json<T: Serialize>(v: &T) -> Result<String, Error> {
    serde_json::to_string_pretty(v).map_err(|e| Error::invalid(format!("encoding JSON: {e}")))
}

/// Checks the `--json` path before a run, so a bad path fails at once
/// rather than after minutes of measuring.
fn open_json(path: &Option<PathBuf>) -> Result<Option<OutputPath>, Error> {
    OutputPath::check_opt("--json", path)
}

fn write_json<T: Serialize>(out: Option<OutputPath>, v: &T) -> Result<(), Error> {
    if let Some(out) = out {
        out.write((to_json(v)? + "\n").as_bytes())?;
    }
    Ok(())
}

/// The directory for a bench's NVMe tier: `--path`, else the configured
/// NVMe path (`--config`, `$STRATA_CONFIG`, `STRATA_NVME_PATH`), else the
/// current directory. Warns (one line, the run goes on) when it is RAM.
pub(crate) fn nvme_path(
    flag_path: Option<PathBuf>,
    config: Option<&Path>,
) -> Result<PathBuf, Error> {
    let path = match flag_path {
        Some(p) => p,
        None => cli::configured_nvme_path(config)?.unwrap_or_else(|| PathBuf::from(".")),
    };
    if let Some(fs) = strata_bench::machine::ram_filesystem(&path) {
        out::defer_warning(format!(
            "strata: warning: {} is on {fs}: the \"NVMe\" tier there is RAM, not a disk",
            path.display()
        ));
    }
    Ok(path)
}

/// Runs `work` with a progress bar on the terminal (none when stderr is not
/// one), cleared when it ends.
fn with_progress<T, E>(
    quiet: bool,
    work: impl FnOnce(&mut dyn FnMut(&str, f64)) -> Result<T, E>,
) -> Result<T, E> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(1000)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {percent:>3}% {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let result = work(&mut |phase, fraction| {
        // The work has started: what it was warned about can be said.
        out::flush_warnings();
        bar.set_message(phase.to_string());
        bar.set_position((fraction * 1000.0) as u64);
    });
    bar.finish_and_clear();
    if result.is_ok() {
        out::flush_warnings();
    }
    result
}

/// `--page-sizes` (comma-separated) and `--size`, which must hold the
/// largest page.
fn page_sizes_and_size(page_sizes: &str, size: &str) -> Result<(Vec<usize>, u64), Error> {
    let page_sizes = page_sizes
        .split(',')
        .map(|p| page_size_arg("--page-sizes", p))
        .collect::<Result<Vec<_>, _>>()?;
    cli::no_repeats("--page-sizes", &page_sizes, |&p| format_size(p as u64))?;
    let size = size_arg("--size", size)?;
    let largest = page_sizes.iter().copied().max().unwrap_or(4096) as u64;
    if size < largest {
        return Err(Error::invalid(format!(
            "--size {} is smaller than the largest page size {}",
            format_size(size),
            format_size(largest)
        )));
    }
    // Page sizes are powers of two: a multiple of the largest is one of
    // every other.
    if size % largest != 0 {
        return Err(Error::invalid(format!(
            "--size {} is not a whole number of {} pages",
            format_size(size),
            format_size(largest)
        )));
    }
    Ok((page_sizes, size))
}

fn size_arg(flag: &str, text: &str) -> Result<u64, Error> {
    parse_size(text).map_err(|e| e.context(flag))
}

fn page_size_arg(flag: &str, text: &str) -> Result<usize, Error> {
    let v = size_arg(flag, text)?;
    let v =
        usize::try_from(v).map_err(|_| Error::invalid(format!("{flag} {text} is too large")))?;
    check_page_size(v).map_err(|e| e.context(flag))?;
    Ok(v)
}

fn bench_io(a: IoArgs, config: Option<&Path>) -> Result<(), Error> {
    let params = bench::io::IoParams {
        path: nvme_path(a.path, config)?,
        size: size_arg("--size", &a.size)?,
        pattern: a
            .pattern
            .parse()
            .map_err(|e: Error| e.context("--pattern"))?,
        bs: page_size_arg("--bs", &a.bs)?,
        qd: a.qd,
        seconds: a.seconds,
        engine: a
            .engine
            .parse::<EngineChoice>()
            .map_err(|e| e.context("--engine"))?,
        seed: a.seed,
    };
    if params.size == 0 {
        return Err(Error::invalid("--size is zero"));
    }
    if !(1..=4096).contains(&params.qd) {
        return Err(Error::invalid(format!(
            "--qd {} is outside 1..=4096",
            params.qd
        )));
    }
    // Checked again by the run; here before the report's file is opened.
    let week = std::time::Duration::from_secs(7 * 86400);
    if std::time::Duration::try_from_secs_f64(params.seconds)
        .map_or(true, |d| d.is_zero() || d > week)
    {
        return Err(Error::invalid(format!(
            "--seconds {} must be a positive number of at most a week",
            params.seconds
        )));
    }
    let json = open_json(&a.json)?;
    let r = with_progress(false, |progress| bench::io::run(&params, progress))?;
    outln!(
        "{:<9} {:>5} {:>4} {:>7} {:>12} {:>12} {:>10}",
        "pattern",
        "bs",
        "qd",
        "engine",
        "iops",
        "bandwidth",
        "lat (µs)"
    );
    outln!(
        "{:<9} {:>5} {:>4} {:>7} {:>12.0} {:>12} {:>10.1}",
        r.pattern,
        format_size(r.bs as u64),
        r.qd,
        r.engine,
        r.iops,
        format_rate(r.bytes_per_sec),
        r.mean_latency_us
    );
    write_json(json, &r)
}

fn bench_copy(a: CopyArgs) -> Result<(), Error> {
    let (page_sizes, size) = page_sizes_and_size(&a.page_sizes, &a.size)?;
    let params = bench::copy::CopyParams {
        size,
        page_sizes,
        rounds: match a.rounds {
            0 => return Err(Error::invalid("--rounds must be at least 1")),
            n => n,
        },
        cxl_mode: if a.emulate_cxl {
            CxlMode::Emulated
        } else {
            CxlMode::real_or_emulated(&strata::sys::Topology::detect())
        },
        cxl_bandwidth: a
            .cxl_bandwidth
            .as_deref()
            .map(|b| size_arg("--cxl-bandwidth", b).map(|v| v as f64))
            .transpose()?,
        cxl_latency_ns: a.cxl_latency_ns,
    };
    // The emulated link's limits, refused under the flags' names.
    let link = |bandwidth, latency_ns| strata::link::LinkModel {
        bandwidth,
        latency_ns,
    };
    if let Some(bandwidth) = params.cxl_bandwidth {
        link(bandwidth, 0)
            .check()
            .map_err(|e| e.context("--cxl-bandwidth"))?;
    }
    link(1e9, params.cxl_latency_ns)
        .check()
        .map_err(|e| e.context("--cxl-latency-ns"))?;
    let json = open_json(&a.json)?;
    let r = with_progress(false, |progress| bench::copy::run(&params, progress))?;
    outln!(
        "cxl: {}",
        match &r.cxl_emulation {
            Some(m) => format!(
                "emulated ({} cap, +{} ns per transfer)",
                format_rate(m.bandwidth),
                m.latency_ns
            ),
            None => r.cxl.clone(),
        }
    );
    outln!(
        "{:<11} {:>6} {:>12} {:>12} {:>12} {:>6}",
        "link",
        "page",
        "page copy",
        "memcpy",
        "limit",
        "ratio"
    );
    for c in &r.cases {
        outln!(
            "{:<11} {:>6} {:>12} {:>12} {:>12} {:>6.2}",
            c.link,
            format_size(c.page_size as u64),
            format_rate(c.bytes_per_sec),
            format_rate(c.memcpy_bytes_per_sec),
            format_rate(c.limit_bytes_per_sec),
            c.ratio
        );
    }
    write_json(json, &r)
}

fn bench_migrate(a: MigrateArgs, config: Option<&Path>) -> Result<(), Error> {
    let (page_sizes, size) = page_sizes_and_size(&a.page_sizes, &a.size)?;
    if size > 4 << 30 {
        return Err(Error::invalid(
            "--size above 4G would need that much of every tier",
        ));
    }
    let params = bench::migrate::MigrateParams {
        device: a.device.parse().map_err(|e: Error| e.context("--device"))?,
        page_sizes,
        size,
        path: nvme_path(a.path, config)?,
    };
    let json = open_json(&a.json)?;
    let r = with_progress(false, |progress| bench::migrate::run(&params, progress))?;
    outln!("backend: {} (cxl emulated)", r.backend);
    outln!(
        "{:<13} {:>6} {:>12} {:>12} {:>6}  time",
        "link",
        "page",
        "migration",
        "raw link",
        "ratio"
    );
    for c in &r.cases {
        outln!(
            "{:<13} {:>6} {:>12} {:>12} {:>6.2}  {}",
            c.link,
            format_size(c.page_size as u64),
            format_rate(c.bytes_per_sec),
            format_rate(c.raw_bytes_per_sec),
            c.ratio,
            c.time
        );
    }
    write_json(json, &r)
}

fn print_info(info: &strata::info::Info) -> Result<(), Error> {
    outln!("strata {}", info.version);
    match &info.gpu {
        Some(g) => outln!(
            "gpu:       {} ({}, {}, sm {})",
            g.ordinal,
            g.name,
            format_size(g.memory_bytes),
            g.compute_capability
        ),
        None => outln!(
            "gpu:       none ({})",
            info.gpu_absent_reason.as_deref().unwrap_or("unknown")
        ),
    }
    outln!(
        "nvrtc:     {}",
        match &info.nvrtc {
            Some(v) => format!("{v} (the CUDA kernels compile at run time)"),
            None => "not loaded (CUDA kernels cannot compile; needs the cuda feature and libnvrtc.so or libnvrtc.so.12 on the library path)".into(),
        }
    );
    outln!(
        "io_uring:  {}",
        if info.io_uring {
            "yes".to_string()
        } else {
            format!("no ({})", info.io_uring_error.as_deref().unwrap_or(""))
        }
    );
    outln!("io engine: {}", info.io_engine);
    outln!(
        "backend:   {}",
        info.backend.unwrap_or("none (no device tier)")
    );
    outln!(
        "THP:       {}",
        if info.transparent_huge_pages {
            "allowed"
        } else {
            "not allowed"
        }
    );
    outln!("numa nodes:");
    for n in &info.numa_nodes {
        outln!(
            "  node {:<3} {:>8}  {}",
            n.id,
            format_size(n.memory_bytes),
            if n.cpu_less {
                "CPU-less (CXL candidate)".to_string()
            } else {
                format!("{} cpus", n.cpus.len())
            }
        );
    }
    if !info.memory_tiers.is_empty() {
        outln!("kernel memory tiers:");
        for t in &info.memory_tiers {
            outln!("  tier {:<4} nodes {:?}", t.id, t.nodes);
        }
    }
    outln!("tiers:");
    for t in &info.tiers {
        outln!(
            "  {:<7} {:>8}  {}{}",
            t.tier.name(),
            format_size(t.capacity_bytes),
            t.detail,
            match (t.emulated, t.tier) {
                (true, strata::Tier::Device) => " [simulated]",
                (true, _) => " [emulated]",
                _ => "",
            }
        );
        if let Some(p) = &t.problem {
            outln!("          problem: {p}");
        }
    }
    Ok(())
}
