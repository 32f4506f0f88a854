//! A table's row cache: rows kept in the fastest memory tier at their own
//! granularity, as FBGEMM's UVM caching keeps them in device memory, while
//! the table's pages stay wherever the runtime placed them (host, CXL,
//! NVMe).
//!
//! A page-granular placement pays a whole page's move for every row it
//! brings in; with rows drawn from a skewed law, most rows sharing a hot
//! row's page are cold, and the fast memory they take is wasted. The row
//! cache spends that memory on rows: [`slots`](RowCache) of one row each
//! in a buffer held in the fastest tier, a policy of the runtime's
//! ([`crate::policy`]) choosing which rows stay, and the gather filling a
//! missed row's slot with the row it read (the fill is the miss's own
//! read: nothing else crosses the link).
//!
//! The slots live in the fastest memory tier — the simulated device's
//! memory (host memory there), or host memory on a runtime without a
//! device — held there for the cache's lifetime and read and written in
//! place ([`OwnedViewMut`]), as a kernel does: no copy crosses the
//! modelled link. Both gathers read through the cache:
//! [`gather_mapped`](super::EmbeddingTable::gather_mapped) (the simulated
//! kernel; a missed row filled as the kernel reads it) and
//! [`gather`](super::EmbeddingTable::gather) (missed rows' pages fetched
//! as for any gather, then the rows copied into their slots). A CUDA
//! device's memory is not lent to the host, and a CUDA kernel for the
//! cache is not built: a table on a CUDA device refuses it.
//!
//! The cache writes back. A sparse update (SGD, row-wise Adagrad, the
//! fused backward) of a cached row changes the cached copy only and marks
//! its slot dirty; the table's row is written when the row leaves the
//! cache, or at [`flush`](super::EmbeddingTable::flush). Rows written
//! (`write_rows`) go to the table and their cached copies alike. A dirty
//! row the policy evicts becomes an *orphan*: its bytes are kept until
//! the table holds them (written back at the end of the call that evicted
//! it, and before any other call goes on), and read in the table's place
//! meanwhile; a write-back that fails keeps them and fails the call, so
//! an update acknowledged is never lost: every row is, in this order, its
//! cached copy, its orphan, or the table's row.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use crate::error::{Error, ErrorKind};
use crate::policy::{self, Outcome, Policy, PolicyKind};
use crate::runtime::{OwnedViewMut, Placement, Runtime};
use crate::tier::Tier;

use super::Result;

/// How many rows a table keeps in its row cache, and by which policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCacheOptions {
    /// Rows the cache holds (its memory: this many rows, in whole pages;
    /// at most 2^32 − 1).
    pub rows: usize,
    /// The policy that picks which rows stay.
    pub policy: PolicyKind,
}

impl RowCacheOptions {
    /// `rows` rows under the runtime's default policy.
    pub fn new(rows: usize) -> Self {
        Self {
            rows,
            policy: PolicyKind::Default,
        }
    }
}

/// What the cache served in one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Served {
    /// Lookups served from a cached copy.
    pub hits: u64,
    /// Missed rows brought into a slot.
    pub fills: u64,
}

/// The cache's state; every call holds it whole (see [`RowCache`]).
pub(super) struct RowCache {
    /// The slots: `capacity` rows, `per_page` to a page, held in the
    /// fastest memory tier (the simulated device's, or host memory on a
    /// runtime without a device) for the cache's lifetime.
    slots: OwnedViewMut,
    policy: Box<dyn Policy>,
    kind: PolicyKind,
    capacity: usize,
    per_page: usize,
    row_bytes: usize,
    /// Cached row → its slot.
    slot_of: HashMap<u64, u32>,
    free: Vec<u32>,
    /// Slots whose row was changed here only (an update): the table's row
    /// is older until it is written back.
    dirty: Vec<bool>,
    /// Rows changed here only that left the cache (evicted dirty, or the
    /// cache forgotten): their bytes until the table holds them.
    orphans: HashMap<u64, Vec<f32>>,
}

impl std::fmt::Debug for RowCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowCache")
            .field("capacity", &self.capacity)
            .field("cached", &self.slot_of.len())
            .field("orphans", &self.orphans.len())
            .field("policy", &self.kind)
            .finish()
    }
}

impl RowCache {
    /// A cache of `options.rows` rows of `row_bytes` in `rt`'s fastest
    /// memory tier: the simulated device's, or host memory without a
    /// device (a CUDA device is refused). A row must fit in a page.
    pub(super) fn new(rt: &Runtime, options: RowCacheOptions, row_bytes: usize) -> Result<Self> {
        let tier = match rt.device_backend() {
            Some(crate::device::BackendKind::Sim) => Tier::Device,
            None => Tier::Host,
            Some(crate::device::BackendKind::Cuda) => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "a row cache lives in the fastest tier's memory, lent to the host: the simulated device's or host memory, not a CUDA device's (a CUDA kernel for it is not built)",
                )
                .into())
            }
        };
        let page = rt.page_size();
        if options.rows == 0 || options.rows > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "a row cache holds 1..=2^32 − 1 rows, not {}",
                options.rows
            ))
            .into());
        }
        if matches!(options.policy, PolicyKind::Belady | PolicyKind::Lookahead) {
            return Err(Error::invalid(format!(
                "a row cache's policy cannot be {}: it needs the future accesses, which a row cache never has",
                options.policy
            ))
            .into());
        }
        if row_bytes > page {
            return Err(Error::invalid(format!(
                "a row of {row_bytes} bytes does not fit in a page of {page}: a row cache keeps whole rows in a page"
            ))
            .into());
        }
        let per_page = page / row_bytes;
        let pages = options.rows.div_ceil(per_page);
        // Held in the tier for good: a full tier is refused here, and no
        // call waits for the slots to come back.
        let slots = rt
            .alloc_with((pages * page) as u64, Placement::Prefer(tier))?
            .into_view_mut(tier)?;
        Ok(Self {
            slots,
            policy: policy::build(options.policy, options.rows, None)?,
            kind: options.policy,
            capacity: options.rows,
            per_page,
            row_bytes,
            slot_of: HashMap::new(),
            free: (0..options.rows as u32).rev().collect(),
            dirty: vec![false; options.rows],
            orphans: HashMap::new(),
        })
    }

    /// Rows the cache holds at most.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rows cached now.
    pub(super) fn len(&self) -> usize {
        self.slot_of.len()
    }

    /// Runs `f` with the slots lent writable and this cache's bookkeeping.
    pub(super) fn with_slots<T>(
        &mut self,
        f: impl FnOnce(&mut Slots<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        let mut pages: Vec<&mut [u8]> =
            self.slots.pages_mut().into_iter().map(|(_, b)| b).collect();
        let mut slots = Slots {
            pages: &mut pages,
            policy: &mut *self.policy,
            slot_of: &mut self.slot_of,
            free: &mut self.free,
            dirty: &mut self.dirty,
            orphans: &mut self.orphans,
            per_page: self.per_page,
            row_bytes: self.row_bytes,
            served: Served::default(),
        };
        f(&mut slots)
    }

    /// Copies each of `rows` (a row and its new bytes) into its slot where
    /// the row is cached: rows written. `written`: the table holds them
    /// too (the slots are clean); otherwise (a write that failed part way)
    /// the cached copies are the rows' bytes, to be written back.
    pub(super) fn refresh<'a>(
        &mut self,
        rows: impl IntoIterator<Item = (u64, &'a [u8])>,
        written: bool,
    ) {
        let places: Vec<(u32, &[u8])> = rows
            .into_iter()
            .filter_map(|(r, bytes)| Some((*self.slot_of.get(&r)?, bytes)))
            .collect();
        if places.is_empty() {
            return;
        }
        let (per_page, row_bytes) = (self.per_page, self.row_bytes);
        let mut pages: Vec<&mut [u8]> =
            self.slots.pages_mut().into_iter().map(|(_, b)| b).collect();
        for (s, bytes) in places {
            let (p, range) = place(s, per_page, row_bytes);
            pages[p][range].copy_from_slice(bytes);
            self.dirty[s as usize] = !written;
        }
    }

    /// Applies `f` to the cached copy of each of `rows` that is cached
    /// (`f(k, values)` for `rows[k]`), marking it dirty: an update, held
    /// here until the row is written back. Returns the positions of the
    /// rows not cached, for the table to update.
    pub(super) fn update(
        &mut self,
        rows: &[i64],
        mut f: impl FnMut(usize, &mut [f32]),
    ) -> Vec<usize> {
        let (per_page, row_bytes) = (self.per_page, self.row_bytes);
        let mut rest = Vec::new();
        let mut hits: Vec<(usize, u32)> = Vec::new();
        for (k, &r) in rows.iter().enumerate() {
            match self.slot_of.get(&(r as u64)) {
                Some(&s) => hits.push((k, s)),
                None => rest.push(k),
            }
        }
        if hits.is_empty() {
            return rest;
        }
        let mut pages: Vec<&mut [u8]> =
            self.slots.pages_mut().into_iter().map(|(_, b)| b).collect();
        let mut values = vec![0f32; row_bytes / 4];
        for (k, s) in hits {
            let (p, range) = place(s, per_page, row_bytes);
            let bytes = &mut pages[p][range];
            bytemuck::cast_slice_mut::<f32, u8>(&mut values).copy_from_slice(bytes);
            f(k, &mut values);
            bytes.copy_from_slice(bytemuck::cast_slice(&values));
            self.dirty[s as usize] = true;
        }
        rest
    }

    /// Puts the cached copies and orphans of `indices` over `out` (one row
    /// each, read from the table): what a read of the rows returns.
    pub(super) fn overlay(&mut self, indices: &[i64], out: &mut [f32]) {
        let d = self.row_bytes / 4;
        let (per_page, row_bytes) = (self.per_page, self.row_bytes);
        let pages: Vec<&mut [u8]> = self.slots.pages_mut().into_iter().map(|(_, b)| b).collect();
        for (k, &r) in indices.iter().enumerate() {
            let dst = &mut out[k * d..(k + 1) * d];
            if let Some(&s) = self.slot_of.get(&(r as u64)) {
                let (p, range) = place(s, per_page, row_bytes);
                bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(&pages[p][range]);
            } else if let Some(v) = self.orphans.get(&(r as u64)) {
                dst.copy_from_slice(v);
            }
        }
    }

    /// Whether rows wait to be written back ([`orphans`](Self::orphans)).
    pub(super) fn has_orphans(&self) -> bool {
        !self.orphans.is_empty()
    }

    /// The orphans, sorted by row: their rows and bytes (one row each).
    pub(super) fn orphans(&self) -> (Vec<i64>, Vec<f32>) {
        let mut rows: Vec<u64> = self.orphans.keys().copied().collect();
        rows.sort_unstable();
        let data = rows
            .iter()
            .flat_map(|r| self.orphans[r].iter().copied())
            .collect();
        (rows.into_iter().map(|r| r as i64).collect(), data)
    }

    /// The table now holds the orphans' bytes.
    pub(super) fn orphans_written(&mut self) {
        self.orphans.clear();
    }

    /// The dirty rows, sorted by row: their rows, bytes and slots.
    pub(super) fn dirty_rows(&mut self) -> (Vec<i64>, Vec<f32>, Vec<u32>) {
        let mut held: Vec<(u64, u32)> = self
            .slot_of
            .iter()
            .filter(|&(_, &s)| self.dirty[s as usize])
            .map(|(&r, &s)| (r, s))
            .collect();
        held.sort_unstable();
        let (per_page, row_bytes) = (self.per_page, self.row_bytes);
        let pages: Vec<&mut [u8]> = self.slots.pages_mut().into_iter().map(|(_, b)| b).collect();
        let mut data = vec![0f32; held.len() * row_bytes / 4];
        for (k, &(_, s)) in held.iter().enumerate() {
            let (p, range) = place(s, per_page, row_bytes);
            bytemuck::cast_slice_mut::<f32, u8>(
                &mut data[k * row_bytes / 4..(k + 1) * row_bytes / 4],
            )
            .copy_from_slice(&pages[p][range]);
        }
        let rows = held.iter().map(|&(r, _)| r as i64).collect();
        (rows, data, held.into_iter().map(|(_, s)| s).collect())
    }

    /// The table now holds the rows of `slots` as cached.
    pub(super) fn mark_clean(&mut self, slots: &[u32]) {
        for &s in slots {
            self.dirty[s as usize] = false;
        }
    }

    /// Forgets every cached row (after a gather that failed with slots
    /// given to rows not yet read into them): the dirty ones become
    /// orphans, so nothing is lost, and the rest are the table's.
    pub(super) fn forget(&mut self) -> Result<()> {
        let policy = policy::build(self.kind, self.capacity, None)?;
        let (rows, data, _) = self.dirty_rows();
        let d = self.row_bytes / 4;
        for (k, r) in rows.into_iter().enumerate() {
            self.orphans
                .insert(r as u64, data[k * d..(k + 1) * d].to_vec());
        }
        self.policy = policy;
        self.slot_of.clear();
        self.free = (0..self.capacity as u32).rev().collect();
        self.dirty.iter_mut().for_each(|x| *x = false);
        Ok(())
    }
}

/// The slots lent to one call ([`RowCache::with_slots`]).
pub(super) struct Slots<'s, 'v> {
    pages: &'s mut [&'v mut [u8]],
    policy: &'s mut dyn Policy,
    slot_of: &'s mut HashMap<u64, u32>,
    free: &'s mut Vec<u32>,
    dirty: &'s mut [bool],
    orphans: &'s mut HashMap<u64, Vec<f32>>,
    per_page: usize,
    row_bytes: usize,
    served: Served,
}

/// Where one lookup's row comes from ([`Slots::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// Cached in this slot (counted as a hit).
    Cached(u32),
    /// Missed and admitted: read it from the table and fill this slot.
    Fill(u32),
    /// Missed and not admitted: read it from the table.
    Table,
}

impl Slots<'_, '_> {
    /// One lookup of `row`, in lookup order, as the policy decides it. A
    /// dirty row evicted for it becomes an orphan (its bytes copied out
    /// before the slot is reused).
    pub(super) fn lookup(&mut self, row: u64) -> Look {
        match self.policy.access(row) {
            Outcome::Hit => match self.slot_of.get(&row) {
                Some(&s) => {
                    self.served.hits += 1;
                    Look::Cached(s)
                }
                // The policy and the slots agree by construction; were they
                // ever not to, the row is read from the table, not made up.
                None => Look::Table,
            },
            Outcome::Miss { evicted } => {
                if let Some(v) = evicted {
                    if let Some(s) = self.slot_of.remove(&v) {
                        if std::mem::take(&mut self.dirty[s as usize]) {
                            let mut bytes = vec![0f32; self.row_bytes / 4];
                            self.read(s, &mut bytes);
                            self.orphans.insert(v, bytes);
                        }
                        self.free.push(s);
                    }
                }
                // A row the policy calls missed keeps a slot it still has
                // (no policy here does that; were one to, the slot's bytes
                // are the row's own, and dropping it could drop a change).
                if let Some(&s) = self.slot_of.get(&row) {
                    self.served.hits += 1;
                    return Look::Cached(s);
                }
                match self.free.pop() {
                    Some(s) => {
                        self.slot_of.insert(row, s);
                        Look::Fill(s)
                    }
                    None => Look::Table,
                }
            }
            Outcome::Bypass => Look::Table,
        }
    }

    /// The row slot `slot` holds, into `out` (one row of floats).
    pub(super) fn read(&self, slot: u32, out: &mut [f32]) {
        let (p, range) = place(slot, self.per_page, self.row_bytes);
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(&self.pages[p][range]);
    }

    /// The bytes of `row` if it is an orphan: read them, not the table's.
    pub(super) fn orphan(&self, row: u64) -> Option<&[f32]> {
        self.orphans.get(&row).map(Vec::as_slice)
    }

    /// What this call served so far.
    pub(super) fn served(&self) -> Served {
        self.served
    }

    /// Copies a missed row's bytes into the slot [`lookup`](Self::lookup)
    /// gave it: read from the table (a clean slot), or the row's orphan
    /// (the slot takes it over, dirty).
    pub(super) fn fill(&mut self, slot: u32, row: u64, values: &[f32]) {
        let (p, range) = place(slot, self.per_page, self.row_bytes);
        self.pages[p][range].copy_from_slice(bytemuck::cast_slice(values));
        self.dirty[slot as usize] = self.orphans.remove(&row).is_some();
        self.served.fills += 1;
    }
}

fn place(s: u32, per_page: usize, row_bytes: usize) -> (usize, std::ops::Range<usize>) {
    let s = s as usize;
    let at = (s % per_page) * row_bytes;
    (s / per_page, at..at + row_bytes)
}
