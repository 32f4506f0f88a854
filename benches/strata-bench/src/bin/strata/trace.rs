//! `strata trace replay` and `strata trace gen`.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use serde::Serialize;

use strata::policy::{self, lookahead, lru::Lru, Policy, PolicyKind, ReplayReport};
use strata::size::parse_size;
use strata::trace;
use strata::Error;
use strata_bench::gen::{self, GenKind, GenParams};

use super::{open_json, write_json};
use crate::out::OutputPath;

#[derive(Subcommand)]
pub enum TraceCommand {
    /// Replay a trace against a placement policy (or all of them).
    Replay(ReplayArgs),
    /// Generate a synthetic trace.
    Gen(GenArgs),
}

#[derive(Args)]
pub struct ReplayArgs {
    /// Trace file: one decimal page id per line, `#` comments.
    #[arg(long)]
    trace: PathBuf,
    /// Pages the cache holds.
    #[arg(long)]
    capacity_pages: usize,
    /// lru, lfu, lrfu, gmt, lookahead, arc, s3fifo, sieve, perfect-lfu,
    /// lfu-admission (the last two references for comparison), belady,
    /// default, a comma-separated list of them, or all (default: the default
    /// policy).
    #[arg(long)]
    policy: Option<String>,
    /// lru: pages per group, the unit of residency and eviction (2 MiB /
    /// page size for the Unified-Memory-like baseline).
    #[arg(long, default_value_t = 1)]
    group_pages: u64,
    /// lookahead: accesses of the future it sees (default: twice the
    /// capacity).
    #[arg(long)]
    window: Option<usize>,
    /// Also write the report as JSON to this file (a list with --policy all
    /// or a list of policies).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct GenArgs {
    /// zipf, loop, mix, shift (synthetic); bfs, sssp, pr, cc (page traces
    /// of the graph kernels over a generated CSR graph); emb (embedding-bag
    /// lookups over several tables); moe (expert loads of the synthetic MoE
    /// router, in layer order).
    #[arg(long)]
    kind: String,
    /// File to write.
    #[arg(long)]
    out: PathBuf,
    /// Pages: of the Zipf distribution, the loop, the hot set of a mix, each
    /// phase's working set (shift).
    #[arg(long, default_value_t = GenParams::default().pages)]
    pages: u64,
    /// Accesses (default 1000000; for bfs, sssp, pr, cc, emb and moe a
    /// limit, default none).
    #[arg(long)]
    accesses: Option<usize>,
    /// Zipf exponent (zipf, mix, shift, moe).
    #[arg(long, default_value_t = GenParams::default().alpha, allow_negative_numbers = true)]
    alpha: f64,
    /// Seed of the random choices.
    #[arg(long, default_value_t = GenParams::default().seed)]
    seed: u64,
    /// mix: share of accesses that belong to one-pass scans.
    #[arg(long, default_value_t = GenParams::default().scan_fraction)]
    scan_fraction: f64,
    /// mix: pages per scan.
    #[arg(long, default_value_t = GenParams::default().scan_length)]
    scan_length: u64,
    /// shift: accesses per phase.
    #[arg(long, default_value_t = GenParams::default().phase)]
    phase: usize,
    /// shift: share of a phase's pages the next phase keeps.
    #[arg(long, default_value_t = GenParams::default().overlap)]
    overlap: f64,
    /// bfs, sssp, pr, cc: kron (Graph500 Kronecker) or uniform.
    #[arg(long, default_value = "kron")]
    graph: String,
    /// Graph kinds: log2 of the vertices.
    #[arg(long, default_value_t = GenParams::default().scale)]
    scale: u32,
    /// Graph kinds: edges per vertex.
    #[arg(long, default_value_t = GenParams::default().edge_factor)]
    edge_factor: u32,
    /// Graph kinds and emb: bytes per page (e.g. 4k, 64k).
    #[arg(long, default_value = "4k")]
    page_size: String,
    /// bfs, sssp: searches from random roots (at least 1).
    #[arg(long, default_value_t = GenParams::default().roots)]
    roots: usize,
    /// pr: PageRank sweeps (at least 1).
    #[arg(long, default_value_t = GenParams::default().iterations)]
    iterations: usize,
    /// sssp: bucket width of delta-stepping (weights are 1..=255).
    #[arg(long, default_value_t = GenParams::default().delta)]
    delta: u64,
    /// emb: one Zipf exponent per table, comma-separated (0: uniform).
    #[arg(long, default_value = "1.1,0.9,0.7,0.5")]
    alphas: String,
    /// emb: rows per table.
    #[arg(long, default_value_t = GenParams::default().rows)]
    rows: usize,
    /// emb: bytes per row (e.g. 128, 1k).
    #[arg(long, default_value_t = GenParams::default().row_bytes, value_parser = size_value)]
    row_bytes: u64,
    /// emb: bags per batch.
    #[arg(long, default_value_t = GenParams::default().batch)]
    batch: usize,
    /// emb: indices per bag.
    #[arg(long, default_value_t = GenParams::default().pooling)]
    pooling: usize,
    /// emb: batches (at least 1).
    #[arg(long, default_value_t = GenParams::default().batches)]
    batches: usize,
    /// moe: layers.
    #[arg(long, default_value_t = GenParams::default().layers)]
    layers: usize,
    /// moe: experts per layer.
    #[arg(long, default_value_t = GenParams::default().experts)]
    experts: usize,
    /// moe: experts per token and layer.
    #[arg(long, default_value_t = GenParams::default().top_k)]
    top_k: usize,
    /// moe: per-token probability that a layer's popularity order swaps two
    /// adjacent ranks.
    #[arg(long, default_value_t = GenParams::default().drift)]
    drift: f64,
    /// moe: tokens (at least 1).
    #[arg(long, default_value_t = GenParams::default().tokens)]
    tokens: usize,
}

/// A size with binary suffixes, parsed as clap reads the argument (clap's
/// refusal names the flag).
fn size_value(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.message().to_string())
}

pub fn run(command: TraceCommand) -> Result<(), Error> {
    match command {
        TraceCommand::Replay(a) => replay(a),
        TraceCommand::Gen(a) => gen(a),
    }
}

/// One policy's line of the JSON report.
#[derive(Serialize)]
struct ReplayJson<'a> {
    policy: &'a str,
    accesses: u64,
    hits: u64,
    misses: u64,
    hit_rate: f64,
    capacity_pages: usize,
    /// Only where the capacity was clamped: the pages (of groups) the
    /// trace touches, which a larger cache behaves exactly like.
    #[serde(skip_serializing_if = "Option::is_none")]
    effective_capacity_pages: Option<usize>,
    trace: String,
    seconds: f64,
}

fn replay(a: ReplayArgs) -> Result<(), Error> {
    let kinds: Vec<PolicyKind> = match a.policy.as_deref() {
        None => vec![PolicyKind::Default],
        Some("all") => PolicyKind::ALL.to_vec(),
        Some(p) => p
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<PolicyKind>()
                    .map_err(|e| Error::invalid(format!("--policy: {}; or all", e.message())))
            })
            .collect::<Result<_, Error>>()?,
    };
    crate::cli::no_repeats("--policy", &kinds, |k| k.name().to_string())?;
    if a.capacity_pages == 0 {
        return Err(Error::invalid("--capacity-pages must be at least 1"));
    }
    if a.group_pages == 0 || a.group_pages > a.capacity_pages as u64 {
        return Err(Error::invalid(format!(
            "--group-pages {} must be between 1 and the capacity ({})",
            a.group_pages, a.capacity_pages
        )));
    }
    if a.capacity_pages as u64 % a.group_pages != 0 {
        return Err(Error::invalid(format!(
            "--capacity-pages {} is not a whole number of --group-pages {} groups",
            a.capacity_pages, a.group_pages
        )));
    }
    // A flag for a policy that is not replayed would be silently ignored.
    if a.group_pages != 1 && !kinds.contains(&PolicyKind::Lru) {
        return Err(Error::invalid(
            "--group-pages applies to lru only, and --policy does not name it",
        ));
    }
    if a.window.is_some() && !kinds.contains(&PolicyKind::Lookahead) {
        return Err(Error::invalid(
            "--window applies to lookahead only, and --policy does not name it",
        ));
    }
    crate::out::distinct_files(&[("--trace", Some(&a.trace)), ("--json", a.json.as_deref())])?;
    let json = open_json(&a.json)?;
    crate::cli::input_file("--trace", &a.trace)?;
    // At most one access per two bytes ("0\n"), each held as a u64 (4 B
    // per byte of file) three times at the peak: the trace, the copy that
    // counts its distinct pages, and a policy's view of the future.
    let trace_bytes = std::fs::metadata(&a.trace).map_or(0, |m| m.len());
    strata_bench::machine::check_memory(
        format_args!("--trace {}", a.trace.display()),
        "its accesses, their distinct pages and a policy's index of them",
        trace_bytes.saturating_mul(12),
    )?;
    let t = trace::read(&a.trace)?;
    if t.is_empty() {
        return Err(Error::invalid(format!(
            "--trace {} holds no accesses",
            a.trace.display()
        )));
    }
    // A cache larger than the pages (groups) the trace touches never
    // evicts, so it behaves exactly like one that holds just those; the
    // policies preallocate for their capacity, so it is clamped there.
    let mut distinct = t.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let mut groups: Vec<u64> = distinct.iter().map(|p| p / a.group_pages).collect();
    groups.dedup();
    let touched = (distinct.len() as u64).max(1);
    let touched_in_groups = (groups.len() as u64).max(1).saturating_mul(a.group_pages);
    drop(distinct);
    drop(groups);
    let clamp = |kind: PolicyKind| -> usize {
        let limit = if kind == PolicyKind::Lru {
            touched_in_groups
        } else {
            touched
        };
        (a.capacity_pages as u64).min(limit) as usize
    };
    // A bar on a terminal: the policy being replayed and how far along
    // the whole replay is.
    let reports = crate::with_progress(false, |progress| {
        let mut reports: Vec<(ReplayReport, usize)> = Vec::new();
        let n = kinds.len() as f64;
        for (i, &kind) in kinds.iter().enumerate() {
            let capacity = clamp(kind);
            let mut p: Box<dyn Policy> = match kind {
                PolicyKind::Lru => Box::new(Lru::with_group(capacity, a.group_pages)),
                PolicyKind::Lookahead => Box::new(lookahead::Lookahead::with_future(
                    capacity,
                    &t,
                    a.window
                        .unwrap_or_else(|| lookahead::default_window(capacity)),
                )),
                k => policy::build(k, capacity, Some(&t))?,
            };
            let name = p.name().to_string();
            let report = policy::replay_with_progress(p.as_mut(), &t, &mut |done| {
                progress(&name, (i as f64 + done) / n)
            });
            reports.push((report, capacity));
        }
        Ok::<_, Error>(reports)
    })?;
    outln!(
        "trace: {} ({} accesses), capacity {} pages",
        a.trace.display(),
        t.len(),
        a.capacity_pages
    );
    let used = reports
        .iter()
        .map(|r| r.1)
        .max()
        .unwrap_or(a.capacity_pages);
    if used < a.capacity_pages {
        outln!(
            "the trace touches {touched} distinct pages: the cache never fills, and replays as {used} pages"
        );
    }
    // As wide as the longest policy's name (`lfu-admission`), so the
    // columns line up.
    let w = reports
        .iter()
        .map(|(r, _)| r.policy.len())
        .max()
        .unwrap_or(0)
        .max("policy".len());
    outln!(
        "{:<w$} {:>12} {:>12} {:>9} {:>14}",
        "policy",
        "hits",
        "misses",
        "hit rate",
        "accesses/s"
    );
    for (r, _) in &reports {
        outln!(
            "{:<w$} {:>12} {:>12} {:>8.2}% {:>14.0}",
            r.policy,
            r.hits,
            r.misses,
            100.0 * r.hit_rate,
            r.accesses as f64 / r.seconds.max(1e-9)
        );
    }
    let rows: Vec<ReplayJson> = reports
        .iter()
        .map(|(r, used)| ReplayJson {
            policy: &r.policy,
            accesses: r.accesses,
            hits: r.hits,
            misses: r.misses,
            hit_rate: r.hit_rate,
            capacity_pages: a.capacity_pages,
            effective_capacity_pages: (*used < a.capacity_pages).then_some(*used),
            trace: a.trace.display().to_string(),
            seconds: r.seconds,
        })
        .collect();
    if rows.len() > 1 || a.policy.as_deref() == Some("all") {
        write_json(json, &rows)
    } else {
        write_json(json, &rows[0])
    }
}

/// The knobs set (to other than their defaults) that `kind` does not use,
/// each with a line saying so: `--kind zipf --scan-fraction 0.5` writes a
/// plain Zipf trace, and the user is told rather than left to think the
/// scans are in it. A warning, not a refusal: a script may pass one set of
/// knobs to every kind. The graph kernels share theirs (`--roots` and
/// `--iterations` for all four); `--seed` and `--accesses` apply to every
/// kind.
fn unused_knobs(kind: GenKind, a: &GenArgs) -> Vec<String> {
    use GenKind::*;
    let d = GenParams::default();
    let synthetic: &[GenKind] = &[Zipf, Loop, Mix, Shift];
    let graph: &[GenKind] = &[Bfs, Sssp, Pr, Cc];
    let knobs: [(&str, bool, &[GenKind], &str); 20] = [
        (
            "--pages",
            a.pages != d.pages,
            synthetic,
            "zipf, loop, mix and shift",
        ),
        (
            "--alpha",
            a.alpha != d.alpha,
            &[Zipf, Mix, Shift, Moe],
            "zipf, mix, shift and moe",
        ),
        (
            "--scan-fraction",
            a.scan_fraction != d.scan_fraction,
            &[Mix],
            "mix",
        ),
        (
            "--scan-length",
            a.scan_length != d.scan_length,
            &[Mix],
            "mix",
        ),
        ("--phase", a.phase != d.phase, &[Shift], "shift"),
        ("--overlap", a.overlap != d.overlap, &[Shift], "shift"),
        ("--graph", a.graph != "kron", graph, "the graph kinds"),
        ("--scale", a.scale != d.scale, graph, "the graph kinds"),
        (
            "--edge-factor",
            a.edge_factor != d.edge_factor,
            graph,
            "the graph kinds",
        ),
        ("--roots", a.roots != d.roots, graph, "the graph kinds"),
        (
            "--iterations",
            a.iterations != d.iterations,
            graph,
            "the graph kinds",
        ),
        ("--delta", a.delta != d.delta, graph, "the graph kinds"),
        (
            "--page-size",
            a.page_size != "4k",
            &[Bfs, Sssp, Pr, Cc, Emb],
            "the graph kinds and emb",
        ),
        ("--alphas", a.alphas != "1.1,0.9,0.7,0.5", &[Emb], "emb"),
        ("--rows", a.rows != d.rows, &[Emb], "emb"),
        ("--row-bytes", a.row_bytes != d.row_bytes, &[Emb], "emb"),
        ("--batch", a.batch != d.batch, &[Emb], "emb"),
        ("--pooling", a.pooling != d.pooling, &[Emb], "emb"),
        ("--batches", a.batches != d.batches, &[Emb], "emb"),
        ("--layers", a.layers != d.layers, &[Moe], "moe"),
    ];
    let moe: [(&str, bool); 4] = [
        ("--experts", a.experts != d.experts),
        ("--top-k", a.top_k != d.top_k),
        ("--drift", a.drift != d.drift),
        ("--tokens", a.tokens != d.tokens),
    ];
    let knobs = knobs
        .into_iter()
        .chain(moe.map(|(flag, set)| (flag, set, &[Moe][..], "moe")));
    knobs
        .filter(|(_, set, kinds, _)| *set && !kinds.contains(&kind))
        .map(|(flag, _, _, names)| {
            format!(
                "strata: warning: {flag} is not used by --kind {} (it is for {names})",
                a.kind
            )
        })
        .collect()
}

fn gen(a: GenArgs) -> Result<(), Error> {
    let kind: GenKind = a.kind.parse().map_err(|e: Error| e.context("--kind"))?;
    let unused = unused_knobs(kind, &a);
    let page_size = parse_size(&a.page_size).map_err(|e| e.context("--page-size"))?;
    // Kinds whose length their own parameters set take --accesses as a limit.
    let graph_kind = kind.is_graph() || matches!(kind, GenKind::Emb | GenKind::Moe);
    let alphas = a
        .alphas
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<f64>()
                .ok()
                .filter(|a| a.is_finite() && *a >= 0.0)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "--alphas {:?}: {x:?} is not a number ≥ 0",
                        a.alphas
                    ))
                })
        })
        .collect::<Result<Vec<f64>, Error>>()?;
    let params = GenParams {
        kind,
        pages: a.pages,
        accesses: a.accesses.unwrap_or(if graph_kind { 0 } else { 1_000_000 }),
        alpha: a.alpha,
        seed: a.seed,
        scan_fraction: a.scan_fraction,
        scan_length: a.scan_length,
        graph: a.graph.parse().map_err(|e: Error| e.context("--graph"))?,
        scale: a.scale,
        edge_factor: a.edge_factor,
        page_size,
        roots: a.roots,
        iterations: a.iterations,
        phase: a.phase,
        overlap: a.overlap,
        delta: a.delta,
        alphas,
        rows: a.rows,
        row_bytes: a.row_bytes,
        batch: a.batch,
        pooling: a.pooling,
        batches: a.batches,
        layers: a.layers,
        experts: a.experts,
        top_k: a.top_k,
        drift: a.drift,
        tokens: a.tokens,
    };
    if !(0.0..=1.0).contains(&a.drift) {
        return Err(Error::invalid(format!(
            "--drift {} is not a probability (0 to 1)",
            a.drift
        )));
    }
    // 0 would be an empty trace (or, as a limit, read as no limit).
    if a.accesses == Some(0) {
        return Err(Error::invalid("--accesses must be at least 1"));
    }
    if !graph_kind && params.pages == 0 {
        return Err(Error::invalid("--pages must be at least 1"));
    }
    let out = OutputPath::check("--out", &a.out)?;
    let t = gen::generate(&params)?;
    out.write_with(|w| trace::write(w, &t, &format!("strata trace gen: {}", params.describe())))?;
    for line in unused {
        crate::out::warn(format_args!("{line}"));
    }
    let mut pages = t.clone();
    pages.sort_unstable();
    pages.dedup();
    outln!(
        "wrote {} accesses to {} distinct pages to {}",
        t.len(),
        pages.len(),
        a.out.display()
    );
    Ok(())
}
