//! Buffers: the public face of a page table.
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;

use super::hints::{count_read_promotion, ReadPromotion};
use super::inner::Inner;
use super::map::DeviceMap;
use super::mover::Engine;
use super::request::{Priority, Request, Source};
use super::shared::Shared;
use super::table::{lost, Lost, PageGuard, Resident, Table, Zero};
use super::ticket::Ticket;
use crate::error::{Error, ErrorKind, Result};
use crate::hotness::{Harvest, HarvestParams};
use crate::tier::{PageStore, Tier};

/// An allocation whose pages may live in any tier. Dropping it returns
/// every slot and its reservation (once moves still in flight for it end).
pub struct Buffer {
    pub(super) table: Arc<Table>,
    /// Keeps the runtime (its engine, its balancer) alive while the buffer
    /// lives.
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.table.len)
            .field("pages", &self.table.pages.len())
            .finish()
    }
}

fn read_only(p: usize) -> Error {
    Error::invalid(format!(
        "page {p} is held read-only (a read-only kernel launch or a borrowed view of the buffer); writes are refused until it ends"
    ))
}

impl Buffer {
    pub(super) fn new(table: Arc<Table>, inner: Arc<Inner>) -> Self {
        Self { table, inner }
    }

    pub(super) fn rt(&self) -> &Shared {
        &self.table.rt
    }

    pub(super) fn engine(&self) -> &Engine {
        &self.inner.mover
    }

    pub(super) fn table(&self) -> &Table {
        &self.table
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.table.len
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Number of pages.
    pub fn page_count(&self) -> usize {
        self.table.pages.len()
    }

    /// Where page `page` lives: `None` while it has never been written.
    pub fn tier_of(&self, page: usize) -> Result<Option<Tier>> {
        let entry = self
            .table
            .pages
            .get(page)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "page {page} is beyond the buffer's {} pages",
                    self.table.pages.len()
                ))
            })?
            .lock();
        match &entry.loc {
            Zero => Ok(None),
            Resident { tier, .. } => Ok(Some(*tier)),
            Lost => Err(lost(page)),
        }
    }

    /// How many of the buffer's pages live in each tier right now (pages
    /// never written are in none; lost pages are counted apart). A page
    /// with a move in flight counts where it was before the move: this
    /// never waits for a move or a read.
    pub fn residency(&self) -> Residency {
        let mut r = Residency::default();
        for page in self.table.pages.iter() {
            match page.seen() {
                Zero => r.unwritten += 1,
                Lost => r.lost += 1,
                Resident { tier, .. } => r.pages[tier as usize] += 1,
            }
        }
        r
    }

    /// Whether any page of the buffer is pinned now (a view, a launch, a
    /// pin someone still holds): such pages stay where they are when the
    /// buffer is moved.
    pub(crate) fn any_pinned(&self) -> bool {
        self.table.pages.iter().any(|e| e.lock().pins > 0)
    }

    /// Whether `ptr..ptr + len` overlaps the host-reachable memory of this
    /// buffer's runtime (host and CXL arenas, a simulated device's
    /// allocation): memory strata lent out (a pin's addresses, a DLPack view
    /// of one). Such memory as a destination or source would alias the
    /// pages being read or written: [`read`](Self::read) and
    /// [`write`](Self::write) go through a copy then, and callers that
    /// write into caller memory by other paths check here.
    pub fn overlaps_runtime_memory(&self, ptr: *const u8, len: usize) -> bool {
        let (start, end) = (ptr as u64, (ptr as u64).saturating_add(len as u64));
        len > 0
            && self
                .rt()
                .tiers
                .stores()
                .filter_map(|s| s.host_memory())
                .any(|r| start < r.end && r.start < end)
    }

    /// Reads `out.len()` values of `T` starting at byte `offset` (any
    /// alignment: the bytes are copied).
    pub fn read_as<T: bytemuck::Pod>(&self, offset: u64, out: &mut [T]) -> Result<()> {
        self.read(offset, bytemuck::cast_slice_mut(out))
    }

    /// Writes the values of `data` starting at byte `offset`; as
    /// [`write`](Self::write).
    pub fn write_as<T: bytemuck::Pod>(&self, offset: u64, data: &[T]) -> Result<()> {
        self.write(offset, bytemuck::cast_slice(data))
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.table.len => Ok(()),
            _ => Err(Error::invalid(format!(
                "range {offset}+{len} exceeds the buffer's {} bytes",
                self.table.len
            ))),
        }
    }

    /// Pieces of `offset..offset+len` by page: (page, offset in page, length).
    fn pieces(&self, offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let page = self.rt().page_size() as u64;
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
        self.table.store(tier)
    }

    /// Reads `out.len()` bytes at `offset`, from whichever tiers hold them.
    /// `out` may be strata's own memory (a pinned page's addresses): the
    /// bytes then go through a copy.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        if self.overlaps_runtime_memory(out.as_ptr(), out.len()) {
            let mut copy = vec![0u8; out.len()];
            self.read(offset, &mut copy)?;
            out.copy_from_slice(&copy);
            return Ok(());
        }
        let page = self.rt().page_size();
        let mut done = 0;
        for (p, within, n) in self.pieces(offset, out.len()) {
            let dst = &mut out[done..done + n];
            let mut entry = self.table.pages[p].lock();
            entry.referenced = true;
            self.table.touch(p);
            let mut promote = entry.take_promotion();
            if let (Some(tier), true) = (promote, n == page) {
                // A whole-page read moves the page first and reads it from
                // memory: one disk read, not two.
                drop(entry);
                entry = self.promote_before_read(p, tier);
                promote = None;
            }
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
            drop(entry);
            if let Some(tier) = promote {
                self.promote_after_read(p, tier);
            }
            done += n;
        }
        Ok(())
    }

    /// A read of part of page `p` found it marked by the balancer for
    /// promotion into `tier` (and read it where it was): the page moves
    /// there now, in the background at prefetch priority (the read's
    /// caller uses the page; it does not wait for background work). The
    /// move is settled (counted, its failure kept for `Runtime::check`) by
    /// the balancer's next round, `check`, `stop_balancer` or `shutdown`.
    fn promote_after_read(&self, p: usize, tier: Tier) {
        let ticket = Ticket::new();
        self.engine().submit(
            &self.table,
            promotion(p, tier, Priority::Prefetch),
            false,
            &ticket,
        );
        self.inner.hints.read_promotions.lock().push(ReadPromotion {
            ticket,
            table: Arc::downgrade(&self.table),
            page: p,
            dst: tier,
        });
    }

    /// A read of the whole of page `p` found it marked for promotion into
    /// `tier`: the page moves there first, at demand priority, and the read
    /// goes on from wherever it is then (a failed move leaves it readable
    /// where it was; the failure is kept for `Runtime::check` unless it was
    /// only a full tier).
    fn promote_before_read(&self, p: usize, tier: Tier) -> PageGuard<'_> {
        let rt = self.rt();
        if let Err(e) = self
            .engine()
            .run(&self.table, promotion(p, tier, Priority::Demand))
        {
            if e.kind() != ErrorKind::OutOfCapacity {
                rt.note_background("a promotion on read", e);
            }
        }
        let entry = self.table.pages[p].lock();
        if entry.tier() == Some(tier) {
            count_read_promotion(rt);
        }
        entry
    }

    /// Writes `data` at `offset`. A page written for the first time takes a
    /// slot in the fastest tier with room (or the hinted tier). A write
    /// that fails leaves the page as it was before that page's write.
    /// Pages mapped for a read-only kernel launch refuse writes.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        if self.overlaps_runtime_memory(data.as_ptr(), data.len()) {
            // strata's own memory as the source: through a copy, as `read`.
            let copy = data.to_vec();
            return self.write(offset, &copy);
        }
        let page = self.rt().page_size();
        let mut scratch = Vec::new();
        let mut done = 0;
        for (p, within, n) in self.pieces(offset, data.len()) {
            let src = &data[done..done + n];
            let mut entry = self.table.pages[p].lock();
            if self.table.launches.lock().held_read_only() {
                return Err(read_only(p));
            }
            let entry = &mut *entry;
            entry.referenced = true;
            self.table.touch(p);
            let full = n == page;
            if matches!(entry.loc, Lost) {
                return Err(lost(p));
            }
            // Before the bytes change, so that a write failing part-way
            // (a device copy in place) leaves no clean copy to go back to:
            // a move of this page that copied it before this write does
            // not commit, and its clean copy goes (see page.rs).
            self.table.note_write(entry);
            match &mut entry.loc {
                Resident { tier, slot } => {
                    let store = self.table.store(*tier);
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
                    entry.loc = self.engine().first_write(&self.table, bytes, None)?;
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Counts `times` accesses to page `page` that reached it without a
    /// read of their own: a caller that read the page once for several
    /// uses (a batch of lookups into one NVMe page) reports the rest here,
    /// so the balancer sees how often the page is used. Sampling and trace
    /// recording apply as to reads.
    pub fn touch(&self, page: usize, times: u32) -> Result<()> {
        if page >= self.table.pages.len() {
            return Err(Error::invalid(format!(
                "page {page} is beyond the buffer's {} pages",
                self.table.pages.len()
            )));
        }
        for _ in 0..times {
            self.table.touch(page);
        }
        Ok(())
    }

    /// Folds the pages' access counts into their decayed scores and returns
    /// the hottest pages not in device memory and the coldest in it (see
    /// [`crate::hotness`]). Parameters out of range are an error
    /// ([`HarvestParams::check`]) and change nothing. A running balancer
    /// harvests the same counters: the counts one takes, the other does not
    /// see (harvest here for a placement of your own, or let the balancer
    /// place, not both).
    pub fn harvest(&self, params: HarvestParams) -> Result<Harvest> {
        params.check()?;
        let mut scores = self.table.scores.lock();
        // The counts about to be taken settle promotions waiting for their
        // payback (see `Table::note_harvest`).
        for (p, c) in self.table.counters.iter().enumerate() {
            self.table
                .note_harvest(p, c.load(std::sync::atomic::Ordering::Relaxed));
        }
        // Where each page is, without waiting for moves in flight (which
        // would hold `scores`, and the balancer's rounds, meanwhile).
        let resident = |p: usize| self.table.pages[p].seen_tier() == Some(Tier::Device);
        crate::hotness::harvest(&self.table.counters, &mut scores, &resident, params)
    }

    /// Refuses every kernel launch over this buffer's device maps from now
    /// on ([`DeviceMap::prepare`] fails with `Closed`, as it does once the
    /// buffer is dropped); launches already made, pins and reads and writes
    /// go on. For a binding whose handle to the buffer ends while pins made
    /// from it keep it alive (the C ABI's `strata_buffer_free`).
    pub fn close_launches(&self) {
        self.table.launches.lock().closed = true;
    }

    /// The buffer's device map (made on first use); see [`DeviceMap`].
    pub fn device_map(&self) -> Result<DeviceMap> {
        DeviceMap::of(&self.table, &self.inner)
    }

    /// Moves the pages of `range` that live in tiers faster than `tier`
    /// down to `tier`, or — where it is full — back onto their clean copy
    /// in a slower tier (no copy) or else to the next slower tier with
    /// room; `OutOfCapacity` when none has. Pages never written stay
    /// unmaterialized, and pinned pages stay where they are pinned. A page
    /// written (or moved by background eviction) while it moves is moved
    /// again as it now is, a few times at most.
    pub fn evict(&self, range: Range<u64>, tier: Tier) -> Result<()> {
        let pages = self.table.page_range(&range)?;
        if self.rt().store(tier).is_none() {
            return Err(Error::invalid(format!("the {tier} tier is not configured")));
        }
        // First everything that fits into `tier` itself, in batches; then
        // page by page down the slower tiers for what did not fit. Every
        // move goes through the engine at demand priority.
        let demote = |pages: Vec<usize>, dst: Tier| {
            self.engine().run(
                &self.table,
                Request {
                    pages,
                    dst,
                    from: Source::Above(tier),
                    priority: Priority::Demand,
                    room: None,
                },
            )
        };
        // Pages with a clean copy in `tier` go back to it here, under their
        // locks: no copy, so nothing for the engine to schedule. So do
        // pages with a clean copy below `tier` while `tier` has no free
        // slot: making room there would drop other pages' clean copies
        // (whose next demotion then writes) to copy a page that needs no
        // copy at all.
        let targets = self.rt().tiers.below(tier);
        let store = self.rt().store(tier).expect("checked above");
        let pages: Vec<usize> = pages
            .filter(|&p| {
                let mut entry = self.table.pages[p].lock();
                if entry.tier().is_none_or(|t| t >= tier) {
                    return true;
                }
                let clean = entry.clean.as_ref().map(|(t, _)| *t);
                let dst = match clean {
                    Some(t) if t == tier => t,
                    Some(t)
                        if targets.contains(&t) && store.used_pages() >= store.capacity_pages() =>
                    {
                        t
                    }
                    _ => return true,
                };
                !self.table.demote_to_clean(p, &mut entry, dst)
            })
            .collect();
        let mut full = demote(pages.clone(), tier)?;
        // A move abandoned because its page changed meanwhile (a write, or
        // background eviction moving it first) left the page above `tier`:
        // try those again, a few times (pinned pages stay, as said).
        for _ in 0..3 {
            let skip: std::collections::HashSet<usize> = full.iter().copied().collect();
            let again: Vec<usize> = pages
                .iter()
                .copied()
                .filter(|p| !skip.contains(p))
                .filter(|&p| {
                    let e = self.table.pages[p].lock();
                    e.pins == 0 && e.tier().is_some_and(|t| t < tier)
                })
                .collect();
            if again.is_empty() {
                break;
            }
            full.extend(demote(again, tier)?);
        }
        if full.is_empty() {
            return Ok(());
        }
        for p in full {
            // A page whose clean copy lies in a slower tier goes back to it
            // with no copy: `tier` has no room, and the copy is valid.
            {
                let mut entry = self.table.pages[p].lock();
                let clean = entry.clean.as_ref().map(|(t, _)| *t);
                if clean.is_some_and(|t| targets.contains(&t))
                    && self
                        .table
                        .demote_to_clean(p, &mut entry, clean.expect("checked"))
                {
                    continue;
                }
            }
            // Stays an error unless a slower tier takes the page.
            let mut taken = false;
            for &t in &targets {
                if demote(vec![p], t)?.is_empty() {
                    taken = true;
                    break;
                }
            }
            if !taken {
                return Err(Error::new(
                    ErrorKind::OutOfCapacity,
                    format!(
                        "page {p} cannot be evicted to the {tier} tier or below: all full ({})",
                        self.rt().capacity_report()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Cancels the request of `ticket` (one this runtime's moves returned,
    /// a [`prefetch`](Self::prefetch) above all): its batches still queued
    /// are dropped, their pages left where they are, readable as ever; a
    /// batch already moving finishes. Waiting on the ticket then returns as
    /// soon as that batch is done, with the request's result so far (pages
    /// that found the tier full are no error then). Returns the pages
    /// dropped (0 for a request already finished). A ticket of another
    /// runtime is marked cancelled, and that runtime drops its batches as
    /// its lanes reach them (not counted here).
    pub fn cancel(&self, ticket: &Ticket) -> usize {
        self.engine().cancel(ticket)
    }

    /// Moves the pages of `range` into `tier` (up or down) in the
    /// background and returns at once (the caller's thread never evicts:
    /// room is made by the engine's lanes); the ticket carries the first
    /// error. Where `tier` is full, clean copies there are dropped first,
    /// then the unpinned pages of `tier` outside `range` (of any buffer)
    /// not referenced since the clock hand last passed are demoted to
    /// slower tiers. Pages referenced since are valued more than a
    /// prefetch: what would need them is declined — it stays readable
    /// where it is, the request still succeeds, and
    /// [`Ticket::declined`] and `Stats::prefetches_declined` count it (the
    /// hand has passed those pages meanwhile: a later prefetch finds them
    /// cold unless they are used again). When no page could make room at
    /// all (the rest pinned or in a kernel launch, the tiers below full)
    /// the pages that fit move, the ticket's error is `OutOfCapacity`, and
    /// the others stay readable where they were.
    /// Pinned pages stay where they are pinned, and pages never written
    /// stay unmaterialized (neither is an error).
    pub fn prefetch(&self, range: Range<u64>, tier: Tier) -> Ticket {
        let pages = match self.table.page_range(&range) {
            Ok(p) => p,
            Err(e) => return Ticket::done(Err(e)),
        };
        if self.rt().store(tier).is_none() {
            return Ticket::done(Err(Error::invalid(format!(
                "the {tier} tier is not configured"
            ))));
        }
        // The engine groups the pages by the tier they are in now, one lane
        // each; a lane re-checks every page under its lock.
        let ticket = Ticket::new();
        // The balancer's policies hear of it (`Policy::hint`; of a request
        // cancelled before the next round, of the pages that came).
        self.inner
            .hints
            .add(tier, self.table.id, pages.clone(), &ticket);
        self.engine().submit(
            &self.table,
            Request {
                pages: pages.clone().collect(),
                dst: tier,
                from: Source::Any,
                priority: Priority::Prefetch,
                room: Some(pages),
            },
            true,
            &ticket,
        );
        ticket
    }

    /// Frees the buffer now (the same as dropping it).
    pub fn free(self) {}
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.table.drop_buffer();
    }
}

/// Where a buffer's pages are: [`Buffer::residency`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Residency {
    /// Pages per tier, indexed by [`Tier`] (`pages[Tier::Host as usize]`).
    pub pages: [u64; 4],
    /// Pages never written (they read as zeros and take no slot).
    pub unwritten: u64,
    /// Pages lost to I/O errors (see [`Stats::lost_pages`](super::Stats::lost_pages)).
    pub lost: u64,
}

impl Residency {
    /// Pages resident in `tier`.
    pub fn in_tier(&self, tier: Tier) -> u64 {
        self.pages[tier as usize]
    }
}

/// The move of marked page `p` into `tier` that a read carries out,
/// making room there as a pin or a prefetch of the page would (the
/// balancer marked the page when it had room for it; the tier may have
/// filled since).
fn promotion(p: usize, tier: Tier, priority: Priority) -> Request {
    Request {
        pages: vec![p],
        dst: tier,
        from: Source::Not(tier),
        priority,
        room: Some(p..p + 1),
    }
}
