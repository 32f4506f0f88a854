//! Buffers and their page tables.
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Inner, Placement};
use crate::error::{Error, ErrorKind, Result};
use crate::io::AlignedBuf;
use crate::tier::{NvmeStore, PageStore, Slot, Tier};

/// Pages moved together: their NVMe I/O is in flight at once.
const BATCH: usize = 32;

/// Move reservations (see `Inner::reserve_move`), given back on drop.
struct Reserved<'a> {
    rt: &'a super::Inner,
    pages: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.rt.release(self.pages);
    }
}

/// Where a page is.
#[derive(Debug)]
enum Loc {
    /// Never written: reads as zeros, holds no slot.
    Zero,
    /// In a slot of a tier.
    Resident { tier: Tier, slot: Slot },
    /// Its slot is in an NVMe read of a batched move. Only seen under the
    /// page lock — unless the I/O engine failed with the read in flight,
    /// when the page stays this way and reads say so (never zeros).
    Lost,
}

/// One page-table entry.
#[derive(Debug)]
struct Entry {
    loc: Loc,
    /// Live [`Pin`]s covering the page: while non-zero it never moves.
    pins: u32,
}

use Loc::{Lost, Resident, Zero};

fn lost(p: usize) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("page {p} was lost: the i/o engine failed while the page was moving"),
    )
}

/// An allocation whose pages may live in any tier. Dropping it returns
/// every slot and its reservation.
pub struct Buffer {
    rt: Arc<Inner>,
    len: u64,
    placement: Placement,
    /// The page table: one lock per page, held for the length of one
    /// page's read, write or move (never across pages, never while waiting
    /// for another page).
    pages: Box<[Mutex<Entry>]>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.len)
            .field("pages", &self.pages.len())
            .finish()
    }
}

/// The handle of an asynchronous request. In this version requests finish
/// before the call that made them returns, so a ticket is always ready;
/// the interface is the one the asynchronous mover will keep.
#[derive(Debug)]
#[must_use = "a ticket carries the request's error, if any"]
pub struct Ticket {
    result: Option<Result<()>>,
}

impl Ticket {
    fn done(result: Result<()>) -> Self {
        Self {
            result: Some(result),
        }
    }

    /// Waits for the request and returns its result.
    pub fn wait(mut self) -> Result<()> {
        self.result.take().unwrap_or(Ok(()))
    }

    /// The result if the request has finished (always, in this version).
    pub fn poll(&self) -> Option<Result<()>> {
        self.result.clone()
    }
}

impl Buffer {
    pub(super) fn new(rt: Arc<Inner>, len: u64, pages: u64, placement: Placement) -> Self {
        Self {
            rt,
            len,
            placement,
            pages: (0..pages)
                .map(|_| Mutex::new(Entry { loc: Zero, pins: 0 }))
                .collect(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Number of pages.
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Where page `page` lives: `None` while it has never been written.
    pub fn tier_of(&self, page: usize) -> Result<Option<Tier>> {
        let entry = self
            .pages
            .get(page)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "page {page} is beyond the buffer's {} pages",
                    self.pages.len()
                ))
            })?
            .lock();
        match &entry.loc {
            Zero => Ok(None),
            Resident { tier, .. } => Ok(Some(*tier)),
            Lost => Err(lost(page)),
        }
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::invalid(format!(
                "range {offset}+{len} exceeds the buffer's {} bytes",
                self.len
            ))),
        }
    }

    /// Pieces of `offset..offset+len` by page: (page, offset in page, length).
    fn pieces(&self, offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let page = self.rt.page_size() as u64;
        let end = offset + len as u64;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let p = at / page;
            let within = at % page;
            let n = (page - within).min(end - at);
            at += n;
            Some((p as usize, within as usize, n as usize))
        })
    }

    fn store(&self, tier: Tier) -> &dyn PageStore {
        self.rt
            .store(tier)
            .expect("entries only name configured tiers")
    }

    /// Reads `out.len()` bytes at `offset`, from whichever tiers hold them.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        let page = self.rt.page_size();
        let mut done = 0;
        for (p, within, n) in self.pieces(offset, out.len()) {
            let dst = &mut out[done..done + n];
            let entry = self.pages[p].lock();
            match &entry.loc {
                Zero => dst.fill(0),
                Lost => return Err(lost(p)),
                Resident { tier, slot } => {
                    let store = self.store(*tier);
                    if n == page {
                        store.read_page(slot, dst)?;
                    } else {
                        store.read_range(slot, within, dst)?;
                    }
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at `offset`. A page written for the first time takes a
    /// slot in the fastest tier with room (or the hinted tier). A write
    /// that fails leaves the page as it was before that page's write.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        let page = self.rt.page_size();
        let mut scratch = Vec::new();
        let mut done = 0;
        for (p, within, n) in self.pieces(offset, data.len()) {
            let src = &data[done..done + n];
            let mut entry = self.pages[p].lock();
            let full = n == page;
            match &mut entry.loc {
                Resident { tier, slot } => {
                    let store = self.store(*tier);
                    if full {
                        store.write_page(slot, src)?;
                    } else {
                        store.write_range(slot, within, src)?;
                    }
                }
                Lost => return Err(lost(p)),
                Zero => {
                    let bytes: &[u8] = if full {
                        src
                    } else {
                        scratch.clear();
                        scratch.resize(page, 0);
                        scratch[within..within + n].copy_from_slice(src);
                        &scratch
                    };
                    entry.loc = self.first_write(bytes, None)?;
                    self.rt
                        .counters
                        .first_writes
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Tiers in the order a first write tries them.
    fn placement_order(&self) -> Vec<Tier> {
        let mut order: Vec<Tier> = self.rt.stores().map(|s| s.tier()).collect();
        if let Placement::Prefer(t) = self.placement {
            order.retain(|&x| x != t);
            order.insert(0, t);
        }
        order
    }

    /// Puts a never-written page in a slot: of `only`, or of the first
    /// tier in placement order with room.
    fn first_write(&self, page: &[u8], only: Option<Tier>) -> Result<Loc> {
        let order = match only {
            Some(t) => vec![t],
            None => self.placement_order(),
        };
        for tier in order {
            let store = self.store(tier);
            let Ok(mut slot) = store.alloc() else {
                continue;
            };
            return match store.write_page(&mut slot, page) {
                Ok(()) => Ok(Resident { tier, slot }),
                Err(e) => {
                    store.free(slot)?;
                    Err(e)
                }
            };
        }
        Err(Error::new(
            ErrorKind::OutOfCapacity,
            format!(
                "no tier has a free slot for a first write ({})",
                self.rt.capacity_report()
            ),
        ))
    }

    fn page_range(&self, range: &Range<u64>) -> Result<Range<usize>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::invalid(format!(
                "range {}..{} is outside the buffer's {} bytes",
                range.start, range.end, self.len
            )));
        }
        let page = self.rt.page_size() as u64;
        Ok((range.start / page) as usize..range.end.div_ceil(page) as usize)
    }

    /// Moves page `p` into `dst` (copy, then commit). `Ok(false)` when
    /// there was nothing to move, or the page is pinned (pinned pages never
    /// move).
    fn move_page(&self, p: usize, dst: Tier, only_from_faster_than: Option<Tier>) -> Result<bool> {
        let mut entry = self.pages[p].lock();
        if entry.pins > 0 {
            return Ok(false);
        }
        // Checked under the lock: another thread may have moved the page
        // since the caller looked.
        if let (Some(limit), Resident { tier, .. }) = (only_from_faster_than, &entry.loc) {
            if *tier >= limit {
                return Ok(false);
            }
        }
        self.move_locked(p, &mut entry, dst)
    }

    fn move_locked(&self, p: usize, entry: &mut Entry, dst: Tier) -> Result<bool> {
        let Resident { tier: src, slot } = &mut entry.loc else {
            return Ok(false);
        };
        if *src == dst {
            return Ok(false);
        }
        let src = *src;
        let from = self.store(src);
        let to = self
            .rt
            .store(dst)
            .ok_or_else(|| Error::invalid(format!("the {dst} tier is not configured")))?;
        let started = std::time::Instant::now();
        // The page holds two slots until the move commits: account the
        // second against the runtime's capacity.
        self.rt.reserve_move()?;
        let moved = (|| {
            let mut fresh = to.alloc()?;
            // One copy, straight from the source's bytes where it has them.
            match from.with_page(slot, &mut |bytes| to.write_new(&mut fresh, bytes)) {
                Ok(()) => Ok(fresh),
                Err(e) => {
                    to.free(fresh)?;
                    Err(e)
                }
            }
        })();
        self.rt.release(1);
        match moved {
            Ok(fresh) => {
                let Resident { slot: old, .. } = std::mem::replace(
                    &mut entry.loc,
                    Resident {
                        tier: dst,
                        slot: fresh,
                    },
                ) else {
                    unreachable!("the entry was resident")
                };
                from.free(old)?;
                self.rt.counters.moves.fetch_add(1, Ordering::Relaxed);
                self.rt.link(src, dst).record(
                    self.rt.page_size(),
                    started.elapsed(),
                    std::time::Duration::ZERO,
                );
                Ok(true)
            }
            Err(e) => {
                // A full destination is a refusal, not a failed move (as in
                // the batched path).
                if e.kind() != ErrorKind::OutOfCapacity {
                    self.rt
                        .counters
                        .failed_moves
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(e.context(format!("moving page {p} from {src} to {dst}")))
            }
        }
    }

    /// Makes the pages of `range` resident in `tier` (moving or
    /// materializing them) and keeps them there until the returned guard
    /// drops. The guard gives each page's address: a device address on the
    /// device tier, a host address on the host and CXL tiers (NVMe pages are
    /// not addressable and cannot be pinned). A pin larger than the tier, or
    /// one that cannot be satisfied, is an error and pins nothing.
    ///
    /// Writes through the runtime still reach pinned pages, in place, while
    /// whoever holds the addresses (a kernel, a C caller) may be using them:
    /// ordering the two is the caller's job, as for any shared buffer.
    pub fn pin(&self, range: Range<u64>, tier: Tier) -> Result<Pin<'_>> {
        let pages = self.page_range(&range)?;
        let store = self
            .rt
            .store(tier)
            .ok_or_else(|| Error::invalid(format!("the {tier} tier is not configured")))?;
        if tier == Tier::Nvme {
            return Err(Error::invalid(
                "nvme pages are not addressable and cannot be pinned",
            ));
        }
        if pages.len() as u64 > store.capacity_pages() as u64 {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "a pin of {} pages exceeds the {tier} tier's {} pages",
                    pages.len(),
                    store.capacity_pages()
                ),
            ));
        }
        let mut pin = Pin {
            buffer: self,
            pages: pages.start..pages.start,
            tier,
            addresses: Vec::with_capacity(pages.len()),
        };
        let zeros = vec![0u8; self.rt.page_size()];
        for p in pages {
            let mut entry = self.pages[p].lock();
            match &entry.loc {
                Resident { tier: t, .. } if *t == tier => {}
                Resident { .. } if entry.pins > 0 => {
                    return Err(Error::invalid(format!(
                        "page {p} is pinned in another tier"
                    )));
                }
                Resident { .. } => {
                    self.move_locked(p, &mut entry, tier)?;
                }
                Lost => return Err(lost(p)),
                Zero => {
                    entry.loc = self.first_write(&zeros, Some(tier))?;
                    self.rt
                        .counters
                        .first_writes
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            let Resident { slot, .. } = &entry.loc else {
                unreachable!("made resident above")
            };
            pin.addresses
                .push(store.address(slot).expect("memory tiers are addressable"));
            entry.pins += 1;
            if entry.pins == 1 {
                self.rt.pinned[tier as usize].fetch_add(1, Ordering::Relaxed);
            }
            // The guard now covers this page (and unpins it on drop, also
            // if a later page fails).
            pin.pages.end = p + 1;
        }
        Ok(pin)
    }

    /// Moves the pages of `range` that live in tiers faster than `tier`
    /// down to `tier`, or — where it is full — to the next slower tier with
    /// room; `OutOfCapacity` when none has. Pages never written stay
    /// unmaterialized, and pinned pages stay where they are pinned.
    pub fn evict(&self, range: Range<u64>, tier: Tier) -> Result<()> {
        let pages = self.page_range(&range)?;
        if self.rt.store(tier).is_none() {
            return Err(Error::invalid(format!("the {tier} tier is not configured")));
        }
        // First everything that fits into `tier` itself, in batches; then
        // page by page down the slower tiers for what did not fit.
        let full = self.move_batched(pages.clone(), tier, &|t| t < tier)?;
        if full.is_empty() {
            return Ok(());
        }
        let targets: Vec<Tier> = self
            .rt
            .stores()
            .map(|s| s.tier())
            .filter(|&t| t > tier)
            .collect();
        for p in full {
            // Stays an error unless a slower tier takes the page.
            let mut last = Some(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "page {p} cannot be evicted to the {tier} tier or below: all full ({})",
                    self.rt.capacity_report()
                ),
            ));
            for &t in &targets {
                match self.move_page(p, t, Some(tier)) {
                    Ok(_) => {
                        last = None;
                        break;
                    }
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity => last = Some(e),
                    Err(e) => return Err(e),
                }
            }
            if let Some(e) = last {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Moves the pages of `range` into `tier` (up or down). The ticket
    /// carries the first error; pages that could not move stay readable
    /// where they were. Pinned pages stay where they are pinned, and pages
    /// never written stay unmaterialized (neither is an error).
    pub fn prefetch(&self, range: Range<u64>, tier: Tier) -> Ticket {
        let result = (|| {
            let pages = self.page_range(&range)?;
            if self.rt.store(tier).is_none() {
                return Err(Error::invalid(format!("the {tier} tier is not configured")));
            }
            match self.move_batched(pages, tier, &|_| true)?.first() {
                None => Ok(()),
                Some(&p) => Err(Error::new(
                    ErrorKind::OutOfCapacity,
                    format!(
                        "page {p} cannot move to the {tier} tier: it is full ({})",
                        self.rt.capacity_report()
                    ),
                )),
            }
        })();
        Ticket::done(result)
    }

    /// Moves the pages of `pages` whose tier satisfies `wanted` into `dst`,
    /// [`BATCH`] at a time, with the NVMe reads or writes of a batch in
    /// flight together. Returns the pages that found `dst` full; any other
    /// failure is returned as an error after the batch (its pages stay
    /// where they were).
    fn move_batched(
        &self,
        pages: Range<usize>,
        dst: Tier,
        wanted: &dyn Fn(Tier) -> bool,
    ) -> Result<Vec<usize>> {
        let mut full = Vec::new();
        let all: Vec<usize> = pages.collect();
        // A batch never exceeds what one NVMe session keeps in flight.
        let batch = self
            .rt
            .store(Tier::Nvme)
            .and_then(|s| s.as_any().downcast_ref::<NvmeStore>())
            .map_or(BATCH, |n| n.queue_depth().min(BATCH))
            .max(1);
        for chunk in all.chunks(batch) {
            self.move_chunk(chunk, dst, wanted, &mut full)?;
        }
        Ok(full)
    }

    fn move_chunk(
        &self,
        chunk: &[usize],
        dst: Tier,
        wanted: &dyn Fn(Tier) -> bool,
        full: &mut Vec<usize>,
    ) -> Result<()> {
        // Ascending page order, the only order in which more than one page
        // lock is ever held, so two batches cannot deadlock.
        let mut guards: Vec<(usize, parking_lot::MutexGuard<'_, Entry>)> = Vec::new();
        let mut lost_page = None;
        for &p in chunk {
            let entry = self.pages[p].lock();
            if matches!(entry.loc, Lost) {
                lost_page.get_or_insert(p);
            }
            let movable = entry.pins == 0
                && matches!(&entry.loc, Resident { tier, .. } if *tier != dst && wanted(*tier));
            if movable {
                guards.push((p, entry));
            }
        }
        let nvme = self
            .rt
            .store(Tier::Nvme)
            .and_then(|s| s.as_any().downcast_ref::<NvmeStore>());
        let src_of = |e: &Entry| match &e.loc {
            Resident { tier, .. } => *tier,
            // Only resident pages are batched; a page whose slot is in a
            // read counts as NVMe-sourced.
            Zero | Lost => Tier::Nvme,
        };
        let Some(nvme) = nvme
            .filter(|_| dst == Tier::Nvme || guards.iter().any(|(_, e)| src_of(e) == Tier::Nvme))
        else {
            // No NVMe I/O to overlap: page by page, under the locks held.
            let mut first_err = lost_page.map(lost);
            for (p, entry) in guards.iter_mut() {
                match self.move_locked(*p, entry, dst) {
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            return first_err.map_or(Ok(()), Err);
        };
        let to = self
            .rt
            .store(dst)
            .ok_or_else(|| Error::invalid(format!("the {dst} tier is not configured")))?;
        let started = std::time::Instant::now();
        let mut first_err: Option<Error> = lost_page.map(lost);

        // Reserve the second slot of each move (see `move_locked`); the
        // guard gives the reservations back on every way out.
        let mut reserved = Reserved {
            rt: &self.rt,
            pages: 0,
        };
        guards.retain(|(p, _)| match self.rt.reserve_move() {
            Ok(()) => {
                reserved.pages += 1;
                true
            }
            Err(_) => {
                full.push(*p);
                false
            }
        });

        // From here on nothing returns early: a slot taken out of its entry
        // for a read must be put back (or the page marked lost).

        // 1. Source bytes into buffers: NVMe pages read together.
        let mut data: Vec<Option<AlignedBuf>> = (0..guards.len()).map(|_| None).collect();
        match nvme.session() {
            Err(e) => {
                first_err.get_or_insert(e);
            }
            Ok(mut session) => {
                for (i, (_, entry)) in guards.iter_mut().enumerate() {
                    if src_of(entry) == Tier::Nvme {
                        // The slot travels with its read and comes back in the
                        // completion; the page lock keeps everyone else out.
                        let buf = match nvme.buffer() {
                            Ok(b) => b,
                            Err(e) => {
                                first_err.get_or_insert(e);
                                continue;
                            }
                        };
                        let Resident { slot, .. } = std::mem::replace(&mut entry.loc, Lost) else {
                            unreachable!("checked resident")
                        };
                        if let Err(r) = session.submit_read(slot, buf, i as u64) {
                            entry.loc = Resident {
                                tier: Tier::Nvme,
                                slot: r.slot,
                            };
                            first_err.get_or_insert(r.error);
                        }
                    } else {
                        let from = self.store(src_of(entry));
                        let Resident { slot, .. } = &entry.loc else {
                            unreachable!()
                        };
                        let mut buf = match nvme.buffer() {
                            Ok(b) => b,
                            Err(e) => {
                                first_err.get_or_insert(e);
                                continue;
                            }
                        };
                        match from.with_page(slot, &mut |b| {
                            buf.copy_from_slice(b);
                            Ok(())
                        }) {
                            Ok(()) => data[i] = Some(buf),
                            Err(e) => {
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                }
                let mut done = Vec::new();
                // Every slot in a read must come back to its page: after an
                // engine error, keep reaping (a few times) what is in flight.
                for _ in 0..4 {
                    if session.in_flight() == 0 {
                        break;
                    }
                    let reaped = session.reap(session.in_flight(), &mut done);
                    for c in done.drain(..) {
                        let i = c.tag as usize;
                        guards[i].1.loc = Resident {
                            tier: Tier::Nvme,
                            slot: c.slot,
                        };
                        match c.result {
                            Ok(()) => data[i] = Some(c.buf),
                            Err(e) => {
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                    if let Err(e) = reaped {
                        // Reads never reaped keep their pages marked lost.
                        first_err.get_or_insert(e);
                    }
                }
            }
        }

        // 2. Destination slots written: NVMe writes together.
        let mut fresh: Vec<Option<Slot>> = (0..guards.len()).map(|_| None).collect();
        if dst == Tier::Nvme {
            let mut session = match nvme.session() {
                Ok(s) => Some(s),
                Err(e) => {
                    first_err.get_or_insert(e);
                    None
                }
            };
            for (i, buf) in data.iter_mut().enumerate() {
                let Some(session) = session.as_mut() else {
                    break;
                };
                let Some(buf) = buf.take() else { continue };
                match nvme.alloc() {
                    Ok(slot) => {
                        if let Err(r) = session.submit_write(slot, buf, i as u64) {
                            let _ = nvme.free(r.slot);
                            first_err.get_or_insert(r.error);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(guards[i].0),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            if let Some(session) = session.as_mut() {
                let mut done = Vec::new();
                let reaped = session.reap(session.in_flight(), &mut done);
                for c in done {
                    match c.result {
                        Ok(()) => fresh[c.tag as usize] = Some(c.slot),
                        Err(e) => {
                            let _ = nvme.free(c.slot);
                            first_err.get_or_insert(e);
                        }
                    }
                }
                if let Err(e) = reaped {
                    // Writes still in flight: their fresh slots stay
                    // allocated (leaked); the pages keep their old copies.
                    first_err.get_or_insert(e);
                }
            }
        } else {
            for (i, buf) in data.iter().enumerate() {
                let Some(buf) = buf else { continue };
                match to.alloc() {
                    Ok(mut slot) => match to.write_new(&mut slot, buf) {
                        Ok(()) => fresh[i] = Some(slot),
                        Err(e) => {
                            let _ = to.free(slot);
                            first_err.get_or_insert(e);
                        }
                    },
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(guards[i].0),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }

        // 3. Commit: each page switches to its new slot; the old is freed.
        let mut committed: Vec<Tier> = Vec::new();
        let mut failed = 0u64;
        for (i, (p, entry)) in guards.iter_mut().enumerate() {
            let Some(slot) = fresh[i].take() else {
                if !full.contains(p) {
                    failed += 1;
                }
                continue;
            };
            let src = src_of(entry);
            let Resident { slot: old, .. } =
                std::mem::replace(&mut entry.loc, Resident { tier: dst, slot })
            else {
                unreachable!("checked resident")
            };
            // Freeing fails only for a slot of another store, which the
            // page table never holds.
            let _ = self.store(src).free(old);
            committed.push(src);
        }
        // The batch's time is shared by the pages it moved.
        if !committed.is_empty() {
            let per_page = started.elapsed() / committed.len() as u32;
            for &src in &committed {
                self.rt.link(src, dst).record(
                    self.rt.page_size(),
                    per_page,
                    std::time::Duration::ZERO,
                );
            }
        }
        self.rt
            .counters
            .moves
            .fetch_add(committed.len() as u64, Ordering::Relaxed);
        self.rt
            .counters
            .failed_moves
            .fetch_add(failed, Ordering::Relaxed);
        drop(reserved);
        match first_err {
            Some(e) => Err(e.context(format!("moving pages to the {dst} tier"))),
            None => Ok(()),
        }
    }

    /// Frees the buffer now (the same as dropping it).
    pub fn free(self) {}
}

/// Pages held resident in one tier; see [`Buffer::pin`].
#[derive(Debug)]
#[must_use = "the pages are unpinned when the guard drops"]
pub struct Pin<'a> {
    buffer: &'a Buffer,
    pages: Range<usize>,
    tier: Tier,
    addresses: Vec<u64>,
}

impl Pin<'_> {
    /// The tier the pages are pinned in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The pinned pages (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pages.clone()
    }

    /// Each pinned page's address (device or host), in page order. The
    /// addresses stay valid until the guard drops; what is done through
    /// them is outside Rust's checks (kernels, C callers).
    pub fn addresses(&self) -> &[u64] {
        &self.addresses
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        for p in self.pages.clone() {
            let mut entry = self.buffer.pages[p].lock();
            entry.pins -= 1;
            if entry.pins == 0 {
                self.buffer.rt.pinned[self.tier as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        for entry in self.pages.iter_mut() {
            if let Resident { tier, slot } = std::mem::replace(&mut entry.get_mut().loc, Zero) {
                // A store refuses only slots that are not its own, which the
                // page table never holds.
                let _ = self.rt.store(tier).map(|s| s.free(slot));
            }
        }
        self.rt.release(self.pages.len() as u64);
    }
}
