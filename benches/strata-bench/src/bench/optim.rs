//! `strata bench optim`: steps of the offloaded Adam with its states in
//! host DRAM, CXL memory (emulated where the machine has none) or NVMe,
//! beside the limits in the same run: this machine's memcpy bandwidth and,
//! for NVMe, the store's sequential read bandwidth at the same page size
//! and queue depth. The update runs on the CPU or, with `--update cuda`, on
//! a GPU (`kernels/adam.cu`).
//!
//! Every step is a framework's: the parameters (of `--dtype`: fp32, bf16
//! or fp16, with gradients of the same type) are written back each step
//! beside the fp32 masters and moments in the tier. With `--roofline` the
//! run also measures a STREAM-style triad over arrays the size of the
//! states, on every thread, and reports the step's fraction of the time
//! that bandwidth needs for the bytes a step must move.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use rayon::prelude::*;
use strata::error::{Error, Result};
use strata::io::{AlignedBuf, IoOp};
use strata::offload::optim::{
    bf16, f16, Element, Importance, OffloadedAdam, OptimConfig, StateTier, Updater,
};
use strata::runtime::Runtime;
use strata::tier::{CxlConfig, CxlMode, NvmeConfig, NvmeStore, PageStore};

/// Parameters.
#[derive(Debug, Clone, Serialize)]
pub struct OptimParams {
    /// Parameters (fp32).
    pub params: usize,
    /// "host", "cxl" or "nvme".
    pub tier: String,
    /// Chunk bytes per state array.
    pub chunk: usize,
    /// Directory for the NVMe states.
    pub path: PathBuf,
    /// Timed steps (after one untimed).
    pub steps: usize,
    /// Where the update runs.
    pub update: Updater,
    /// Importance-aware mode (ZenFlow), or plain.
    pub importance: Option<Importance>,
    /// The states in a runtime's tier ([`OffloadedAdam::on`]: pages of
    /// `chunk` bytes, the runtime's own NVMe file in `path`) rather than
    /// in the optimizer's private runtime (the same step path either way).
    pub shared: bool,
    /// The parameters' and gradients' type: "float32", "bfloat16" or "float16".
    pub dtype: String,
    /// Measure the memory-bandwidth roofline (a triad) in the same run.
    pub roofline: bool,
}

/// The memory-bandwidth roofline of a step.
#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    /// STREAM-style triad (a = b + s·c, 12 bytes an element counted) on
    /// every thread over arrays as large as the states: the best of 5.
    pub triad_bytes_per_sec: f64,
    /// Bytes per parameter a step must move at the least: the fp32 master
    /// and both moments read and written (24) and the gradient read, plus
    /// for a bf16 or fp16 parameter its rounding written (fp32: 28; bf16
    /// and fp16: 28).
    pub bytes_per_param: u64,
    /// Bytes per parameter this step moves: as above; in importance mode
    /// or with the CUDA updater, for fp32, plus the parameter written apart
    /// from its master (32). fp32 parameters are otherwise their own
    /// master (the aliased step, 28).
    pub moved_per_param: u64,
    /// Seconds the triad's bandwidth needs for `bytes_per_param`.
    pub bound_seconds: f64,
    /// `bound_seconds / step_seconds`: 1 is the roofline.
    pub fraction: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct OptimReport {
    /// Where the update ran: "cpu" or "cuda".
    pub backend: &'static str,
    /// The GPU it ran on ("GPU 0 (name)"), for `cuda`.
    pub gpu: Option<String>,
    /// Where the states lived.
    pub tier: &'static str,
    /// Whether that tier was emulated (CXL without a CPU-less node).
    pub emulated: bool,
    /// Parameters.
    pub params: OptimParams,
    /// Bytes of weights and moments.
    pub state_bytes: u64,
    /// Timed steps (with importance-aware mode, whole windows).
    pub timed_steps: usize,
    /// Mean seconds per timed step.
    pub step_seconds: f64,
    /// Mean state bytes read plus written per timed step.
    pub state_bytes_per_step: f64,
    /// State bytes read plus written per second of step time.
    pub bytes_per_sec: f64,
    /// Mean seconds per step the update waited on I/O.
    pub io_wait_seconds: f64,
    /// Single-thread memcpy bandwidth of this machine, bytes/s (each byte
    /// copied counted once): a reference beside the step's rate, not a
    /// bound on it (the step runs on every thread and counts what it reads
    /// and what it writes; `--roofline` gives the memory bound).
    pub memcpy_bytes_per_sec: f64,
    /// `bytes_per_sec / memcpy_bytes_per_sec`.
    pub ratio_to_memcpy: f64,
    /// The NVMe store's sequential read bandwidth (NVMe tier only).
    pub nvme_seq_read_bytes_per_sec: Option<f64>,
    /// The NVMe store's sequential write bandwidth, over pages already
    /// written, as a step's write-back is (NVMe tier only).
    pub nvme_seq_write_bytes_per_sec: Option<f64>,
    /// The disk's time for a step: its state bytes read at the sequential
    /// read rate plus those written at the sequential write rate, one after
    /// the other, seconds (NVMe tier only). A disk that serves reads and
    /// writes at once can beat it.
    pub nvme_bound_seconds: Option<f64>,
    /// `nvme_bound_seconds / step_seconds`: the step's fraction of the
    /// disk's time (above 1 where the disk overlapped reads and writes).
    pub nvme_fraction: Option<f64>,
    /// CPU threads the host-tier update used (cpu).
    pub threads: usize,
    /// The parameters' type.
    pub dtype: &'static str,
    /// The memory-bandwidth roofline (`--roofline`).
    pub roofline: Option<Roofline>,
}

/// Runs the benchmark.
pub fn run(p: &OptimParams, progress: &mut dyn FnMut(&str, f64)) -> Result<OptimReport> {
    if p.params == 0 || p.steps == 0 {
        return Err(Error::invalid("--params and --steps must be at least 1"));
    }
    strata::size::check_page_size(p.chunk).map_err(|e| e.context("--chunk"))?;
    let tier = match p.tier.as_str() {
        "host" => StateTier::Host,
        "cxl" => StateTier::Cxl,
        "nvme" => StateTier::Nvme(p.path.clone()),
        t => {
            return Err(Error::invalid(format!(
                "--tier {t:?}: use host, cxl or nvme"
            )))
        }
    };
    let chunk_elems = p.chunk / 4;
    if p.params < chunk_elems {
        // The tier moves whole chunks: a step of fewer parameters would be
        // timed on one chunk's padding, its bandwidth a fiction.
        return Err(Error::invalid(format!(
            "--params {} is less than one chunk of state (--chunk {} holds {chunk_elems} parameters)",
            p.params,
            strata::size::format_size(p.chunk as u64)
        )));
    }
    let state_bytes = (p.params.div_ceil(chunk_elems) as u64).saturating_mul(3 * p.chunk as u64);
    let params = p.params as u64;
    // Peak: the fp32 weights and gradients the run starts from and their
    // copies in --dtype (16 bytes a parameter at most) beside the states;
    // the NVMe tier keeps only those arrays in memory.
    let (memory, what) = match tier {
        StateTier::Nvme(_) => (params.saturating_mul(16), "weights and gradients"),
        _ => (
            state_bytes.saturating_add(params.saturating_mul(16)),
            "states, weights and gradients",
        ),
    };
    let dtype = match p.dtype.as_str() {
        "float32" | "f32" | "fp32" => "float32",
        "bfloat16" | "bf16" => "bfloat16",
        "float16" | "f16" | "fp16" => "float16",
        d => {
            return Err(Error::invalid(format!(
                "--dtype {d:?}: use f32, bf16 or f16"
            )))
        }
    };
    crate::machine::check_memory(format!("--params {}", p.params), what, memory)?;
    progress("memcpy", 0.0);
    let memcpy = strata::lowlevel::local_memcpy_bandwidth();
    let nvme_seq = if matches!(tier, StateTier::Nvme(_)) {
        progress("nvme sequential read and write", 0.05);
        Some(seq_read_write(&p.path, p.chunk, state_bytes.min(1 << 30))?)
    } else {
        None
    };
    progress("layout", 0.2);
    let w: Vec<f32> = (0..p.params).map(|i| ((i % 1000) as f32) * 1e-3).collect();
    let mut cfg = OptimConfig::new(tier);
    cfg.chunk_bytes = p.chunk;
    cfg.updater = p.update;
    cfg.importance = p.importance;
    // A shared runtime: its tier holds the states (with a 64 MiB host tier
    // beside an NVMe one, as a user's runtime might have).
    let runtime = if p.shared {
        let margin = 64 << 20;
        let mut b = Runtime::builder().page_size(p.chunk);
        b = match p.tier.as_str() {
            "host" => b.host(state_bytes + margin),
            "cxl" => b.host(margin).cxl(CxlConfig::new(
                CxlMode::Emulated,
                state_bytes + margin,
                p.chunk,
            )),
            // Room for the store's reserve (1/64 of its slots), in pages.
            _ => b.host(margin).nvme(NvmeConfig::new(
                &p.path,
                (state_bytes + state_bytes / 32 + margin).next_multiple_of(p.chunk as u64),
                p.chunk,
            )),
        };
        Some(b.build()?)
    } else {
        None
    };
    let mut opt = match &runtime {
        Some(rt) => OffloadedAdam::on(rt, &w, cfg)?,
        None => OffloadedAdam::new(&w, cfg)?,
    };
    let mut w: Vec<f32> = (0..p.params).map(|i| ((i % 1000) as f32) * 1e-3).collect();
    let g: Vec<f32> = (0..p.params)
        .map(|i| (((i * 7) % 13) as f32 - 6.0) * 1e-3)
        .collect();
    // Importance-aware mode: whole windows (the untimed step was a flush,
    // so every `every`-th timed step is one).
    let steps = match p.importance {
        Some(imp) => p.steps.max(1).div_ceil(imp.every as usize) * imp.every as usize,
        None => p.steps,
    };
    // fp32 parameters are their own master (as strata.optim runs them):
    // the aliased step, 28 bytes a parameter; in CXL or on NVMe only the
    // moments stream.
    let alias = dtype == "float32" && p.importance.is_none() && p.update == Updater::Cpu;
    let mut timed = |progress: &mut dyn FnMut(&str, f64)| -> Result<Timed> {
        match dtype {
            "bfloat16" => time_steps::<bf16>(&mut opt, &w, &g, steps, false, progress),
            "float16" => time_steps::<f16>(&mut opt, &w, &g, steps, false, progress),
            _ => time_steps::<f32>(&mut opt, &w, &g, steps, alias, progress),
        }
    };
    let Timed {
        secs,
        wait,
        read,
        written,
    } = timed(progress)?;
    let bytes = read + written;
    w.clear();
    w.shrink_to_fit();
    let roofline = if p.roofline {
        progress("triad", 0.95);
        let triad = triad_bandwidth(state_bytes as usize / 12);
        let (least, moved) = if dtype == "float32" && !alias {
            (28, 32)
        } else {
            (28, 28)
        };
        let bound = (least * p.params as u64) as f64 / triad;
        Some(Roofline {
            triad_bytes_per_sec: triad,
            bytes_per_param: least,
            moved_per_param: moved,
            bound_seconds: bound,
            fraction: bound / (secs / steps as f64).max(1e-12),
        })
    } else {
        None
    };
    progress("done", 1.0);
    let bps = bytes as f64 / secs.max(1e-12);
    let nvme_bound = nvme_seq
        .map(|(r, w)| (read as f64 / r.max(1e-12) + written as f64 / w.max(1e-12)) / steps as f64);
    Ok(OptimReport {
        backend: opt.updater().name(),
        gpu: opt.gpu(),
        tier: opt_tier_name(&p.tier),
        emulated: opt.emulated(),
        params: p.clone(),
        state_bytes,
        timed_steps: steps,
        step_seconds: secs / steps as f64,
        state_bytes_per_step: bytes as f64 / steps as f64,
        bytes_per_sec: bps,
        io_wait_seconds: wait / steps as f64,
        memcpy_bytes_per_sec: memcpy,
        ratio_to_memcpy: bps / memcpy,
        nvme_seq_read_bytes_per_sec: nvme_seq.map(|(r, _)| r),
        nvme_seq_write_bytes_per_sec: nvme_seq.map(|(_, w)| w),
        nvme_bound_seconds: nvme_bound,
        nvme_fraction: nvme_bound.map(|b| b / (secs / steps as f64).max(1e-12)),
        threads: rayon::current_num_threads(),
        dtype,
        roofline,
    })
}

/// What the timed steps took, summed over them.
struct Timed {
    secs: f64,
    wait: f64,
    /// State bytes read.
    read: u64,
    /// State bytes written.
    written: u64,
}

/// One untimed step, then `steps` timed ones, a framework's: gradients of
/// `T` in, parameters of `T` written back. Seconds, I/O-wait seconds and
/// state bytes read and written over the timed steps.
fn time_steps<T: Element>(
    opt: &mut OffloadedAdam,
    w: &[f32],
    g: &[f32],
    steps: usize,
    alias: bool,
    progress: &mut dyn FnMut(&str, f64),
) -> Result<Timed> {
    let mut params: Vec<T> = w.iter().map(|&x| T::from_f32(x)).collect();
    let grads: Vec<T> = g.iter().map(|&x| T::from_f32(x)).collect();
    let step = |opt: &mut OffloadedAdam, params: &mut [T]| match T::as_f32_mut(params) {
        Some(w) if alias => opt.step_aliased(&grads, 1.0, w),
        _ => opt.step_mixed(&grads, 1.0, params),
    };
    step(opt, &mut params)?;
    let mut t = Timed {
        secs: 0.0,
        wait: 0.0,
        read: 0,
        written: 0,
    };
    for s in 0..steps {
        progress("steps", 0.3 + 0.65 * s as f64 / steps as f64);
        let st = step(opt, &mut params)?;
        t.secs += st.seconds;
        t.wait += st.io_wait_seconds;
        t.read += st.bytes_read;
        t.written += st.bytes_written;
    }
    Ok(t)
}

/// STREAM's triad, a = b + s·c over `n` fp32 elements an array, on every
/// rayon thread (first-touched by them): bytes per second counting 12 an
/// element, the best of 5 passes.
pub fn triad_bandwidth(n: usize) -> f64 {
    let n = n.max(1 << 20);
    let block = 1 << 16;
    let mut a = vec![0f32; n];
    let mut b = vec![0f32; n];
    let mut c = vec![0f32; n];
    // First touch on the threads that will run the triad.
    b.par_chunks_mut(block).for_each(|x| x.fill(1.0));
    c.par_chunks_mut(block).for_each(|x| x.fill(2.0));
    a.par_chunks_mut(block).for_each(|x| x.fill(0.0));
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        a.par_chunks_mut(block)
            .zip(b.par_chunks(block))
            .zip(c.par_chunks(block))
            .for_each(|((a, b), c)| {
                for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                    *a = b + 3.0 * c;
                }
            });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&a);
    (12 * n) as f64 / best.max(1e-12)
}

fn opt_tier_name(t: &str) -> &'static str {
    match t {
        "host" => "host",
        "cxl" => "cxl",
        _ => "nvme",
    }
}

/// A sequential write pass and a sequential read pass over `bytes` of a
/// fresh store (laid out first, so the write overwrites as a step's
/// write-back does) at page size `page` and the default queue depth, as
/// `strata bench io --pattern write|read` do: (read, write) bytes/s.
fn seq_read_write(dir: &std::path::Path, page: usize, bytes: u64) -> Result<(f64, f64)> {
    let pages = bytes.div_ceil(page as u64).max(64);
    let store = NvmeStore::new(&NvmeConfig::new(
        dir,
        (pages + pages / 63 + 1) * page as u64,
        page,
    ))?;
    let mut slots = Vec::with_capacity(pages as usize);
    for _ in 0..pages {
        slots.push(Some(store.alloc()?));
    }
    let depth = store.queue_depth();
    let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| store.buffer()).collect::<Result<_>>()?;
    let mut session = store.session()?;
    super::sequential_pass(
        &mut session,
        &mut slots,
        &mut bufs,
        IoOp::Write,
        &mut |b| b.fill(0x5a),
        &mut |_| {},
    )?;
    let t = Instant::now();
    super::sequential_pass(
        &mut session,
        &mut slots,
        &mut bufs,
        IoOp::Write,
        &mut |b| b.fill(0xa5),
        &mut |_| {},
    )?;
    let write_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    super::sequential_pass(
        &mut session,
        &mut slots,
        &mut bufs,
        IoOp::Read,
        &mut |_| {},
        &mut |_| {},
    )?;
    let read_secs = t.elapsed().as_secs_f64();
    drop(session);
    for s in slots.into_iter().flatten() {
        store.free(s)?;
    }
    let total = pages as f64 * page as f64;
    Ok((total / read_secs.max(1e-12), total / write_secs.max(1e-12)))
}
