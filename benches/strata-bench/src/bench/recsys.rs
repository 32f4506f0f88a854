//! `strata bench recsys`: DLRM-style embedding-bag forward (sum pooling)
//! over tiered embedding tables ([`EmbeddingTable`], pooled through their
//! device maps as a kernel does) on the simulated device: strata's row
//! cache in device memory (the tables' pages in host memory), strata's
//! placement of whole pages by the balancer (`strata-pages`), beside an
//! FBGEMM-style LRU row cache (cache_load_factor 0.2), zero-copy and
//! everything on the device. Times are **modelled** GPU time (the graph
//! benchmark's [`GpuModel`]).

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::machine::{check_memory, product};
use crate::workloads::graph::model::Platform;
use crate::workloads::graph::tiered::GpuModel;
use crate::workloads::recsys::{self, Batch, Dist};
use strata::device::DeviceChoice;
use strata::error::{Error, ErrorKind, Result};
use strata::offload::embedding::{Bags, EmbeddingTable, Lookups, RowCacheOptions, TableOptions};
use strata::policy::{lru::Lru, Policy, PolicyKind};
use strata::runtime::{BalancerConfig, Placement, Runtime};

use super::graph::Budget;

/// Parameters.
#[derive(Debug, Clone, Serialize)]
pub struct RecsysParams {
    /// Embedding tables.
    pub tables: usize,
    /// Rows per table.
    pub rows: usize,
    /// f32 elements per row.
    pub dim: usize,
    /// Rows summed per bag.
    pub pooling: usize,
    /// Bags per table per batch.
    pub batch: usize,
    /// Batches.
    pub batches: usize,
    /// Index distribution.
    pub dist: Dist,
    /// Device memory for the tables.
    pub device_budget: Budget,
    /// strata's policy.
    pub policy: PolicyKind,
    /// Run the baselines too.
    pub baselines: bool,
    /// Seed of the indices.
    pub seed: u64,
    /// Page size of the tiered tables.
    pub page_size: usize,
    /// The modelled GPU.
    #[serde(serialize_with = "platform_name")]
    pub platform: Platform,
}

fn platform_name<S: serde::Serializer>(p: &Platform, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.name)
}

/// One configuration's results.
#[derive(Debug, Clone, Serialize)]
pub struct RecsysResult {
    /// `strata`, `strata-pages`, `lru-cache`, `zero-copy` or `all-device`.
    pub config: &'static str,
    /// Row lookups per modelled second.
    pub lookups_per_sec: f64,
    /// Share of row lookups served by device memory.
    pub hit_rate: f64,
    /// Bytes moved into device memory (migrations, cache fills).
    pub bytes_moved: u64,
    /// Modelled seconds of all batches.
    pub seconds: f64,
    /// Of `seconds`, the migrations between batches (strata's balancer), at
    /// the preset's DMA rate and per-copy cost.
    pub migration_seconds: f64,
    /// Wall seconds on this machine.
    pub wall_seconds: f64,
    /// Batches whose outputs were checked against a direct computation.
    pub verified_batches: usize,
    /// strata-pages: of its promotions into device memory, (those whose
    /// page was read there before it left, those that were not); settled
    /// at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub promotions_paid: Option<(u64, u64)>,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct RecsysReport {
    /// "simulated".
    pub backend: &'static str,
    /// Times are modelled.
    pub modelled: bool,
    /// Parameters.
    pub params: RecsysParams,
    /// Bytes of all tables.
    pub table_bytes: u64,
    /// The device budget in bytes.
    pub budget_bytes: u64,
    /// Only where the budget asked for was more than the tables need: that
    /// budget (`budget_bytes` is then the tables' size, all of them on the
    /// device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_requested: Option<u64>,
    /// Row lookups per configuration run.
    pub lookups: u64,
    /// The modelled GPU.
    pub model: GpuModel,
    /// One entry per configuration.
    pub results: Vec<RecsysResult>,
    /// The best fixed placements of the budget, chosen with hindsight of
    /// the batches' own lookup counts: rows (what a row cache could at best
    /// hold) and pages (what page-granular tiering could).
    pub static_optimum: Vec<StaticOptimum>,
}

/// The best fixed placement of the device budget for these batches: the
/// most-looked-up units (rows or pages), placed before the first batch at
/// no cost. Under an independent reference model (Zipf and uniform draws)
/// no online policy that does not see the future does better in the long
/// run (Aho, Denning and Ullman's A0); with temporal locality (a replayed
/// file) a dynamic policy can.
#[derive(Debug, Clone, Serialize)]
pub struct StaticOptimum {
    /// `rows` or `pages`.
    pub granularity: &'static str,
    /// Share of lookups the placement serves from device memory.
    pub hit_rate: f64,
    /// Lookups per modelled second, timed as the configurations are.
    pub lookups_per_sec: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Config {
    /// strata's row cache.
    Strata,
    /// strata's placement of whole pages.
    StrataPages,
    LruCache,
    ZeroCopy,
    AllDevice,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Strata => "strata",
            Config::StrataPages => "strata-pages",
            Config::LruCache => "lru-cache",
            Config::ZeroCopy => "zero-copy",
            Config::AllDevice => "all-device",
        }
    }
}

/// Every this many batches, one is checked against a direct computation.
const VERIFY_EVERY: usize = 8;

/// Runs every configuration.
pub fn run(params: &RecsysParams, progress: &mut dyn FnMut(&str, f64)) -> Result<RecsysReport> {
    if params.tables == 0 || params.rows == 0 || params.dim == 0 || params.pooling == 0 {
        return Err(Error::invalid(
            "--tables, --rows, --dim and --pooling must be at least 1",
        ));
    }
    if params.batch == 0 || params.batches == 0 {
        return Err(Error::invalid("--batch and --batches must be at least 1"));
    }
    if params.rows > u32::MAX as usize {
        return Err(Error::invalid("--rows is at most 2^32 − 1"));
    }
    strata::size::check_page_size(params.page_size)?;
    let row_bytes = params.dim.saturating_mul(4);
    if params.page_size % row_bytes != 0 {
        return Err(Error::invalid(format!(
            "a row of {row_bytes} bytes (--dim {}) must divide the page size {}",
            params.dim, params.page_size
        )));
    }
    let table_bytes = (params.rows as u64).saturating_mul(row_bytes as u64);
    let total = table_bytes.saturating_mul(params.tables as u64);
    let asked = match params.device_budget {
        Budget::Bytes(b) => b,
        Budget::Percent(p) => ((total as f64 * p / 100.0) as u64).max(params.page_size as u64),
    };
    // More than the tables is the tables (as `bench graph` takes it): the
    // device never holds more than all of them.
    let budget = asked.min(total.next_multiple_of(params.page_size as u64));
    let budget_requested = (asked > budget).then_some(asked);
    // Peak, one configuration at a time: the tables in the host tier, the
    // device's (or the row cache's) copy of up to the budget, the indices.
    let indices = product(&[
        params.tables as u64,
        params.batch as u64,
        params.pooling as u64,
        params.batches as u64,
        4,
    ])
    .saturating_add(product(&[params.tables as u64, params.batches as u64, 24]));
    let memory = total
        .saturating_add(budget.min(total))
        .saturating_add(indices)
        .saturating_add(8 << 20);
    // The flags of the larger part: the tables', or the indices'.
    let flags = if indices > total {
        format!(
            "--tables {} --batch {} --pooling {} --batches {}",
            params.tables, params.batch, params.pooling, params.batches
        )
    } else {
        format!(
            "--tables {} --rows {} --dim {}",
            params.tables, params.rows, params.dim
        )
    };
    check_memory(
        flags,
        "the tables, their device copy and the indices",
        memory,
    )?;
    progress("indices", 0.0);
    let batches = recsys::generate(
        &params.dist,
        params.tables,
        params.rows,
        params.batch,
        params.pooling,
        params.batches,
        params.seed,
    )?;
    if budget / (params.page_size as u64) < params.tables as u64 {
        return Err(Error::invalid(format!(
            "--device-budget {} is less than a page of {} for each of the {} tables (strata's row caches)",
            strata::size::format_size(budget),
            strata::size::format_size(params.page_size as u64),
            params.tables
        )));
    }
    let lookups: u64 = batches
        .iter()
        .map(|b| b.iter().map(Vec::len).sum::<usize>() as u64)
        .sum();
    let model = GpuModel::from(&params.platform);
    let mut configs = vec![Config::Strata];
    if params.baselines {
        configs.extend([
            Config::StrataPages,
            Config::LruCache,
            Config::ZeroCopy,
            Config::AllDevice,
        ]);
    }
    let mut results = Vec::new();
    for (i, &config) in configs.iter().enumerate() {
        progress(config.name(), i as f64 / configs.len() as f64);
        results.push(run_config(params, config, budget, &batches, &model)?);
    }
    progress("done", 1.0);
    let row_bytes = params.dim as u64 * 4;
    let rows_per_page = params.page_size as u64 / row_bytes;
    let static_optimum = [("rows", 1), ("pages", rows_per_page)]
        .into_iter()
        .map(|(granularity, unit)| {
            let hits = static_hits(params, &batches, unit, budget / (unit * row_bytes));
            let seconds = modelled_seconds(params, &model, batches.len(), hits, lookups - hits);
            StaticOptimum {
                granularity,
                hit_rate: hits as f64 / lookups.max(1) as f64,
                lookups_per_sec: lookups as f64 / seconds.max(1e-12),
            }
        })
        .collect();
    Ok(RecsysReport {
        backend: "simulated",
        modelled: true,
        params: params.clone(),
        table_bytes: total,
        budget_bytes: budget,
        budget_requested,
        lookups,
        model,
        results,
        static_optimum,
    })
}

/// Lookups served by the `slots` most-looked-up units of `unit` rows.
fn static_hits(p: &RecsysParams, batches: &[Batch], unit: u64, slots: u64) -> u64 {
    let per_table = (p.rows as u64).div_ceil(unit) as usize;
    let mut counts = vec![0u64; per_table * p.tables];
    for batch in batches {
        for (t, ids) in batch.iter().enumerate() {
            for &row in ids {
                counts[t * per_table + (row as u64 / unit) as usize] += 1;
            }
        }
    }
    let slots = (slots as usize).min(counts.len());
    if slots == 0 {
        return 0;
    }
    counts.select_nth_unstable_by(slots - 1, |a, b| b.cmp(a));
    counts[..slots].iter().sum()
}

/// Modelled seconds of `batches` batches with `device` row lookups served
/// from device memory and `host` read over PCIe, before any migration.
fn modelled_seconds(
    p: &RecsysParams,
    model: &GpuModel,
    batches: usize,
    device: u64,
    host: u64,
) -> f64 {
    let row_tx = (p.dim as u64 * 4).div_ceil(model.line);
    batches as f64 * model.launch_seconds
        + (device * row_tx * model.line) as f64 / model.hbm_bandwidth
        + (host * row_tx * model.line) as f64 / model.pcie_bandwidth
}

fn run_config(
    p: &RecsysParams,
    config: Config,
    budget: u64,
    batches: &[Batch],
    model: &GpuModel,
) -> Result<RecsysResult> {
    let row_bytes = p.dim * 4;
    let table_bytes = (p.rows * row_bytes) as u64;
    let total = table_bytes * p.tables as u64 + p.tables as u64 * p.page_size as u64;
    let device = match config {
        Config::Strata | Config::StrataPages => budget,
        Config::AllDevice => total,
        Config::LruCache | Config::ZeroCopy => 0,
    };
    let rt = Runtime::builder()
        .page_size(p.page_size)
        .device(DeviceChoice::Sim, device)
        .host(total)
        .background_eviction(false)
        .sampling((config == Config::StrataPages).then_some(2))
        .build()?;
    let tables: Vec<EmbeddingTable> = (0..p.tables)
        .map(|t| {
            // strata starts with the device empty, as the row cache does:
            // its row cache fills with the rows the batches miss
            // (`strata`), or the balancer fills the device with the pages
            // they touch (`strata-pages`). Each table has a row cache of
            // its own, an equal share of the budget's whole pages (the
            // tables draw their rows from the same law); the LRU row cache
            // is one over every table.
            let placement = match config {
                Config::Strata | Config::StrataPages => Placement::Prefer(strata::tier::Tier::Host),
                _ => Placement::Fastest,
            };
            let row_cache = (config == Config::Strata).then(|| RowCacheOptions {
                rows: ((budget / p.page_size as u64) as usize / p.tables).max(1)
                    * (p.page_size / row_bytes),
                policy: p.policy,
            });
            let options = TableOptions {
                placement,
                row_cache,
                ..TableOptions::default()
            };
            let table = EmbeddingTable::with_options(&rt, p.rows as u64, p.dim, options)?;
            let rows_per_piece = ((8 << 20) / row_bytes).max(1);
            for start in (0..p.rows).step_by(rows_per_piece) {
                let end = (start + rows_per_piece).min(p.rows);
                let data: Vec<f32> = (start..end)
                    .flat_map(|r| (0..p.dim).map(move |d| recsys::value(t, r, d)))
                    .collect();
                table.write_rows(start as i64, &data)?;
            }
            Ok(table)
        })
        .collect::<Result<_>>()?;
    if config == Config::StrataPages {
        rt.configure_balancer(
            BalancerConfig::default()
                .with_policy(p.policy)
                // A page with a sixteenth of its floats read in a batch is a
                // candidate (found best of 1/1, 1/4, 1/16 on the default run).
                .with_min_accesses((p.page_size / 4 / 16) as u64),
        )?;
        rt.balance_once()?;
    }
    // The row cache holds as many rows as the device budget does (20% of
    // the rows at the default budget: FBGEMM's cache_load_factor 0.2).
    let mut cache = (config == Config::LruCache).then(|| {
        let rows = (budget / row_bytes as u64).max(1) as usize;
        Lru::new(rows)
    });
    // Every bag holds `pooling` rows.
    let offsets: Vec<i64> = (0..=p.batch as i64).map(|b| b * p.pooling as i64).collect();
    // Each table's indices as the gather takes them, and its pooled bags
    // (one row per bag), reused from batch to batch.
    let mut indices: Vec<Vec<i64>> = vec![Vec::with_capacity(p.batch * p.pooling); p.tables];
    let mut outputs: Vec<Vec<f32>> = vec![vec![0f32; p.batch * p.dim]; p.tables];
    let (mut device_rows, mut host_rows, mut fills) = (0u64, 0u64, 0u64);
    let mut seconds = 0.0;
    let mut migration_seconds = 0.0;
    let mut moved = 0u64;
    let mut verified = 0;
    let wall = Instant::now();
    for (bi, batch) in batches.iter().enumerate() {
        let before = rt.stats().device_links.unwrap_or_default();
        // Each table's bags pooled as the GPU kernel would, through the
        // table's device map: rows in device memory, or read zero-copy
        // over PCIe. Bag `b` of table `t` samples its accesses on a
        // sampler seeded `t * batch + b`. Tables run in parallel too, so
        // that threads count into different tables' page counters.
        let lookups: Vec<Lookups> = tables
            .par_iter()
            .zip(batch)
            .zip(&mut indices)
            .zip(&mut outputs)
            .enumerate()
            .map(|(t, (((table, ids), indices), out))| {
                indices.clear();
                indices.extend(ids.iter().map(|&r| r as i64));
                let seed = (t * p.batch) as u64;
                Ok(table.gather_mapped(&Bags::new(indices, &offsets), seed, out)?)
            })
            .collect::<Result<_>>()?;
        let (mut d, mut h) = (0u64, 0u64);
        for l in &lookups {
            d += l.fast_hits;
            h += l.lookups - l.fast_hits;
            fills += l.cache_fills;
        }
        if let Some(c) = &mut cache {
            // The row cache in its own accounting: a hit is served from
            // device memory, a miss fills the row over PCIe.
            let hits = lru_hits(c, batch);
            fills += (d + h) - hits;
            (d, h) = (hits, (d + h) - hits);
        }
        if bi % VERIFY_EVERY == 0 {
            check(p, batch, &outputs).map_err(|why| {
                Error::new(
                    ErrorKind::Corrupted,
                    format!("{} batch {bi}: {why}", config.name()),
                )
            })?;
            verified += 1;
        }
        if config == Config::StrataPages {
            rt.balance_once()?;
        }
        let after = rt.stats().device_links.unwrap_or_default();
        device_rows += d;
        host_rows += h;
        moved += (after.0.bytes - before.0.bytes) + (after.1.bytes - before.1.bytes);
        // The moves at the preset's DMA rate and per-copy cost, as the
        // graph benchmark charges them (the runtime's own simulated link
        // is its PCIe Gen4 default, not the preset's).
        let migration = p
            .platform
            .h2d(after.0.bytes - before.0.bytes, after.0.ops - before.0.ops)
            + p.platform
                .d2h(after.1.bytes - before.1.bytes, after.1.ops - before.1.ops);
        seconds += modelled_seconds(p, model, 1, d, h) + migration;
        migration_seconds += migration;
    }
    let wall_seconds = wall.elapsed().as_secs_f64();
    let promotions_paid = if config == Config::StrataPages {
        // The pages still in device memory leave (uncharged), so every
        // promotion is settled.
        for t in &tables {
            let b = t.buffer();
            b.evict(0..b.len(), strata::tier::Tier::Host)?;
        }
        let s = rt.stats();
        Some((s.promotions_paid, s.promotions_unpaid))
    } else {
        None
    };
    let (d, h) = (device_rows, host_rows);
    // Fills of a row cache cross PCIe (already in `seconds`: a miss is a
    // host read, the fill its own read).
    let bytes_moved = moved + fills * row_bytes as u64;
    Ok(RecsysResult {
        config: config.name(),
        lookups_per_sec: (d + h) as f64 / seconds.max(1e-12),
        hit_rate: d as f64 / (d + h).max(1) as f64,
        bytes_moved,
        seconds,
        migration_seconds,
        wall_seconds,
        verified_batches: verified,
        promotions_paid,
    })
}

/// Lookups of `batch` that the row cache `cache` serves, table by table,
/// bag by bag, in order (a miss brings the row in).
fn lru_hits(cache: &mut Lru, batch: &Batch) -> u64 {
    let mut hits = 0;
    for (t, ids) in batch.iter().enumerate() {
        for &row in ids {
            hits += u64::from(cache.access((t as u64) << 32 | row as u64).is_hit());
        }
    }
    hits
}

/// The pooled outputs of `batch` (one row per bag, table by table) equal
/// sums computed directly from the tables' defining values, in the same
/// order (so exactly equal).
fn check(p: &RecsysParams, batch: &Batch, outputs: &[Vec<f32>]) -> std::result::Result<(), String> {
    for t in 0..p.tables {
        for bag in 0..p.batch {
            let mut want = vec![0f32; p.dim];
            for &row in &batch[t][bag * p.pooling..(bag + 1) * p.pooling] {
                for (d, w) in want.iter_mut().enumerate() {
                    *w += recsys::value(t, row as usize, d);
                }
            }
            if outputs[t][bag * p.dim..(bag + 1) * p.dim] != want[..] {
                return Err(format!("table {t} bag {bag} differs from the direct sum"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rows: usize) -> RecsysParams {
        RecsysParams {
            tables: 2,
            rows,
            dim: 4,
            pooling: 1,
            batch: 1,
            batches: 1,
            dist: Dist::Uniform,
            device_budget: Budget::Percent(20.0),
            policy: PolicyKind::Default,
            baselines: false,
            seed: 1,
            page_size: 4096,
            platform: Platform::default(),
        }
    }

    #[test]
    fn static_optimum_keeps_the_most_looked_up_units() {
        let p = params(8);
        // Table 0: row 0 ×3, row 5 ×2, rows 6 and 7 once; table 1: row 1 ×4.
        let batches: Vec<Batch> = vec![vec![vec![0, 0, 0, 5, 5, 6, 7], vec![1, 1, 1, 1]]];
        assert_eq!(static_hits(&p, &batches, 1, 1), 4);
        assert_eq!(static_hits(&p, &batches, 1, 2), 7);
        assert_eq!(static_hits(&p, &batches, 1, 100), 11);
        // Units of 4 rows: table 0's rows 4..8 (4 lookups) tie table 1's
        // rows 0..4; both fit in two slots.
        assert_eq!(static_hits(&p, &batches, 4, 1), 4);
        assert_eq!(static_hits(&p, &batches, 4, 2), 8);
        assert_eq!(static_hits(&p, &batches, 4, 0), 0);
    }
}
