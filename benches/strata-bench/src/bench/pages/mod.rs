//! `strata bench pages`: small random reads over a data set four times (or
//! so) the size of DRAM, on real DRAM and a real disk, no device tier —
//! strata (DRAM the fastest tier, optional emulated CXL, NVMe below, the
//! balancer placing pages) beside the operating system's page cache (the
//! same bytes in a file read through `mmap` by a child process held to the
//! same memory by a cgroup v1 memory limit, with and without
//! `MADV_RANDOM`) and, with the `foyer` feature, foyer's hybrid cache (the
//! same memory, a disk cache in the same directory, misses filled from the
//! data file). Every read is checked against the content written, and
//! Belady's misses on the same page sequence are the bound.
//!
//! What each configuration holds in memory: strata its DRAM tier (`--dram`
//! bytes) and its page table; NVMe through O_DIRECT, so no page cache. The
//! page cache baseline everything the cgroup charges: the file's cached
//! pages and the child's own memory (a few MiB: its stack, its latency
//! record). foyer its in-memory cache (`--dram` bytes of values), its disk
//! cache and source reads with direct I/O.
#![forbid(unsafe_code)]

#[cfg(feature = "foyer")]
mod foyer_peer;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::machine::{check_memory, product};
use crate::random::{Rng, Zipf};
use strata::error::{Error, ErrorKind, Result};
use strata::io::AlignedBuf;
use strata::policy::belady::Belady;
use strata::policy::{self, PolicyKind};
use strata::runtime::{BalancerConfig, Runtime};
use strata::tier::{CxlConfig, CxlMode, NvmeConfig, Tier};

/// Which pages the reads go to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Access {
    /// Zipf(`alpha`) over all pages, the hottest scattered.
    Zipf {
        /// Skew.
        alpha: f64,
    },
    /// Zipf(`alpha`), the hot set re-drawn every `period` reads.
    Shift {
        /// Skew.
        alpha: f64,
        /// Reads between re-draws.
        period: u64,
    },
    /// One decimal page id per line (`#` comments), as `strata trace` writes.
    File {
        /// The trace.
        path: PathBuf,
    },
}

impl std::fmt::Display for Access {
    /// As `--access` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Access::Zipf { alpha } => write!(f, "zipf:{alpha}"),
            Access::Shift { alpha, period } => write!(f, "shift:{alpha}:{period}"),
            Access::File { path } => write!(f, "file:{}", path.display()),
        }
    }
}

impl FromStr for Access {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let alpha = |a: &str| -> Result<f64> {
            match a.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(Error::invalid(format!(
                    "zipf skew {a:?} is not a positive number"
                ))),
            }
        };
        let parts: Vec<&str> = s.splitn(3, ':').collect();
        match parts.as_slice() {
            ["zipf", a] => Ok(Access::Zipf { alpha: alpha(a)? }),
            ["shift", a, p] => match p.parse::<u64>() {
                Ok(period) if period > 0 => Ok(Access::Shift {
                    alpha: alpha(a)?,
                    period,
                }),
                _ => Err(Error::invalid(format!(
                    "shift period {p:?} is not a positive number of reads"
                ))),
            },
            ["file", ..] if s.len() > 5 => Ok(Access::File {
                path: PathBuf::from(&s[5..]),
            }),
            _ => Err(Error::invalid(format!(
                "access {s:?}: use zipf:ALPHA, shift:ALPHA:PERIOD or file:PATH"
            ))),
        }
    }
}

/// The configurations `--configs` takes: strata with the balancer's
/// defaults, strata with promotions from NVMe moved in the background or
/// left to the pages' next reads (`BalancerConfig::promote_on_read`), the
/// page cache (default readahead, and `MADV_RANDOM`) and foyer.
pub const CONFIGS: [&str; 6] = [
    "strata",
    "strata-background",
    "strata-on-read",
    "os",
    "os-random",
    "foyer",
];

/// Parameters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PagesParams {
    /// Bytes of data (a whole number of pages).
    pub data: u64,
    /// DRAM for the data: strata's fastest tier, the page cache's limit,
    /// foyer's memory.
    pub dram: u64,
    /// Emulated CXL memory between DRAM and NVMe (strata only).
    pub cxl: Option<u64>,
    /// Page size.
    pub page_size: usize,
    /// Directory on the disk measured.
    pub path: PathBuf,
    /// Which pages are read.
    pub access: Access,
    /// Reads per configuration.
    pub ops: u64,
    /// Threads reading.
    pub threads: usize,
    /// Bytes per read.
    pub read_bytes: usize,
    /// Run the page cache (and foyer) too.
    pub baselines: bool,
    /// Only these configurations (`None`: strata, and the baselines if
    /// asked).
    pub configs: Option<Vec<String>>,
    /// strata's balancer: accesses a round for a page to be a promotion
    /// candidate (`None`: the balancer's default).
    pub min_accesses: Option<u64>,
    /// strata's balancer: its placement policy (named in the report's
    /// note).
    #[serde(skip, default = "default_policy")]
    pub policy: strata::policy::PolicyKind,
    /// strata's balancer balances the pairs of tiers below DRAM too (CXL
    /// and NVMe), not only DRAM.
    #[serde(default)]
    pub lower_levels: bool,
    /// Rounds of all configurations, interleaved.
    pub trials: usize,
    /// Seed of the content and the page sequence.
    pub seed: u64,
}

fn default_policy() -> strata::policy::PolicyKind {
    strata::policy::PolicyKind::Default
}

impl PagesParams {
    /// Pages of data.
    pub fn data_pages(&self) -> u64 {
        self.data / self.page_size as u64
    }

    /// Pages of DRAM.
    pub fn dram_pages(&self) -> u64 {
        self.dram / self.page_size as u64
    }

    /// Refuses what cannot run, naming the argument.
    pub fn check(&self) -> Result<()> {
        strata::size::check_page_size(self.page_size).map_err(|e| e.context("--page-size"))?;
        let ps = self.page_size as u64;
        if self.data % ps != 0 || self.data_pages() < 2 {
            return Err(Error::invalid(format!(
                "--data {} must be a whole number of pages, at least 2, of {ps} bytes",
                self.data
            )));
        }
        if self.dram < ps || self.dram >= self.data {
            return Err(Error::invalid(format!(
                "--dram {} must hold a page at least and less than --data {}",
                self.dram, self.data
            )));
        }
        if let Some(c) = self.cxl {
            if c < ps {
                return Err(Error::invalid(format!("--cxl {c} is smaller than a page")));
            }
        }
        if self.read_bytes < 8
            || self.read_bytes % 8 != 0
            || self.read_bytes > self.page_size
            || self.page_size % self.read_bytes != 0
        {
            return Err(Error::invalid(format!(
                "--read-bytes {} must be a multiple of 8 that divides the page size {}",
                self.read_bytes, self.page_size
            )));
        }
        if self.threads == 0 || self.threads > 256 {
            return Err(Error::invalid(format!(
                "--threads {} is not in 1..=256",
                self.threads
            )));
        }
        if self.ops == 0 {
            return Err(Error::invalid("--ops must be at least 1"));
        }
        if let Some(c) = &self.configs {
            if let Some(bad) = c.iter().find(|c| !CONFIGS.contains(&c.as_str())) {
                return Err(Error::invalid(format!(
                    "--configs: unknown configuration {bad:?} ({})",
                    CONFIGS.join(", ")
                )));
            }
            if c.is_empty() {
                return Err(Error::invalid("--configs names no configuration"));
            }
            if let Some(twice) = c.iter().enumerate().find(|(i, x)| c[..*i].contains(x)) {
                return Err(Error::invalid(format!(
                    "--configs names {:?} twice",
                    twice.1
                )));
            }
            if self.baselines {
                return Err(Error::invalid(
                    "--baselines adds the peers to the default configurations; with --configs, name them there",
                ));
            }
            // A setting of strata's would be silently ignored.
            let strata_only = [
                ("--cxl", self.cxl.is_some()),
                ("--policy", self.policy != PolicyKind::Default),
                ("--min-accesses", self.min_accesses.is_some()),
                ("--lower-levels", self.lower_levels),
            ];
            if let Some((flag, _)) = strata_only.iter().find(|(_, given)| *given) {
                if !c.iter().any(|c| c.starts_with("strata")) {
                    return Err(Error::invalid(format!(
                        "{flag} is strata's, and --configs runs no strata configuration"
                    )));
                }
            }
        }
        // The page cache's process shares its memory limit with the page
        // cache it measures: below a few MiB the limit kills it.
        let os = match &self.configs {
            Some(c) => c.iter().any(|c| c.starts_with("os")),
            None => self.baselines,
        };
        if os && self.dram < MIN_OS_DRAM {
            return Err(Error::invalid(format!(
                "--dram {} is below the {MIN_OS_DRAM} bytes the page cache's process needs under its memory limit (configurations os, os-random)",
                self.dram
            )));
        }
        if self.trials == 0 {
            return Err(Error::invalid("--trials must be at least 1"));
        }
        Ok(())
    }
}

/// The smallest `--dram` the page cache's configurations run under (their
/// process's own memory shares the cgroup's limit).
const MIN_OS_DRAM: u64 = 4 << 20;

/// One configuration's run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PagesResult {
    /// `strata`, `os`, `os-random` (with `MADV_RANDOM`) or `foyer`.
    pub config: String,
    /// Which round (from 0).
    pub trial: usize,
    /// Reads per wall second (all threads; the checks included).
    pub ops_per_sec: f64,
    /// Median read latency, µs (the read only, not its check).
    pub p50_us: f64,
    /// 99th percentile read latency, µs.
    pub p99_us: f64,
    /// Bytes the process read from the disk meanwhile (`/proc/self/io`).
    pub disk_bytes_read: u64,
    /// Bytes the process wrote to the disk meanwhile (`/proc/self/io`):
    /// 0 is the target for these read-only traces.
    #[serde(default)]
    pub disk_bytes_written: u64,
    /// Share of reads served from DRAM: strata's fast tier; the page
    /// cache's reads without a major fault; foyer's in-memory hits.
    pub fast_tier_hit_rate: f64,
    /// Reads whose bytes were not the content written.
    pub wrong_reads: u64,
    /// Pages dropped: strata's lost pages; for foyer, pages it had cached
    /// and had to fetch from the data file again.
    pub lost: u64,
    /// Wall seconds of the reads.
    pub seconds: f64,
    /// What this configuration did, in a few words.
    pub note: String,
}

/// The bound on the same page sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Bound {
    /// Belady's MIN misses with `--dram` pages.
    pub belady_misses: u64,
    /// The best fixed placement chosen in hindsight: the `--dram` pages read
    /// most, their share of the reads.
    pub static_optimum_hit_rate: f64,
    /// The online reference policies (LRU, perfect LFU with and without
    /// admission, ARC, S3-FIFO, SIEVE: those the policy corpus compares
    /// against) replayed per read with `--dram` pages: each one's misses.
    pub references: Vec<(String, u64)>,
    /// The best of them: its name and misses.
    pub best_reference: (String, u64),
}

/// The online references the bound replays: the policy corpus's six.
pub const REFERENCES: [PolicyKind; 6] = [
    PolicyKind::Lru,
    PolicyKind::PerfectLfu,
    PolicyKind::LfuAdmission,
    PolicyKind::Arc,
    PolicyKind::S3Fifo,
    PolicyKind::Sieve,
];

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct PagesReport {
    /// No device is involved: DRAM and the disk.
    pub backend: &'static str,
    /// Parameters.
    pub params: PagesParams,
    /// Pages of data.
    pub data_pages: u64,
    /// Pages of DRAM.
    pub dram_pages: u64,
    /// Reads per configuration (`--ops`, or the trace's length).
    pub ops: u64,
    /// Every run, in the order run.
    pub results: Vec<PagesResult>,
    /// The bounds.
    pub bound: Bound,
    /// Configurations not run, and why.
    pub skipped: Vec<String>,
    /// Each strata configuration against each peer run beside it.
    pub comparisons: Vec<Comparison>,
}

/// A strata configuration against a peer, over the trials both ran: each
/// pair is the two runs of one trial (run one after the other).
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// strata's configuration.
    pub config: String,
    /// The peer's.
    pub peer: String,
    /// Trials both ran.
    pub pairs: usize,
    /// strata's median ops/s over the peer's.
    pub ops_ratio: f64,
    /// The lowest and highest ratio of ops/s within a pair.
    pub ops_ratio_pairs: (f64, f64),
    /// The medians of the trials' p99 read latencies, µs: strata's, the
    /// peer's.
    pub p99_us: (f64, f64),
    /// Pairs in which strata's p99 was the lower.
    pub p99_lower_pairs: usize,
    /// strata's median bytes read from the disk over the peer's (`None`
    /// where the peer read none: no ratio).
    pub disk_read_ratio: Option<f64>,
}

/// Every strata configuration of `results` against every peer there.
pub fn compare(results: &[PagesResult]) -> Vec<Comparison> {
    let mut configs: Vec<&str> = Vec::new();
    for r in results {
        if !configs.contains(&r.config.as_str()) {
            configs.push(&r.config);
        }
    }
    let ours = configs.iter().filter(|c| c.starts_with("strata"));
    let mut out = Vec::new();
    for &config in ours {
        for &peer in configs.iter().filter(|c| !c.starts_with("strata")) {
            let pairs: Vec<(&PagesResult, &PagesResult)> = results
                .iter()
                .filter(|a| a.config == config)
                .filter_map(|a| {
                    results
                        .iter()
                        .find(|b| b.config == peer && b.trial == a.trial)
                        .map(|b| (a, b))
                })
                .collect();
            if pairs.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&PagesResult) -> f64, ours: bool| {
                let mut v: Vec<f64> = pairs
                    .iter()
                    .map(|&(a, b)| f(if ours { a } else { b }))
                    .collect();
                super::median(&mut v)
            };
            let ops = |r: &PagesResult| r.ops_per_sec;
            let p99 = |r: &PagesResult| r.p99_us;
            let disk = |r: &PagesResult| r.disk_bytes_read as f64;
            let within = pairs.iter().map(|(a, b)| a.ops_per_sec / b.ops_per_sec);
            let peer_disk = med(&disk, false);
            out.push(Comparison {
                config: config.to_string(),
                peer: peer.to_string(),
                pairs: pairs.len(),
                ops_ratio: med(&ops, true) / med(&ops, false),
                ops_ratio_pairs: (
                    within.clone().fold(f64::INFINITY, f64::min),
                    within.fold(0.0, f64::max),
                ),
                p99_us: (med(&p99, true), med(&p99, false)),
                p99_lower_pairs: pairs.iter().filter(|(a, b)| a.p99_us < b.p99_us).count(),
                disk_read_ratio: (peer_disk > 0.0).then(|| med(&disk, true) / peer_disk),
            });
        }
    }
    out
}

/// A cheap, well-mixed 64-bit hash (SplitMix64's finalizer).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The content's word `w` of page `p`: unique to its place, so a read of
/// the wrong page or offset never passes.
fn word(seed: u64, p: u64, w: u64) -> u64 {
    mix(seed ^ mix(p.wrapping_add(1)) ^ w.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Page `p`'s content.
pub fn fill_page(seed: u64, p: u64, out: &mut [u8]) {
    for (w, c) in out.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&word(seed, p, w as u64).to_le_bytes());
    }
}

/// Whether `got`, read at byte `off` of page `p`, is the content (every
/// eighth word and the last are compared: enough to catch any wrong page
/// or offset, cheap beside the read).
pub fn check(seed: u64, p: u64, off: usize, got: &[u8]) -> bool {
    let words = got.len() / 8;
    let first = off as u64 / 8;
    let at = |i: usize| u64::from_le_bytes(got[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    (0..words)
        .step_by(8)
        .chain(std::iter::once(words - 1))
        .all(|i| at(i) == word(seed, p, first + i as u64))
}

/// The byte offset within its page of read `i`.
pub fn offset(p: &PagesParams, i: u64) -> usize {
    let slots = (p.page_size / p.read_bytes) as u64;
    (mix(p.seed.wrapping_add(0x5eed) ^ i) % slots) as usize * p.read_bytes
}

/// Refuses, as bad input, a run whose sequence, bounds and tiers this
/// machine cannot hold: per read its page (4 bytes), the bounds' copy of it
/// and Belady's next use (8 each); per DRAM page the six references'
/// bookkeeping; per data page its count; the DRAM and CXL tiers.
fn check_memory_for(p: &PagesParams) -> Result<()> {
    let reads = match &p.access {
        // A trace file's reads are its lines, of two bytes at least.
        Access::File { path } => std::fs::metadata(path)
            .map(|m| (m.len() / 2).min(p.ops))
            .unwrap_or(p.ops),
        _ => p.ops,
    };
    let bytes = product(&[reads, 4 + 8 + 8])
        .saturating_add(product(&[p.dram_pages(), REFERENCES.len() as u64, 128]))
        .saturating_add(product(&[p.data_pages(), 8]))
        .saturating_add(p.dram)
        .saturating_add(p.cxl.unwrap_or(0));
    check_memory(
        format_args!(
            "--ops {} with --dram {}{}",
            p.ops,
            p.dram,
            p.cxl.map(|c| format!(" --cxl {c}")).unwrap_or_default()
        ),
        "each read's page, the bounds' replays and the memory tiers",
        bytes,
    )
}

/// The page of every read.
pub fn sequence(p: &PagesParams) -> Result<Vec<u32>> {
    let n = p.data_pages();
    if n > u32::MAX as u64 {
        return Err(Error::invalid(format!(
            "{n} pages are too many (at most 2^32)"
        )));
    }
    let mut rng = Rng::new(p.seed);
    // A ranking of the pages: a uniformly random permutation, rank → page.
    // (An affine scramble `a·r + b` with a fixed `a` only rotated the
    // ranking from one seed or period to the next: a "re-drawn" hot set
    // was the old one shifted by a random number of ranks, sometimes a few
    // ranks, sometimes most of the cache.)
    let ranking = |rng: &mut Rng| {
        let mut pages: Vec<u32> = (0..n as u32).collect();
        rng.shuffle(&mut pages);
        pages
    };
    match &p.access {
        Access::Zipf { alpha } => {
            let z = Zipf::new(n, *alpha)?;
            let r = ranking(&mut rng);
            Ok((0..p.ops)
                .map(|_| r[(z.sample(&mut rng) - 1) as usize])
                .collect())
        }
        Access::Shift { alpha, period } => {
            let z = Zipf::new(n, *alpha)?;
            let mut out = Vec::with_capacity(p.ops as usize);
            while (out.len() as u64) < p.ops {
                // Each period ranks the pages afresh, independently of the
                // last.
                let r = ranking(&mut rng);
                let k = (*period).min(p.ops - out.len() as u64);
                out.extend((0..k).map(|_| r[(z.sample(&mut rng) - 1) as usize]));
            }
            Ok(out)
        }
        Access::File { path } => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| crate::files::read_error("reading", path, e))?;
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let id: u64 = line.parse().map_err(|_| {
                    Error::invalid(format!(
                        "{} line {}: {line:?} is not a page id",
                        path.display(),
                        i + 1
                    ))
                })?;
                if id >= n {
                    return Err(Error::invalid(format!(
                        "{} line {}: page {id} is past the data's {n} pages",
                        path.display(),
                        i + 1
                    )));
                }
                out.push(id as u32);
                if out.len() as u64 == p.ops {
                    break;
                }
            }
            if out.is_empty() {
                return Err(Error::invalid(format!(
                    "{} holds no page ids",
                    path.display()
                )));
            }
            Ok(out)
        }
    }
}

/// Belady's misses, the static optimum and the online references over
/// `seq` with `dram` pages.
pub fn bound(seq: &[u32], dram: u64, data_pages: u64) -> Result<Bound> {
    let trace: Vec<u64> = seq.iter().map(|&x| x as u64).collect();
    let mut min = Belady::new(dram as usize, &trace);
    let r = strata::policy::replay(&mut min, &trace);
    let references = REFERENCES
        .iter()
        .map(|&k| {
            let mut policy = policy::build(k, dram as usize, None)?;
            let misses = strata::policy::replay(policy.as_mut(), &trace).misses;
            Ok((k.name().to_string(), misses))
        })
        .collect::<Result<Vec<_>>>()?;
    let best_reference = references
        .iter()
        .min_by_key(|(_, m)| *m)
        .cloned()
        .expect("six references");
    let mut counts = vec![0u64; data_pages as usize];
    for &p in seq {
        counts[p as usize] += 1;
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let top: u64 = counts.iter().take(dram as usize).sum();
    Ok(Bound {
        belady_misses: r.misses,
        static_optimum_hit_rate: top as f64 / seq.len().max(1) as f64,
        references,
        best_reference,
    })
}

/// Bytes this process has read from and written to block devices
/// (`/proc/self/io`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DiskIo {
    pub read: u64,
    pub written: u64,
}

impl DiskIo {
    /// The counts now.
    /// The counts now; an error where the kernel does not give them (a
    /// disk figure read as zero would be a wrong one).
    pub fn now() -> Result<Self> {
        let io = std::fs::read_to_string("/proc/self/io").map_err(|e| {
            Error::io(
                "reading /proc/self/io (the disk bytes are counted there)",
                e,
            )
        })?;
        let field = |name: &str| {
            io.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
                .ok_or_else(|| Error::invalid(format!("/proc/self/io has no {name}")))
        };
        Ok(Self {
            read: field("read_bytes:")?,
            written: field("write_bytes:")?,
        })
    }

    /// What was read and written since `self`.
    pub fn since(self) -> Result<Self> {
        let now = Self::now()?;
        Ok(Self {
            read: now.read.saturating_sub(self.read),
            written: now.written.saturating_sub(self.written),
        })
    }
}

/// Latencies (ns) → (p50, p99) in µs.
fn percentiles(mut ns: Vec<u32>) -> (f64, f64) {
    if ns.is_empty() {
        return (0.0, 0.0);
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    (at(0.5), at(0.99))
}

/// What one reading thread saw.
#[derive(Default)]
pub struct ThreadTally {
    /// Read latencies, ns.
    pub latencies: Vec<u32>,
    /// Reads served from DRAM.
    pub fast: u64,
    /// Reads whose bytes were wrong.
    pub wrong: u64,
}

/// One read: `(i, page, offset, out)` → whether DRAM served it.
pub type ReadFn<'a> = dyn Fn(u64, u64, usize, &mut [u8]) -> Result<bool> + Sync + 'a;

/// Runs `read(i, page, offset, out) -> served from DRAM` for every read,
/// read `i` on thread `i % threads`, and sums what the threads saw.
pub fn drive(
    p: &PagesParams,
    seq: &[u32],
    ready: &dyn Fn() -> Result<()>,
    read: &ReadFn<'_>,
) -> Result<(ThreadTally, f64)> {
    let t = p.threads;
    // Allocated and written before `ready` (a child process joins its
    // cgroup there, so this memory is not charged to the page cache's
    // limit) and before the clock starts.
    let mut tallies: Vec<ThreadTally> = (0..t)
        .map(|_| ThreadTally {
            latencies: vec![u32::MAX; seq.len() / t + 1],
            ..Default::default()
        })
        .collect();
    ready()?;
    let start = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = tallies
            .iter_mut()
            .enumerate()
            .map(|(k, tally)| {
                s.spawn(move || -> Result<()> {
                    let mut buf = vec![0u8; p.read_bytes];
                    let mut n = 0;
                    for i in (k..seq.len()).step_by(t) {
                        let page = seq[i] as u64;
                        let off = offset(p, i as u64);
                        let t0 = Instant::now();
                        let fast = read(i as u64, page, off, &mut buf)?;
                        tally.latencies[n] = t0.elapsed().as_nanos().min(u32::MAX as u128) as u32;
                        n += 1;
                        tally.fast += fast as u64;
                        if !check(p.seed, page, off, &buf) {
                            tally.wrong += 1;
                        }
                    }
                    tally.latencies.truncate(n);
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::invalid("a reader panicked")))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    for r in results {
        r?;
    }
    let mut all = ThreadTally::default();
    for t in tallies {
        all.latencies.extend(t.latencies);
        all.fast += t.fast;
        all.wrong += t.wrong;
    }
    Ok((all, seconds))
}

/// A configuration's result from what its threads saw.
pub fn finish(
    config: &str,
    trial: usize,
    tally: ThreadTally,
    seconds: f64,
    disk: DiskIo,
    lost: u64,
    note: String,
) -> PagesResult {
    let ops = tally.latencies.len() as f64;
    let (p50_us, p99_us) = percentiles(tally.latencies);
    PagesResult {
        config: config.to_string(),
        trial,
        ops_per_sec: ops / seconds.max(1e-9),
        p50_us,
        p99_us,
        disk_bytes_read: disk.read,
        disk_bytes_written: disk.written,
        fast_tier_hit_rate: tally.fast as f64 / ops.max(1.0),
        wrong_reads: tally.wrong,
        lost,
        seconds,
        note,
    }
}

/// strata: DRAM (the fastest tier), emulated CXL if asked, NVMe below in
/// `--path`; the data written page by page and evicted to NVMe, so strata
/// starts cold as the peers do (not timed), then the reads
/// with the balancer running at its defaults (`on_read`: with
/// promotions from NVMe left to the pages' next reads, or not).
pub fn run_strata(
    p: &PagesParams,
    seq: &[u32],
    trial: usize,
    on_read: Option<bool>,
) -> Result<PagesResult> {
    let ps = p.page_size;
    let pages = p.data_pages();
    // The NVMe tier holds all the data, with room for its reserve and for
    // the second slots of the moves in flight when everything is evicted
    // to it before the reads.
    let nvme = (pages + (pages / 63 + 1).min(64) + 1 + 64) * ps as u64;
    let mut b = Runtime::builder()
        .page_size(ps)
        .host(p.dram)
        .nvme(NvmeConfig::new(&p.path, nvme, ps))
        .background_eviction(true);
    if let Some(cxl) = p.cxl {
        b = b.cxl(CxlConfig::new(CxlMode::Emulated, cxl, ps));
    }
    let rt = b.build()?;
    let buf = rt.alloc(p.data)?;
    let mut page = vec![0u8; ps];
    for q in 0..pages {
        fill_page(p.seed, q, &mut page);
        buf.write(q * ps as u64, &page)?;
    }
    // Cold, as the peers start: the data on disk, DRAM empty (the page
    // cache's file is dropped from it, foyer's cache starts empty).
    buf.evict(0..buf.len(), Tier::Nvme)?;
    let mut balancer = BalancerConfig::default()
        .with_policy(p.policy)
        .with_lower_levels(p.lower_levels);
    if let Some(m) = p.min_accesses {
        balancer = balancer.with_min_accesses(m);
    }
    let name = match on_read {
        None => "strata",
        Some(false) => "strata-background",
        Some(true) => "strata-on-read",
    };
    if let Some(on) = on_read {
        balancer = balancer.with_promote_on_read(on);
    }
    let min = balancer.min_accesses;
    let on_read = balancer.promote_on_read;
    rt.start_balancer(balancer)?;
    let disk0 = DiskIo::now()?;
    let cxl_reads = std::sync::atomic::AtomicU64::new(0);
    let (tally, seconds) = drive(p, seq, &|| Ok(()), &|_, page, off, out| {
        let tier = buf.tier_of(page as usize)?;
        if tier == Some(Tier::Cxl) {
            cxl_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        buf.read(page * ps as u64 + off as u64, out)?;
        Ok(tier == Some(Tier::Host))
    })?;
    let cxl_reads = cxl_reads.into_inner();
    rt.stop_balancer();
    // After the balancer's last moves: what they read and wrote counts.
    let disk = disk0.since()?;
    rt.check()?;
    let s = rt.stats();
    let note = format!(
        "DRAM tier {} pages{}, NVMe (O_DIRECT) below; balancer policy {}, min_accesses {min}, promotions from NVMe {}: {} promotions ({} by reads), {} demotions, {} back to their clean copy with no write; of the promotions settled, {} paid (read in DRAM before they left) and {} did not{}",
        p.dram_pages(),
        p.cxl
            .map(|c| format!(", emulated CXL {} pages", c / ps as u64))
            .unwrap_or_default(),
        p.policy,
        if on_read {
            "on the next read"
        } else {
            "in the background"
        },
        s.promotions,
        s.promotions_on_read,
        s.demotions,
        s.clean_demotions,
        s.promotions_paid,
        s.promotions_unpaid,
        p.cxl
            .map(|_| format!(
                "; {:.1}% of reads served from CXL (DRAM or CXL: {:.1}%)",
                100.0 * cxl_reads as f64 / seq.len().max(1) as f64,
                100.0 * (tally.fast + cxl_reads) as f64 / seq.len().max(1) as f64
            ))
            .unwrap_or_default()
    );
    Ok(finish(
        name,
        trial,
        tally,
        seconds,
        disk,
        s.lost_pages,
        note,
    ))
}

/// The data file the baselines read: `--path`/strata-bench-pages.data.
pub fn data_file(p: &PagesParams) -> PathBuf {
    p.path.join("strata-bench-pages.data")
}

/// Writes the data file (synced), then drops it from the page cache.
pub fn write_data_file(p: &PagesParams) -> Result<()> {
    let path = data_file(p);
    let io = |e| Error::io(format!("writing {}", path.display()), e);
    let mut f = File::create(&path).map_err(io)?;
    let mut chunk = vec![0u8; p.page_size];
    for q in 0..p.data_pages() {
        fill_page(p.seed, q, &mut chunk);
        f.write_all(&chunk).map_err(io)?;
    }
    f.sync_all().map_err(io)?;
    drop_cached(&path)
}

/// Drops `path`'s clean pages from the page cache (`POSIX_FADV_DONTNEED`),
/// so a baseline starts cold.
pub fn drop_cached(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    crate::sys::fadvise_dontneed(&f).map_err(|e| {
        Error::io(
            format!("dropping {} from the page cache", path.display()),
            e,
        )
    })
}

/// A cgroup v1 memory group for one child, removed on drop.
pub struct MemoryGroup {
    dir: PathBuf,
}

impl MemoryGroup {
    /// A new group limited to `bytes`; `None` where this machine has no
    /// cgroup v1 memory controller (or it cannot be written).
    pub fn new(bytes: u64) -> Result<Option<Self>> {
        let root = Path::new("/sys/fs/cgroup/memory");
        if !root.join("cgroup.procs").exists() {
            return Ok(None);
        }
        let dir = root.join(format!("strata-bench-pages-{}", std::process::id()));
        if std::fs::create_dir(&dir).is_err() && !dir.is_dir() {
            return Ok(None);
        }
        let g = Self { dir };
        // A controller that refuses the limit is as good as none (the
        // group is removed when `g` drops).
        Ok(
            std::fs::write(g.dir.join("memory.limit_in_bytes"), bytes.to_string())
                .is_ok()
                .then_some(g),
        )
    }

    /// The group's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for MemoryGroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What a child process is asked to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildSpec {
    /// The run's parameters.
    pub params: PagesParams,
    /// `os` or `os-random`.
    pub config: String,
    /// The round.
    pub trial: usize,
    /// The cgroup to join before reading.
    pub cgroup: Option<PathBuf>,
}

/// The page cache baseline, in this (child) process: joins the cgroup,
/// maps the data file and reads through the map.
pub fn run_os_child(spec: &ChildSpec) -> Result<PagesResult> {
    let p = &spec.params;
    let seq = sequence(p)?;
    let path = data_file(p);
    let file =
        File::open(&path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let map = crate::sys::map_read_only(&file)
        .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
    if spec.config == "os-random" {
        map.advise(memmap2::Advice::Random)
            .map_err(|e| Error::io("madvise(MADV_RANDOM)", e))?;
    }
    let ps = p.page_size;
    let read = |_: u64, page: u64, off: usize, out: &mut [u8]| -> Result<bool> {
        let at = page as usize * ps + off;
        out.copy_from_slice(&map[at..at + out.len()]);
        Ok(false)
    };
    // Fault counts say which reads missed: read them around the run.
    let faults0 = major_faults()?;
    let join = || -> Result<()> {
        if let Some(g) = &spec.cgroup {
            std::fs::write(g.join("cgroup.procs"), std::process::id().to_string())
                .map_err(|e| Error::io("joining the cgroup", e))?;
        }
        Ok(())
    };
    let disk0 = DiskIo::now()?;
    let (mut tally, seconds) = drive(p, &seq, &join, &read)?;
    let disk = disk0.since()?;
    let faults = major_faults()? - faults0;
    let ops = tally.latencies.len() as u64;
    tally.fast = ops.saturating_sub(faults);
    // A DRAM hit is a read that took no major fault: exact for reads of
    // one OS page; a longer read may take several faults, which count as
    // several misses (the hit rate then a lower bound).
    let os_page = 4096;
    let note = format!(
        "mmap of the data file{}, {}; {} major faults{}",
        if spec.config == "os-random" {
            " with MADV_RANDOM"
        } else {
            ", default readahead"
        },
        match &spec.cgroup {
            Some(_) => format!("cgroup v1 memory limit {} bytes", p.dram),
            None => "no memory limit (no cgroup v1 memory controller)".into(),
        },
        faults,
        if p.read_bytes > os_page {
            "; DRAM hits are reads less faults, a lower bound for reads longer than a 4 KiB OS page"
        } else {
            ""
        }
    );
    Ok(finish(
        &spec.config,
        spec.trial,
        tally,
        seconds,
        disk,
        0,
        note,
    ))
}

/// ru_majflt of this process, from /proc/self/stat (field 12); an error
/// where it cannot be read (zero faults would read as every read a hit).
fn major_faults() -> Result<u64> {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            rest.split(' ').nth(9)?.parse().ok()
        })
        .ok_or_else(|| Error::invalid("cannot read the major faults in /proc/self/stat"))
}

/// Runs every configuration, `trials` rounds interleaved. `child` runs a
/// page cache baseline in a new process and returns its result (the
/// `strata` binary runs itself with a hidden subcommand).
pub fn run(
    p: &PagesParams,
    child: &dyn Fn(&ChildSpec) -> Result<PagesResult>,
    progress: &mut dyn FnMut(&str, f64),
) -> Result<PagesReport> {
    p.check()?;
    if !p.path.is_dir() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("--path {} is not a directory", p.path.display()),
        ));
    }
    check_memory_for(p)?;
    let seq = sequence(p)?;
    let bound = bound(&seq, p.dram_pages(), p.data_pages())?;
    let mut skipped = Vec::new();
    let wanted: Vec<&str> = match &p.configs {
        Some(c) => c.iter().map(String::as_str).collect(),
        None if p.baselines => vec!["strata", "os", "os-random", "foyer"],
        None => vec!["strata"],
    };
    let mut configs: Vec<&str> = Vec::new();
    let mut group = None;
    if wanted.iter().any(|c| !c.starts_with("strata")) {
        write_data_file(p)?;
    }
    for c in wanted {
        match c {
            "os" | "os-random" => {
                if group.is_none() {
                    group = MemoryGroup::new(p.dram)?;
                }
                if group.is_none() {
                    skipped.push(format!(
                        "{c}: no cgroup v1 memory controller here (the page cache would hold everything)"
                    ));
                    continue;
                }
            }
            "foyer" if !cfg!(feature = "foyer") => {
                skipped.push(
                    "foyer: built without the foyer feature (cargo build --release --features foyer)"
                        .into(),
                );
                continue;
            }
            _ => {}
        }
        configs.push(c);
    }
    if configs.is_empty() {
        // Nothing asked for can run here: bad input, not an empty report.
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("no configuration can run here: {}", skipped.join("; ")),
        ));
    }
    let steps = (p.trials * configs.len()) as f64;
    let mut results = Vec::new();
    for trial in 0..p.trials {
        for (k, &config) in configs.iter().enumerate() {
            progress(config, (trial * configs.len() + k) as f64 / steps);
            let r = match config {
                "strata" => run_strata(p, &seq, trial, None)?,
                "strata-background" => run_strata(p, &seq, trial, Some(false))?,
                "strata-on-read" => run_strata(p, &seq, trial, Some(true))?,
                "os" | "os-random" => {
                    drop_cached(&data_file(p))?;
                    child(&ChildSpec {
                        params: p.clone(),
                        config: config.to_string(),
                        trial,
                        cgroup: group.as_ref().map(|g| g.dir().to_path_buf()),
                    })?
                }
                _ => run_foyer(p, &seq, trial)?,
            };
            results.push(r);
        }
    }
    progress("done", 1.0);
    let _ = std::fs::remove_file(data_file(p));
    Ok(PagesReport {
        backend: "none (DRAM and disk only)",
        params: p.clone(),
        data_pages: p.data_pages(),
        dram_pages: p.dram_pages(),
        ops: seq.len() as u64,
        comparisons: compare(&results),
        results,
        bound,
        skipped,
    })
}

#[cfg(feature = "foyer")]
fn run_foyer(p: &PagesParams, seq: &[u32], trial: usize) -> Result<PagesResult> {
    foyer_peer::run(p, seq, trial)
}

#[cfg(not(feature = "foyer"))]
fn run_foyer(_: &PagesParams, _: &[u32], _: usize) -> Result<PagesResult> {
    Err(Error::new(
        ErrorKind::Unsupported,
        "foyer: built without the foyer feature",
    ))
}

/// Reads page `q` of the data file into `buf` with O_DIRECT (a foyer miss's
/// source of truth).
pub fn read_source(file: &File, p: &PagesParams, q: u64, buf: &mut AlignedBuf) -> Result<()> {
    file.read_exact_at(&mut buf[..p.page_size], q * p.page_size as u64)
        .map_err(|e| Error::io(format!("reading page {q} of the data file"), e))
}

/// Opens the data file for O_DIRECT reads.
pub fn open_direct(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::io(format!("opening {} (O_DIRECT)", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(config: &str, trial: usize, ops: f64, p99: f64, disk: u64) -> PagesResult {
        PagesResult {
            config: config.into(),
            trial,
            ops_per_sec: ops,
            p50_us: 1.0,
            p99_us: p99,
            disk_bytes_read: disk,
            disk_bytes_written: 0,
            fast_tier_hit_rate: 0.5,
            wrong_reads: 0,
            lost: 0,
            seconds: 1.0,
            note: String::new(),
        }
    }

    #[test]
    fn comparisons_pair_the_runs_of_each_trial() {
        let results = [
            result("strata", 0, 300.0, 10.0, 30),
            result("os-random", 0, 100.0, 20.0, 10),
            result("strata", 1, 200.0, 30.0, 40),
            result("os-random", 1, 200.0, 25.0, 20),
            result("strata", 2, 100.0, 20.0, 50),
            result("os-random", 2, 50.0, 15.0, 20),
            // A peer's trial strata did not run pairs with nothing.
            result("os-random", 3, 1.0, 1.0, 1),
        ];
        let c = compare(&results);
        assert_eq!(c.len(), 1);
        let c = &c[0];
        assert_eq!(
            (c.config.as_str(), c.peer.as_str(), c.pairs),
            ("strata", "os-random", 3)
        );
        // Medians 200 against 100; within the pairs 3, 1 and 2.
        assert_eq!(c.ops_ratio, 2.0);
        assert_eq!(c.ops_ratio_pairs, (1.0, 3.0));
        assert_eq!(c.p99_us, (20.0, 20.0));
        assert_eq!(c.p99_lower_pairs, 1);
        assert_eq!(c.disk_read_ratio, Some(2.0));
        // Nothing to compare without a peer.
        assert!(compare(&results[..1]).is_empty());
    }

    fn params(access: Access) -> PagesParams {
        PagesParams {
            data: 64 * 4096,
            dram: 16 * 4096,
            cxl: None,
            page_size: 4096,
            path: PathBuf::from("."),
            access,
            ops: 5000,
            threads: 2,
            read_bytes: 512,
            baselines: false,
            configs: None,
            min_accesses: None,
            policy: default_policy(),
            lower_levels: false,
            trials: 1,
            seed: 7,
        }
    }

    #[test]
    fn content_checks_catch_wrong_pages_and_offsets() {
        let mut page = vec![0u8; 4096];
        fill_page(3, 9, &mut page);
        assert!(check(3, 9, 512, &page[512..1024]));
        assert!(!check(3, 8, 512, &page[512..1024]), "another page");
        assert!(!check(3, 9, 1024, &page[512..1024]), "another offset");
        let mut torn = page[512..1024].to_vec();
        torn[511] ^= 1;
        assert!(!check(3, 9, 512, &torn), "the last word");
    }

    #[test]
    fn sequences_stay_in_range_and_shift_moves_the_hot_set() {
        let p = params(Access::Zipf { alpha: 0.99 });
        let z = sequence(&p).unwrap();
        assert_eq!(z.len(), 5000);
        assert!(z.iter().all(|&x| (x as u64) < p.data_pages()));
        let s = sequence(&params(Access::Shift {
            alpha: 1.2,
            period: 2500,
        }))
        .unwrap();
        let top = |xs: &[u32]| {
            let mut c = std::collections::HashMap::new();
            for &x in xs {
                *c.entry(x).or_insert(0) += 1;
            }
            c.into_iter().max_by_key(|&(_, n)| n).unwrap().0
        };
        assert_ne!(top(&s[..2500]), top(&s[2500..]), "the hot page moved");
        // A re-drawn hot set is an independent draw: the quarter of the
        // pages hot in one period takes a share of the next period's reads
        // near a quarter every time — never most of them (the old ranking
        // rotated by a few hundred ranks), never almost none (rotated so
        // that the old hot pages fall in the tail).
        let mut q = params(Access::Shift {
            alpha: 0.99,
            period: 50_000,
        });
        q.data = 4096 * 4096;
        q.ops = 21 * 50_000;
        let n = q.data_pages() as usize;
        let s = sequence(&q).unwrap();
        let periods: Vec<&[u32]> = s.chunks(50_000).collect();
        for (k, w) in periods.windows(2).enumerate() {
            let mut c = vec![0u32; n];
            for &x in w[0] {
                c[x as usize] += 1;
            }
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(c[i]));
            let mut hot = vec![false; n];
            for &i in &order[..n / 4] {
                hot[i] = true;
            }
            let kept = w[1].iter().filter(|&&x| hot[x as usize]).count();
            let share = kept as f64 / w[1].len() as f64;
            assert!(
                (0.1..0.45).contains(&share),
                "re-draw {k}: the last hot quarter takes {share:.3} of the reads (independent: about 0.25)"
            );
        }
        let b = bound(&z, 16, 64).unwrap();
        assert!(b.belady_misses < 5000 && b.static_optimum_hit_rate > 0.25);
        // Six online references, none below MIN; the best is their least.
        assert_eq!(b.references.len(), 6);
        assert!(b.references.iter().all(|(_, m)| *m >= b.belady_misses));
        let least = b.references.iter().map(|(_, m)| *m).min().unwrap();
        assert_eq!(b.best_reference.1, least);
        assert!(
            least > b.belady_misses,
            "an online policy misses more than MIN here"
        );
    }

    #[test]
    fn bad_arguments_are_refused() {
        for s in [
            "zipf",
            "zipf:-1",
            "zipf:0",
            "shift:0:10",
            "shift:1:0",
            "file:",
            "uniform",
        ] {
            assert!(s.parse::<Access>().is_err(), "{s}");
        }
        let mut p = params(Access::Zipf { alpha: 1.0 });
        p.dram = p.data;
        assert!(p.check().is_err());
        let mut p = params(Access::Zipf { alpha: 1.0 });
        p.read_bytes = 12;
        assert!(p.check().is_err());
    }

    #[test]
    fn strata_reads_every_byte_right() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = params(Access::Zipf { alpha: 0.99 });
        p.path = dir.path().to_path_buf();
        let seq = sequence(&p).unwrap();
        for on_read in [false, true] {
            let r = run_strata(&p, &seq, 0, Some(on_read)).unwrap();
            assert_eq!(r.wrong_reads, 0, "on_read {on_read}");
            assert_eq!(r.lost, 0);
            assert!(r.fast_tier_hit_rate > 0.0 && r.fast_tier_hit_rate <= 1.0);
        }
    }
}
