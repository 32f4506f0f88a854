//! An offloaded Adam/AdamW: fp32 master weights and both moments live in
//! host DRAM, (emulated) CXL memory or NVMe, and each `step` streams them
//! through in chunks.
//!
//! State layout: the parameters are cut into chunks of `chunk_bytes / 4`
//! elements; each chunk has three pages (one slot each) — weights, first
//! moment, second moment — in a store whose page size is `chunk_bytes`.
//!
//! How a step moves the state, per tier:
//!
//! - **host**: the CPU reaches DRAM directly, so chunks are updated in
//!   place in their slots, chunks spread over the CPU's threads (rayon).
//!   No staging copy: that is what states in DRAM are for.
//! - **cxl**: three stages on three threads with bounded channels and
//!   three staging sets: a reader copies chunk i+1 out of CXL memory (the
//!   store paces copies when emulated) while the updater works on chunk i
//!   and a writer copies chunk i−1 back.
//! - **nvme**: one [`NvmeSession`](crate::lowlevel::NvmeSession) on the
//!   stepping thread keeps the reads of the next chunks in flight (up to
//!   the queue depth) while chunk i updates, and chunk i's writes drain
//!   behind it; nothing waits for a write until the step's end. Writes go
//!   to the chunk's slots in place: after a failed write the optimizer
//!   refuses further steps (its state is no longer whole).
//!
//! - **a shared runtime** ([`OffloadedAdam::on`]): the states are a
//!   buffer of a runtime the caller also allocates from, placed first in
//!   the configured tier of that runtime and moved by it like any buffer's
//!   pages (the budgets per tier are shared); each chunk's three pages are
//!   read in place wherever they are, updated and written back, chunks in
//!   parallel.
//!
//! "Waited on I/O" is the time the update loop spent blocked waiting for a
//! chunk to arrive (plus, on NVMe, draining the last writes); on a shared
//! runtime, the time in the chunks' reads and writes, summed over the
//! threads.
//!
//! **The update** (the same order of operations for every element, so the
//! result is bitwise that of a plain loop; `t` counts steps from 1, `bc1 =
//! 1 − β1^t` and `bc2 = 1 − β2^t` computed in f64 then rounded to f32):
//!
//! ```text
//! m = β1·m + (1−β1)·g
//! v = β2·v + (1−β2)·(g·g)
//! w = w − lr·((m / bc1) / (sqrt(v / bc2) + ε) + wd·w)      (wd = 0: Adam)
//! ```
//!
//! **Importance-aware mode** (ZenFlow's idea): the steps come in windows
//! of `every` steps. The last step of a window (and the first step ever)
//! is a *flush*: it streams every chunk, as a plain step does, and updates
//! every element once — the resident elements (below) with this step's
//! gradient, the others with the mean of the gradients they accumulated
//! over the window (this step's included) — and then chooses, per chunk,
//! the `fraction` of elements with the largest |g| of this step as the
//! next window's resident set, keeping their weights and moments in host
//! memory beside the optimizer (with `Updater::Cuda` their update runs on
//! the GPU, the compact arrays crossing PCIe each step; keeping them in
//! device memory between steps is not done yet). The other steps of the
//! window touch no state in the tier at all: the resident elements update
//! with their gradient (every step, as plain Adam would), the others add
//! theirs to an accumulator in host memory. A window of `every` steps therefore reads
//! and writes the tier's state once instead of `every` times. Between
//! flushes the resident copy is the truth; [`OffloadedAdam::read_state`]
//! merges it in. (ZenFlow picks its important set periodically too:
//! choosing anew every step would need every chunk every step.)
//!
//! **Where the update runs** ([`Updater`]): on the CPU (a loop the
//! compiler vectorizes; host-tier chunks over rayon's threads), or on a
//! GPU (`--features cuda`: `kernels/adam.cu` through
//! `lowlevel::cuda_adam`). The GPU path takes each chunk as it
//! arrives from its tier, uploads it through pinned staging buffers in
//! tiles, double-buffered on two streams, and copies the results back
//! before the chunk is written back; on host-tier states the tiles of all
//! chunks form one pipeline. The kernel does the same fp32 operations in
//! the same order (no FMA contraction, IEEE division and square root), so
//! both updaters give bitwise the same state.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::io::AlignedBuf;
use crate::runtime::{Buffer, Placement, Runtime};
use crate::sys::Topology;
use crate::tier::nvme::NvmeCompletion;
use crate::tier::{
    CxlConfig, CxlMode, CxlStore, HostConfig, HostStore, NvmeConfig, NvmeStore, PageStore, Slot,
    Tier,
};

/// Adam hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay (AdamW); 0 for Adam.
    pub weight_decay: f32,
}

impl Default for AdamParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The scalars of step `t`.
#[derive(Debug, Clone, Copy)]
pub struct StepScalars {
    /// Hyper-parameters.
    pub p: AdamParams,
    /// 1 − β1^t.
    pub bc1: f32,
    /// 1 − β2^t.
    pub bc2: f32,
}

impl StepScalars {
    /// For step `t` (from 1).
    pub fn new(p: AdamParams, t: u64) -> Self {
        let t = t.min(i32::MAX as u64) as i32;
        Self {
            p,
            bc1: (1.0 - (p.beta1 as f64).powi(t)) as f32,
            bc2: (1.0 - (p.beta2 as f64).powi(t)) as f32,
        }
    }
}

/// The element-wise update over equal-length slices (see the module docs
/// for the exact formula). A plain loop the compiler vectorizes.
pub fn adam_update(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: &StepScalars) {
    let n = w.len().min(m.len()).min(v.len()).min(g.len());
    let (w, m, v, g) = (&mut w[..n], &mut m[..n], &mut v[..n], &g[..n]);
    let AdamParams {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    } = s.p;
    let (c1, c2) = (1.0 - beta1, 1.0 - beta2);
    for i in 0..n {
        let gi = g[i];
        let mi = beta1 * m[i] + c1 * gi;
        let vi = beta2 * v[i] + c2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        w[i] -= lr * ((mi / s.bc1) / ((vi / s.bc2).sqrt() + eps) + weight_decay * w[i]);
    }
}

/// Where the states live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateTier {
    /// Host DRAM.
    Host,
    /// CXL memory: a CPU-less node if there is one, else emulated.
    Cxl,
    /// An NVMe tier in this directory (a disk, not tmpfs).
    Nvme(PathBuf),
}

impl StateTier {
    /// "host", "cxl" or "nvme".
    pub fn name(&self) -> &'static str {
        match self {
            StateTier::Host => "host",
            StateTier::Cxl => "cxl",
            StateTier::Nvme(_) => "nvme",
        }
    }
}

/// Importance-aware mode; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Importance {
    /// Share of each chunk's elements updated every step (0 < f ≤ 1).
    pub fraction: f64,
    /// The rest are updated every this many steps.
    pub every: u64,
}

/// Where the element-wise update runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Updater {
    /// On the CPU (vectorized; host-tier chunks over rayon's threads).
    #[default]
    Cpu,
    /// On GPU 0 with `kernels/adam.cu` (cargo feature `cuda`); building
    /// the optimizer fails with `NoDevice` ("no CUDA device: …") where
    /// there is no GPU, driver or NVRTC.
    Cuda,
}

impl Updater {
    /// "cpu" or "cuda".
    pub fn name(self) -> &'static str {
        match self {
            Updater::Cpu => "cpu",
            Updater::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for Updater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Updater {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Updater::Cpu),
            "cuda" => Ok(Updater::Cuda),
            _ => Err(Error::invalid(format!(
                "unknown updater {s:?} (use cpu or cuda)"
            ))),
        }
    }
}

/// How to build an [`OffloadedAdam`].
#[derive(Debug, Clone)]
pub struct OptimConfig {
    /// Where the states live.
    pub tier: StateTier,
    /// Bytes of one chunk of one state array (the store's page size).
    pub chunk_bytes: usize,
    /// Hyper-parameters.
    pub adam: AdamParams,
    /// Importance-aware mode, or every element every step.
    pub importance: Option<Importance>,
    /// Where the update runs.
    pub updater: Updater,
}

impl OptimConfig {
    /// States in `tier`, 1 MiB chunks, default Adam, plain mode, the
    /// update on the CPU.
    pub fn new(tier: StateTier) -> Self {
        Self {
            tier,
            chunk_bytes: 1 << 20,
            adam: AdamParams::default(),
            importance: None,
            updater: Updater::Cpu,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StepStats {
    /// Wall seconds of the step.
    pub seconds: f64,
    /// State bytes read.
    pub bytes_read: u64,
    /// State bytes written.
    pub bytes_written: u64,
    /// Seconds the update waited for I/O.
    pub io_wait_seconds: f64,
}

enum Store {
    Host(HostStore),
    Cxl(CxlStore),
    Nvme(NvmeStore),
    /// A buffer of a runtime shared with others ([`OffloadedAdam::on`]):
    /// chunk `c`'s weights, first and second moments are its pages
    /// `3c`, `3c + 1` and `3c + 2`.
    Runtime {
        buf: Buffer,
        rt: Runtime,
        /// The tier the states were placed in.
        home: Tier,
    },
}

impl Store {
    /// The store of the raw slots, for every store but a runtime's.
    fn pages(&self) -> Option<&dyn PageStore> {
        match self {
            Store::Host(s) => Some(s),
            Store::Cxl(s) => Some(s),
            Store::Nvme(s) => Some(s),
            Store::Runtime { .. } => None,
        }
    }
}

/// Adam/AdamW with offloaded states; see the module docs.
pub struct OffloadedAdam {
    store: Store,
    /// Per chunk: weights, m, v.
    slots: Vec<[Option<Slot>; 3]>,
    params: usize,
    chunk: usize,
    t: u64,
    config: OptimConfig,
    /// Importance mode: deferred gradient sums, steps since the last
    /// flush, and per chunk the resident elements (empty before the first
    /// flush).
    accum: Vec<f32>,
    deferred_steps: u64,
    resident: Vec<Resident>,
    /// Set after a failed write: the state is no longer whole.
    broken: bool,
    /// The GPU update (`Updater::Cuda`).
    gpu: Option<Gpu>,
}

#[cfg(feature = "cuda")]
type Gpu = crate::device::cuda_adam::CudaAdam;

/// Without the `cuda` feature there is never a GPU updater.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Gpu {}

fn open_gpu(updater: Updater) -> Result<Option<Gpu>> {
    match updater {
        Updater::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Updater::Cuda => Ok(Some(Gpu::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Updater::Cuda => Err(Error::new(
            ErrorKind::NoDevice,
            "no CUDA device: strata was built without the cuda feature",
        )),
    }
}

/// Importance mode: one chunk's resident elements (their indices in the
/// chunk, ascending) and their weights and moments, the truth between
/// flushes.
#[derive(Debug, Default, Clone)]
struct Resident {
    idx: Vec<u32>,
    w: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Resident {
    /// Puts the resident values back into the chunk's state.
    fn scatter(&self, w: &mut [f32], m: &mut [f32], v: &mut [f32]) {
        for (j, &i) in self.idx.iter().enumerate() {
            let i = i as usize;
            (w[i], m[i], v[i]) = (self.w[j], self.m[j], self.v[j]);
        }
    }

    /// Chooses the next window's resident elements by this step's |g| and
    /// copies their state out of the chunk.
    fn choose(g: &[f32], fraction: f64, w: &[f32], m: &[f32], v: &[f32]) -> Self {
        let idx: Vec<u32> = match importance_threshold(g, fraction) {
            None => (0..g.len() as u32).collect(),
            Some(t) => (0..g.len() as u32)
                .filter(|&i| g[i as usize].abs() >= t)
                .collect(),
        };
        let pick = |a: &[f32]| idx.iter().map(|&i| a[i as usize]).collect();
        Self {
            w: pick(w),
            m: pick(m),
            v: pick(v),
            idx,
        }
    }
}

/// What a streamed step does to each chunk, shared by the CPU and GPU
/// updates.
#[derive(Clone, Copy)]
struct StepPlan {
    chunk: usize,
    params: usize,
    /// Importance mode's flush: the share of elements to keep resident,
    /// and the steps the accumulators cover.
    flush: Option<(f64, u64)>,
}

impl StepPlan {
    /// Chunk `c`'s elements of the parameter vector.
    fn range(&self, c: usize) -> std::ops::Range<usize> {
        c * self.chunk..((c + 1) * self.chunk).min(self.params)
    }

    /// Before chunk `c`'s update: the gradient each element updates with.
    /// Plain: this step's. A flush: the resident values go back into the
    /// chunk, resident elements take this step's gradient and the others
    /// the mean of their accumulated ones (this step's added); the
    /// accumulators are cleared.
    fn gradient<'g>(
        &self,
        c: usize,
        grads: &'g [f32],
        state: [&mut [f32]; 3],
        acc: &mut [f32],
        resident: Option<&Resident>,
    ) -> std::borrow::Cow<'g, [f32]> {
        let g = &grads[self.range(c)];
        let Some((_, deferred)) = self.flush else {
            return g.into();
        };
        let [w, m, v] = state;
        let n = g.len();
        let mut eff: Vec<f32> = (0..n).map(|i| (acc[i] + g[i]) / deferred as f32).collect();
        if let Some(r) = resident {
            r.scatter(w, m, v);
            for &i in &r.idx {
                eff[i as usize] = g[i as usize];
            }
        }
        acc[..n].fill(0.0);
        eff.into()
    }

    /// After chunk `c`'s update on a flush: its next resident set.
    fn choose(&self, c: usize, grads: &[f32], w: &[f32], m: &[f32], v: &[f32]) -> Option<Resident> {
        let (fraction, _) = self.flush?;
        let g = &grads[self.range(c)];
        let n = g.len();
        Some(Resident::choose(g, fraction, &w[..n], &m[..n], &v[..n]))
    }
}

impl std::fmt::Debug for OffloadedAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadedAdam")
            .field("params", &self.params)
            .field("tier", &self.config.tier)
            .field("chunk_bytes", &self.config.chunk_bytes)
            .field("step", &self.t)
            .finish()
    }
}

/// A host-tier chunk's three state arrays, writable in place.
fn host_state<'a>(h: &'a HostStore, set: &'a mut [Option<Slot>; 3]) -> Result<[&'a mut [f32]; 3]> {
    let [w, m, v] = set;
    Ok([
        as_f32_mut(h.bytes_mut(w.as_mut().expect("slot home"))?),
        as_f32_mut(h.bytes_mut(m.as_mut().expect("slot home"))?),
        as_f32_mut(h.bytes_mut(v.as_mut().expect("slot home"))?),
    ])
}

fn as_f32_mut(b: &mut [u8]) -> &mut [f32] {
    bytemuck::cast_slice_mut(b)
}

impl OffloadedAdam {
    /// The checks every constructor makes.
    fn check_config(weights: &[f32], config: &OptimConfig) -> Result<()> {
        crate::size::check_page_size(config.chunk_bytes).map_err(|e| e.context("chunk"))?;
        if weights.is_empty() {
            return Err(Error::invalid("an optimizer needs at least one parameter"));
        }
        if let Some(imp) = config.importance {
            if !(imp.fraction > 0.0 && imp.fraction <= 1.0) || imp.every == 0 {
                return Err(Error::invalid(format!(
                    "importance fraction {} must be in (0, 1] and every {} at least 1",
                    imp.fraction, imp.every
                )));
            }
        }
        Ok(())
    }

    /// Stores `weights` as the fp32 master weights (moments zero) in the
    /// configured tier.
    pub fn new(weights: &[f32], config: OptimConfig) -> Result<Self> {
        Self::check_config(weights, &config)?;
        // Before any state is laid out: no GPU is the cheapest failure.
        let gpu = open_gpu(config.updater)?;
        let chunk = config.chunk_bytes / 4;
        let chunks = weights.len().div_ceil(chunk);
        let pages = chunks as u64 * 3;
        let bytes = pages * config.chunk_bytes as u64;
        let store = match &config.tier {
            StateTier::Host => {
                Store::Host(HostStore::new(&HostConfig::new(bytes, config.chunk_bytes))?)
            }
            StateTier::Cxl => {
                // Real CXL memory (a CPU-less node) where there is some.
                let topo = Topology::detect();
                // Real CXL memory (a CPU-less node) where there is some and it
                // takes the state; emulated otherwise.
                let cxl =
                    |mode| CxlStore::new(&CxlConfig::new(mode, bytes, config.chunk_bytes), &topo);
                Store::Cxl(match CxlMode::real_or_emulated(&topo) {
                    CxlMode::Auto => cxl(CxlMode::Auto).or_else(|_| cxl(CxlMode::Emulated))?,
                    mode => cxl(mode)?,
                })
            }
            StateTier::Nvme(dir) => {
                // Room for the store's reserve (1/64 of its slots, ≤ 64).
                let extra = (pages / 63 + 1).min(64);
                Store::Nvme(NvmeStore::new(&NvmeConfig::new(
                    dir,
                    (pages + extra) * config.chunk_bytes as u64,
                    config.chunk_bytes,
                ))?)
            }
        };
        let mut page = vec![0u8; config.chunk_bytes];
        let zeros = vec![0u8; config.chunk_bytes];
        let mut slots = Vec::with_capacity(chunks);
        let ps = store.pages().expect("a raw store");
        for c in 0..chunks {
            let src = &weights[c * chunk..((c + 1) * chunk).min(weights.len())];
            page.fill(0);
            page[..src.len() * 4].copy_from_slice(bytemuck::cast_slice(src));
            let mut set: [Option<Slot>; 3] = [None, None, None];
            for (k, s) in set.iter_mut().enumerate() {
                let mut slot = ps.alloc()?;
                ps.write_new(&mut slot, if k == 0 { &page } else { &zeros })?;
                *s = Some(slot);
            }
            slots.push(set);
        }
        Ok(Self::assemble(store, slots, weights.len(), config, gpu))
    }

    /// The optimizer over its laid-out `store`, before its first step.
    fn assemble(
        store: Store,
        slots: Vec<[Option<Slot>; 3]>,
        params: usize,
        config: OptimConfig,
        gpu: Option<Gpu>,
    ) -> Self {
        let accum = if config.importance.is_some() {
            vec![0.0; params]
        } else {
            Vec::new()
        };
        Self {
            store,
            slots,
            params,
            chunk: config.chunk_bytes / 4,
            t: 0,
            config,
            accum,
            deferred_steps: 0,
            resident: Vec::new(),
            broken: false,
            gpu,
        }
    }

    /// Stores `weights` as the fp32 master weights (moments zero) in a
    /// buffer of `rt`, a runtime shared with the caller's buffers and other
    /// offload objects: the states take their place in `config.tier` of
    /// `rt` (host, CXL or NVMe — for NVMe the runtime's own, the path in
    /// `StateTier::Nvme` is not used) under the same budgets as everything
    /// else, placed there first and moved by the runtime like any buffer's
    /// pages. `config.chunk_bytes` must be `rt`'s page size. Each step
    /// reads and writes every chunk's three pages in place, wherever they
    /// are, chunks in parallel. Updates run on the CPU (`Updater::Cpu`).
    pub fn on(rt: &Runtime, weights: &[f32], config: OptimConfig) -> Result<Self> {
        Self::check_config(weights, &config)?;
        if config.chunk_bytes != rt.page_size() {
            return Err(Error::invalid(format!(
                "chunk of {} bytes: an optimizer on a runtime uses its page size, {} bytes",
                config.chunk_bytes,
                rt.page_size()
            )));
        }
        if config.updater != Updater::Cpu {
            return Err(Error::invalid(format!(
                "the {} updater is not available for an optimizer on a shared runtime; use cpu",
                config.updater.name()
            )));
        }
        let home = match &config.tier {
            StateTier::Host => Tier::Host,
            StateTier::Cxl => Tier::Cxl,
            StateTier::Nvme(_) => Tier::Nvme,
        };
        if !rt.tiers().contains(&home) {
            return Err(Error::invalid(format!(
                "the runtime has no {home} tier for the optimizer's states"
            )));
        }
        let chunk = config.chunk_bytes / 4;
        let chunks = weights.len().div_ceil(chunk);
        let page = config.chunk_bytes;
        let buf = rt.alloc_with((chunks * 3 * page) as u64, Placement::Prefer(home))?;
        let mut set = vec![0f32; 3 * chunk];
        for c in 0..chunks {
            let src = &weights[c * chunk..((c + 1) * chunk).min(weights.len())];
            set.fill(0.0);
            set[..src.len()].copy_from_slice(src);
            buf.write_as((c * 3 * page) as u64, &set)?;
        }
        // Where `home` was full the pages went to the fastest tier with
        // room: down to `home` or below with them.
        buf.evict(0..buf.len(), home)?;
        let store = Store::Runtime {
            buf,
            rt: rt.clone(),
            home,
        };
        Ok(Self::assemble(
            store,
            Vec::new(),
            weights.len(),
            config,
            None,
        ))
    }

    /// Chunks of the state arrays.
    fn chunks(&self) -> usize {
        self.params.div_ceil(self.chunk)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params
    }

    /// Always false: an optimizer has at least one parameter.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// Whether the states are on an emulated medium (CXL without a CPU-less node).
    pub fn emulated(&self) -> bool {
        match &self.store {
            Store::Runtime { rt, home, .. } => rt
                .stats()
                .tiers
                .iter()
                .any(|t| t.tier == *home && t.emulated),
            s => s.pages().is_some_and(|p| p.emulated()),
        }
    }

    /// Where the update runs.
    pub fn updater(&self) -> Updater {
        self.config.updater
    }

    /// The GPU the update runs on ("GPU 0 (name)"), if it runs on one.
    pub fn gpu(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        {
            self.gpu.as_ref().map(|g| g.description())
        }
        #[cfg(not(feature = "cuda"))]
        {
            self.gpu.as_ref().map(|g| match *g {})
        }
    }

    fn check(&self, grads: &[f32]) -> Result<()> {
        if self.broken {
            return Err(Error::new(
                ErrorKind::Closed,
                "an earlier step failed part-way (reading, updating or writing the state); it is no longer whole",
            ));
        }
        if grads.len() != self.params {
            return Err(Error::invalid(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.params
            )));
        }
        Ok(())
    }

    /// One optimizer step with these gradients.
    pub fn step(&mut self, grads: &[f32]) -> Result<StepStats> {
        self.step_into(grads, None)
    }

    /// As [`step`](Self::step), also leaving the updated weights in
    /// `weights` (one per parameter): a framework's parameter tensor. Each
    /// chunk's weights are copied out while the update has them (no second
    /// pass over the tier); with host-tier states updated on a GPU they are
    /// read back after the step ([`read_state_into`](Self::read_state_into)).
    /// A wrong length is refused before the step; a step that fails part-way
    /// may leave some chunks of `weights` new (the optimizer then refuses
    /// further steps, as after any failed step).
    pub fn step_into(
        &mut self,
        grads: &[f32],
        mut weights: Option<&mut [f32]>,
    ) -> Result<StepStats> {
        if let Some(w) = weights.as_deref() {
            if w.len() != self.params {
                return Err(Error::invalid(format!(
                    "{} weights out for {} parameters",
                    w.len(),
                    self.params
                )));
            }
        }
        let (stats, filled) = self.step_inner(grads, weights.as_deref_mut())?;
        if let (Some(w), false) = (weights, filled) {
            self.read_state_into(0, w)?;
        }
        Ok(stats)
    }

    /// As [`step_into`](Self::step_into), for a caller whose `weights`
    /// already hold the parameters as the previous step left them (a
    /// framework's parameter tensor, kept in step with the optimizer):
    /// only the elements this step changes are written. In
    /// importance-aware mode a step inside a window then costs no pass
    /// over the tier's weights, only over the resident elements.
    pub fn step_in_place(&mut self, grads: &[f32], weights: &mut [f32]) -> Result<StepStats> {
        let in_window = self
            .config
            .importance
            .is_some_and(|imp| !self.resident.is_empty() && self.deferred_steps + 1 < imp.every);
        if !in_window {
            return self.step_into(grads, Some(weights));
        }
        if weights.len() != self.params {
            return Err(Error::invalid(format!(
                "{} weights out for {} parameters",
                weights.len(),
                self.params
            )));
        }
        let (stats, _) = self.step_inner(grads, None)?;
        for (c, r) in self.resident.iter().enumerate() {
            let dst = &mut weights[c * self.chunk..];
            for (&i, &w) in r.idx.iter().zip(&r.w) {
                dst[i as usize] = w;
            }
        }
        Ok(stats)
    }

    /// The step; true when it filled `weights` itself.
    fn step_inner(
        &mut self,
        grads: &[f32],
        weights: Option<&mut [f32]>,
    ) -> Result<(StepStats, bool)> {
        self.check(grads)?;
        let start = Instant::now();
        self.t += 1;
        let s = StepScalars::new(self.config.adam, self.t);
        let mut flush = None;
        if let Some(imp) = self.config.importance {
            self.deferred_steps += 1;
            if self.resident.is_empty() || self.deferred_steps >= imp.every {
                flush = Some((imp.fraction, self.deferred_steps));
            } else {
                // A step inside a window: no state I/O.
                if let Err(e) = self.resident_step(grads, &s) {
                    self.broken = true;
                    return Err(e);
                }
                let stats = StepStats {
                    seconds: start.elapsed().as_secs_f64(),
                    ..Default::default()
                };
                return Ok((stats, false));
            }
        }
        let plan = StepPlan {
            chunk: self.chunk,
            params: self.params,
            flush,
        };
        let n_chunks = self.chunks();
        let mut acc_chunks: Vec<&mut [f32]> = self.accum.chunks_mut(plan.chunk).collect();
        acc_chunks.resize_with(n_chunks, || &mut []);
        // Where the host path copies each chunk's new weights (if asked).
        // Every path but the GPU's over host-tier states (one pipeline of
        // tiles) copies each chunk's new weights out while it has them.
        let filled =
            weights.is_some() && !(matches!(&self.store, Store::Host(_)) && self.gpu.is_some());
        let mut out_chunks: Vec<&mut [f32]> = match weights {
            Some(w) if filled => w.chunks_mut(plan.chunk).collect(),
            _ => Vec::new(),
        };
        out_chunks.resize_with(n_chunks, || &mut []);
        let old = std::mem::take(&mut self.resident);
        let mut chosen: Vec<Option<Resident>> = vec![None; n_chunks];
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables, unused_mut))]
        let mut gpu = self.gpu.as_mut();
        // The update of one chunk's state buffers, on the CPU or the GPU;
        // the resident set it leaves for the next window, on a flush.
        let update_one = |c: usize,
                          w: &mut [f32],
                          m: &mut [f32],
                          v: &mut [f32],
                          acc: &mut [f32],
                          gpu: Option<&mut Gpu>|
         -> Result<Option<Resident>> {
            let g = plan.gradient(c, grads, [&mut *w, &mut *m, &mut *v], acc, old.get(c));
            let n = g.len();
            match gpu {
                #[cfg(feature = "cuda")]
                Some(gpu) => {
                    use crate::device::cuda_adam::Chunk;
                    gpu.update(
                        &s,
                        vec![Chunk {
                            w: &mut w[..n],
                            m: &mut m[..n],
                            v: &mut v[..n],
                            g: &g,
                        }],
                    )?;
                }
                #[cfg(not(feature = "cuda"))]
                Some(gpu) => match *gpu {},
                None => adam_update(&mut w[..n], &mut m[..n], &mut v[..n], &g, &s),
            }
            Ok(plan.choose(c, grads, w, m, v))
        };
        // A failure past this point may leave some chunks updated and
        // others not: the optimizer refuses further steps.
        let streamed = match &self.store {
            #[cfg(feature = "cuda")]
            Store::Host(h) if gpu.is_some() => {
                // Every chunk in one pipeline of tiles: the gradients
                // first, then one update, then the next resident sets.
                let gpu = gpu.take().expect("checked");
                (|| -> Result<Duration> {
                    let mut grads_eff = Vec::with_capacity(n_chunks);
                    for (c, (set, acc)) in self.slots.iter_mut().zip(&mut acc_chunks).enumerate() {
                        let [w, m, v] = host_state(h, set)?;
                        grads_eff.push(plan.gradient(c, grads, [w, m, v], acc, old.get(c)));
                    }
                    let mut chunks = Vec::with_capacity(n_chunks);
                    for (set, g) in self.slots.iter_mut().zip(&grads_eff) {
                        let [w, m, v] = host_state(h, set)?;
                        let n = g.len();
                        chunks.push(crate::device::cuda_adam::Chunk {
                            w: &mut w[..n],
                            m: &mut m[..n],
                            v: &mut v[..n],
                            g,
                        });
                    }
                    gpu.update(&s, chunks)?;
                    for (c, set) in self.slots.iter_mut().enumerate() {
                        let [w, m, v] = host_state(h, set)?;
                        chosen[c] = plan.choose(c, grads, w, m, v);
                    }
                    Ok(Duration::ZERO)
                })()
            }
            Store::Host(h) => self
                .slots
                .par_iter_mut()
                .zip(acc_chunks.par_iter_mut())
                .zip(chosen.par_iter_mut())
                .zip(out_chunks.par_iter_mut())
                .enumerate()
                .try_for_each(|(c, (((set, acc), out), wout))| -> Result<()> {
                    let [w, m, v] = host_state(h, set)?;
                    let g = plan.gradient(c, grads, [&mut *w, &mut *m, &mut *v], acc, old.get(c));
                    let n = g.len();
                    adam_update(&mut w[..n], &mut m[..n], &mut v[..n], &g, &s);
                    *out = plan.choose(c, grads, w, m, v);
                    // Empty unless asked: the new weights, still in cache.
                    wout.copy_from_slice(&w[..wout.len()]);
                    Ok(())
                })
                .map(|()| Duration::ZERO),
            Store::Cxl(x) => {
                let page = self.config.chunk_bytes;
                staged(x, &mut self.slots, page, &mut |c, bufs| {
                    let [w, m, v] = bufs;
                    chosen[c] = update_one(c, w, m, v, acc_chunks[c], gpu.as_deref_mut())?;
                    let wout = &mut out_chunks[c];
                    wout.copy_from_slice(&w[..wout.len()]);
                    Ok(())
                })
            }
            Store::Runtime { buf, .. } => {
                // Every chunk's three pages read in place, wherever the
                // runtime has them, updated, written back; chunks in
                // parallel. The I/O time is summed over the threads.
                let page = self.config.chunk_bytes;
                let chunk = plan.chunk;
                let io_ns = std::sync::atomic::AtomicU64::new(0);
                let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
                    let t = Instant::now();
                    let r = f();
                    io_ns.fetch_add(
                        t.elapsed().as_nanos() as u64,
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    r
                };
                acc_chunks
                    .par_iter_mut()
                    .zip(chosen.par_iter_mut())
                    .zip(out_chunks.par_iter_mut())
                    .enumerate()
                    .try_for_each(|(c, ((acc, out), wout))| -> Result<()> {
                        let off = (c * 3 * page) as u64;
                        let mut set = vec![0f32; 3 * chunk];
                        timed(&mut || buf.read_as(off, &mut set))?;
                        let (w, rest) = set.split_at_mut(chunk);
                        let (m, v) = rest.split_at_mut(chunk);
                        *out = update_one(c, w, m, v, acc, None)?;
                        wout.copy_from_slice(&w[..wout.len()]);
                        timed(&mut || buf.write_as(off, &set))
                    })
                    .map(|()| {
                        Duration::from_nanos(io_ns.load(std::sync::atomic::Ordering::Relaxed))
                    })
            }
            Store::Nvme(n) => streamed(n, &mut self.slots, &mut |c, bufs| {
                let [w, m, v] = bufs;
                let (w, m, v) = (as_f32_mut(w), as_f32_mut(m), as_f32_mut(v));
                chosen[c] = update_one(c, w, m, v, acc_chunks[c], gpu.as_deref_mut())?;
                let wout = &mut out_chunks[c];
                wout.copy_from_slice(&w[..wout.len()]);
                Ok(())
            }),
        };
        let io_wait = match streamed {
            Ok(d) => d,
            Err(e) => {
                self.broken = true;
                if flush.is_some() {
                    // What `read_state` merges in: the new resident copy
                    // of the chunks this flush updated, the old one (still
                    // the truth) of the others.
                    let mut old = old.into_iter();
                    self.resident = chosen
                        .into_iter()
                        .map(|new| {
                            let old = old.next().unwrap_or_default();
                            new.unwrap_or(old)
                        })
                        .collect();
                }
                return Err(e);
            }
        };
        if flush.is_some() {
            self.resident = chosen.into_iter().map(Option::unwrap_or_default).collect();
            self.deferred_steps = 0;
        }
        let bytes = self.chunks() as u64 * 3 * self.config.chunk_bytes as u64;
        let stats = StepStats {
            seconds: start.elapsed().as_secs_f64(),
            bytes_read: bytes,
            bytes_written: bytes,
            io_wait_seconds: io_wait.as_secs_f64(),
        };
        Ok((stats, filled))
    }

    /// A step inside an importance window: the resident elements update
    /// with their gradients (on the GPU with `Updater::Cuda`), the others
    /// accumulate theirs. No state in the tier is touched.
    fn resident_step(&mut self, grads: &[f32], s: &StepScalars) -> Result<()> {
        let chunk = self.chunk;
        let gathered: Vec<Vec<f32>> = self
            .resident
            .par_iter()
            .enumerate()
            .map(|(c, r)| {
                let g = &grads[c * chunk..];
                r.idx.iter().map(|&i| g[i as usize]).collect()
            })
            .collect();
        match self.gpu.as_mut() {
            #[cfg(feature = "cuda")]
            Some(gpu) => {
                let chunks = self
                    .resident
                    .iter_mut()
                    .zip(&gathered)
                    .map(|(r, g)| crate::device::cuda_adam::Chunk {
                        w: &mut r.w,
                        m: &mut r.m,
                        v: &mut r.v,
                        g,
                    })
                    .collect();
                gpu.update(s, chunks)?;
            }
            #[cfg(not(feature = "cuda"))]
            Some(gpu) => match *gpu {},
            None => self
                .resident
                .par_iter_mut()
                .zip(&gathered)
                .for_each(|(r, g)| adam_update(&mut r.w, &mut r.m, &mut r.v, g, s)),
        }
        // The others accumulate; a resident element's accumulator stays 0.
        self.accum
            .par_chunks_mut(chunk)
            .zip(grads.par_chunks(chunk))
            .zip(self.resident.par_iter())
            .for_each(|((acc, g), r)| {
                for (a, x) in acc.iter_mut().zip(g) {
                    *a += x;
                }
                for &i in &r.idx {
                    acc[i as usize] = 0.0;
                }
            });
        Ok(())
    }

    /// Reads the master weights back.
    pub fn weights(&self) -> Result<Vec<f32>> {
        self.read_state(0)
    }

    /// Reads a state array: 0 weights, 1 first moment, 2 second moment.
    pub fn read_state(&self, which: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0; self.params];
        self.read_state_into(which, &mut out)?;
        Ok(out)
    }

    /// As [`read_state`](Self::read_state), into `out` (one value per
    /// parameter): whole chunks are read straight into it, so a caller that
    /// keeps the parameters in an array of its own (a framework's tensor)
    /// pays one pass over them and no allocation.
    pub fn read_state_into(&self, which: usize, out: &mut [f32]) -> Result<()> {
        if which > 2 {
            return Err(Error::invalid(format!("state {which}: use 0, 1 or 2")));
        }
        if out.len() != self.params {
            return Err(Error::invalid(format!(
                "{} values for {} parameters",
                out.len(),
                self.params
            )));
        }
        let chunk = self.chunk;
        let mut scratch = Vec::new();
        for c in 0..self.chunks() {
            let dst = &mut out[c * chunk..((c + 1) * chunk).min(self.params)];
            match (&self.store, self.slots.get(c)) {
                (Store::Runtime { buf, .. }, _) => {
                    buf.read_as(((c * 3 + which) * self.config.chunk_bytes) as u64, dst)?
                }
                (store, Some(set)) => {
                    let ps = store.pages().expect("raw stores");
                    let slot = set[which].as_ref().expect("slot home");
                    if dst.len() == chunk {
                        ps.read_page(slot, bytemuck::cast_slice_mut(dst))?;
                    } else {
                        // The last chunk is short: through a whole page.
                        scratch.resize(self.config.chunk_bytes, 0u8);
                        ps.read_page(slot, &mut scratch)?;
                        dst.copy_from_slice(&as_f32_mut(&mut scratch)[..dst.len()]);
                    }
                }
                (_, None) => unreachable!("a slot set per chunk"),
            }
            // Between flushes the resident copy is the truth.
            if let Some(r) = self.resident.get(c) {
                let src = [&r.w, &r.m, &r.v][which];
                for (j, &i) in r.idx.iter().enumerate() {
                    dst[i as usize] = src[j];
                }
            }
        }
        Ok(())
    }
}

impl OffloadedAdam {
    /// The hyper-parameters the next steps use.
    pub fn adam(&self) -> AdamParams {
        self.config.adam
    }

    /// Changes the hyper-parameters from the next step on (a learning-rate
    /// schedule, a framework's parameter groups edited between steps).
    pub fn set_adam(&mut self, adam: AdamParams) {
        self.config.adam = adam;
    }

    /// Sets the step count (the bias corrections of the next step use
    /// `steps + 1`), as when a saved optimizer is restored.
    pub fn set_steps(&mut self, steps: u64) {
        self.t = steps;
    }

    /// Overwrites a state array: 0 weights, 1 first moment, 2 second
    /// moment, `values` holding one value per parameter (restoring a
    /// saved optimizer, or weights changed outside it). In
    /// importance-aware mode the resident copies take the new values too
    /// (they are the truth between flushes); the window's gradient sums
    /// and resident set are kept ([`set_importance_window`](Self::set_importance_window)
    /// restores those). A failed write leaves the optimizer refusing
    /// further steps, as a failed step does.
    pub fn write_state(&mut self, which: usize, values: &[f32]) -> Result<()> {
        if which > 2 {
            return Err(Error::invalid(format!("state {which}: use 0, 1 or 2")));
        }
        if values.len() != self.params {
            return Err(Error::invalid(format!(
                "{} values for {} parameters",
                values.len(),
                self.params
            )));
        }
        let chunk = self.chunk;
        let mut page = vec![0u8; self.config.chunk_bytes];
        for c in 0..self.chunks() {
            let src = &values[c * chunk..((c + 1) * chunk).min(values.len())];
            page.fill(0);
            page[..src.len() * 4].copy_from_slice(bytemuck::cast_slice(src));
            let written = match (&self.store, self.slots.get_mut(c)) {
                (Store::Runtime { buf, .. }, _) => {
                    buf.write(((c * 3 + which) * self.config.chunk_bytes) as u64, &page)
                }
                (store, Some(set)) => store
                    .pages()
                    .expect("raw stores")
                    .write_page(set[which].as_mut().expect("slot home"), &page),
                (_, None) => unreachable!("a slot set per chunk"),
            };
            if let Err(e) = written {
                self.broken = true;
                return Err(e);
            }
            if let Some(r) = self.resident.get_mut(c) {
                let dst = [&mut r.w, &mut r.m, &mut r.v][which].iter_mut();
                for (d, &i) in dst.zip(&r.idx) {
                    *d = src[i as usize];
                }
            }
        }
        Ok(())
    }

    /// Importance-aware mode's window, for a checkpoint that resumes
    /// exactly ([`set_importance_window`](Self::set_importance_window));
    /// `None` in plain mode.
    pub fn importance_window(&self) -> Option<ImportanceWindow> {
        self.config.importance?;
        let resident = self
            .resident
            .iter()
            .enumerate()
            .flat_map(|(c, r)| {
                r.idx
                    .iter()
                    .map(move |&i| (c * self.chunk) as u64 + i as u64)
            })
            .collect();
        Some(ImportanceWindow {
            deferred_steps: self.deferred_steps,
            accumulated: self.accum.clone(),
            resident,
            started: !self.resident.is_empty(),
        })
    }

    /// Restores a window saved by [`importance_window`](Self::importance_window)
    /// (after the state arrays: the resident elements' values are taken
    /// from the state as it is now). Refused, changing nothing, in plain
    /// mode or where the window does not fit this optimizer.
    pub fn set_importance_window(&mut self, window: &ImportanceWindow) -> Result<()> {
        let Some(imp) = self.config.importance else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "an importance window for an optimizer in plain mode",
            ));
        };
        if window.accumulated.len() != self.params {
            return Err(Error::invalid(format!(
                "an importance window of {} gradient sums for {} parameters",
                window.accumulated.len(),
                self.params
            )));
        }
        if window.deferred_steps >= imp.every {
            return Err(Error::invalid(format!(
                "an importance window {} steps in, of windows of {}",
                window.deferred_steps, imp.every
            )));
        }
        if window.started == window.resident.is_empty() {
            return Err(Error::invalid(
                "an importance window that has started has resident elements (and only then)",
            ));
        }
        if window.resident.windows(2).any(|p| p[0] >= p[1])
            || window
                .resident
                .last()
                .is_some_and(|&i| i >= self.params as u64)
        {
            return Err(Error::invalid(
                "an importance window's resident elements must be ascending parameter indices",
            ));
        }
        let mut resident = Vec::new();
        if window.started {
            let state: Vec<Vec<f32>> = (0..3).map(|k| self.read_state(k)).collect::<Result<_>>()?;
            resident = vec![Resident::default(); self.chunks()];
            for &i in &window.resident {
                let i = i as usize;
                let r = &mut resident[i / self.chunk];
                r.idx.push((i % self.chunk) as u32);
                r.w.push(state[0][i]);
                r.m.push(state[1][i]);
                r.v.push(state[2][i]);
            }
        }
        self.resident = resident;
        self.accum.clone_from(&window.accumulated);
        self.deferred_steps = window.deferred_steps;
        Ok(())
    }
}

/// Importance-aware mode's window between two flushes: what a checkpoint
/// needs besides the state arrays to resume exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportanceWindow {
    /// Steps since the last flush.
    pub deferred_steps: u64,
    /// Per parameter, the gradients accumulated since the last flush (0
    /// for resident elements).
    pub accumulated: Vec<f32>,
    /// The parameters updated every step in this window, ascending.
    pub resident: Vec<u64>,
    /// Whether a first flush has chosen them (before it, none is).
    pub started: bool,
}

/// The |g| from which an element is among the `fraction` largest (at
/// least one); `None` when that is every element. Ties at the threshold
/// may keep a few more. Flushes choose resident elements with it.
fn importance_threshold(g: &[f32], fraction: f64) -> Option<f32> {
    let n = g.len();
    let keep = ((n as f64 * fraction).ceil() as usize).clamp(1, n.max(1));
    if keep >= n {
        return None;
    }
    let mut mags: Vec<f32> = g.iter().map(|x| x.abs()).collect();
    let (_, &mut threshold, _) = mags.select_nth_unstable_by(n - keep, f32::total_cmp);
    Some(threshold)
}

/// The update of chunk `c`, given its three state buffers.
type ChunkUpdate<'a, B> = dyn FnMut(usize, &mut [B; 3]) -> Result<()> + 'a;

/// The CXL pipeline: reader, updater (this thread), writer, three
/// staging sets. Slots travel with their chunk through the stages and come
/// back in `slots`, also when a read, an update or a write fails (the
/// stages then stop; a chunk after a failed write is not written). Returns
/// the time the updater waited for the reader.
fn staged(
    store: &CxlStore,
    slots: &mut [[Option<Slot>; 3]],
    page: usize,
    update: &mut ChunkUpdate<'_, Vec<f32>>,
) -> Result<Duration> {
    use crossbeam::channel::{bounded, SendError};
    use std::sync::atomic::{AtomicBool, Ordering};
    const SETS: usize = 3;
    type Set = [Vec<f32>; 3];
    type Item = (usize, [Slot; 3], Set);
    let (free_tx, free_rx) = bounded::<Set>(SETS);
    let (full_tx, full_rx) = bounded::<Item>(SETS);
    let (done_tx, done_rx) = bounded::<Item>(SETS);
    for _ in 0..SETS {
        let b = || vec![0f32; page / 4];
        free_tx.send([b(), b(), b()]).expect("room for every set");
    }
    let n = slots.len();
    let owned: Vec<[Slot; 3]> = slots
        .iter_mut()
        .map(|s| s.each_mut().map(|x| x.take().expect("slot home")))
        .collect();
    // Set when an update or a write fails: the reader and the updater
    // stop at their next chunk.
    let stop = AtomicBool::new(false);
    let stop = &stop;
    let (waited, back, err) = std::thread::scope(|sc| {
        // The reader hands back the chunks it did not pass on.
        let reader = sc.spawn(move || -> (Vec<(usize, [Slot; 3])>, Result<()>) {
            let mut left = Vec::new();
            let mut result = Ok(());
            let mut owned = owned.into_iter().enumerate();
            for (c, set) in owned.by_ref() {
                if stop.load(Ordering::Relaxed) {
                    left.push((c, set));
                    break;
                }
                let Ok(mut bufs) = free_rx.recv() else {
                    left.push((c, set));
                    break;
                };
                let read = (0..3).try_for_each(|k| {
                    store.read_page(&set[k], bytemuck::cast_slice_mut(&mut bufs[k]))
                });
                if let Err(e) = read {
                    // The chunks read before still update and go back.
                    left.push((c, set));
                    result = Err(e);
                    break;
                }
                if let Err(SendError((c, set, _))) = full_tx.send((c, set, bufs)) {
                    left.push((c, set));
                    break;
                }
            }
            left.extend(owned);
            (left, result)
        });
        // The writer hands back every chunk it was given, written or (after
        // a failed write) not.
        let writer = sc.spawn(move || -> (Vec<(usize, [Slot; 3])>, Result<()>) {
            let mut back = Vec::with_capacity(n);
            let mut result = Ok(());
            for (c, mut set, bufs) in done_rx.iter() {
                if result.is_ok() {
                    // In place: an emulated medium paces the copy.
                    result = (0..3).try_for_each(|k| {
                        store.write_page(&mut set[k], bytemuck::cast_slice(&bufs[k]))
                    });
                    if result.is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
                back.push((c, set));
                let _ = free_tx.send(bufs);
            }
            (back, result)
        });
        let mut waited = Duration::ZERO;
        let mut here = Vec::new();
        let mut failed = Ok(());
        for _ in 0..n {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let t = Instant::now();
            let Ok((c, set, mut bufs)) = full_rx.recv() else {
                break;
            };
            waited += t.elapsed();
            if let Err(e) = update(c, &mut bufs) {
                // Not written back.
                stop.store(true, Ordering::Relaxed);
                here.push((c, set));
                failed = Err(e);
                break;
            }
            if let Err(SendError((c, set, _))) = done_tx.send((c, set, bufs)) {
                here.push((c, set));
                break;
            }
        }
        // The writer finishes (its free sets let a waiting reader see the
        // stop); chunks read but not updated come home from here.
        drop(done_tx);
        here.extend(full_rx.iter().map(|(c, set, _)| (c, set)));
        let (left, r) = reader.join().expect("reader thread");
        let (written, w) = writer.join().expect("writer thread");
        here.extend(left);
        here.extend(written);
        (waited, here, failed.and(r).and(w))
    });
    for (c, set) in back {
        back_home(slots, c, set);
    }
    err?;
    if slots.iter().any(|s| s.iter().any(Option::is_none)) {
        return Err(Error::new(
            ErrorKind::Io,
            "a chunk of the optimizer state did not come back",
        ));
    }
    Ok(waited)
}

fn back_home(slots: &mut [[Option<Slot>; 3]], c: usize, set: [Slot; 3]) {
    let [a, b, d] = set;
    slots[c] = [Some(a), Some(b), Some(d)];
}

/// The NVMe pipeline's state on the stepping thread.
struct Stream<'a, 's> {
    store: &'a NvmeStore,
    session: crate::tier::nvme::NvmeSession<'a>,
    slots: &'s mut [[Option<Slot>; 3]],
    arrived: Vec<[Option<AlignedBuf>; 3]>,
    got: Vec<u8>,
    pool: Vec<AlignedBuf>,
    done: Vec<NvmeCompletion>,
    next_read: usize,
    ahead: usize,
    first_err: Option<Error>,
}

impl Stream<'_, '_> {
    fn room(&self) -> usize {
        self.session.depth() - self.session.in_flight()
    }

    /// Submits reads of the chunks up to `c + ahead` while the queue has room.
    fn fill(&mut self, c: usize) -> Result<()> {
        while self.next_read < self.slots.len()
            && self.next_read <= c + self.ahead
            && self.room() >= 3
        {
            let r = self.next_read;
            for k in 0..3 {
                let buf = match self.pool.pop() {
                    Some(b) => b,
                    None => self.store.buffer()?,
                };
                let slot = self.slots[r][k].take().expect("slot home");
                if let Err(rej) = self.session.submit_read(slot, buf, (r * 3 + k) as u64) {
                    self.slots[r][k] = Some(rej.slot);
                    return Err(rej.error);
                }
            }
            self.next_read += 1;
        }
        Ok(())
    }

    /// Reaps at least one completion.
    fn reap(&mut self) -> Result<()> {
        self.session.reap(1, &mut self.done)?;
        for cpl in self.done.drain(..) {
            let (c, k) = (cpl.tag as usize / 3, cpl.tag as usize % 3);
            self.slots[c][k] = Some(cpl.slot);
            if let Err(e) = cpl.result {
                self.first_err.get_or_insert(e);
                self.pool.push(cpl.buf);
                continue;
            }
            match cpl.op {
                crate::io::IoOp::Read => {
                    self.arrived[c][k] = Some(cpl.buf);
                    self.got[c] += 1;
                }
                crate::io::IoOp::Write => self.pool.push(cpl.buf),
            }
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<()> {
        while self.session.in_flight() > 0 {
            self.reap()?;
        }
        Ok(())
    }
}

/// The NVMe pipeline on one session; see the module docs.
fn streamed(
    store: &NvmeStore,
    slots: &mut [[Option<Slot>; 3]],
    update: &mut ChunkUpdate<'_, AlignedBuf>,
) -> Result<Duration> {
    let session = store.session()?;
    let depth = session.depth();
    if depth < 6 {
        return Err(Error::invalid(format!(
            "an nvme queue depth of {depth} is below the 6 a streamed step needs"
        )));
    }
    let n = slots.len();
    let mut st = Stream {
        store,
        session,
        slots,
        arrived: (0..n).map(|_| [None, None, None]).collect(),
        got: vec![0; n],
        pool: Vec::new(),
        done: Vec::with_capacity(depth),
        next_read: 0,
        // Reads of this many chunks ahead, leaving room for writes.
        ahead: (depth / 3 - 1).max(1),
        first_err: None,
    };
    let mut waited = Duration::ZERO;
    let r = (|| -> Result<()> {
        for c in 0..n {
            st.fill(c)?;
            while st.got[c] < 3 {
                let t = Instant::now();
                st.reap()?;
                waited += t.elapsed();
                if let Some(e) = st.first_err.take() {
                    return Err(e);
                }
                st.fill(c)?;
            }
            let a = &mut st.arrived[c];
            let mut bufs = [
                a[0].take().expect("arrived"),
                a[1].take().expect("arrived"),
                a[2].take().expect("arrived"),
            ];
            update(c, &mut bufs)?;
            while st.room() < 3 {
                st.reap()?;
            }
            for (k, buf) in bufs.into_iter().enumerate() {
                let slot = st.slots[c][k].take().expect("slot home");
                if let Err(rej) = st.session.submit_write(slot, buf, (c * 3 + k) as u64) {
                    st.slots[c][k] = Some(rej.slot);
                    return Err(rej.error);
                }
            }
        }
        let t = Instant::now();
        st.drain()?;
        waited += t.elapsed();
        Ok(())
    })();
    if r.is_err() {
        // Every slot back home before the error goes up.
        let _ = st.drain();
    }
    r?;
    match st.first_err {
        Some(e) => Err(e),
        None => Ok(waited),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    fn emulated_cxl(pages: u64) -> CxlStore {
        let config = CxlConfig::new(CxlMode::Emulated, pages * PAGE as u64, PAGE);
        CxlStore::new(&config, &Topology::detect()).unwrap()
    }

    fn home(slots: &[[Option<Slot>; 3]]) -> bool {
        slots.iter().all(|s| s.iter().all(Option::is_some))
    }

    /// A slot of another store: reading it fails.
    fn foreign_slot() -> Slot {
        let other = HostStore::new(&HostConfig::new(PAGE as u64, PAGE)).unwrap();
        other.alloc().unwrap()
    }

    #[test]
    fn staged_brings_every_slot_home_when_an_update_fails() {
        let store = emulated_cxl(3 * 8);
        let mut slots: Vec<[Option<Slot>; 3]> = (0..8)
            .map(|_| [(); 3].map(|()| Some(store.alloc().unwrap())))
            .collect();
        let r = staged(&store, &mut slots, PAGE, &mut |c, _| {
            if c == 2 {
                Err(Error::invalid("injected"))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert!(home(&slots), "a failed update lost slots");
    }

    #[test]
    fn staged_brings_every_slot_home_when_a_read_fails() {
        let store = emulated_cxl(3 * 8);
        let mut slots: Vec<[Option<Slot>; 3]> = (0..8)
            .map(|_| [(); 3].map(|()| Some(store.alloc().unwrap())))
            .collect();
        slots[3][1] = Some(foreign_slot());
        let r = staged(&store, &mut slots, PAGE, &mut |_, _| Ok(()));
        assert!(r.is_err());
        assert!(home(&slots), "a failed read lost slots");
    }

    /// A flush that fails half-way leaves each chunk readable as it is:
    /// the chunks it wrote as after the step, the others as before it
    /// (their resident elements included), and refuses further steps.
    #[test]
    fn a_failed_flush_leaves_each_chunk_readable() {
        let chunk = PAGE / 4;
        let n = 3 * chunk + 100;
        let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let grads = |t: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| ((i * 2654435761 + t * 97) % 10007) as f32 / 10007.0 - 0.5)
                .collect()
        };
        let mut cfg = OptimConfig::new(StateTier::Cxl);
        cfg.chunk_bytes = PAGE;
        cfg.adam.lr = 1e-2;
        cfg.importance = Some(Importance {
            fraction: 0.25,
            every: 3,
        });
        let mut a = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
        let mut b = OffloadedAdam::new(&w0, cfg).unwrap();
        // Step 1 flushes, 2 and 3 update only the resident elements, 4
        // flushes again.
        for t in 1..=3 {
            a.step(&grads(t)).unwrap();
            b.step(&grads(t)).unwrap();
        }
        let before: Vec<Vec<f32>> = (0..3).map(|k| a.read_state(k).unwrap()).collect();
        b.step(&grads(4)).unwrap();
        let after: Vec<Vec<f32>> = (0..3).map(|k| b.read_state(k).unwrap()).collect();
        // The last chunk's second moment cannot be read: the flush fails
        // after writing the other chunks.
        let last = a.slots.len() - 1;
        let good = a.slots[last][2].replace(foreign_slot());
        assert!(a.step(&grads(4)).is_err());
        assert!(a.slots[last][2].is_some(), "the failed step lost the slot");
        a.slots[last][2] = good;
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let cut = last * chunk;
        for k in 0..3 {
            let got = a.read_state(k).unwrap();
            assert_eq!(bits(&got[..cut]), bits(&after[k][..cut]), "state {k}");
            assert_eq!(bits(&got[cut..]), bits(&before[k][cut..]), "state {k}");
        }
        assert_eq!(a.step(&grads(5)).unwrap_err().kind(), ErrorKind::Closed);
    }

    /// A restored optimizer (weights, moments and step count written into
    /// a fresh one) continues bitwise as the original does, on every tier
    /// kind that needs no disk; hyper-parameters changed between steps
    /// apply from the next one.
    #[test]
    fn restored_state_continues_bitwise() {
        let n = 3 * PAGE / 4 + 5;
        let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let g = |t: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| ((i * 40503 + t * 31) % 997) as f32 / 997.0 - 0.5)
                .collect()
        };
        for tier in [StateTier::Host, StateTier::Cxl] {
            let mut cfg = OptimConfig::new(tier);
            cfg.chunk_bytes = PAGE;
            cfg.adam.weight_decay = 0.01;
            let mut a = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
            for t in 1..=3 {
                a.step(&g(t)).unwrap();
            }
            let mut b = OffloadedAdam::new(&vec![0.0; n], cfg).unwrap();
            for k in 0..3 {
                b.write_state(k, &a.read_state(k).unwrap()).unwrap();
            }
            b.set_steps(a.steps());
            let faster = AdamParams {
                lr: 5e-3,
                ..a.adam()
            };
            a.set_adam(faster);
            b.set_adam(faster);
            for t in 4..=5 {
                a.step(&g(t)).unwrap();
                b.step(&g(t)).unwrap();
            }
            let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for k in 0..3 {
                assert_eq!(
                    bits(a.read_state(k).unwrap()),
                    bits(b.read_state(k).unwrap())
                );
            }
            assert_eq!(b.steps(), 5);
            assert_eq!(
                b.write_state(1, &[0.0; 3]).unwrap_err().kind(),
                ErrorKind::InvalidArgument
            );
            assert_eq!(
                b.write_state(3, &w0).unwrap_err().kind(),
                ErrorKind::InvalidArgument
            );
        }
        let mut cfg = OptimConfig::new(StateTier::Host);
        cfg.chunk_bytes = PAGE;
        cfg.importance = Some(Importance {
            fraction: 0.5,
            every: 2,
        });
        let mut c = OffloadedAdam::new(&w0, cfg).unwrap();
        c.set_importance_window(&ImportanceWindow {
            deferred_steps: 0,
            accumulated: vec![0.0; n],
            resident: vec![],
            started: false,
        })
        .unwrap();
        assert_eq!(
            a_plain_window_is_refused(&w0).kind(),
            ErrorKind::Unsupported
        );
        c.write_state(0, &w0).unwrap();
        assert_eq!(c.read_state(0).unwrap(), w0);
    }

    fn a_plain_window_is_refused(w0: &[f32]) -> Error {
        let mut cfg = OptimConfig::new(StateTier::Host);
        cfg.chunk_bytes = PAGE;
        let mut plain = OffloadedAdam::new(w0, cfg).unwrap();
        assert!(plain.importance_window().is_none());
        plain
            .set_importance_window(&ImportanceWindow {
                deferred_steps: 0,
                accumulated: vec![0.0; w0.len()],
                resident: vec![],
                started: false,
            })
            .unwrap_err()
    }

    /// Importance mode: an optimizer restored mid-window (state arrays,
    /// step count and window written into a fresh one) continues bitwise
    /// as the original does; weights written from outside mid-window
    /// reach the resident copies; step_in_place leaves the caller's
    /// weights equal to the optimizer's at every step.
    #[test]
    fn importance_window_restores_and_steps_in_place() {
        let chunk = PAGE / 4;
        let n = 2 * chunk + 77;
        let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).sin()).collect();
        let g = |t: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| ((i * 2654435761 + t * 131) % 8191) as f32 / 8191.0 - 0.5)
                .collect()
        };
        let mut cfg = OptimConfig::new(StateTier::Cxl);
        cfg.chunk_bytes = PAGE;
        cfg.adam.lr = 1e-2;
        cfg.importance = Some(Importance {
            fraction: 0.1,
            every: 4,
        });
        let mut a = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
        let mut mine = w0.clone();
        for t in 1..=6 {
            a.step_in_place(&g(t), &mut mine).unwrap();
            assert_eq!(mine, a.read_state(0).unwrap(), "step {t}");
        }
        // Step 6 is inside the second window (flushes at 1 and 5).
        let win = a.importance_window().unwrap();
        assert_eq!(win.deferred_steps, 1);
        assert!(win.started && !win.resident.is_empty());
        let mut b = OffloadedAdam::new(&vec![0.0; n], cfg).unwrap();
        for k in 0..3 {
            b.write_state(k, &a.read_state(k).unwrap()).unwrap();
        }
        b.set_steps(a.steps());
        b.set_importance_window(&win).unwrap();
        assert_eq!(b.importance_window().unwrap(), win);
        // Weights changed from outside mid-window, in both.
        let halved: Vec<f32> = a.read_state(0).unwrap().iter().map(|w| w * 0.5).collect();
        a.write_state(0, &halved).unwrap();
        b.write_state(0, &halved).unwrap();
        assert_eq!(a.read_state(0).unwrap(), halved);
        let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for t in 7..=10 {
            a.step(&g(t)).unwrap();
            b.step(&g(t)).unwrap();
            for k in 0..3 {
                assert_eq!(
                    bits(a.read_state(k).unwrap()),
                    bits(b.read_state(k).unwrap())
                );
            }
        }
        let mut bad = win.clone();
        bad.resident = vec![5, 3];
        assert_eq!(
            b.set_importance_window(&bad).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        bad = win;
        bad.deferred_steps = 4;
        assert_eq!(
            b.set_importance_window(&bad).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
