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
mod rows;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::device::BackendKind;
use crate::runtime::{Access, Buffer, Placement, Runtime};
use crate::tier::Tier;

pub use error::{EmbeddingError, Result};
use pages::{Fetched, PageLocks, Rows, Rule};
pub use rows::RowCacheOptions;
use rows::{Look, RowCache};

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

/// Runs `f` on a copy of `out` (strata's own memory lent out: a pinned
/// page's view), written back once `f` has returned, failed or not.
fn through_copy<R>(out: &mut [f32], f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
    let mut copy = out.to_vec();
    let r = f(&mut copy);
    // Back on error too: what the call did to it (an update's accumulators
    // of the rows that took their step) stays as it would without the copy.
    out.copy_from_slice(&copy);
    r
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
    /// Rows kept in the fastest memory tier at their own granularity (a
    /// row cache, as FBGEMM's UVM caching): the simulated device's memory,
    /// or host memory on a runtime without a device (refused on a CUDA
    /// device); both gathers read through it, and updates of cached rows
    /// stay in it until the rows leave it or
    /// [`flush`](EmbeddingTable::flush) (a write-back cache: gathers
    /// write the changed rows they evict, so they fail while the table's
    /// buffer is held read-only, by a view or a launch). Changes not
    /// written back when the table drops go with it. None by default.
    pub row_cache: Option<RowCacheOptions>,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            placement: Placement::Fastest,
            threads: DEFAULT_THREADS,
            row_cache: None,
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
    /// when the batch was gathered, or in the row cache.
    pub fast_hits: u64,
    /// Of `fast_hits`, those the row cache served.
    pub cache_hits: u64,
    /// Missed rows the row cache took in (each filled by the miss's own
    /// read).
    pub cache_fills: u64,
}

/// An embedding table of `rows` rows of `dim` fp32 values in a buffer of a
/// runtime (row `r` at byte `r * dim * 4`; rows may straddle pages). Calls
/// may run from several threads at once: every update and write of rows
/// applies whole, whichever rows the others touch (two threads' updates of
/// one row both apply, one after the other); a read racing a write of a
/// row that straddles two pages may see part of each.
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
    cache_hits: AtomicU64,
    cache_fills: AtomicU64,
    /// The row cache, if any: every call that reads or writes the table
    /// through it holds it for the whole call.
    cache: Option<parking_lot::Mutex<RowCache>>,
    /// Held by the rows' read-modify-writes and writes ([`PageLocks`]).
    locks: PageLocks,
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
        let cache = options
            .row_cache
            .map(|o| RowCache::new(rt, o, dim * 4).map(parking_lot::Mutex::new))
            .transpose()?;
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
            cache_hits: AtomicU64::new(0),
            cache_fills: AtomicU64::new(0),
            cache,
            locks: PageLocks::new(),
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

    /// The buffer holding the rows. With a row cache, a row updated in the
    /// cache reaches the buffer when it leaves the cache or at
    /// [`flush`](Self::flush); [`read_rows`](Self::read_rows) and the
    /// gathers see it at once. A buffer kept past the table's drop holds
    /// what was written back by then: flush first.
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

    /// Whether `out` is strata's own memory (a pinned page lent out, e.g.
    /// a DLPack view of one): the calls that write into caller memory then
    /// work on a copy of it ([`through_copy`]), and `write_rows` writes
    /// from one, so that no page copy reads and writes the same bytes.
    fn lent(&self, out: &[f32]) -> bool {
        self.buffer()
            .overlaps_runtime_memory(out.as_ptr().cast(), std::mem::size_of_val(out))
    }

    fn io(&self) -> Rows<'_> {
        Rows {
            buf: &self.buf,
            dim: self.dim,
            page: self.page,
            threads: self.threads,
            locks: &self.locks,
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
        if self.lent(data) {
            // strata's own memory as the source: through a copy.
            let copy = data.to_vec();
            return self.write_rows(start, &copy);
        }
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
        let Some(cache) = &self.cache else {
            return Ok(self.io().write_parallel(at, bytemuck::cast_slice(data))?);
        };
        let mut cache = cache.lock();
        self.write_back(&mut cache)?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let written = self.io().write_parallel(at, bytes);
        // A write that failed part way leaves the cached copies holding
        // the new rows, dirty: the table's may be either.
        cache.refresh(
            bytes
                .chunks_exact(self.dim * 4)
                .enumerate()
                .map(|(k, b)| (start as u64 + k as u64, b)),
            written.is_ok(),
        );
        Ok(written?)
    }

    /// Writes back every row the row cache holds changed (updates of
    /// cached rows wait in it until their rows leave it): afterwards the
    /// table's [`buffer`](Self::buffer) holds every row as the gathers see
    /// it. A no-op without a row cache. A write that fails keeps the
    /// changes in the cache, to be written by a later call.
    pub fn flush(&self) -> Result<()> {
        let Some(cache) = &self.cache else {
            return Ok(());
        };
        let mut cache = cache.lock();
        self.write_back(&mut cache)?;
        let (rows, data, slots) = cache.dirty_rows();
        if !rows.is_empty() {
            self.io().put(&rows, &data)?;
            cache.mark_clean(&slots);
        }
        Ok(())
    }

    /// Writes the row cache's orphans (rows changed in it that left it)
    /// to the table; every call through the cache but `read_rows` begins
    /// with this, and a call that fails here changes nothing. Orphans are
    /// read in the table's place until it succeeds.
    fn write_back(&self, cache: &mut RowCache) -> Result<()> {
        if cache.has_orphans() {
            let (rows, data) = cache.orphans();
            self.io().put(&rows, &data)?;
            cache.orphans_written();
        }
        Ok(())
    }

    /// Reads the rows of `indices` into `out` (`indices.len()` rows),
    /// uncounted in [`stats`](Self::stats) (the pages' access counters
    /// see them).
    pub fn read_rows(&self, indices: &[i64], out: &mut [f32]) -> Result<()> {
        self.check_indices(indices)?;
        self.check_rows_len("out", out.len(), indices.len())?;
        if self.lent(out) {
            return through_copy(out, |out| self.read_rows(indices, out));
        }
        let offsets: Vec<i64> = (0..=indices.len() as i64).collect();
        let bags = Bags::new(indices, &offsets);
        // Held across the read: the rows it overlays stay as they are.
        let mut cache = self.cache.as_ref().map(|c| c.lock());
        let (fetched, _) = self.io().fetch(indices, self.fastest)?;
        self.pool(&fetched, &bags, 0, out)?;
        if let Some(cache) = &mut cache {
            cache.overlay(indices, out);
        }
        Ok(())
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
        if self.lent(out) {
            return through_copy(out, |out| self.gather(bags, out));
        }
        if let Some(cache) = &self.cache {
            return self.gather_through_cache(&mut cache.lock(), bags, out);
        }
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
                ..Lookups::default()
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
            ..Lookups::default()
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
        if self.lent(out) {
            return through_copy(out, |out| self.gather_mapped(bags, seed, out));
        }
        if self.rt.device_backend() == Some(BackendKind::Cuda) {
            return Err(crate::error::Error::new(
                crate::error::ErrorKind::Unsupported,
                "gather_mapped reads through the device map as a simulated kernel: a CUDA device's memory is not readable by the host (use gather)",
            )
            .into());
        }
        if let Some(cache) = &self.cache {
            return self.gather_cached(&mut cache.lock(), bags, seed, out);
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
            ..Lookups::default()
        }))
    }

    /// [`gather_mapped`](Self::gather_mapped) through the row cache: the
    /// lookups in order, as the row cache's kernel takes them (bag by bag,
    /// each bag's rows in index order). A cached row is read from its slot
    /// in device memory; a missed one through the table's map (a device
    /// hit where its page is on the device), and copied into the slot the
    /// policy gives it. Bags run one after another: the policy's state is
    /// one sequence.
    fn gather_cached(
        &self,
        cache: &mut RowCache,
        bags: &Bags<'_>,
        seed: u64,
        out: &mut [f32],
    ) -> Result<Lookups> {
        self.write_back(cache)?;
        let map = self.buf.device_map()?;
        let launch = map.prepare(Access::ReadOnly)?;
        let dim = self.dim;
        let mut reader = launch.reader(seed);
        let mut row = vec![0f32; dim];
        let mut table_hits = 0u64;
        let served = cache.with_slots(|slots| {
            for (b, dst) in out.chunks_mut(dim).enumerate() {
                dst.fill(0.0);
                let mut kept = 0usize;
                for (r, w) in bag_rows(bags, b) {
                    match slots.lookup(r) {
                        Look::Cached(s) => slots.read(s, &mut row),
                        look => {
                            if let Some(v) = slots.orphan(r) {
                                // Evicted changed by this call: the table's
                                // row is older.
                                row.copy_from_slice(v);
                            } else {
                                let base = r * dim as u64;
                                for (d, x) in row.iter_mut().enumerate() {
                                    let (v, _, on_device) = reader.load_at::<f32>(base + d as u64);
                                    if d == 0 {
                                        table_hits += u64::from(on_device);
                                    }
                                    *x = v;
                                }
                            }
                            if let Look::Fill(s) = look {
                                slots.fill(s, r, &row);
                            }
                        }
                    }
                    // `w * v` is `v` exactly for w = 1, as the uncached path.
                    let w = w.unwrap_or(1.0);
                    dst.iter_mut().zip(&row).for_each(|(o, &v)| *o += w * v);
                    kept += 1;
                }
                finish_bag(dst, kept, bags.pooling);
            }
            Ok(slots.served())
        })?;
        drop(launch);
        // The rows this call evicted changed (the launch refused writes).
        self.write_back(cache)?;
        Ok(self.count(Lookups {
            lookups: bags.indices.len() as u64,
            fast_hits: table_hits + served.hits,
            cache_hits: served.hits,
            cache_fills: served.fills,
        }))
    }

    /// [`gather`](Self::gather) through the row cache. The lookups are
    /// decided in order first (a cached row copied out of its slot; a
    /// missed one noted, with the slot the policy gave it); the pages of
    /// the rows to read from the table are then fetched as
    /// [`gather`](Self::gather) fetches them (every NVMe page whole, once);
    /// the missed rows go into their slots; and the bags are pooled in
    /// order, so the sums are the uncached gather's bit for bit. A row
    /// looked up again after its miss in the same call counts as a cached
    /// hit and is read from the page its miss fetched.
    fn gather_through_cache(
        &self,
        cache: &mut RowCache,
        bags: &Bags<'_>,
        out: &mut [f32],
    ) -> Result<Lookups> {
        self.write_back(cache)?;
        let dim = self.dim;
        // Where each lookup's row comes from for the pooling.
        enum From {
            /// A hit, read from its slot into `staged` (in order).
            Slot,
            /// A row filled by this call: the `k`-th of `filled` (its
            /// miss or a repeat of it), read once for its fill.
            Fill(usize),
            /// Not cached: read from the table.
            Table,
        }
        let mut looks: Vec<From> = Vec::with_capacity(bags.indices.len());
        let mut staged: Vec<f32> = Vec::new();
        let mut need: Vec<i64> = Vec::new();
        let mut filled: Vec<(u32, u64)> = Vec::new();
        let mut row = vec![0f32; dim];
        let served = cache.with_slots(|slots| {
            // The slots filled by this call, and which of `filled` each is.
            let mut fresh = std::collections::HashMap::new();
            for b in 0..bags.len() {
                for (r, _) in bag_rows(bags, b) {
                    let look = match slots.lookup(r) {
                        Look::Cached(s) => match fresh.get(&s) {
                            // Admitted earlier in this call: its miss
                            // fetched it.
                            Some(&k) => From::Fill(k),
                            None => {
                                slots.read(s, &mut row);
                                staged.extend_from_slice(&row);
                                From::Slot
                            }
                        },
                        Look::Fill(s) => {
                            fresh.insert(s, filled.len());
                            filled.push((s, r));
                            need.push(r as i64);
                            From::Fill(filled.len() - 1)
                        }
                        Look::Table => {
                            need.push(r as i64);
                            From::Table
                        }
                    };
                    looks.push(look);
                }
            }
            Ok(slots.served())
        })?;
        let io = self.io();
        let mut rows: Vec<f32> = Vec::with_capacity(filled.len() * dim);
        // The rows evicted changed go to the table before it is read (a
        // row may be read again after its eviction). The slots of the
        // misses are given to their rows already: a write-back or fetch
        // that fails leaves them holding other rows' bytes, so the cache
        // forgets every row (the changed ones kept as orphans) before the
        // error goes back.
        let fetched = self.write_back(cache).and_then(|()| {
            let (fetched, hits) = io.fetch(&need, self.fastest)?;
            for &(_, r) in &filled {
                io.row(&fetched, r, &mut row)?;
                rows.extend_from_slice(&row);
            }
            Ok((fetched, hits))
        });
        let fetched = match fetched {
            Ok(f) => f,
            Err(e) => {
                cache.forget()?;
                return Err(e);
            }
        };
        let (fetched, table_hits) = fetched;
        cache.with_slots(|slots| {
            for (k, &(s, r)) in filled.iter().enumerate() {
                slots.fill(s, r, &rows[k * dim..(k + 1) * dim]);
            }
            Ok(())
        })?;
        let (mut i, mut k) = (0usize, 0usize);
        for (b, dst) in out.chunks_mut(dim).enumerate() {
            dst.fill(0.0);
            let mut kept = 0;
            for (r, w) in bag_rows(bags, b) {
                // A filled row is pooled from the bytes read for its fill:
                // read again, it would count twice as an access of its page.
                match looks[i] {
                    From::Slot => {
                        row.copy_from_slice(&staged[k * dim..(k + 1) * dim]);
                        k += 1;
                    }
                    From::Fill(f) => row.copy_from_slice(&rows[f * dim..(f + 1) * dim]),
                    From::Table => io.row(&fetched, r, &mut row)?,
                }
                add_row(dst, &row, w);
                kept += 1;
                i += 1;
            }
            finish_bag(dst, kept, bags.pooling);
        }
        Ok(self.count(Lookups {
            lookups: bags.indices.len() as u64,
            fast_hits: served.hits + table_hits,
            cache_hits: served.hits,
            cache_fills: filled.len() as u64,
        }))
    }

    /// Rows the row cache holds now and at most (None: no row cache).
    pub fn row_cache_len(&self) -> Option<(usize, usize)> {
        let c = self.cache.as_ref()?.lock();
        Some((c.len(), c.capacity()))
    }

    /// A fused update of `rows`: a cached row's copy takes its step in
    /// the row cache (dirty there until it is written back), the other
    /// rows in the table. Row-wise Adagrad's accumulators take every
    /// row's step first. A table write that fails part way leaves the
    /// accumulators and the cached rows stepped and some of the other rows
    /// not (which is not known), as without a cache.
    fn update_through(
        &self,
        rows: &[i64],
        grads: &[f32],
        rule: Rule,
        state: Option<&mut [f32]>,
    ) -> Result<()> {
        let io = self.io();
        let Some(cache) = &self.cache else {
            let scale = io.steps(rows, grads, rule, state);
            return Ok(io.apply(rows, grads, &scale)?);
        };
        let mut cache = cache.lock();
        self.write_back(&mut cache)?;
        let scale = io.steps(rows, grads, rule, state);
        let d = self.dim;
        let rest = cache.update(rows, |k, w| {
            pages::step(w, &grads[k * d..(k + 1) * d], scale[k])
        });
        if rest.is_empty() {
            return Ok(());
        }
        let table_rows: Vec<i64> = rest.iter().map(|&k| rows[k]).collect();
        let table_grads: Vec<f32> = rest
            .iter()
            .flat_map(|&k| grads[k * d..(k + 1) * d].iter().copied())
            .collect();
        let table_scale: Vec<f32> = rest.iter().map(|&k| scale[k]).collect();
        Ok(io.apply(&table_rows, &table_grads, &table_scale)?)
    }

    fn count(&self, l: Lookups) -> Lookups {
        self.lookups.fetch_add(l.lookups, Ordering::Relaxed);
        self.fast_hits.fetch_add(l.fast_hits, Ordering::Relaxed);
        self.cache_hits.fetch_add(l.cache_hits, Ordering::Relaxed);
        self.cache_fills.fetch_add(l.cache_fills, Ordering::Relaxed);
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
        self.update_through(rows, grads, Rule::Sgd { lr }, None)
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
        if self.lent(state) {
            return through_copy(state, |state| {
                self.rowwise_adagrad(rows, grads, state, lr, eps)
            });
        }
        let rule = Rule::RowwiseAdagrad { lr, eps };
        self.update_through(rows, grads, rule, Some(state))
    }

    /// The fused backward of pooling `bags`: each bag's gradient (`grad`,
    /// one row of `dim` per bag) is spread over its rows — times the row's
    /// weight, divided by the bag's count for a mean, padding left out —
    /// summed per distinct row in lookup order, and `update` applied to
    /// each row once (FBGEMM's fused backward; the same sums as a
    /// framework's `index_add` over the lookups).
    pub fn backward(&self, bags: &Bags<'_>, grad: &[f32], update: Update<'_>) -> Result<()> {
        self.check_bags(bags, grad, "grad")?;
        let update = match update {
            Update::RowwiseAdagrad { lr, eps, state } if self.lent(state) => {
                return through_copy(state, |state| {
                    self.backward(bags, grad, Update::RowwiseAdagrad { lr, eps, state })
                });
            }
            update => update,
        };
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
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            cache_fills: self.cache_fills.load(Ordering::Relaxed),
        }
    }

    /// Sets [`stats`](Self::stats) back to zero.
    pub fn reset_stats(&self) {
        self.lookups.store(0, Ordering::Relaxed);
        self.fast_hits.store(0, Ordering::Relaxed);
        self.cache_hits.store(0, Ordering::Relaxed);
        self.cache_fills.store(0, Ordering::Relaxed);
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
