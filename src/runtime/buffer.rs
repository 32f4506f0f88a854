//! Buffers: the public face of a page table.
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::MutexGuard;

use super::map::DeviceMap;
use super::mover::{Priority, Request, Source, Ticket};
use super::page::Entry;
use super::table::{lost, Lost, Resident, Table, Zero};
use super::Inner;
use crate::error::{Error, ErrorKind, Result};
use crate::hotness::{Harvest, HarvestParams};
use crate::tier::{PageStore, Tier};

/// An allocation whose pages may live in any tier. Dropping it returns
/// every slot and its reservation (once moves still in flight for it end).
pub struct Buffer {
    table: Arc<Table>,
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
    pub(super) fn new(table: Arc<Table>) -> Self {
        Self { table }
    }

    fn rt(&self) -> &Inner {
        &self.table.rt
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
    /// never written are in none; lost pages are counted apart).
    pub fn residency(&self) -> Residency {
        let mut r = Residency::default();
        for entry in self.table.pages.iter() {
            match &entry.lock().loc {
                Zero => r.unwritten += 1,
                Lost => r.lost += 1,
                Resident { tier, .. } => r.pages[*tier as usize] += 1,
            }
        }
        r
    }

    /// Whether `ptr..ptr + len` overlaps the host or CXL memory of this
    /// buffer's runtime: memory strata lent out (a pin's addresses, a DLPack
    /// view of one). Passing such memory back as `read`'s destination or
    /// `write`'s source would alias the pages being read or written; a
    /// binding that cannot rule it out checks here and goes through a copy.
    pub fn overlaps_runtime_memory(&self, ptr: *const u8, len: usize) -> bool {
        let (start, end) = (ptr as u64, (ptr as u64).saturating_add(len as u64));
        len > 0
            && self
                .rt()
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
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
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
        let rt = self.rt();
        let ticket = Ticket::new();
        rt.mover.submit(
            &self.table,
            promotion(p, tier, Priority::Prefetch),
            false,
            &ticket,
        );
        rt.hints
            .read_promotions
            .lock()
            .push(super::balancer::ReadPromotion {
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
    fn promote_before_read(&self, p: usize, tier: Tier) -> MutexGuard<'_, Entry> {
        let rt = self.rt();
        if let Err(e) = rt
            .mover
            .run(&self.table, promotion(p, tier, Priority::Demand))
        {
            if e.kind() != ErrorKind::OutOfCapacity {
                rt.note_background("a promotion on read", e);
            }
        }
        let entry = self.table.pages[p].lock();
        if entry.tier() == Some(tier) {
            super::balancer::count_read_promotion(rt);
        }
        entry
    }

    /// Writes `data` at `offset`. A page written for the first time takes a
    /// slot in the fastest tier with room (or the hinted tier). A write
    /// that fails leaves the page as it was before that page's write.
    /// Pages mapped for a read-only kernel launch refuse writes.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
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
                    entry.loc = self.table.first_write(bytes, None)?;
                }
            }
            // A move of this page that copied it before this write does
            // not commit (see page.rs).
            entry.note_write();
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
    /// [`crate::hotness`]).
    pub fn harvest(&self, params: HarvestParams) -> Harvest {
        let mut scores = self.table.scores.lock();
        let resident = |p: usize| self.table.pages[p].lock().tier() == Some(Tier::Device);
        crate::hotness::harvest(&self.table.counters, &mut scores, &resident, params)
    }

    /// The buffer's device map (made on first use); see [`DeviceMap`].
    pub fn device_map(&self) -> Result<DeviceMap> {
        DeviceMap::of(&self.table)
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
        let pages = self.table.page_range(&range)?;
        let store = self
            .rt()
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
        // The whole range first, in batches, through the engine at demand
        // priority (room made in `tier` as a prefetch makes it); then page
        // by page under each page's lock, moving again what raced away.
        let elsewhere: Vec<usize> = pages
            .clone()
            .filter(|&p| {
                let e = self.table.pages[p].lock();
                e.pins == 0 && e.tier().is_some_and(|t| t != tier)
            })
            .collect();
        if !elsewhere.is_empty() {
            match self.demand_move(elsewhere.clone(), tier, &pages) {
                // What did not fit is tried again page by page below.
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {}
                Err(e) => return Err(e),
            }
            let moved = elsewhere
                .iter()
                .filter(|&&p| self.table.pages[p].lock().tier() == Some(tier))
                .count();
            self.rt()
                .counters
                .faults
                .fetch_add(moved as u64, Ordering::Relaxed);
        }
        let zeros = vec![0u8; self.rt().page_size()];
        for p in pages.clone() {
            // A full tier gets room made in it (a victim demoted), with the
            // page unlocked meanwhile: a few tries, then the error stands.
            let mut tries = 0;
            let mut entry = loop {
                let mut entry = self.table.pages[p].lock();
                let src = match &entry.loc {
                    Resident { tier: t, .. } if *t == tier => break entry,
                    Resident { .. } if entry.pins > 0 => {
                        return Err(Error::invalid(format!(
                            "page {p} is pinned in another tier"
                        )));
                    }
                    Resident { tier: t, .. } => *t,
                    Lost => return Err(lost(p)),
                    Zero => match self.table.first_write(&zeros, Some(&[tier])) {
                        Ok(loc) => {
                            entry.loc = loc;
                            break entry;
                        }
                        Err(e) if e.kind() == ErrorKind::OutOfCapacity && tries < 3 => {
                            drop(entry);
                            tries += 1;
                            // Never by demoting a page of this pin's range.
                            let (_, failed) = super::reclaim::make_room_for(
                                &self.table.rt,
                                tier,
                                1,
                                &self.table,
                                &pages,
                                Priority::Demand,
                            );
                            if let Some(e) = failed {
                                self.rt().note_background("making room for a pin", e);
                            }
                            continue;
                        }
                        Err(e) => return Err(e),
                    },
                };
                drop(entry);
                if !self.table.may_move(src, tier) {
                    return Err(Error::invalid(format!(
                        "page {p} cannot move to the {tier} tier while a kernel launch maps it"
                    )));
                }
                if tries == 3 {
                    return Err(Error::new(
                        ErrorKind::OutOfCapacity,
                        format!(
                            "page {p} cannot move to the {tier} tier: it is full ({})",
                            self.rt().capacity_report()
                        ),
                    ));
                }
                tries += 1;
                let full = self.demand_move(vec![p], tier, &pages)?;
                if full.is_empty() && self.table.pages[p].lock().tier() == Some(tier) {
                    self.rt().counters.faults.fetch_add(1, Ordering::Relaxed);
                }
            };
            let Resident { slot, .. } = &entry.loc else {
                unreachable!("made resident above")
            };
            pin.addresses
                .push(store.address(slot).expect("memory tiers are addressable"));
            // Whoever holds the address may write through it: a move that
            // copied the page before this pin does not commit.
            if entry.pin() {
                self.rt().pinned[tier as usize].fetch_add(1, Ordering::Relaxed);
            }
            // The guard now covers this page (and unpins it on drop, also
            // if a later page fails).
            pin.pages.end = p + 1;
        }
        Ok(pin)
    }

    /// Moves `pages` into `tier` through the engine at demand priority,
    /// making room there (never by demoting a page of `protect`); waits.
    /// The pages that still found `tier` full.
    fn demand_move(
        &self,
        pages: Vec<usize>,
        tier: Tier,
        protect: &Range<usize>,
    ) -> Result<Vec<usize>> {
        self.rt().mover.run(
            &self.table,
            Request {
                pages,
                dst: tier,
                from: Source::Any,
                priority: Priority::Demand,
                room: Some(protect.clone()),
            },
        )
    }

    /// Moves the pages of `range` that live in tiers faster than `tier`
    /// down to `tier`, or — where it is full — to the next slower tier with
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
            self.rt().mover.run(
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
        let pages: Vec<usize> = pages.collect();
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
        let targets = self.rt().tiers_below(tier);
        for p in full {
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

    /// Moves the pages of `range` into `tier` (up or down) in the
    /// background and returns at once; the ticket carries the first error.
    /// Where `tier` is full, room is made as [`pin`](Self::pin) makes it:
    /// the coldest unpinned pages of `tier` outside `range` (of any buffer)
    /// are demoted to slower tiers. When that cannot make enough room (a
    /// range larger than the tier, the rest pinned or in a kernel launch,
    /// the tiers below full) the pages that fit move, the ticket's error is
    /// `OutOfCapacity`, and the others stay readable where they were.
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
        // The balancer's policies hear of it (`Policy::hint`).
        self.rt().hints.add(tier, self.table.id, pages.clone());
        // The engine groups the pages by the tier they are in now, one lane
        // each; a lane re-checks every page under its lock.
        let ticket = Ticket::new();
        self.rt().mover.submit(
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
        self.table.clear();
    }
}

impl Buffer {
    /// [`pin`](Self::pin) for holders that cannot keep a borrow of the
    /// buffer alive (the C ABI's handle tables): the guard holds a
    /// reference to the buffer, which therefore lives until the guard drops.
    pub fn pin_owned(self: &Arc<Self>, range: Range<u64>, tier: Tier) -> Result<OwnedPin> {
        let mut pin = self.pin(range, tier)?;
        // The owned guard takes the pinned pages over; the borrowed one is
        // left covering none, so its drop unpins nothing.
        let pages = std::mem::replace(&mut pin.pages, 0..0);
        let addresses = std::mem::take(&mut pin.addresses);
        Ok(OwnedPin {
            buffer: self.clone(),
            pages,
            tier,
            addresses,
        })
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
            let mut entry = self.buffer.table.pages[p].lock();
            if entry.unpin() {
                self.buffer.table.rt.pinned[self.tier as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A [`Pin`] that owns a reference to its buffer; see [`Buffer::pin_owned`].
#[derive(Debug)]
#[must_use = "the pages are unpinned when the guard drops"]
pub struct OwnedPin {
    buffer: Arc<Buffer>,
    pages: Range<usize>,
    tier: Tier,
    addresses: Vec<u64>,
}

impl OwnedPin {
    /// The tier the pages are pinned in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The pinned pages (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pages.clone()
    }

    /// Each pinned page's address, as [`Pin::addresses`].
    pub fn addresses(&self) -> &[u64] {
        &self.addresses
    }
}

impl Drop for OwnedPin {
    fn drop(&mut self) {
        // Unpins exactly as the borrowed guard does.
        drop(Pin {
            buffer: &self.buffer,
            pages: std::mem::replace(&mut self.pages, 0..0),
            tier: self.tier,
            addresses: Vec::new(),
        });
    }
}

/// The move of marked page `p` into `tier` that a read carries out.
fn promotion(p: usize, tier: Tier, priority: Priority) -> Request {
    Request {
        pages: vec![p],
        dst: tier,
        from: Source::Not(tier),
        priority,
        room: None,
    }
}
