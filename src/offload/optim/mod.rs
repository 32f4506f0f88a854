//! An offloaded Adam/AdamW: fp32 master weights and both moments live in
//! host DRAM, CXL memory (emulated where the machine has none) or NVMe, and
//! each `step` streams them through in chunks.
//!
//! | file | what |
//! |------|------|
//! | `mod.rs` | [`OffloadedAdam`]: steps, the state read and written, checkpoints |
//! | `config.rs` | [`OptimConfig`] (tier, chunk, hyper-parameters, [`Importance`], [`Updater`]) and [`StepStats`] |
//! | `states.rs` | the state arrays as runtime buffers, and the one path a step takes through them |
//! | `update.rs` | where the update runs ([`Updater`]): the CPU, or a GPU |
//! | `precision.rs` | mixed precision: the parameters' and gradients' [`Element`] types (`f32`, [`bf16`], [`f16`](struct@f16)) |
//! | `window.rs` | importance-aware mode's window ([`ImportanceWindow`]) |
//! | `tests.rs` | unit tests: failures part-way through a step, restored state |
//!
//! The arithmetic is [`crate::adam`]'s (re-exported here), shared with the
//! GPU kernel.
//!
//! **One path.** The states are buffers of a runtime: a private one that
//! [`OffloadedAdam::new`] builds for the configured tier (a host tier the
//! size of the states; or a host tier for a few chunks beside a CXL or
//! NVMe tier holding them), or the caller's ([`OffloadedAdam::on`]), where
//! the states share each tier's budget with everything else and are moved
//! by the runtime like any buffer's pages. A step is the same either way,
//! for both updaters: each chunk's weights and moments are updated on the
//! runtime's pages in the host tier, in place — pinned where they live in
//! the host tier; streamed through it from CXL or NVMe, the reads of the
//! next chunks and the writes of the previous ones overlapping the update
//! (see `states.rs`).
//!
//! "Waited on I/O" is the time the step spent waiting for its chunks'
//! pages to arrive in the host tier (and be pinned there) and, streamed,
//! for the last ones to go back.
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
//! compiler vectorizes, the chunks of a batch over rayon's threads), or on
//! a GPU (`--features cuda`: `kernels/adam.cu` through
//! `lowlevel::cuda_adam`), which takes the chunks of a batch as they lie
//! in the host tier, uploads them through pinned staging buffers in tiles,
//! double-buffered on two streams, and copies the results back before the
//! chunks are released. The kernel does the same fp32 operations in the
//! same order (no FMA contraction, IEEE division and square root), so
//! both updaters give bitwise the same state.
#![forbid(unsafe_code)]

mod config;
mod precision;
mod states;
mod update;
mod window;

use std::time::Instant;

pub use crate::adam::{adam_update, adam_update_with, AdamParams, StepScalars};
pub use config::{Importance, OptimConfig, StateTier, StepStats, Updater};
pub use precision::{bf16, f16, Element};
pub use window::ImportanceWindow;

use crate::error::{Error, ErrorKind, Result};
use crate::runtime::Runtime;
use crate::sys::Topology;
use crate::tier::{CxlConfig, CxlMode, HostConfig, NvmeConfig, Tier};
use states::{States, Window};
use update::{Gpu, Outcome, StepUpdate};
use window::{Resident, StepPlan};

/// Adam/AdamW with offloaded states; see the module docs.
pub struct OffloadedAdam {
    states: States,
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
    /// Set after a step or state write that failed part-way: the state is
    /// no longer whole.
    broken: bool,
    /// The GPU update (`Updater::Cuda`).
    gpu: Option<Gpu>,
    /// Set by [`OffloadedAdam::step_aliased`]: the caller's array holds the
    /// master weights from then on, not the tier.
    aliased: bool,
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

/// Lanes of chunks updated in place: enough for every CPU thread to find
/// work in each batch.
fn lanes() -> usize {
    4 * rayon::current_num_threads()
}

/// The private runtime of [`OffloadedAdam::new`]: its page is a chunk;
/// the states' tier holds `pages` of them, and beside CXL or NVMe a host
/// tier holds the chunks a step streams through.
fn private_runtime(config: &OptimConfig, pages: u64) -> Result<Runtime> {
    let page = config.chunk_bytes;
    let base = Runtime::builder()
        .page_size(page)
        .background_eviction(false)
        .sampling(None);
    let staging = || {
        let window = Window::fit(page, pages as usize / 3, usize::MAX);
        HostConfig::new((2 * window.host_pages() * page) as u64, page)
    };
    match &config.tier {
        StateTier::Host => base
            .host_config(HostConfig::new(pages * page as u64, page))
            .build(),
        StateTier::Cxl => {
            let topo = Topology::detect();
            let cxl = |mode| {
                base.clone()
                    .host_config(staging())
                    .cxl(CxlConfig::new(mode, pages * page as u64, page))
                    .build()
            };
            // Real CXL memory (a CPU-less node) where there is some and it
            // takes the states; emulated otherwise.
            match CxlMode::real_or_emulated(&topo) {
                CxlMode::Auto => cxl(CxlMode::Auto).or_else(|_| cxl(CxlMode::Emulated)),
                mode => cxl(mode),
            }
        }
        StateTier::Nvme(dir) => {
            // Room for the store's reserve (1/64 of its slots, ≤ 64) and
            // the pages on their way between the tiers.
            let extra = (pages / 63 + 1).min(64)
                + 2 * Window::fit(page, pages as usize / 3, usize::MAX).host_pages() as u64;
            base.host_config(staging())
                .nvme(NvmeConfig::new(dir, (pages + extra) * page as u64, page))
                .build()
        }
    }
}

impl OffloadedAdam {
    /// The checks every constructor makes.
    fn check_config(weights: &[f32], config: &OptimConfig) -> Result<()> {
        crate::size::check_page_size(config.chunk_bytes).map_err(|e| e.context("chunk"))?;
        config.adam.check()?;
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
    /// configured tier, in a runtime of the optimizer's own.
    pub fn new(weights: &[f32], config: OptimConfig) -> Result<Self> {
        Self::check_config(weights, &config)?;
        // Before any state is laid out: no GPU is the cheapest failure.
        let gpu = update::open_gpu(config.updater)?;
        let chunks = weights.len().div_ceil(config.chunk_bytes / 4);
        let rt = private_runtime(&config, chunks as u64 * 3)?;
        let states = States::lay_out(rt, home_of(&config.tier), weights, lanes())?;
        Ok(Self::assemble(states, weights.len(), config, gpu))
    }

    /// The optimizer over its laid-out `states`, before its first step.
    fn assemble(states: States, params: usize, config: OptimConfig, gpu: Option<Gpu>) -> Self {
        let accum = if config.importance.is_some() {
            vec![0.0; params]
        } else {
            Vec::new()
        };
        Self {
            states,
            params,
            chunk: config.chunk_bytes / 4,
            t: 0,
            config,
            accum,
            deferred_steps: 0,
            resident: Vec::new(),
            broken: false,
            gpu,
            aliased: false,
        }
    }

    /// Stores `weights` as the fp32 master weights (moments zero) in
    /// buffers of `rt`, a runtime shared with the caller's buffers and
    /// other offload objects: the states take their place in `config.tier`
    /// of `rt` (host, CXL or NVMe — for NVMe the runtime's own, the path in
    /// `StateTier::Nvme` is not used) under the same budgets as everything
    /// else, placed there first and moved by the runtime like any buffer's
    /// pages. `config.chunk_bytes` must be `rt`'s page size. Steps take the
    /// same path as [`new`](Self::new)'s, through `rt`'s host tier. Updates
    /// run on the CPU (`Updater::Cpu`).
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
        let home = home_of(&config.tier);
        if !rt.tiers().contains(&home) {
            return Err(Error::invalid(format!(
                "the runtime has no {home} tier for the optimizer's states"
            )));
        }
        let states = States::lay_out(rt.clone(), home, weights, lanes())?;
        Ok(Self::assemble(states, weights.len(), config, None))
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
        let home = self.states.home();
        self.states
            .runtime()
            .stats()
            .tiers
            .iter()
            .any(|t| t.tier == home && t.emulated)
    }

    /// Where the update runs.
    pub fn updater(&self) -> Updater {
        self.config.updater
    }

    /// The GPU the update runs on ("GPU 0 (name)"), if it runs on one.
    pub fn gpu(&self) -> Option<String> {
        self.gpu.as_ref().map(update::describe)
    }

    fn check(&self, grads: usize, unscale: f32) -> Result<()> {
        self.check_not_aliased()?;
        if self.broken {
            return Err(Error::new(
                ErrorKind::Closed,
                "an earlier step failed part-way (reading, updating or writing the state); it is no longer whole",
            ));
        }
        if grads != self.params {
            return Err(Error::invalid(format!(
                "{grads} gradients for {} parameters",
                self.params
            )));
        }
        if !(unscale.is_finite() && unscale > 0.0) {
            return Err(Error::invalid(format!(
                "a gradient unscale factor of {unscale}: it must be finite and positive"
            )));
        }
        Ok(())
    }

    fn check_not_aliased(&self) -> Result<()> {
        if self.aliased {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the master weights are the caller's array (step_aliased): step with step_aliased, and read the weights from that array",
            ));
        }
        Ok(())
    }

    fn check_len(&self, n: usize, what: &str) -> Result<()> {
        if n != self.params {
            return Err(Error::invalid(format!(
                "{n} {what} for {} parameters",
                self.params
            )));
        }
        Ok(())
    }

    /// One optimizer step with these gradients. A step that fails before
    /// it updated any chunk (the state could not be pinned or read: a
    /// shared runtime's tier full for a moment, a failed read) leaves the
    /// optimizer as it was, and can be taken again; one that fails
    /// part-way leaves some chunks updated and others not, and the
    /// optimizer refuses further steps (`Closed`).
    pub fn step(&mut self, grads: &[f32]) -> Result<StepStats> {
        self.step_into(grads, None)
    }

    /// As [`step`](Self::step), also leaving the updated weights in
    /// `weights` (one per parameter): a framework's parameter tensor. Each
    /// chunk's weights are copied out while the update has them (no second
    /// pass over the tier). A wrong length is refused before the step; a
    /// step that fails part-way may leave some chunks of `weights` new (the
    /// optimizer then refuses further steps, as after any failed step).
    pub fn step_into(
        &mut self,
        grads: &[f32],
        mut weights: Option<&mut [f32]>,
    ) -> Result<StepStats> {
        if let Some(w) = weights.as_deref() {
            self.check_len(w.len(), "weights out")?;
        }
        let (stats, streamed) = self.step_inner(grads, 1.0, weights.as_deref_mut())?;
        if let (Some(w), false) = (weights, streamed) {
            // A step inside an importance window: the tier's weights and
            // the resident ones. The step itself has happened; weights
            // that could not be read back leave `w` neither before nor
            // after it, so the optimizer refuses further steps, as after
            // any failed step.
            if let Err(e) = self.read_state_into(0, w) {
                self.broken = true;
                return Err(e);
            }
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
        self.step_mixed(grads, 1.0, weights)
    }

    /// The mixed-precision step: as [`step_in_place`](Self::step_in_place),
    /// with gradients and parameters each in their own [`Element`] type
    /// (`f32`, [`bf16`] or [`f16`](struct@f16); a framework's bf16 parameters with
    /// bf16 or fp32 gradients, say). The fp32 master weights and moments
    /// in the tier are the truth: each chunk's gradients are widened to
    /// fp32 and multiplied by `unscale` (1 / a loss scale, or 1), the
    /// update runs in fp32, and the new master weights are rounded to
    /// nearest even into `weights`. A bad length or an `unscale` that is
    /// not finite and positive is refused before the step.
    pub fn step_mixed<G: Element, W: Element>(
        &mut self,
        grads: &[G],
        unscale: f32,
        weights: &mut [W],
    ) -> Result<StepStats> {
        self.check_len(weights.len(), "weights out")?;
        let in_window = self
            .config
            .importance
            .is_some_and(|imp| !self.resident.is_empty() && self.deferred_steps + 1 < imp.every);
        if !in_window {
            let (stats, streamed) = self.step_inner(grads, unscale, Some(weights))?;
            debug_assert!(streamed, "a step outside a window streams the states");
            return Ok(stats);
        }
        let (stats, _) = self.step_inner(grads, unscale, None::<&mut [W]>)?;
        for (c, r) in self.resident.iter().enumerate() {
            r.merge_into(0, &mut weights[c * self.chunk..]);
        }
        Ok(stats)
    }

    /// A step whose master weights are the caller's fp32 array (a
    /// framework's parameter tensor): the tier keeps only the moments'
    /// truth, and each element of `weights` is read and written once, in
    /// place — 28 bytes a parameter for fp32 gradients, against 32 for
    /// [`step_mixed`](Self::step_mixed)'s master beside the parameter.
    /// With the states in CXL or on NVMe only the moments stream (two
    /// arrays of the three: 16 bytes a parameter each way, not 24).
    /// In plain mode, updated on the CPU;
    /// `weights` must hold the values the optimizer was built with (or
    /// last written with [`write_state`](Self::write_state)`(0, ..)`)
    /// at the first aliased step. From then on every step is aliased and
    /// the tier's weights are not kept: [`read_state`](Self::read_state)`(0)`
    /// and the other steps are refused (the weights are the caller's).
    pub fn step_aliased<G: Element>(
        &mut self,
        grads: &[G],
        unscale: f32,
        weights: &mut [f32],
    ) -> Result<StepStats> {
        if self.config.importance.is_some() || self.gpu.is_some() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "an aliased step needs plain mode and the CPU updater",
            ));
        }
        self.check_len(weights.len(), "weights")?;
        let was = std::mem::replace(&mut self.aliased, false);
        if let Err(e) = self.check(grads.len(), unscale) {
            self.aliased = was;
            return Err(e);
        }
        let r = self.step_inner_as(grads, unscale, Some(weights), true);
        // Even a failed aliased step may have updated some chunks of
        // `weights`: the tier's copy is no longer theirs.
        self.aliased = true;
        Ok(r?.0)
    }

    /// The step; true when it streamed the states (and so filled
    /// `weights`).
    fn step_inner<G: Element, W: Element>(
        &mut self,
        grads: &[G],
        unscale: f32,
        weights: Option<&mut [W]>,
    ) -> Result<(StepStats, bool)> {
        self.step_inner_as(grads, unscale, weights, false)
    }

    fn step_inner_as<G: Element, W: Element>(
        &mut self,
        grads: &[G],
        unscale: f32,
        weights: Option<&mut [W]>,
        alias: bool,
    ) -> Result<(StepStats, bool)> {
        self.check(grads.len(), unscale)?;
        let start = Instant::now();
        let (t_before, deferred_before) = (self.t, self.deferred_steps);
        // Saturating: a step count restored at the top of its range stays
        // there (the bias corrections are 1 long before it).
        self.t = self.t.saturating_add(1);
        let s = StepScalars::new(self.config.adam, self.t);
        let mut flush = None;
        if let Some(imp) = self.config.importance {
            self.deferred_steps += 1;
            if self.resident.is_empty() || self.deferred_steps >= imp.every {
                flush = Some((imp.fraction, self.deferred_steps));
            } else {
                // A step inside a window: no state I/O.
                let g = G::widen(grads, unscale);
                if let Err(e) = self.resident_step(&g, &s) {
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
        let mut accs = self.accum.chunks_mut(plan.chunk);
        let mut outs = weights.map(|w| w.chunks_mut(plan.chunk));
        let mut outcomes: Vec<Outcome<'_, W>> = (0..n_chunks)
            .map(|_| Outcome {
                acc: accs.next().unwrap_or_default(),
                chosen: None,
                weights_out: outs.as_mut().and_then(Iterator::next).unwrap_or_default(),
            })
            .collect();
        let old = std::mem::take(&mut self.resident);
        let job = StepUpdate {
            s,
            plan,
            grads,
            unscale,
            alias,
            old: &old,
        };
        // A GPU takes many chunks at once, one call at a time.
        let across = self.gpu.is_some();
        let gpu = parking_lot::Mutex::new(&mut self.gpu);
        // A failure past this point may leave some chunks updated and
        // others not: the optimizer refuses further steps. One before any
        // chunk was updated (its state could not be pinned or read: a
        // shared runtime's tier full for a moment, a read that failed)
        // changed nothing, and the step can be taken again.
        let updated = std::sync::atomic::AtomicBool::new(false);
        let streamed = self.states.step(&mut outcomes, across, alias, &|batch| {
            updated.store(true, std::sync::atomic::Ordering::Relaxed);
            job.run(gpu.lock().as_mut(), batch)
        });
        let chosen = outcomes.into_iter().map(|o| o.chosen);
        let io_wait = match streamed {
            Ok(d) => d,
            Err(e) if !updated.load(std::sync::atomic::Ordering::Relaxed) => {
                self.t = t_before;
                self.deferred_steps = deferred_before;
                self.resident = old;
                return Err(e);
            }
            Err(e) => {
                self.broken = true;
                if flush.is_some() {
                    // What `read_state` merges in: the new resident copy
                    // of the chunks this flush updated, the old one (still
                    // the truth) of the others.
                    let mut old = old.into_iter();
                    self.resident = chosen
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
            self.resident = chosen.map(Option::unwrap_or_default).collect();
            self.deferred_steps = 0;
        }
        // The tier's arrays a step reads and writes: the moments alone
        // where the caller's array is the master.
        let arrays = if alias { 2 } else { 3 };
        let bytes = self.chunks() as u64 * arrays * self.config.chunk_bytes as u64;
        let stats = StepStats {
            seconds: start.elapsed().as_secs_f64(),
            bytes_read: bytes,
            bytes_written: bytes,
            io_wait_seconds: io_wait.as_secs_f64(),
        };
        Ok((stats, true))
    }

    /// A step inside an importance window: the resident elements update
    /// with their gradients (on the GPU with `Updater::Cuda`), the others
    /// accumulate theirs. No state in the tier is touched.
    fn resident_step(&mut self, grads: &[f32], s: &StepScalars) -> Result<()> {
        use rayon::prelude::*;
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
        let arrays = self
            .resident
            .iter_mut()
            .zip(&gathered)
            .map(|(r, g)| update::Arrays {
                w: &mut r.w,
                m: &mut r.m,
                v: &mut r.v,
                g,
            })
            .collect();
        update::update_arrays(self.gpu.as_mut(), s, arrays)?;
        window::accumulate(&mut self.accum, grads, chunk, &self.resident);
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
    /// parameter): the state is read straight into it, so a caller that
    /// keeps the parameters in an array of its own (a framework's tensor)
    /// pays one pass over them and no allocation.
    pub fn read_state_into(&self, which: usize, out: &mut [f32]) -> Result<()> {
        if which > 2 {
            return Err(Error::invalid(format!("state {which}: use 0, 1 or 2")));
        }
        self.check_len(out.len(), "values")?;
        if which == 0 {
            self.check_not_aliased()?;
        }
        self.states.read(which, out)?;
        // Between flushes the resident copy is the truth.
        for (c, r) in self.resident.iter().enumerate() {
            r.merge_into(which, &mut out[c * self.chunk..]);
        }
        Ok(())
    }

    /// The hyper-parameters the next steps use.
    pub fn adam(&self) -> AdamParams {
        self.config.adam
    }

    /// Changes the hyper-parameters from the next step on (a learning-rate
    /// schedule, a framework's parameter groups edited between steps).
    pub fn set_adam(&mut self, adam: AdamParams) -> Result<()> {
        adam.check()?;
        self.config.adam = adam;
        Ok(())
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
        self.check_len(values.len(), "values")?;
        if let Err(e) = self.states.write(which, values) {
            self.broken = true;
            return Err(e);
        }
        for (c, r) in self.resident.iter_mut().enumerate() {
            r.take_from(which, &values[c * self.chunk..]);
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
        window.check(self.params, imp.every)?;
        let mut resident = Vec::new();
        if window.started {
            let state: Vec<Vec<f32>> = (0..3).map(|k| self.read_state(k)).collect::<Result<_>>()?;
            resident = window.residents(&state, self.chunk, self.chunks());
        }
        self.resident = resident;
        self.accum.clone_from(&window.accumulated);
        self.deferred_steps = window.deferred_steps;
        Ok(())
    }
}

/// The runtime tier a [`StateTier`] names.
fn home_of(tier: &StateTier) -> Tier {
    match tier {
        StateTier::Host => Tier::Host,
        StateTier::Cxl => Tier::Cxl,
        StateTier::Nvme(_) => Tier::Nvme,
    }
}

#[cfg(test)]
mod tests;
