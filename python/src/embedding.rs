//! `strata._strata.RowTable`: an embedding table of fp32 rows in a strata
//! buffer, under `strata.nn.EmbeddingBag` (which holds the torch side).
//! Each call does a whole batch at once with the GIL released: a pooled
//! gather (sum or mean of the bags' rows, optional per-sample weights) and
//! the fused sparse updates (SGD, row-wise Adagrad) that write the touched
//! rows back in place. Plus the balancer's controls, which a table's hot
//! rows depend on: `start_balancer`, `stop_balancer`, `balance_once`.
//!
//! Rows are read through `strata::Buffer::read`, and every lookup counts in
//! its page's access counter (`Buffer::touch` for lookups served from a
//! page read once), so the balancer sees the table's hotness. Pages in a
//! tier without an address (NVMe), and memory-tier pages that enough of a
//! batch's lookups share, are read whole, once per call and in parallel
//! (one synchronous request per worker thread, so a batch keeps that many
//! NVMe reads in flight); other rows are read one by one where they are.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use strata::runtime::BalancerConfig;
use strata::{PolicyKind, Tier};

use crate::buffer::Buffer;
use crate::errors::{invalid, raise};
use crate::pybuf::Contiguous;
use crate::runtime::Runtime;

fn ints(bytes: &[u8], what: &str) -> PyResult<Vec<i64>> {
    if bytes.len() % 8 != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes are not a whole number of int64 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| i64::from_ne_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

fn floats(bytes: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if bytes.len() % 4 != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes are not a whole number of float32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
        .collect())
}

fn floats_mut<'a>(bytes: &'a mut [u8], what: &str) -> PyResult<&'a mut [f32]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|_| invalid(format!("{what} is not an aligned array of float32 values")))
}

/// The update rule of a fused sparse update.
#[derive(Clone, Copy)]
enum Rule {
    Sgd {
        lr: f32,
    },
    /// FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row.
    RowwiseAdagrad {
        lr: f32,
        eps: f32,
    },
}

/// The table: `rows` rows of `dim` fp32 values, row `r` at byte `r*dim*4`.
struct Table {
    buf: Arc<strata::Buffer>,
    rows: u64,
    dim: usize,
    page: u64,
    fastest: Tier,
    threads: usize,
}

impl Table {
    fn row_bytes(&self) -> u64 {
        self.dim as u64 * 4
    }

    /// The pages row `r` spans.
    fn pages_of(&self, r: u64) -> std::ops::RangeInclusive<u64> {
        let start = r * self.row_bytes();
        start / self.page..=(start + self.row_bytes() - 1) / self.page
    }

    /// Bytes of page `p` that the buffer holds (the last may be short).
    fn page_len(&self, p: u64) -> usize {
        (self.buf.len() - p * self.page).min(self.page) as usize
    }

    /// Writes `data` at byte `at`, in page-aligned pieces on the worker
    /// threads (an NVMe page's write is synchronous: loading a table keeps
    /// that many in flight).
    fn write_parallel(&self, at: u64, data: &[u8]) -> strata::Result<()> {
        let page = self.page as usize;
        // The first piece ends at a page boundary, the others are whole pages.
        let head = ((self.page - at % self.page) % self.page) as usize;
        let head = head.min(data.len());
        self.buf.write(at, &data[..head])?;
        let rest = &data[head..];
        let pages = rest.len().div_ceil(page);
        let per = pages.div_ceil(self.threads.max(1)).max(1) * page;
        let errors: Vec<strata::Error> = std::thread::scope(|s| {
            let workers: Vec<_> = rest
                .chunks(per)
                .enumerate()
                .map(|(k, piece)| {
                    let off = at + (head + k * per) as u64;
                    s.spawn(move || self.buf.write(off, piece))
                })
                .collect();
            workers
                .into_iter()
                .filter_map(|w| w.join().expect("a write worker panicked").err())
                .collect()
        });
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Refuses any index outside the table, before anything is read.
    fn check(&self, idx: &[i64]) -> PyResult<()> {
        if let Some(&bad) = idx.iter().find(|&&i| i < 0 || i as u64 >= self.rows) {
            return Err(PyIndexError::new_err(format!(
                "index {bad} is out of range for an embedding table of {} rows",
                self.rows
            )));
        }
        Ok(())
    }

    /// The pages of `rows` read whole, once, into one arena (in parallel):
    /// those in a tier without an address (NVMe), and those of the other
    /// tiers that enough lookups share that one page copy is cheaper than
    /// reading their rows one by one. Also how many of `rows` start in a
    /// page of the fastest tier.
    fn fetch(&self, rows: &[i64]) -> strata::Result<(Fetched, u64)> {
        // Every page of every lookup, with repeats: (page, lookups).
        let mut all: Vec<u64> = rows.iter().flat_map(|&r| self.pages_of(r as u64)).collect();
        all.sort_unstable();
        let mut runs: Vec<(u64, u32)> = Vec::new();
        for &p in &all {
            match runs.last_mut() {
                Some((q, n)) if *q == p => *n = n.saturating_add(1),
                _ => runs.push((p, 1)),
            }
        }
        drop(all);
        let per_page = (self.page / self.row_bytes()).max(1) as u32;
        let share = (per_page / 4).max(2);
        let mut whole = Vec::new();
        let mut fast = Vec::new();
        for &(p, n) in &runs {
            let t = self.buf.tier_of(p as usize)?;
            if t == Some(self.fastest) {
                fast.push(p);
            }
            if t == Some(Tier::Nvme) || (t.is_some() && n >= share) {
                whole.push((p, n));
            }
        }
        let first = |r: i64| r as u64 * self.row_bytes() / self.page;
        let hits = rows
            .iter()
            .filter(|&&r| fast.binary_search(&first(r)).is_ok())
            .count() as u64;
        // Each lookup counts as an access (the balancer's measure of heat),
        // though a page read whole is read once for all of its lookups.
        for &(p, n) in &whole {
            self.buf.touch(p as usize, n - 1)?;
        }
        let page = self.page as usize;
        let mut arena = vec![0u8; whole.len() * page];
        let per = whole.len().div_ceil(self.threads.max(1)).max(1);
        let errors: Vec<strata::Error> = std::thread::scope(|s| {
            let workers: Vec<_> = whole
                .chunks(per)
                .zip(arena.chunks_mut(per * page))
                .map(|(ps, dst)| {
                    s.spawn(move || -> strata::Result<()> {
                        for (&(p, _), d) in ps.iter().zip(dst.chunks_mut(page)) {
                            let n = self.page_len(p);
                            self.buf.read(p * self.page, &mut d[..n])?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .filter_map(|w| w.join().expect("a page read panicked").err())
                .collect()
        });
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        let pages = whole.into_iter().map(|(p, _)| p).collect();
        Ok((Fetched { pages, arena }, hits))
    }

    /// Row `r` into `out` (`dim` values): from fetched page copies where
    /// all its pages were fetched, else read through the buffer.
    fn row(&self, fetched: &Fetched, r: u64, out: &mut [f32]) -> strata::Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        let start = r * self.row_bytes();
        let page = self.page as usize;
        let mut at = 0usize;
        for p in self.pages_of(r) {
            let Ok(slot) = fetched.pages.binary_search(&p) else {
                return self.buf.read(start, bytes);
            };
            let from = (start + at as u64 - p * self.page) as usize;
            let n = (page - from).min(bytes.len() - at);
            bytes[at..at + n]
                .copy_from_slice(&fetched.arena[slot * page + from..slot * page + from + n]);
            at += n;
        }
        Ok(())
    }

    /// Pools bag `b` of `offsets` into `out` rows, for the bags of `out`
    /// starting at bag `first`.
    #[allow(clippy::too_many_arguments)]
    fn pool(
        &self,
        fetched: &Fetched,
        idx: &[i64],
        offsets: &[i64],
        weights: Option<&[f32]>,
        mean: bool,
        padding: Option<i64>,
        first: usize,
        out: &mut [f32],
    ) -> strata::Result<()> {
        let d = self.dim;
        let mut row = vec![0f32; d];
        for (k, dst) in out.chunks_mut(d).enumerate() {
            let b = first + k;
            let (lo, hi) = (offsets[b] as usize, offsets[b + 1] as usize);
            dst.fill(0.0);
            let mut n = 0usize;
            for i in lo..hi {
                if Some(idx[i]) == padding {
                    continue;
                }
                self.row(fetched, idx[i] as u64, &mut row)?;
                let w = weights.map_or(1.0, |w| w[i]);
                for (o, &v) in dst.iter_mut().zip(&row) {
                    *o += w * v;
                }
                n += 1;
            }
            if mean && n > 0 {
                let inv = n as f32;
                dst.iter_mut().for_each(|o| *o /= inv);
            }
        }
        Ok(())
    }

    /// Applies `rule` to the distinct rows `rows` (sorted here) with their
    /// gradients, writing each back in place. Rows sharing NVMe pages are
    /// read and written as whole pages, once each; `state` holds one
    /// row-wise Adagrad accumulator per table row.
    fn update(
        &self,
        rows: &[i64],
        grads: &[f32],
        rule: Rule,
        state: Option<&mut [f32]>,
    ) -> strata::Result<()> {
        let d = self.dim;
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_unstable_by_key(|&i| rows[i]);
        // Runs of rows whose pages overlap: (first, last) positions in order.
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            let ps = self.pages_of(rows[i] as u64);
            match groups.last_mut() {
                Some(g) if *ps.start() <= *self.pages_of(rows[order[g.1]] as u64).end() => g.1 = k,
                _ => groups.push((k, k)),
            }
        }
        // New accumulator values are computed first (each row's own), so the
        // page groups below can run in parallel without sharing state.
        let mut scale = vec![0f32; rows.len()];
        match rule {
            Rule::Sgd { lr } => scale.fill(lr),
            Rule::RowwiseAdagrad { lr, eps } => {
                let state = state.expect("row-wise Adagrad has its state");
                for (i, s) in scale.iter_mut().enumerate() {
                    let g = &grads[i * d..(i + 1) * d];
                    let mean_sq = g.iter().map(|x| x * x).sum::<f32>() / d as f32;
                    let acc = &mut state[rows[i] as usize];
                    *acc += mean_sq;
                    *s = lr / (acc.sqrt() + eps);
                }
            }
        }
        let apply = |w: &mut [f32], i: usize| {
            let g = &grads[i * d..(i + 1) * d];
            let s = scale[i];
            for (x, &gx) in w.iter_mut().zip(g) {
                *x -= s * gx;
            }
        };
        let rb = self.row_bytes();
        let per = groups.len().div_ceil(self.threads.max(1)).max(1);
        let errors: Vec<strata::Error> = std::thread::scope(|s| {
            let workers: Vec<_> = groups
                .chunks(per)
                .map(|gs| {
                    let (order, apply) = (&order, &apply);
                    s.spawn(move || -> strata::Result<()> {
                        let mut row = vec![0f32; d];
                        let mut span = Vec::new();
                        for &(a, b) in gs {
                            let first = rows[order[a]] as u64;
                            let p0 = *self.pages_of(first).start();
                            let slow = self.buf.tier_of(p0 as usize)? == Some(Tier::Nvme);
                            if !slow {
                                for &i in &order[a..=b] {
                                    let at = rows[i] as u64 * rb;
                                    self.buf.read_as(at, &mut row)?;
                                    apply(&mut row, i);
                                    self.buf.write_as(at, &row)?;
                                }
                                continue;
                            }
                            let p1 = *self.pages_of(rows[order[b]] as u64).end();
                            let start = p0 * self.page;
                            let end = ((p1 + 1) * self.page).min(self.buf.len());
                            span.resize((end - start) as usize, 0u8);
                            self.buf.read(start, &mut span)?;
                            for &i in &order[a..=b] {
                                let at = (rows[i] as u64 * rb - start) as usize;
                                let bytes = &mut span[at..at + rb as usize];
                                let w: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
                                w.copy_from_slice(bytes);
                                apply(&mut row, i);
                                bytes.copy_from_slice(bytemuck::cast_slice(&row));
                            }
                            self.buf.write(start, &span)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .filter_map(|w| w.join().expect("an update worker panicked").err())
                .collect()
        });
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Pages read whole for one call: sorted page numbers and their bytes.
struct Fetched {
    pages: Vec<u64>,
    arena: Vec<u8>,
}

/// An embedding table of `rows` rows of `dim` float32 values in a strata
/// buffer of `runtime` (row r at byte r*dim*4; rows may straddle pages).
/// Arrays passed in are C-contiguous buffer-protocol objects (NumPy views
/// of CPU tensors): indices and offsets int64, values float32. Every call
/// refuses an out-of-range index (IndexError) or malformed offsets
/// (InvalidArgumentError) before it reads or writes anything, and runs
/// with the GIL released. threads: worker threads for NVMe page reads and
/// for updates (the reads in flight at once).
#[pyclass(module = "strata", frozen)]
pub(crate) struct RowTable {
    rt: strata::Runtime,
    table: Table,
    lookups: AtomicU64,
    fast_hits: AtomicU64,
}

#[pymethods]
impl RowTable {
    #[new]
    #[pyo3(signature = (runtime, rows, dim, *, prefer = None, threads = 16))]
    fn new(
        runtime: &Runtime,
        rows: i64,
        dim: i64,
        prefer: Option<&str>,
        threads: i64,
    ) -> PyResult<Self> {
        if rows <= 0 || dim <= 0 {
            return Err(invalid(format!(
                "an embedding table needs at least one row and one column ({rows} x {dim})"
            )));
        }
        if !(1..=1024).contains(&threads) {
            return Err(invalid(format!("threads {threads} is not in 1..=1024")));
        }
        let (rows, dim) = (rows as u64, dim as usize);
        let bytes = rows
            .checked_mul(dim as u64 * 4)
            .ok_or_else(|| invalid(format!("{rows} rows of {dim} float32 overflow a size")))?;
        let placement = match prefer {
            Some(t) => strata::Placement::Prefer(crate::convert::tier(t)?),
            None => strata::Placement::Fastest,
        };
        let rt = runtime.rt.clone();
        let buf = rt.alloc_with(bytes, placement).map_err(raise)?;
        let fastest = rt.tiers()[0];
        Ok(Self {
            table: Table {
                buf: Arc::new(buf),
                rows,
                dim,
                page: rt.page_size() as u64,
                fastest,
                threads: threads as usize,
            },
            rt,
            lookups: AtomicU64::new(0),
            fast_hits: AtomicU64::new(0),
        })
    }

    /// Rows in the table.
    #[getter]
    fn rows(&self) -> u64 {
        self.table.rows
    }

    /// float32 values per row.
    #[getter]
    fn dim(&self) -> usize {
        self.table.dim
    }

    /// The strata buffer holding the rows.
    #[getter]
    fn buffer(&self) -> Buffer {
        Buffer {
            rt: self.rt.clone(),
            buf: self.table.buf.clone(),
        }
    }

    /// The runtime's fastest tier, whose lookups count as hits.
    #[getter]
    fn fast_tier(&self) -> &'static str {
        self.table.fastest.name()
    }

    /// The page (an index) row `row` starts in.
    fn page_of_row(&self, row: i64) -> PyResult<u64> {
        self.table.check(&[row])?;
        Ok(row as u64 * self.table.row_bytes() / self.table.page)
    }

    /// The tier of the page row `row` starts in (None: never written).
    fn tier_of_row(&self, row: i64) -> PyResult<Option<&'static str>> {
        let p = self.page_of_row(row)?;
        Ok(self
            .table
            .buf
            .tier_of(p as usize)
            .map_err(raise)?
            .map(Tier::name))
    }

    /// Writes data (float32, a whole number of rows) as rows start, start+1, ...
    fn write_rows(&self, py: Python<'_>, start: i64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let view = Contiguous::readable(data)?;
        let src = view.as_slice();
        let rb = self.table.row_bytes() as usize;
        if src.len() % rb != 0 {
            return Err(invalid(format!(
                "{} bytes are not a whole number of rows of {} float32",
                src.len(),
                self.table.dim
            )));
        }
        let n = (src.len() / rb) as i64;
        if start < 0 || start as u64 + n as u64 > self.table.rows {
            return Err(PyIndexError::new_err(format!(
                "rows {start}..{} are out of range for an embedding table of {} rows",
                start + n,
                self.table.rows
            )));
        }
        let at = start as u64 * rb as u64;
        // strata's own memory as the source goes through a copy (as
        // Buffer.write does).
        if self
            .table
            .buf
            .overlaps_runtime_memory(src.as_ptr(), src.len())
        {
            let tmp = src.to_vec();
            py.detach(|| self.table.write_parallel(at, &tmp))
                .map_err(raise)
        } else {
            py.detach(|| self.table.write_parallel(at, src))
                .map_err(raise)
        }
    }

    /// Reads the rows of indices (int64) into out (float32, len(indices)
    /// rows).
    fn read_rows(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let idx = ints(Contiguous::readable(indices)?.as_slice(), "indices")?;
        self.table.check(&idx)?;
        let offsets: Vec<i64> = (0..=idx.len() as i64).collect();
        let mut view = Contiguous::writable(out)?;
        let dst = floats_mut(view.as_mut_slice(), "out")?;
        self.run_bags(py, &idx, &offsets, dst)
    }

    /// Pools bags of rows into out (float32, one row per bag): bag b is
    /// indices[offsets[b]:offsets[b+1]] (offsets int64, one more than the
    /// bags, from 0 to len(indices), non-decreasing), summed with weights
    /// (float32, one per index) or without, or averaged (mean=True).
    /// Indices equal to padding_idx are left out (of a mean's count too).
    /// An empty bag gives zeros. Returns (lookups, fast_tier_hits) of the
    /// call, which also add to stats().
    #[pyo3(signature = (indices, offsets, out, *, weights = None, mean = false, padding_idx = None))]
    #[allow(clippy::too_many_arguments)]
    fn bag(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
        mean: bool,
        padding_idx: Option<i64>,
    ) -> PyResult<(u64, u64)> {
        let idx = ints(Contiguous::readable(indices)?.as_slice(), "indices")?;
        self.table.check(&idx)?;
        let offsets = ints(Contiguous::readable(offsets)?.as_slice(), "offsets")?;
        if offsets.first() != Some(&0) {
            return Err(invalid("offsets must start at 0"));
        }
        if offsets.windows(2).any(|w| w[1] < w[0]) {
            return Err(invalid("offsets must be non-decreasing"));
        }
        if *offsets.last().expect("not empty") != idx.len() as i64 {
            return Err(invalid(format!(
                "the last offset {} is not the number of indices {}",
                offsets.last().expect("not empty"),
                idx.len()
            )));
        }
        let weights = match weights {
            Some(w) => {
                let w = floats(Contiguous::readable(w)?.as_slice(), "weights")?;
                if w.len() != idx.len() {
                    return Err(invalid(format!(
                        "{} weights for {} indices",
                        w.len(),
                        idx.len()
                    )));
                }
                Some(w)
            }
            None => None,
        };
        let mut view = Contiguous::writable(out)?;
        let dst = floats_mut(view.as_mut_slice(), "out")?;
        self.counted_bags(
            py,
            &idx,
            &offsets,
            weights.as_deref(),
            mean,
            padding_idx,
            dst,
        )
    }

    /// SGD on the distinct rows `rows` (int64) with their gradients
    /// `grads` (float32, len(rows) x dim): w -= lr * g, in place.
    fn sgd(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        lr: f64,
    ) -> PyResult<()> {
        if !lr.is_finite() {
            return Err(invalid(format!("lr {lr} is not a finite number")));
        }
        let (rows, grads) = self.rows_and_grads(rows, grads)?;
        py.detach(|| {
            self.table
                .update(&rows, &grads, Rule::Sgd { lr: lr as f32 }, None)
        })
        .map_err(raise)
    }

    /// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) on the distinct
    /// rows `rows` with gradients `grads`; `state` (float32, one per table
    /// row) holds the accumulators, updated in place:
    ///
    ///     state[r] += mean(g * g);  w -= lr / (sqrt(state[r]) + eps) * g
    fn rowwise_adagrad(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        state: &Bound<'_, PyAny>,
        lr: f64,
        eps: f64,
    ) -> PyResult<()> {
        if !(lr.is_finite() && eps.is_finite() && eps >= 0.0) {
            return Err(invalid(format!(
                "lr {lr} and eps {eps} must be finite (eps non-negative)"
            )));
        }
        let (rows, grads) = self.rows_and_grads(rows, grads)?;
        let mut view = Contiguous::writable(state)?;
        let st = floats_mut(view.as_mut_slice(), "state")?;
        if st.len() as u64 != self.table.rows {
            return Err(invalid(format!(
                "state holds {} accumulators for a table of {} rows",
                st.len(),
                self.table.rows
            )));
        }
        let rule = Rule::RowwiseAdagrad {
            lr: lr as f32,
            eps: eps as f32,
        };
        py.detach(|| self.table.update(&rows, &grads, rule, Some(st)))
            .map_err(raise)
    }

    /// {"lookups": n, "fast_hits": n}: since the table was made or
    /// reset_stats() last ran.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("lookups", self.lookups.load(Ordering::Relaxed))?;
        d.set_item("fast_hits", self.fast_hits.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// Sets stats() back to zero.
    fn reset_stats(&self) {
        self.lookups.store(0, Ordering::Relaxed);
        self.fast_hits.store(0, Ordering::Relaxed);
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.RowTable(rows={}, dim={}, pages={})",
            self.table.rows,
            self.table.dim,
            self.table.buf.page_count()
        )
    }
}

impl RowTable {
    fn rows_and_grads(
        &self,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<i64>, Vec<f32>)> {
        let rows = ints(Contiguous::readable(rows)?.as_slice(), "rows")?;
        self.table.check(&rows)?;
        let grads = floats(Contiguous::readable(grads)?.as_slice(), "grads")?;
        if grads.len() != rows.len() * self.table.dim {
            return Err(invalid(format!(
                "{} gradient values for {} rows of {}",
                grads.len(),
                rows.len(),
                self.table.dim
            )));
        }
        let mut sorted = rows.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid(
                "rows repeat: a fused update takes each row once, its gradients summed",
            ));
        }
        Ok((rows, grads))
    }

    #[allow(clippy::too_many_arguments)]
    fn counted_bags(
        &self,
        py: Python<'_>,
        idx: &[i64],
        offsets: &[i64],
        weights: Option<&[f32]>,
        mean: bool,
        padding: Option<i64>,
        out: &mut [f32],
    ) -> PyResult<(u64, u64)> {
        let bags = offsets.len() - 1;
        if out.len() != bags * self.table.dim {
            return Err(invalid(format!(
                "out holds {} float32 for {bags} bags of {}",
                out.len(),
                self.table.dim
            )));
        }
        let t = &self.table;
        let (n, hits) = py
            .detach(|| -> strata::Result<(u64, u64)> {
                let (fetched, hits) = t.fetch(idx)?;
                // Two pooling workers: the rows are copied and summed by the
                // CPU, which the NVMe reads above no longer wait on.
                let workers = 2usize.min(bags.max(1));
                let per = bags.div_ceil(workers).max(1);
                let errors: Vec<strata::Error> = std::thread::scope(|s| {
                    let hs: Vec<_> = out
                        .chunks_mut(per * t.dim)
                        .enumerate()
                        .map(|(k, dst)| {
                            let fetched = &fetched;
                            s.spawn(move || {
                                t.pool(fetched, idx, offsets, weights, mean, padding, k * per, dst)
                            })
                        })
                        .collect();
                    hs.into_iter()
                        .filter_map(|h| h.join().expect("a pooling worker panicked").err())
                        .collect()
                });
                match errors.into_iter().next() {
                    Some(e) => Err(e),
                    None => Ok((idx.len() as u64, hits)),
                }
            })
            .map_err(raise)?;
        self.lookups.fetch_add(n, Ordering::Relaxed);
        self.fast_hits.fetch_add(hits, Ordering::Relaxed);
        Ok((n, hits))
    }

    /// Rows of `idx` one per bag of `offsets`, uncounted in stats().
    fn run_bags(
        &self,
        py: Python<'_>,
        idx: &[i64],
        offsets: &[i64],
        out: &mut [f32],
    ) -> PyResult<()> {
        let bags = offsets.len() - 1;
        if out.len() != bags * self.table.dim {
            return Err(invalid(format!(
                "out holds {} float32 for {bags} rows of {}",
                out.len(),
                self.table.dim
            )));
        }
        let t = &self.table;
        py.detach(|| -> strata::Result<()> {
            let (fetched, _) = t.fetch(idx)?;
            t.pool(&fetched, idx, offsets, None, false, None, 0, out)
        })
        .map_err(raise)
    }
}

fn policy(name: Option<&str>) -> PyResult<PolicyKind> {
    match name {
        Some(p) => p.parse::<PolicyKind>().map_err(raise),
        None => Ok(PolicyKind::Default),
    }
}

/// Starts (or restarts, with a fresh policy) the runtime's balancer in the
/// background: every interval seconds it promotes the pages read most into
/// the fastest tier (the device tier; on the simulated device a host DRAM
/// arena) and demotes others. Needs a device tier.
#[pyfunction]
#[pyo3(signature = (runtime, *, interval = 0.02, min_accesses = 0, policy = None))]
pub(crate) fn start_balancer(
    runtime: &Runtime,
    interval: f64,
    min_accesses: i64,
    policy: Option<&str>,
) -> PyResult<()> {
    let interval = match Duration::try_from_secs_f64(interval) {
        Ok(d) if !d.is_zero() => d,
        _ => {
            return Err(invalid(format!(
                "interval {interval} is not a positive number of seconds"
            )))
        }
    };
    let min = crate::convert::offset(min_accesses, "min_accesses")?;
    let config = BalancerConfig::default()
        .with_interval(interval)
        .with_min_accesses(min)
        .with_policy(self::policy(policy)?);
    runtime.rt.start_balancer(config).map_err(raise)
}

/// Stops the runtime's background balancer (its policy state is kept for
/// balance_once).
#[pyfunction]
pub(crate) fn stop_balancer(py: Python<'_>, runtime: &Runtime) {
    py.detach(|| runtime.rt.stop_balancer());
}

/// Runs one balancer round now and returns what it did: {"promotions",
/// "demotions", "bypasses", "deferred", "promotions_below",
/// "demotions_below", "marked"}. Needs a tier below the fastest.
#[pyfunction]
pub(crate) fn balance_once<'py>(
    py: Python<'py>,
    runtime: &Runtime,
) -> PyResult<Bound<'py, PyDict>> {
    let r = py.detach(|| runtime.rt.balance_once()).map_err(raise)?;
    let d = PyDict::new(py);
    d.set_item("promotions", r.promotions)?;
    d.set_item("demotions", r.demotions)?;
    d.set_item("bypasses", r.bypasses)?;
    d.set_item("deferred", r.deferred)?;
    d.set_item("promotions_below", r.promotions_below)?;
    d.set_item("demotions_below", r.demotions_below)?;
    d.set_item("marked", r.marked)?;
    Ok(d)
}

/// Adds the table class and the balancer functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RowTable>()?;
    m.add_function(wrap_pyfunction!(start_balancer, m)?)?;
    m.add_function(wrap_pyfunction!(stop_balancer, m)?)?;
    m.add_function(wrap_pyfunction!(balance_once, m)?)?;
    Ok(())
}
