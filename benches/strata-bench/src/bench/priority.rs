//! `strata bench priority`: what a demand move costs while background
//! eviction has gigabytes of demotions queued, against the same move on an
//! idle runtime — the migration engine's priorities measured on real DRAM
//! and disk.
//!
//! One runtime, DRAM (host) above NVMe, no device tier, watermarks at
//! 1% / 2% of DRAM so that background eviction demotes nearly everything
//! written. A probe buffer's pages live on NVMe; each probe op is a
//! demand promotion (`pin` of one NVMe page into DRAM: a read on the
//! NVMe→DRAM lane) and a demand demotion (`evict` of that page back to
//! NVMe: a write on the DRAM→NVMe lane, the lane the background demotions
//! are queued on). Phases alternate: *busy* — a fresh buffer of `--data`
//! bytes is materialized in DRAM under a pin, the pin ends (the whole
//! buffer becomes the reclaimer's backlog at once), and the probe runs while the reclaimer's
//! backlog (DRAM in use above the low watermark) is at least half of it;
//! *idle* — the backlog gone, the same probe. Every probe page is checked
//! against its content after its round trip.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::random::Rng;
use strata::error::{Error, Result};
use strata::runtime::{Runtime, Watermarks};
use strata::tier::{NvmeConfig, Tier};

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityParams {
    /// Bytes written per busy phase (the backlog).
    pub data: u64,
    /// DRAM for strata's host tier (at least `data` and the probe).
    pub dram: u64,
    /// Page size.
    pub page_size: usize,
    /// Directory of the NVMe tier.
    pub path: PathBuf,
    /// Probe ops per phase, at most.
    pub ops: usize,
    /// Busy and idle phases each, interleaved.
    pub trials: usize,
    /// Seed of the content and of the probe's pages.
    pub seed: u64,
}

/// Pages of the probe buffer.
const PROBE_PAGES: usize = 256;

impl PriorityParams {
    /// Checks the parameters, naming the first bad one.
    pub fn check(&self) -> Result<()> {
        let ps = self.page_size as u64;
        if self.data < 64 * ps || self.data % ps != 0 {
            return Err(Error::invalid(format!(
                "--data {} must be a whole number of pages, at least 64",
                self.data
            )));
        }
        let need = self.data.saturating_add(2 * PROBE_PAGES as u64 * ps);
        if self.dram < need {
            return Err(Error::invalid(format!(
                "--dram {} must hold --data and the probe: at least {need} bytes",
                self.dram
            )));
        }
        if self.ops == 0 || self.trials == 0 {
            return Err(Error::invalid("--ops and --trials must be positive"));
        }
        // --dram defaults to the data and some room: the data is what a
        // user sets then.
        crate::machine::check_memory(
            format_args!("--data {} (--dram {})", self.data, self.dram),
            "the DRAM tier, which holds the data",
            self.dram,
        )
    }
}

/// Latencies of one kind of probe op in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Ops measured.
    pub n: usize,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
}

impl Latency {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            if v.is_empty() {
                0.0
            } else {
                v[((v.len() - 1) as f64 * q).round() as usize]
            }
        };
        Self {
            n: v.len(),
            p50_us: at(0.5),
            p99_us: at(0.99),
        }
    }
}

/// One phase.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// "idle" or "busy".
    pub phase: &'static str,
    /// Trial number.
    pub trial: usize,
    /// `pin` of an NVMe page into DRAM.
    pub promote: Latency,
    /// `evict` of a DRAM page to NVMe.
    pub demote: Latency,
    /// Median reclaim backlog while the probe ran, bytes.
    pub backlog_bytes: u64,
    /// Reclaim batches the engine ran during the phase.
    pub reclaim_batches: u64,
    /// Mean time a demand batch of this phase's probes waited in its
    /// lane's queue, microseconds.
    pub demand_queued_us: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityReport {
    /// No device is involved: DRAM and the disk.
    pub backend: &'static str,
    /// What ran.
    pub params: PriorityParams,
    /// Every phase, in the order run.
    pub phases: Vec<Phase>,
    /// Medians over the trials: busy over idle, promote and demote p50.
    pub ratio_promote_p50: f64,
    /// See `ratio_promote_p50`.
    pub ratio_demote_p50: f64,
    /// Busy over idle, p99 of each.
    pub ratio_promote_p99: f64,
    /// See `ratio_promote_p99`.
    pub ratio_demote_p99: f64,
}

fn content(seed: u64, page: usize, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

fn engine(rt: &Runtime, priority: &str) -> (u64, f64) {
    rt.stats()
        .engine
        .iter()
        .find(|p| p.priority == priority)
        .map_or((0, 0.0), |p| (p.batches, p.mean_queued_us))
}

/// The mean of what was added between two (count, mean) readings of a
/// running mean; 0 when nothing was.
fn mean_since((n0, m0): (u64, f64), (n1, m1): (u64, f64)) -> f64 {
    if n1 <= n0 {
        return 0.0;
    }
    ((m1 * n1 as f64 - m0 * n0 as f64) / (n1 - n0) as f64).max(0.0)
}

/// Bytes of DRAM in use above the low watermark.
fn backlog(rt: &Runtime, low_pages: u64) -> u64 {
    let s = rt.stats();
    let host = s.tiers.iter().find(|t| t.tier == Tier::Host);
    host.map_or(0, |t| (t.used_pages as u64).saturating_sub(low_pages)) * s.page_size as u64
}

/// Runs the benchmark.
pub fn run(p: &PriorityParams, progress: &mut dyn FnMut(&str, f64)) -> Result<PriorityReport> {
    p.check()?;
    let ps = p.page_size;
    let host_pages = p.dram / ps as u64;
    let low = Watermarks::new(0.01, 0.02);
    let low_pages = (host_pages as f64 * low.low) as u64;
    let nvme = p.data + 4 * PROBE_PAGES as u64 * ps as u64 + (64 << 20);
    // The path as every NVMe tier takes it (a directory, a new file's name
    // or a block device), checked before anything is created.
    let nvme = NvmeConfig::new(&p.path, nvme, ps);
    nvme.check().map_err(|e| e.context("--path"))?;
    let rt = Runtime::builder()
        .page_size(ps)
        .host(p.dram)
        .nvme(nvme)
        .watermarks(low)
        .build()?;
    let probe = rt.alloc((PROBE_PAGES * ps) as u64)?;
    for page in 0..PROBE_PAGES {
        probe.write((page * ps) as u64, &content(p.seed, page, ps))?;
    }
    probe.evict(0..probe.len(), Tier::Nvme)?;
    let mut rng = Rng::new(p.seed);
    let mut out = vec![0u8; ps];
    let mut phases = Vec::new();
    let steps = (2 * p.trials) as f64;
    for trial in 0..p.trials {
        for phase in ["busy", "idle"] {
            progress(
                phase,
                (2 * trial + usize::from(phase == "idle")) as f64 / steps,
            );
            let (reclaim_before, _) = engine(&rt, "reclaim");
            let data = if phase == "busy" {
                // Materialized in DRAM under a pin, so that background
                // eviction cannot start before all of it is there; the pin's
                // end hands the reclaimer the whole backlog at once.
                let b = rt.alloc(p.data)?;
                drop(b.pin(0..b.len(), Tier::Host)?);
                Some(b)
            } else {
                // The backlog of the busy phase gone.
                let start = Instant::now();
                while rt.stats().in_flight_moves > 0 || backlog(&rt, low_pages) > p.data / 64 {
                    if start.elapsed() > Duration::from_secs(600) {
                        return Err(Error::invalid(
                            "background eviction did not finish in 10 minutes",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                None
            };
            // The demand lane's queueing during this phase's probes alone
            // (the engine's figure is a mean since the runtime started).
            let demand_before = engine(&rt, "demand");
            let (mut promote, mut demote, mut backlogs) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..p.ops {
                let b = backlog(&rt, low_pages);
                if phase == "busy" && b < p.data / 2 {
                    break;
                }
                backlogs.push(b);
                let page = rng.below(PROBE_PAGES as u64) as usize;
                let range = (page * ps) as u64..((page + 1) * ps) as u64;
                let t = Instant::now();
                let pin = probe.pin(range.clone(), Tier::Host)?;
                promote.push(t.elapsed().as_secs_f64() * 1e6);
                drop(pin);
                let t = Instant::now();
                probe.evict(range.clone(), Tier::Nvme)?;
                demote.push(t.elapsed().as_secs_f64() * 1e6);
                probe.read(range.start, &mut out)?;
                if out != content(p.seed, page, ps) {
                    return Err(Error::new(
                        strata::ErrorKind::Corrupted,
                        format!("probe page {page} read back wrong after its round trip"),
                    ));
                }
            }
            backlogs.sort_unstable();
            let (reclaim_after, _) = engine(&rt, "reclaim");
            phases.push(Phase {
                phase,
                trial,
                promote: Latency::of(promote),
                demote: Latency::of(demote),
                backlog_bytes: backlogs.get(backlogs.len() / 2).copied().unwrap_or(0),
                reclaim_batches: reclaim_after - reclaim_before,
                demand_queued_us: mean_since(demand_before, engine(&rt, "demand")),
            });
            drop(data);
        }
    }
    rt.check()?;
    progress("done", 1.0);
    let ratio = |f: &dyn Fn(&Phase) -> f64| {
        let mut r: Vec<f64> = (0..p.trials)
            .map(|t| {
                let of = |name| phases.iter().find(|x| x.trial == t && x.phase == name);
                match (of("busy"), of("idle")) {
                    (Some(b), Some(i)) if f(i) > 0.0 => f(b) / f(i),
                    _ => f64::NAN,
                }
            })
            .collect();
        r.sort_by(f64::total_cmp);
        // The median (of an even count, the mean of the middle two).
        let n = r.len();
        if n % 2 == 1 {
            r[n / 2]
        } else {
            (r[n / 2 - 1] + r[n / 2]) / 2.0
        }
    };
    Ok(PriorityReport {
        backend: "none (DRAM and disk only)",
        ratio_promote_p50: ratio(&|x| x.promote.p50_us),
        ratio_demote_p50: ratio(&|x| x.demote.p50_us),
        ratio_promote_p99: ratio(&|x| x.promote.p99_us),
        ratio_demote_p99: ratio(&|x| x.demote.p99_us),
        params: p.clone(),
        phases,
    })
}
