//! `strata bench io`: the NVMe store measured the way fio measures a disk.
//!
//! Like fio it lays the file out (writes every block) before the timed
//! phase, walks random patterns as a random permutation per pass (fio's
//! random map: each block once per pass), keeps `qd` operations in flight,
//! and counts completed operations over the wall time of the timed phase.
//! Unlike fio, every page goes through the store: writes are checksummed
//! and every read is verified — the cost a strata user pays. The store
//! keeps 1/64 of its slots (at most 64) in reserve for copy-then-commit
//! writes; the benchmark covers the rest of the file.

use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::random::Rng;
use strata::error::{Error, Result};
use strata::io::{AlignedBuf, EngineChoice, IoOp};
use strata::lowlevel::NvmeCompletion;
use strata::tier::{NvmeConfig, NvmeStore, PageStore, Slot};

/// Access pattern, as fio's `rw=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
}

impl Pattern {
    fn is_read(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::Read)
    }
    fn is_random(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::RandWrite)
    }
    /// fio's name for the pattern.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::Read => "read",
            Pattern::Write => "write",
        }
    }
}

impl FromStr for Pattern {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "randread" => Ok(Pattern::RandRead),
            "randwrite" => Ok(Pattern::RandWrite),
            "read" => Ok(Pattern::Read),
            "write" => Ok(Pattern::Write),
            _ => Err(Error::invalid(format!(
                "unknown pattern {s:?} (use randread, randwrite, read or write)"
            ))),
        }
    }
}

/// Parameters of one run.
#[derive(Debug, Clone, Serialize)]
pub struct IoParams {
    /// Directory, new file name or block device for the store.
    pub path: std::path::PathBuf,
    /// Bytes of the file.
    pub size: u64,
    /// Access pattern.
    pub pattern: Pattern,
    /// Block size (the store's page size).
    pub bs: usize,
    /// Operations in flight (at most the number of blocks in the file).
    pub qd: usize,
    /// Length of the timed phase.
    pub seconds: f64,
    /// Engine.
    pub engine: EngineChoice,
    /// Seed of the random pattern.
    pub seed: u64,
}

/// What `strata bench io` reports (the JSON keys are a stable interface).
#[derive(Debug, Clone, Serialize)]
pub struct IoReport {
    /// No device is involved in this benchmark.
    pub backend: &'static str,
    /// The engine used.
    pub engine: String,
    /// Access pattern.
    pub pattern: &'static str,
    /// Block size.
    pub bs: usize,
    /// Queue depth used: `--qd`, or the number of blocks if smaller.
    pub qd: usize,
    /// File size.
    pub size: u64,
    /// Operations per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Mean completion latency, microseconds.
    pub mean_latency_us: f64,
    /// Operations completed in the timed phase.
    pub ops: u64,
    /// Length of the timed phase, seconds.
    pub seconds: f64,
    /// User CPU time in the timed phase, % of one core (as fio's usr_cpu).
    pub user_cpu_pct: f64,
    /// System CPU time in the timed phase, % of one core (as fio's sys_cpu).
    pub sys_cpu_pct: f64,
    /// What backed the store.
    pub target: String,
    /// All parameters.
    pub params: IoParams,
}

/// Runs the benchmark; `progress` is told the fraction done now and then.
pub fn run(params: &IoParams, progress: &mut dyn FnMut(&str, f64)) -> Result<IoReport> {
    strata::size::check_page_size(params.bs).map_err(|e| e.context("--bs"))?;
    let duration = Duration::try_from_secs_f64(params.seconds)
        .ok()
        .filter(|d| !d.is_zero() && *d <= Duration::from_secs(7 * 86400))
        .ok_or_else(|| {
            Error::invalid(format!(
                "--seconds {} must be a positive number of at most a week",
                params.seconds
            ))
        })?;
    if params.size == 0 {
        return Err(Error::invalid("--size is zero"));
    }
    if params.size % params.bs as u64 != 0 {
        return Err(Error::invalid(format!(
            "--size {} is not a multiple of --bs {}",
            params.size, params.bs
        )));
    }
    let config = NvmeConfig {
        engine: params.engine,
        queue_depth: params.qd,
        ..NvmeConfig::new(params.path.clone(), params.size, params.bs)
    };
    const MAX_BUFFER_BYTES: u64 = 1 << 30;
    if (params.qd.max(64) as u64).saturating_mul(params.bs as u64) > MAX_BUFFER_BYTES
        && (params.qd as u64).saturating_mul(params.bs as u64) > MAX_BUFFER_BYTES / 4
    {
        return Err(Error::invalid(format!(
            "--qd {} x --bs {} needs more than 1 GiB of buffers in flight",
            params.qd, params.bs
        )));
    }
    let store = NvmeStore::new(&config)?;
    let pages = store.capacity_pages() as usize;
    // The session API keeps each slot with its request, so no more than
    // `pages` operations can be in flight, whatever --qd says.
    let depth = params.qd.min(pages);
    let mut slots: Vec<Option<Slot>> = (0..pages)
        .map(|_| store.alloc().map(Some))
        .collect::<Result<_>>()?;
    let mut rng = Rng::new(params.seed);
    // Buffers hold random bytes, and every write stamps a counter into its
    // page (fio's scramble_buffers): a virtual disk that detects zero or
    // duplicate blocks must not see any, or reads would measure its shortcut.
    let new_buffers = |n: usize, rng: &mut Rng| {
        (0..n)
            .map(|_| {
                let mut b = store.buffer()?;
                rng.fill(&mut b[..]);
                Ok(b)
            })
            .collect::<Result<Vec<AlignedBuf>>>()
    };
    let mut stamp = 0u64;
    let mut scramble = |buf: &mut AlignedBuf| {
        stamp += 1;
        buf[..8].copy_from_slice(&stamp.to_le_bytes());
    };

    // Layout: write every block once, sequentially, as fio does (at a
    // depth of at least 64, so that a QD-1 run does not spend minutes here).
    let layout_depth = params.qd.max(64).min(pages);
    let mut bufs = new_buffers(layout_depth, &mut rng)?;
    let mut session = store.session_with_depth(layout_depth)?;
    super::sequential_pass(
        &mut session,
        &mut slots,
        &mut bufs,
        IoOp::Write,
        &mut scramble,
        &mut |laid| {
            if laid % 256 == 0 {
                progress("layout", laid as f64 / pages as f64);
            }
        },
    )?;
    drop(session);
    // Fresh buffers for the timed phase, taken while the layout's are
    // returned to the pool, so they are the pool's (registered) buffers.
    drop(bufs);
    let mut bufs = new_buffers(depth, &mut rng)?;

    // The timed phase.
    let mut session = store.session_with_depth(depth)?;
    let mut done: Vec<NvmeCompletion> = Vec::with_capacity(depth);
    let mut order: Vec<u32> = (0..pages as u32).collect();
    let mut cursor = 0usize;
    let mut next_index = |rng: &mut Rng, slots: &mut [Option<Slot>]| -> Option<usize> {
        // A slot still in flight is skipped (only possible when the file
        // has no more blocks than the queue depth).
        for _ in 0..pages {
            if cursor == 0 && params.pattern.is_random() {
                rng.shuffle(&mut order);
            }
            let i = order[cursor] as usize;
            cursor = (cursor + 1) % pages;
            if slots[i].is_some() {
                return Some(i);
            }
        }
        None
    };
    let mut started: Vec<Instant> = vec![Instant::now(); pages];
    let mut ops = 0u64;
    let mut latency_total = Duration::ZERO;
    let cpu0 = strata::lowlevel::process_cpu_time();
    let t0 = Instant::now();
    let mut last_progress = t0;
    loop {
        let now = Instant::now();
        let submitting = now.duration_since(t0) < duration;
        while submitting && session.in_flight() < session.depth() {
            let Some(i) = next_index(&mut rng, &mut slots) else {
                break;
            };
            let slot = slots[i].take().expect("slot present");
            let mut buf = bufs.pop().expect("a buffer per queue slot");
            started[i] = now;
            let r = if params.pattern.is_read() {
                session.submit_read(slot, buf, i as u64)
            } else {
                scramble(&mut buf);
                session.submit_write(slot, buf, i as u64)
            };
            r.map_err(|r| r.error)?;
        }
        if session.in_flight() == 0 {
            break;
        }
        session.reap(1, &mut done)?;
        let now = Instant::now();
        for c in done.drain(..) {
            c.result?;
            let i = c.tag as usize;
            if now.duration_since(t0) <= duration {
                ops += 1;
                latency_total += now.duration_since(started[i]);
            }
            slots[i] = Some(c.slot);
            bufs.push(c.buf);
        }
        if now.duration_since(last_progress) > Duration::from_millis(200) {
            last_progress = now;
            progress(
                params.pattern.name(),
                (now.duration_since(t0).as_secs_f64() / params.seconds).min(1.0),
            );
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = strata::lowlevel::process_cpu_time();
    let elapsed = params.seconds.min(wall);
    drop(session);
    for slot in slots.into_iter().flatten() {
        store.free(slot)?;
    }
    if ops == 0 {
        return Err(Error::invalid(format!(
            "--seconds {}: no operation completed in that time; give it longer",
            params.seconds
        )));
    }
    let iops = ops as f64 / elapsed;
    Ok(IoReport {
        backend: "none (storage only)",
        engine: store.engine().to_string(),
        pattern: params.pattern.name(),
        bs: params.bs,
        qd: depth,
        size: params.size,
        iops,
        bytes_per_sec: iops * params.bs as f64,
        mean_latency_us: if ops > 0 {
            latency_total.as_secs_f64() * 1e6 / ops as f64
        } else {
            0.0
        },
        ops,
        seconds: elapsed,
        user_cpu_pct: 100.0 * (cpu1.0 - cpu0.0).as_secs_f64() / wall,
        sys_cpu_pct: 100.0 * (cpu1.1 - cpu0.1).as_secs_f64() / wall,
        target: store.description().to_string(),
        params: params.clone(),
    })
}
