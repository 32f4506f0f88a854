//! The tiered embedding table: rows of fp32 values in a runtime
//! [`Buffer`], whose pages live in any tier (device, host, CXL, NVMe) and
//! move as the balancer decides.
//!
//! One call does a whole batch:
//!
//! - [`EmbeddingTable::gather`]: pooled lookups in `nn.EmbeddingBag`'s
//!   form (indices, offsets with one entry more than the bags, sum or mean,
//!   optional per-sample weights, a padding index). Rows are read through
//!   the buffer from wherever their page lives; every NVMe page of the
//!   batch, and every memory page enough of its lookups share, is read
//!   whole once, on worker threads in parallel (one synchronous read per
//!   thread, so a batch keeps that many NVMe reads in flight).
//! - [`EmbeddingTable::gather_mapped`]: the same pooling as a kernel on the
//!   simulated device runs it: through a read-only launch of the table's
//!   device map (NVMe pages staged into memory first), each element load
//!   counted on its bag's own sampler.
//! - [`EmbeddingTable::sgd`] and [`EmbeddingTable::rowwise_adagrad`]: fused
//!   sparse updates (FBGEMM's) that write the touched rows back in place.
//!
//! Every lookup counts in its page's access counter, so the balancer sees
//! the table's hotness. Bad input (an index outside the table, malformed
//! offsets, an array of the wrong length, a row repeated in an update) is
//! an [`EmbeddingError`] returned before anything is read or written.
//!
//! Bound by Python's `strata.nn.EmbeddingBag` and by the C ABI's
//! `strata_embedding_*`; `strata bench recsys` pools with it.
#![forbid(unsafe_code)]

mod error;
mod pages;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::device::BackendKind;
use crate::runtime::{Access, Buffer, Placement, Runtime};
use crate::tier::Tier;

pub use error::{EmbeddingError, Result};
use pages::{Fetched, Rows, Rule};

/// The update a fused [`EmbeddingTable::backward`] applies to each row.
#[derive(Debug)]
pub enum Update<'s> {
    /// `w -= lr * g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Row-wise Adagrad, as [`EmbeddingTable::rowwise_adagrad`] (`state`:
    /// one accumulator per table row).
    RowwiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the accumulator's square root.
        eps: f32,
        /// One accumulator per table row, updated in place.
        state: &'s mut [f32],
    },
}

/// Lookups a gather pools on the calling thread alone, below which a
/// second pooling thread costs more than it saves.
const POOL_ALONE: usize = 1 << 14;

/// Worker threads of a table's page reads and updates, unless set.
pub const DEFAULT_THREADS: usize = 16;
/// The most worker threads a table takes.
pub const MAX_THREADS: usize = 1024;

/// How a table is made ([`EmbeddingTable::with_options`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableOptions {
    /// Where the rows' pages go when first written.
    pub placement: Placement,
    /// Worker threads for page reads and updates: the NVMe reads a batch
    /// keeps in flight (1..=[`MAX_THREADS`]).
    pub threads: usize,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            placement: Placement::Fastest,
            threads: DEFAULT_THREADS,
        }
    }
}

/// How a bag's rows are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The (weighted) sum of the rows.
    #[default]
    Sum,
    /// The (weighted) sum divided by the number of rows pooled.
    Mean,
}

/// The bags of one gather, in `nn.EmbeddingBag`'s form.
#[derive(Debug, Clone, Copy)]
pub struct Bags<'a> {
    /// Row indices, all bags one after another.
    pub indices: &'a [i64],
    /// Bag `b` is `indices[offsets[b]..offsets[b + 1]]`: one entry more
    /// than the bags, from 0 to `indices.len()`, never decreasing (an
    /// empty bag pools to zeros).
    pub offsets: &'a [i64],
    /// One weight per index, multiplying its row (None: all 1).
    pub weights: Option<&'a [f32]>,
    /// Sum or mean.
    pub pooling: Pooling,
    /// Indices equal to this are left out (of a mean's count too).
    pub padding_idx: Option<i64>,
}

impl<'a> Bags<'a> {
    /// Summed bags without weights or padding.
    pub fn new(indices: &'a [i64], offsets: &'a [i64]) -> Self {
        Self {
            indices,
            offsets,
            weights: None,
            pooling: Pooling::Sum,
            padding_idx: None,
        }
    }

    /// With per-sample weights.
    pub fn weights(mut self, weights: &'a [f32]) -> Self {
        self.weights = Some(weights);
        self
    }

    /// With `pooling`.
    pub fn pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// With a padding index.
    pub fn padding_idx(mut self, padding_idx: Option<i64>) -> Self {
        self.padding_idx = padding_idx;
        self
    }

    /// Bags described (offsets less one; checked by the gather).
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// No bag at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Lookups of one gather, or of a table since it was made or
/// [`reset_stats`](EmbeddingTable::reset_stats) last ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lookups {
    /// Row lookups (padding included).
    pub lookups: u64,
    /// Those whose row (its first page) was in the runtime's fastest tier
    /// when the batch was gathered.
    pub fast_hits: u64,
}

/// An embedding table of `rows` rows of `dim` fp32 values in a buffer of a
/// runtime (row `r` at byte `r * dim * 4`; rows may straddle pages). Calls
/// may run from several threads at once; updates of the same rows from two
/// threads at once leave either's result.
pub struct EmbeddingTable {
    rt: Runtime,
    buf: Arc<Buffer>,
    rows: u64,
    dim: usize,
    page: u64,
    fastest: Tier,
    threads: usize,
    lookups: AtomicU64,
    fast_hits: AtomicU64,
}

impl std::fmt::Debug for EmbeddingTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingTable")
            .field("rows", &self.rows)
            .field("dim", &self.dim)
            .field("pages", &self.buf.page_count())
            .finish()
    }
}

impl EmbeddingTable {
    /// A table of `rows` × `dim` in `rt`, pages in the fastest tier with
    /// room, [`DEFAULT_THREADS`] workers. Rows read as zeros until written.
    pub fn new(rt: &Runtime, rows: u64, dim: usize) -> Result<Self> {
        Self::with_options(rt, rows, dim, TableOptions::default())
    }

    /// A table of `rows` × `dim` in `rt`, as `options` say.
    pub fn with_options(
        rt: &Runtime,
        rows: u64,
        dim: usize,
        options: TableOptions,
    ) -> Result<Self> {
        if rows == 0 || dim == 0 {
            return Err(EmbeddingError::Invalid(format!(
                "an embedding table needs at least one row and one column ({rows} x {dim})"
            )));
        }
        if !(1..=MAX_THREADS).contains(&options.threads) {
            return Err(EmbeddingError::Invalid(format!(
                "threads {} is not in 1..={MAX_THREADS}",
                options.threads
            )));
        }
        let bytes = (dim as u64)
            .checked_mul(4)
            .and_then(|b| b.checked_mul(rows))
            .ok_or_else(|| {
                EmbeddingError::Invalid(format!("{rows} rows of {dim} float32 overflow a size"))
            })?;
        let buf = rt.alloc_with(bytes, options.placement)?;
        Ok(Self {
            rt: rt.clone(),
            buf: Arc::new(buf),
            rows,
            dim,
            page: rt.page_size() as u64,
            fastest: rt.tiers()[0],
            threads: options.threads,
            lookups: AtomicU64::new(0),
            fast_hits: AtomicU64::new(0),
        })
    }

    /// Rows in the table.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// fp32 values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The buffer holding the rows.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buf
    }

    /// The runtime the table lives in.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The runtime's fastest tier, whose lookups count as fast hits.
    pub fn fast_tier(&self) -> Tier {
        self.fastest
    }

    fn io(&self) -> Rows<'_> {
        Rows {
            buf: &self.buf,
            dim: self.dim,
            page: self.page,
            threads: self.threads,
        }
    }

    fn row_bytes(&self) -> u64 {
        self.dim as u64 * 4
    }

    /// Refuses any index outside the table.
    fn check_indices(&self, idx: &[i64]) -> Result<()> {
        match idx.iter().find(|&&i| i < 0 || i as u64 >= self.rows) {
            Some(&index) => Err(EmbeddingError::IndexOutOfRange {
                index,
                rows: self.rows,
            }),
            None => Ok(()),
        }
    }

    /// The page (an index into the buffer) row `row` starts in.
    pub fn page_of_row(&self, row: i64) -> Result<u64> {
        self.check_indices(&[row])?;
        Ok(row as u64 * self.row_bytes() / self.page)
    }

    /// The tier of the page row `row` starts in (None: never written).
    pub fn tier_of_row(&self, row: i64) -> Result<Option<Tier>> {
        let p = self.page_of_row(row)?;
        Ok(self.buf.tier_of(p as usize)?)
    }

    /// Writes `data` (a whole number of rows) as rows `start`, `start + 1`,
    /// ..., in page-aligned pieces on the worker threads.
    pub fn write_rows(&self, start: i64, data: &[f32]) -> Result<()> {
        if data.len() % self.dim != 0 {
            return Err(EmbeddingError::Invalid(format!(
                "{} float32 are not a whole number of rows of {}",
                data.len(),
                self.dim
            )));
        }
        let n = (data.len() / self.dim) as u64;
        if start < 0 || start as u64 + n > self.rows {
            return Err(EmbeddingError::RowsOutOfRange {
                start,
                end: start as i128 + n as i128,
                rows: self.rows,
            });
        }
        let at = start as u64 * self.row_bytes();
        Ok(self.io().write_parallel(at, bytemuck::cast_slice(data))?)
    }

    /// Reads the rows of `indices` into `out` (`indices.len()` rows),
    /// uncounted in [`stats`](Self::stats) (the pages' access counters
    /// see them).
    pub fn read_rows(&self, indices: &[i64], out: &mut [f32]) -> Result<()> {
        self.check_indices(indices)?;
        self.check_rows_len("out", out.len(), indices.len())?;
        let offsets: Vec<i64> = (0..=indices.len() as i64).collect();
        let bags = Bags::new(indices, &offsets);
        let (fetched, _) = self.io().fetch(indices, self.fastest)?;
        self.pool(&fetched, &bags, 0, out)
    }

    /// Checks `bags` and `out` against the table: indices in range,
    /// offsets well formed, one weight per index, `out` one row per bag.
    fn check_bags(&self, bags: &Bags<'_>, out: &[f32], what: &'static str) -> Result<()> {
        let (idx, offsets) = (bags.indices, bags.offsets);
        self.check_indices(idx)?;
        if offsets.first() != Some(&0) {
            return Err(EmbeddingError::Offsets("offsets must start at 0".into()));
        }
        if let Some(w) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(EmbeddingError::Offsets(format!(
                "offsets must be non-decreasing (offset {} is {}, offset {} is {})",
                w,
                offsets[w],
                w + 1,
                offsets[w + 1]
            )));
        }
        let last = *offsets.last().expect("starts at 0");
        if last != idx.len() as i64 {
            return Err(EmbeddingError::Offsets(format!(
                "the last offset {last} is not the number of indices {}",
                idx.len()
            )));
        }
        if let Some(w) = bags.weights {
            if w.len() != idx.len() {
                return Err(EmbeddingError::Length {
                    what: "weights",
                    len: w.len(),
                    want: idx.len(),
                    why: "one per index".into(),
                });
            }
        }
        let want = bags.len() * self.dim;
        if out.len() != want {
            return Err(EmbeddingError::Length {
                what,
                len: out.len(),
                want,
                why: format!("{} bags of {}", bags.len(), self.dim),
            });
        }
        Ok(())
    }

    /// Pools `bags` into `out` (one row of `dim` per bag), reading each
    /// row through the buffer from wherever its page lives (see the
    /// module's comment). Returns the call's lookups, which also add to
    /// [`stats`](Self::stats).
    pub fn gather(&self, bags: &Bags<'_>, out: &mut [f32]) -> Result<Lookups> {
        self.check_bags(bags, out, "out")?;
        let (fetched, hits) = self.io().fetch(bags.indices, self.fastest)?;
        // Two pooling workers for a large batch: the rows are copied and
        // summed by the CPU, which the NVMe reads above no longer wait on
        // (a small one pools here: a thread costs more than it saves).
        let n = bags.len();
        let workers = if bags.indices.len() < POOL_ALONE {
            1
        } else {
            2usize.min(n.max(1))
        };
        let per = n.div_ceil(workers).max(1);
        if workers == 1 {
            self.pool(&fetched, bags, 0, out)?;
            return Ok(self.count(Lookups {
                lookups: bags.indices.len() as u64,
                fast_hits: hits,
            }));
        }
        let errors: Vec<EmbeddingError> = std::thread::scope(|s| {
            let hs: Vec<_> = out
                .chunks_mut(per * self.dim)
                .enumerate()
                .map(|(k, dst)| {
                    let fetched = &fetched;
                    s.spawn(move || self.pool(fetched, bags, k * per, dst))
                })
                .collect();
            hs.into_iter()
                .filter_map(|h| h.join().expect("a pooling worker panicked").err())
                .collect()
        });
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        Ok(self.count(Lookups {
            lookups: bags.indices.len() as u64,
            fast_hits: hits,
        }))
    }

    /// Pools the bags of `out` (rows of `dim`), the first being bag `first`.
    fn pool(
        &self,
        fetched: &Fetched,
        bags: &Bags<'_>,
        first: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let io = self.io();
        let mut row = vec![0f32; self.dim];
        for (k, dst) in out.chunks_mut(self.dim).enumerate() {
            dst.fill(0.0);
            let mut kept = 0;
            for (r, w) in bag_rows(bags, first + k) {
                io.row(fetched, r, &mut row)?;
                add_row(dst, &row, w);
                kept += 1;
            }
            finish_bag(dst, kept, bags.pooling);
        }
        Ok(())
    }

    /// Pools `bags` into `out` as a kernel on the simulated device does:
    /// the table's device map is prepared for a read-only launch (NVMe
    /// pages staged into a memory tier first, as for any launch), and each
    /// bag reads its rows element by element through the map, counting
    /// every load on a sampler of its own seeded `seed + bag` (as
    /// [`Launch::reader`](crate::runtime::Launch::reader)). Bags run in
    /// parallel. A lookup is a fast hit when its row's page was in device
    /// memory. Returns the call's lookups, which also add to
    /// [`stats`](Self::stats). `OutOfCapacity` when the memory tiers
    /// cannot hold the whole table (as for any launch); `Unsupported` on a
    /// CUDA device, whose memory the host cannot read. Writes to the table
    /// are refused while the call runs.
    pub fn gather_mapped(&self, bags: &Bags<'_>, seed: u64, out: &mut [f32]) -> Result<Lookups> {
        self.check_bags(bags, out, "out")?;
        if self.rt.device_backend() == Some(BackendKind::Cuda) {
            return Err(crate::error::Error::new(
                crate::error::ErrorKind::Unsupported,
                "gather_mapped reads through the device map as a simulated kernel: a CUDA device's memory is not readable by the host (use gather)",
            )
            .into());
        }
        let map = self.buf.device_map()?;
        let launch = map.prepare(Access::ReadOnly)?;
        let dim = self.dim;
        let hits: u64 = out
            .par_chunks_mut(dim.max(1))
            .enumerate()
            .map(|(b, dst)| {
                let mut reader = launch.reader(seed.wrapping_add(b as u64));
                let (mut hits, mut kept) = (0u64, 0usize);
                dst.fill(0.0);
                for (r, w) in bag_rows(bags, b) {
                    let base = r * dim as u64;
                    let w = w.unwrap_or(1.0);
                    for (d, o) in dst.iter_mut().enumerate() {
                        let (v, _, on_device) = reader.load_at::<f32>(base + d as u64);
                        if d == 0 {
                            hits += u64::from(on_device);
                        }
                        // `w * v` is `v` exactly for w = 1.
                        *o += w * v;
                    }
                    kept += 1;
                }
                finish_bag(dst, kept, bags.pooling);
                hits
            })
            .sum();
        drop(launch);
        Ok(self.count(Lookups {
            lookups: bags.indices.len() as u64,
            fast_hits: hits,
        }))
    }

    fn count(&self, l: Lookups) -> Lookups {
        self.lookups.fetch_add(l.lookups, Ordering::Relaxed);
        self.fast_hits.fetch_add(l.fast_hits, Ordering::Relaxed);
        l
    }

    /// Checks that `what` holds `len` floats: `rows` rows of the table's
    /// width.
    fn check_rows_len(&self, what: &'static str, len: usize, rows: usize) -> Result<()> {
        let want = rows * self.dim;
        if len != want {
            return Err(EmbeddingError::Length {
                what,
                len,
                want,
                why: format!("{rows} rows of {}", self.dim),
            });
        }
        Ok(())
    }

    /// Checks a fused update's rows and gradients.
    fn check_update(&self, rows: &[i64], grads: &[f32]) -> Result<()> {
        self.check_indices(rows)?;
        self.check_rows_len("grads", grads.len(), rows.len())?;
        let mut sorted = rows.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(EmbeddingError::RepeatedRow { row: w[0] });
        }
        Ok(())
    }

    /// SGD on the distinct rows `rows` with their gradients `grads`
    /// (`rows.len()` × `dim`): `w -= lr * g`, in place.
    pub fn sgd(&self, rows: &[i64], grads: &[f32], lr: f32) -> Result<()> {
        if !lr.is_finite() {
            return Err(EmbeddingError::Invalid(format!(
                "lr {lr} is not a finite number"
            )));
        }
        self.check_update(rows, grads)?;
        Ok(self.io().update(rows, grads, Rule::Sgd { lr }, None)?)
    }

    /// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) on the distinct
    /// rows `rows` with gradients `grads`; `state` (one accumulator per
    /// table row) is updated in place:
    ///
    /// ```text
    /// state[r] += mean(g * g);  w -= lr / (sqrt(state[r]) + eps) * g
    /// ```
    pub fn rowwise_adagrad(
        &self,
        rows: &[i64],
        grads: &[f32],
        state: &mut [f32],
        lr: f32,
        eps: f32,
    ) -> Result<()> {
        if !(lr.is_finite() && eps.is_finite() && eps >= 0.0) {
            return Err(EmbeddingError::Invalid(format!(
                "lr {lr} and eps {eps} must be finite (eps non-negative)"
            )));
        }
        self.check_update(rows, grads)?;
        if state.len() as u64 != self.rows {
            return Err(EmbeddingError::Length {
                what: "state",
                len: state.len(),
                want: self.rows as usize,
                why: "one accumulator per table row".into(),
            });
        }
        let rule = Rule::RowwiseAdagrad { lr, eps };
        Ok(self.io().update(rows, grads, rule, Some(state))?)
    }

    /// The fused backward of pooling `bags`: each bag's gradient (`grad`,
    /// one row of `dim` per bag) is spread over its rows — times the row's
    /// weight, divided by the bag's count for a mean, padding left out —
    /// summed per distinct row in lookup order, and `update` applied to
    /// each row once (FBGEMM's fused backward; the same sums as a
    /// framework's `index_add` over the lookups).
    pub fn backward(&self, bags: &Bags<'_>, grad: &[f32], update: Update<'_>) -> Result<()> {
        self.check_bags(bags, grad, "grad")?;
        let d = self.dim;
        // Per kept lookup: its row, its bag and its share of the bag's gradient.
        let mut looks: Vec<(i64, usize, f32)> = Vec::with_capacity(bags.indices.len());
        for b in 0..bags.len() {
            let (lo, hi) = (bags.offsets[b] as usize, bags.offsets[b + 1] as usize);
            let kept = (lo..hi)
                .filter(|&i| Some(bags.indices[i]) != bags.padding_idx)
                .count();
            for i in lo..hi {
                let row = bags.indices[i];
                if Some(row) == bags.padding_idx {
                    continue;
                }
                let mut share = 1.0f32;
                if bags.pooling == Pooling::Mean {
                    share /= kept as f32;
                }
                if let Some(w) = bags.weights {
                    share *= w[i];
                }
                looks.push((row, b, share));
            }
        }
        // Stable: a row's lookups stay in order.
        looks.sort_by_key(|l| l.0);
        let mut rows: Vec<i64> = Vec::new();
        let mut grads: Vec<f32> = Vec::new();
        for &(row, b, share) in &looks {
            if rows.last() != Some(&row) {
                rows.push(row);
                grads.resize(grads.len() + d, 0.0);
            }
            let at = grads.len() - d;
            let src = &grad[b * d..(b + 1) * d];
            for (g, &x) in grads[at..].iter_mut().zip(src) {
                *g += x * share;
            }
        }
        match update {
            Update::Sgd { lr } => self.sgd(&rows, &grads, lr),
            Update::RowwiseAdagrad { lr, eps, state } => {
                self.rowwise_adagrad(&rows, &grads, state, lr, eps)
            }
        }
    }

    /// Lookups since the table was made or [`reset_stats`](Self::reset_stats)
    /// last ran.
    pub fn stats(&self) -> Lookups {
        Lookups {
            lookups: self.lookups.load(Ordering::Relaxed),
            fast_hits: self.fast_hits.load(Ordering::Relaxed),
        }
    }

    /// Sets [`stats`](Self::stats) back to zero.
    pub fn reset_stats(&self) {
        self.lookups.store(0, Ordering::Relaxed);
        self.fast_hits.store(0, Ordering::Relaxed);
    }
}

/// The lookups bag `b` of `bags` pools, in index order: (row, weight; None
/// for 1), indices equal to the padding index left out.
fn bag_rows<'b>(bags: &'b Bags<'_>, b: usize) -> impl Iterator<Item = (u64, Option<f32>)> + 'b {
    let (lo, hi) = (bags.offsets[b] as usize, bags.offsets[b + 1] as usize);
    (lo..hi)
        .filter(|&i| Some(bags.indices[i]) != bags.padding_idx)
        .map(|i| (bags.indices[i] as u64, bags.weights.map(|w| w[i])))
}

/// Ends a bag's pooling: a mean divides the sum by the `kept` rows (an
/// empty bag, or one of padding only, stays zeros).
fn finish_bag(dst: &mut [f32], kept: usize, pooling: Pooling) {
    if pooling == Pooling::Mean && kept > 0 {
        let inv = kept as f32;
        dst.iter_mut().for_each(|o| *o /= inv);
    }
}

/// `dst += w * row` (`dst += row` without a weight).
#[inline]
fn add_row(dst: &mut [f32], row: &[f32], w: Option<f32>) {
    match w {
        None => dst.iter_mut().zip(row).for_each(|(o, &v)| *o += v),
        Some(w) => dst.iter_mut().zip(row).for_each(|(o, &v)| *o += w * v),
    }
}

#[cfg(test)]
mod tests;
