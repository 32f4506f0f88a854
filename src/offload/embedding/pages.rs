//! The table's page-level I/O: rows read where their pages live (pages
//! that a batch's lookups share, and every NVMe page, read whole once and
//! in parallel), rows written in page-aligned pieces on worker threads,
//! and the fused updates' read-modify-write of the rows they touch.
#![forbid(unsafe_code)]

use std::ops::RangeInclusive;

use crate::error::{Error, Result};
use crate::runtime::Buffer;
use crate::tier::Tier;

/// Where a table's rows are: `dim` fp32 values a row, row `r` at byte
/// `r * dim * 4` of `buf`, pages of `page` bytes.
pub(super) struct Rows<'a> {
    pub(super) buf: &'a Buffer,
    pub(super) dim: usize,
    pub(super) page: u64,
    pub(super) threads: usize,
    pub(super) locks: &'a PageLocks,
}

/// Locks over a table's pages (page number modulo their count): a call
/// that reads rows, changes them and writes them back holds those of the
/// pages it spans from its read to its write, and every write of rows
/// holds its page's, so two calls touching different rows of one page
/// never write each other's old bytes back.
pub(super) struct PageLocks(Box<[parking_lot::Mutex<()>]>);

impl PageLocks {
    pub(super) fn new() -> Self {
        Self((0..64).map(|_| parking_lot::Mutex::new(())).collect())
    }

    /// Holds the locks of `pages`, each once, in ascending order (so that
    /// callers holding several never wait on each other in a cycle).
    fn hold(&self, pages: RangeInclusive<u64>) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        let n = self.0.len() as u64;
        let mut stripes: Vec<usize> = if pages.end().saturating_sub(*pages.start()) + 1 >= n {
            (0..n as usize).collect()
        } else {
            pages.map(|p| (p % n) as usize).collect()
        };
        stripes.sort_unstable();
        stripes.dedup();
        stripes.into_iter().map(|i| self.0[i].lock()).collect()
    }
}

/// Pages read whole for one call: sorted page numbers and their bytes.
pub(super) struct Fetched {
    pages: Vec<u64>,
    arena: Vec<u8>,
}

/// The update rule of a fused sparse update.
#[derive(Clone, Copy, Debug)]
pub(super) enum Rule {
    Sgd {
        lr: f32,
    },
    /// FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row.
    RowwiseAdagrad {
        lr: f32,
        eps: f32,
    },
}

/// The first error of the workers of a scope, if any.
fn first_error(errors: impl IntoIterator<Item = Error>) -> Result<()> {
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl Rows<'_> {
    fn row_bytes(&self) -> u64 {
        self.dim as u64 * 4
    }

    /// The pages row `r` spans.
    pub(super) fn pages_of(&self, r: u64) -> RangeInclusive<u64> {
        let start = r * self.row_bytes();
        start / self.page..=(start + self.row_bytes() - 1) / self.page
    }

    /// Bytes of page `p` that the buffer holds (the last may be short).
    fn page_len(&self, p: u64) -> usize {
        (self.buf.len() - p * self.page).min(self.page) as usize
    }

    /// Writes `data` (whole rows) at byte `at` (a row's start), in pieces
    /// of whole rows on the worker threads (an NVMe page's write is
    /// synchronous: loading a table keeps that many in flight).
    pub(super) fn write_parallel(&self, at: u64, data: &[u8]) -> Result<()> {
        let row = self.row_bytes() as usize;
        debug_assert!(at % row as u64 == 0 && data.len() % row == 0);
        let page = self.page as usize;
        let pages = data.len().div_ceil(page);
        // About an equal share of the pages each, cut between rows.
        let per = (pages.div_ceil(self.threads.max(1)).max(1) * page).div_ceil(row) * row;
        if data.len() <= per {
            return self.write_pages(at, data);
        }
        let errors: Vec<Error> = std::thread::scope(|s| {
            let workers: Vec<_> = data
                .chunks(per)
                .enumerate()
                .map(|(k, piece)| {
                    let off = at + (k * per) as u64;
                    s.spawn(move || self.write_pages(off, piece))
                })
                .collect();
            workers
                .into_iter()
                .filter_map(|w| w.join().expect("a write worker panicked").err())
                .collect()
        });
        first_error(errors)
    }

    /// Writes `data` (whole rows) at byte `at` (a row's start), the rows
    /// that start in one page at a time, under the locks of every page they
    /// span: a row across a page boundary is written whole, as an update
    /// of it (which holds the same locks) sees it, never half.
    fn write_pages(&self, at: u64, data: &[u8]) -> Result<()> {
        let row = self.row_bytes();
        let end = at + data.len() as u64;
        let mut off = at;
        while off < end {
            let first = off / self.page;
            // The rows that start before the next page does.
            let rows = ((first + 1) * self.page - off).div_ceil(row).max(1);
            let stop = (off + rows * row).min(end);
            let _held = self.locks.hold(first..=(stop - 1) / self.page);
            self.buf
                .write(off, &data[(off - at) as usize..(stop - at) as usize])?;
            off = stop;
        }
        Ok(())
    }

    /// The NVMe pages of `rows` read whole, once each, into one arena (on
    /// the worker threads, one synchronous read each in flight); rows in
    /// memory tiers are read where they are, by [`row`](Self::row). Also
    /// how many of `rows` start in a page of `fastest`. Every lookup counts
    /// as an access of its page (the balancer's measure of heat), though a
    /// page read whole is read once for all of its lookups.
    pub(super) fn fetch(&self, rows: &[i64], fastest: Tier) -> Result<(Fetched, u64)> {
        let mut hits = 0u64;
        // Every NVMe page of every lookup, with repeats.
        let mut on_disk: Vec<u64> = Vec::new();
        for &r in rows {
            for (k, p) in self.pages_of(r as u64).enumerate() {
                let t = self.buf.tier_of(p as usize)?;
                if k == 0 && t == Some(fastest) {
                    hits += 1;
                }
                if t == Some(Tier::Nvme) {
                    on_disk.push(p);
                }
            }
        }
        if on_disk.is_empty() {
            return Ok((
                Fetched {
                    pages: Vec::new(),
                    arena: Vec::new(),
                },
                hits,
            ));
        }
        on_disk.sort_unstable();
        let mut runs: Vec<(u64, u32)> = Vec::new();
        for &p in &on_disk {
            match runs.last_mut() {
                Some((q, n)) if *q == p => *n = n.saturating_add(1),
                _ => runs.push((p, 1)),
            }
        }
        drop(on_disk);
        for &(p, n) in &runs {
            self.buf.touch(p as usize, n - 1)?;
        }
        let page = self.page as usize;
        let mut arena = vec![0u8; runs.len() * page];
        let reads: Vec<(u64, &mut [u8])> = runs
            .iter()
            .map(|&(p, _)| p)
            .zip(arena.chunks_mut(page))
            .collect();
        self.on_workers(reads, |(p, d)| {
            let n = self.page_len(p);
            self.buf.read(p * self.page, &mut d[..n])
        })?;
        let pages = runs.into_iter().map(|(p, _)| p).collect();
        Ok((Fetched { pages, arena }, hits))
    }

    /// Row `r` into `out` (`dim` values): from fetched page copies where
    /// all its pages were fetched, else read through the buffer.
    pub(super) fn row(&self, fetched: &Fetched, r: u64, out: &mut [f32]) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        let start = r * self.row_bytes();
        if fetched.pages.is_empty() {
            return self.buf.read(start, bytes);
        }
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

    /// Each row's step under `rule` for the distinct rows `rows` with
    /// their gradients: row `i` becomes `w - step[i] * grads[i]`. Row-wise
    /// Adagrad's accumulators (`state`, one per table row) are updated
    /// here.
    pub(super) fn steps(
        &self,
        rows: &[i64],
        grads: &[f32],
        rule: Rule,
        state: Option<&mut [f32]>,
    ) -> Vec<f32> {
        scales(rows, grads, self.dim, rule, state)
    }

    /// Applies the steps `scale` (from [`steps`](Self::steps)) to the
    /// distinct rows `rows` with their gradients, writing each back in
    /// place. Rows sharing NVMe pages are read and written as whole pages,
    /// once each.
    pub(super) fn apply(&self, rows: &[i64], grads: &[f32], scale: &[f32]) -> Result<()> {
        let d = self.dim;
        self.apply_with(rows, |w, i| step(w, &grads[i * d..(i + 1) * d], scale[i]))
    }

    /// Writes `data` (one row each) as the distinct rows `rows`, grouped
    /// by page as updates are: a row cache's write-back.
    pub(super) fn put(&self, rows: &[i64], data: &[f32]) -> Result<()> {
        let d = self.dim;
        self.apply_with(rows, |w, i| w.copy_from_slice(&data[i * d..(i + 1) * d]))
    }

    /// Runs `apply(values, i)` on each of the distinct rows `rows` (row
    /// `rows[i]`) and writes it back in place; rows sharing NVMe pages are
    /// read and written as whole pages, once each, on the worker threads.
    fn apply_with(&self, rows: &[i64], apply: impl Fn(&mut [f32], usize) + Sync) -> Result<()> {
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
        // Groups in memory are updated here; those on NVMe (a read and a
        // write each) on the worker threads.
        let mut on_disk = Vec::new();
        for &(a, b) in &groups {
            let group = &order[a..=b];
            let p0 = *self.pages_of(rows[group[0]] as u64).start();
            if self.buf.tier_of(p0 as usize)? == Some(Tier::Nvme) {
                on_disk.push(group);
            } else {
                self.update_group(rows, group, &apply)?;
            }
        }
        self.on_workers(on_disk, |group| self.update_group(rows, group, &apply))
    }

    /// Runs `work` on every item of `items`, spread over up to the table's
    /// worker threads (none started for no item); the first error.
    fn on_workers<T: Send>(
        &self,
        items: Vec<T>,
        work: impl Fn(T) -> Result<()> + Sync,
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let workers = self.threads.clamp(1, items.len());
        let mut shares: Vec<Vec<T>> = (0..workers).map(|_| Vec::new()).collect();
        for (k, item) in items.into_iter().enumerate() {
            shares[k % workers].push(item);
        }
        let work = &work;
        let errors: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = shares
                .into_iter()
                .map(|share| {
                    s.spawn(move || -> Result<()> {
                        for item in share {
                            work(item)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter()
                .filter_map(|h| h.join().expect("a table worker panicked").err())
                .collect()
        });
        first_error(errors)
    }

    /// One group of rows whose pages overlap (positions into `rows`,
    /// sorted by row): in memory tiers row by row; on NVMe the pages they
    /// span are read, updated and written back whole.
    fn update_group(
        &self,
        rows: &[i64],
        group: &[usize],
        apply: &(impl Fn(&mut [f32], usize) + Sync),
    ) -> Result<()> {
        let rb = self.row_bytes();
        let mut row = vec![0f32; self.dim];
        let first = rows[group[0]] as u64;
        let p0 = *self.pages_of(first).start();
        let last = rows[*group.last().expect("a group is not empty")] as u64;
        let p1 = *self.pages_of(last).end();
        // From the read to the write: no other write of these pages between.
        let _held = self.locks.hold(p0..=p1);
        if self.buf.tier_of(p0 as usize)? != Some(Tier::Nvme) {
            for &i in group {
                let at = rows[i] as u64 * rb;
                self.buf.read_as(at, &mut row)?;
                apply(&mut row, i);
                self.buf.write_as(at, &row)?;
            }
            return Ok(());
        }
        let start = p0 * self.page;
        let end = ((p1 + 1) * self.page).min(self.buf.len());
        let mut span = vec![0u8; (end - start) as usize];
        self.buf.read(start, &mut span)?;
        for &i in group {
            let at = (rows[i] as u64 * rb - start) as usize;
            let bytes = &mut span[at..at + rb as usize];
            let w: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
            w.copy_from_slice(bytes);
            apply(&mut row, i);
            bytes.copy_from_slice(bytemuck::cast_slice(&row));
        }
        self.buf.write(start, &span)
    }
}

/// `w -= s * g`: one row's update (the table's, and its cached copy's).
pub(super) fn step(w: &mut [f32], g: &[f32], s: f32) {
    for (x, &gx) in w.iter_mut().zip(g) {
        *x -= s * gx;
    }
}

/// Each row's step size under `rule`. Row-wise Adagrad's accumulators are
/// updated here first (each row's own), so that the page groups can then
/// run in parallel without sharing state.
fn scales(
    rows: &[i64],
    grads: &[f32],
    d: usize,
    rule: Rule,
    state: Option<&mut [f32]>,
) -> Vec<f32> {
    match rule {
        Rule::Sgd { lr } => vec![lr; rows.len()],
        Rule::RowwiseAdagrad { lr, eps } => {
            let state = state.expect("row-wise Adagrad has its state");
            rows.iter()
                .enumerate()
                .map(|(i, &r)| {
                    let g = &grads[i * d..(i + 1) * d];
                    let mean_sq = g.iter().map(|x| x * x).sum::<f32>() / d as f32;
                    let acc = &mut state[r as usize];
                    *acc += mean_sq;
                    let denom = acc.sqrt() + eps;
                    // 0 only for a row whose gradients so far were all zero
                    // with eps 0: nothing to scale (0 / 0 would be NaN).
                    if denom > 0.0 {
                        lr / denom
                    } else {
                        0.0
                    }
                })
                .collect()
        }
    }
}
