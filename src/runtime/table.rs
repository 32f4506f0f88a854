//! A buffer's page table: one lock per page, and the one commit every copy
//! path ends in ([`Table::commit`], over the transitions of `page.rs`).
//!
//! One lock per page, held for one page's read, write or move. Several
//! page locks are only ever held together by a batched move, which takes
//! them in ascending page order, so batches cannot deadlock.
//!
//! Every change to a page's bytes or place bumps its `version`; a move
//! commits only if the version is unchanged since its copy began, so a
//! write that races a move wins and the move is abandoned (its fresh slot
//! freed). The copy paths (`copy_memory.rs`, `copy_device.rs`,
//! `copy_nvme.rs`, behind `batch.rs`) copy; this module commits and keeps
//! the books of a batch (its reservations, its link time).
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::accounting::Counters;
use super::mapping::MapShared;
use super::shared::Shared;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::{PageStore, Slot, Tier};

pub(crate) use super::page::{
    lost, Begun, Entry, Freed, Loc, Lost, Page, PageGuard, Resident, Zero,
};

/// Pages moved together: their NVMe I/O is in flight at once.
pub(crate) const BATCH: usize = 32;

/// Pages a prefetch or the balancer moves over the device link together:
/// one transfer, waited for once (8 MiB at 64 KiB pages). Demand moves
/// keep [`BATCH`]: one waits at most for the batch its lane is running.
pub(crate) const DEVICE_BATCH: usize = 128;

/// Pages of one batch, locked in ascending order.
pub(crate) type Locked<'a> = Vec<(usize, PageGuard<'a>)>;

/// Where to put a buffer's pages when they are first written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// The fastest tier with a free slot.
    #[default]
    Fastest,
    /// This tier while it has room, then the fastest with room.
    Prefer(Tier),
}

/// Move reservations (see `Accounting::reserve_move`), given back on drop.
pub(crate) struct Reserved<'a> {
    rt: &'a Shared,
    pub(crate) pages: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.rt.release_moves(self.pages);
    }
}

/// Kernel launches over the buffer's device map (see `map.rs`).
#[derive(Debug, Default)]
pub(crate) struct Launches {
    /// Live read-only launches: pages may be promoted (the old copy is
    /// retired until the launches end), never demoted or written.
    pub(crate) read_only: u32,
    /// Live read-write launches: no page in a memory tier moves.
    pub(crate) read_write: u32,
    /// Live borrowed views ([`Buffer::view`](super::Buffer::view)): writes
    /// through the runtime and read-write launches wait.
    pub(crate) views: u32,
    /// A mutable view ([`Buffer::view_mut`](super::Buffer::view_mut)) is
    /// live: no launch starts.
    pub(crate) exclusive: bool,
    /// Slots replaced by promotions during read-only launches: kernels may
    /// still read them through map entries they loaded earlier.
    pub(crate) retired: Vec<(Tier, Slot)>,
    /// The buffer was dropped: no launch starts (a device map may outlive
    /// its buffer), and the last launch to end frees the pages.
    pub(crate) dropped: bool,
    /// No launch starts ([`Buffer::close_launches`](super::Buffer::close_launches)),
    /// the pages staying while the buffer lives (pins made from it hold it).
    pub(crate) closed: bool,
}

impl Launches {
    /// Whether writes through the runtime are refused: a read-only launch
    /// or a borrowed view is live.
    pub(crate) fn held_read_only(&self) -> bool {
        self.read_only > 0 || self.views > 0
    }

    fn any(&self) -> bool {
        self.read_only + self.read_write > 0
    }
}

/// The shared part of a buffer: its page table. Moves in the background
/// hold it while they run, so it outlives a dropped `Buffer` until they end.
pub(crate) struct Table {
    pub(crate) rt: Arc<Shared>,
    /// The buffer's number in this runtime (trace page ids); a freed
    /// buffer's number is reused, late.
    pub(crate) id: u32,
    /// Never reused in this process: what tells a buffer from an earlier
    /// one of the same number (the balancer's state per buffer).
    pub(crate) serial: u64,
    pub(crate) len: u64,
    placement: Placement,
    pub(crate) pages: Box<[Page]>,
    pub(crate) launches: Mutex<Launches>,
    pub(crate) map: Mutex<Option<Arc<MapShared>>>,
    /// The reclaimer's clock hand.
    pub(crate) hand: AtomicUsize,
    /// Where the last search for clean copies to drop stopped.
    pub(crate) clean_hand: AtomicUsize,
    /// Whether the pages' promise was given back (by `clear`).
    released: AtomicBool,
    /// Per-page access counts since the last harvest (see `hotness`).
    pub(crate) counters: Box<[AtomicU32]>,
    /// Per-page decayed scores, updated by harvests.
    pub(crate) scores: Mutex<Vec<f32>>,
    /// Per page, whether its promotion into the fastest tier has paid:
    /// [`UNPROMOTED`], [`PAID`] (accessed there since), or
    /// `AWAITING + n`: promoted, not accessed since, when its access
    /// counter read `n` (accesses counted before the promotion that no
    /// harvest has taken yet). Settled when it leaves.
    payback: Box<[AtomicU32]>,
    /// Promotions into the fastest tier of this buffer that earned at
    /// least one access before the page left, and those that did not.
    pub(crate) paid: AtomicU64,
    pub(crate) unpaid: AtomicU64,
}

/// A page not promoted into the fastest tier (or settled since).
const UNPROMOTED: u32 = 0;
/// Promoted, and accessed there since: the move paid.
const PAID: u32 = 1;
/// Promoted, not accessed there yet; plus the counter's value then.
const AWAITING: u32 = 2;

impl Table {
    pub(crate) fn new(
        rt: Arc<Shared>,
        id: u32,
        len: u64,
        pages: u64,
        placement: Placement,
    ) -> Self {
        static SERIALS: AtomicU64 = AtomicU64::new(0);
        Self {
            rt,
            id,
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            len,
            placement,
            pages: (0..pages).map(|_| Page::default()).collect(),
            launches: Mutex::new(Launches::default()),
            map: Mutex::new(None),
            hand: AtomicUsize::new(0),
            clean_hand: AtomicUsize::new(0),
            released: AtomicBool::new(false),
            counters: (0..pages).map(|_| AtomicU32::new(0)).collect(),
            scores: Mutex::new(vec![0.0; pages as usize]),
            payback: (0..pages).map(|_| AtomicU32::new(UNPROMOTED)).collect(),
            paid: AtomicU64::new(0),
            unpaid: AtomicU64::new(0),
        }
    }

    /// Page `p` moved from `src` to `dst`: a promotion into the fastest
    /// tier starts waiting for its payback, a departure from it settles
    /// (accesses its counter took since the promotion count).
    fn note_payback(&self, p: usize, src: Tier, dst: Tier) {
        let fast = self.rt.tiers.fastest();
        let count = || self.counters[p].load(Ordering::Relaxed);
        if dst == fast && src != fast {
            let awaiting = AWAITING.saturating_add(count());
            self.payback[p].store(awaiting, Ordering::Relaxed);
        } else if src == fast && dst != fast {
            let paid = match self.payback[p].swap(UNPROMOTED, Ordering::Relaxed) {
                UNPROMOTED => return,
                PAID => true,
                awaiting => count() > awaiting - AWAITING,
            };
            let (counter, mine) = if paid {
                (&self.rt.counters().promotions_paid, &self.paid)
            } else {
                (&self.rt.counters().promotions_unpaid, &self.unpaid)
            };
            Counters::add(counter, 1);
            mine.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Page `p` was accessed through the runtime (a read, a write): a
    /// promotion waiting for its payback has it.
    #[inline]
    pub(crate) fn note_access(&self, p: usize) {
        if self.payback[p].load(Ordering::Relaxed) >= AWAITING {
            self.payback[p].store(PAID, Ordering::Relaxed);
        }
    }

    /// A harvest took `count` accesses from page `p`'s counter (and reset
    /// it): a promotion waiting for its payback has it if they are more
    /// than the counter held at the promotion.
    pub(crate) fn note_harvest(&self, p: usize, count: u32) {
        let state = self.payback[p].load(Ordering::Relaxed);
        if state >= AWAITING {
            let next = if count > state - AWAITING {
                PAID
            } else {
                AWAITING
            };
            self.payback[p].store(next, Ordering::Relaxed);
        }
    }

    pub(crate) fn store(&self, tier: Tier) -> &dyn PageStore {
        self.rt
            .store(tier)
            .expect("entries only name configured tiers")
    }

    /// Gives `slot` back to `tier` (a refusal is counted and kept; see
    /// `Shared::free`).
    pub(crate) fn free(&self, tier: Tier, slot: Slot) {
        self.rt.free(tier, slot);
    }

    /// Pages per batch: never more than one NVMe session keeps in flight.
    pub(crate) fn batch(&self) -> usize {
        self.rt
            .tiers
            .nvme()
            .map_or(BATCH, |n| n.queue_depth().min(BATCH))
            .max(1)
    }

    /// Whether a page of a memory tier may leave `src` for `dst` now.
    pub(crate) fn may_move(&self, src: Tier, dst: Tier) -> bool {
        if src == Tier::Nvme {
            // Kernels never address NVMe pages.
            return true;
        }
        let l = self.launches.lock();
        l.read_write == 0 && (l.read_only == 0 || dst < src)
    }

    /// Frees a page's old slot after a move, or retires it while kernels
    /// may still read it; true when retired. A retired slot keeps the move's
    /// reservation (see `Accounting::reserve_move`) until it is freed, so
    /// promised pages still find room.
    fn free_old(&self, tier: Tier, slot: Slot) -> bool {
        if tier != Tier::Nvme {
            let mut l = self.launches.lock();
            if l.any() {
                l.retired.push((tier, slot));
                return true;
            }
        }
        self.free(tier, slot);
        false
    }

    /// Frees retired slots and their reservations.
    pub(crate) fn free_retired(&self, retired: Vec<(Tier, Slot)>) {
        let n = retired.len() as u64;
        for (tier, slot) in retired {
            self.free(tier, slot);
        }
        self.rt.release_moves(n);
    }

    /// Points the device map (if any) at page `p`'s new home. Under a
    /// launch the entry reaches the device's copy (on cuda) at once, one
    /// 8-byte copy; otherwise the next launch uploads the whole map.
    fn remap(&self, p: usize, entry: &Entry) {
        let Resident { tier, slot } = &entry.loc else {
            return;
        };
        let Some(map) = self.map.lock().clone() else {
            return;
        };
        // A launch that starts after this reads the entry when it takes the
        // page's lock, which the caller holds.
        let live = self.launches.lock().any();
        map.set(
            p,
            self.store(*tier).kernel_address(slot),
            *tier == Tier::Device,
            live,
        );
    }

    /// Tiers in the order a first write tries them.
    fn placement_order(&self) -> Vec<Tier> {
        let mut order = self.rt.tiers.list();
        if let Placement::Prefer(t) = self.placement {
            order.retain(|&x| x != t);
            order.insert(0, t);
        }
        order
    }

    /// Puts a never-written page in a slot: of the first tier of `order`
    /// with room (placement order when `None`).
    pub(crate) fn first_write(&self, page: &[u8], order: Option<&[Tier]>) -> Result<Loc> {
        // Every page is promised a slot; one may be held for a moment by a
        // move's second copy: wait for moves then (a few times), never fail
        // for that.
        for _ in 0..64 {
            match self.first_write_once(page, order) {
                Err(e)
                    if e.kind() == ErrorKind::OutOfCapacity
                        && self.rt.acct.wait_for_moves(Duration::from_millis(50)) => {}
                other => return other,
            }
        }
        self.first_write_once(page, order)
    }

    fn first_write_once(&self, page: &[u8], order: Option<&[Tier]>) -> Result<Loc> {
        let default;
        let order = match order {
            Some(o) => o,
            None => {
                default = self.placement_order();
                &default
            }
        };
        for &tier in order {
            let store = self.store(tier);
            let Ok(mut slot) = store.alloc() else {
                continue;
            };
            // A slot fresh from `alloc` holds nothing to keep: written in
            // place (on NVMe no copy-then-commit, no reserve slot needed).
            return match store.write_new(&mut slot, page) {
                Ok(()) => {
                    Counters::add(&self.rt.counters().first_writes, 1);
                    self.rt.filled(tier);
                    Ok(Resident { tier, slot })
                }
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                    self.free(tier, slot);
                    continue;
                }
                Err(e) => {
                    self.free(tier, slot);
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

    /// Commits a move begun at `begun`, the one commit of every copy
    /// path: installs `fresh` (see [`Entry::commit`]), keeps the old slot
    /// as the page's clean copy (a promotion, while no kernel launch may
    /// read the old slot) or frees or retires it, and points the device map
    /// at the page's new home. `Ok(true)` when the old slot was retired (it
    /// keeps the move's reservation); `Err(fresh)` when the page changed
    /// since the copy (the move is abandoned: the caller frees `fresh`).
    pub(crate) fn commit(
        &self,
        p: usize,
        entry: &mut Entry,
        begun: Begun,
        dst: Tier,
        fresh: Slot,
    ) -> std::result::Result<bool, Slot> {
        // During a launch a promoted page's old slot is retired, never
        // kept: kernels may still read it, so it must not be dropped.
        let keep = !self.launches.lock().any();
        let had_clean = entry.clean.is_some();
        let freed = entry.commit(begun, dst, fresh, keep)?;
        self.note_payback(p, begun.src, dst);
        if !had_clean && entry.clean.is_some() {
            self.rt.acct.clean_kept(begun.src);
        }
        if let Some((tier, slot)) = freed.clean {
            // A demotion at or below its copy: the copy is of no use.
            self.release_clean(tier, slot);
        }
        let retired = match freed.old {
            Some((tier, old)) => self.free_old(tier, old),
            None => false,
        };
        self.remap(p, entry);
        Ok(retired)
    }

    /// A demotion of page `p` into `dst` that needs no copy: the page goes
    /// back to its clean copy there, and its old slot is freed. False (and
    /// nothing changes) when it has none in `dst`, is pinned, or a launch
    /// may read it.
    pub(crate) fn demote_to_clean(&self, p: usize, entry: &mut Entry, dst: Tier) -> bool {
        let Some(src) = entry.tier() else {
            return false;
        };
        if !matches!(&entry.clean, Some((t, _)) if *t == dst) || !self.may_move(src, dst) {
            return false;
        }
        let Some((tier, old)) = entry.drop_to_clean(dst) else {
            return false;
        };
        self.rt.acct.clean_released(dst);
        Counters::add(&self.rt.counters().clean_demotions, 1);
        self.note_payback(p, src, dst);
        self.free(tier, old);
        self.remap(p, entry);
        true
    }

    /// Records a change of page `p`'s bytes ([`Entry::note_write`]): its
    /// clean copy, if any, is freed before the write is acknowledged.
    pub(crate) fn note_write(&self, entry: &mut Entry) {
        if let Some((tier, slot)) = entry.note_write() {
            self.release_clean(tier, slot);
            Counters::add(&self.rt.counters().clean_invalidated, 1);
        }
    }

    /// Adds a pin to `entry` ([`Entry::pin`]); a writable pin frees the
    /// clean copy. True for the page's first pin.
    pub(crate) fn pin_entry(&self, entry: &mut Entry, writable: bool) -> bool {
        let (first, stale) = entry.pin(writable);
        if let Some((tier, slot)) = stale {
            self.release_clean(tier, slot);
            Counters::add(&self.rt.counters().clean_invalidated, 1);
        }
        first
    }

    /// Takes page `entry`'s clean copy in `tier` for the tier's room; true
    /// when there was one. The page keeps its own slot.
    pub(crate) fn drop_clean(&self, entry: &mut Entry, tier: Tier) -> bool {
        if !matches!(&entry.clean, Some((t, _)) if *t == tier) {
            return false;
        }
        let (tier, slot) = entry.take_clean().expect("checked above");
        self.release_clean(tier, slot);
        Counters::add(&self.rt.counters().clean_dropped, 1);
        true
    }

    fn release_clean(&self, tier: Tier, slot: Slot) {
        self.rt.acct.clean_released(tier);
        self.free(tier, slot);
    }

    /// Frees what a cleared entry held: its slot and its clean copy.
    fn free_cleared(&self, freed: Freed<Slot>) {
        if let Some((tier, slot)) = freed.old {
            self.free(tier, slot);
        }
        if let Some((tier, slot)) = freed.clean {
            self.release_clean(tier, slot);
        }
    }

    /// [`commit`](Self::commit) of a copy taken with the page's lock held
    /// since: nothing can have changed it.
    pub(crate) fn commit_locked(
        &self,
        p: usize,
        entry: &mut Entry,
        begun: Begun,
        dst: Tier,
        fresh: Slot,
    ) -> bool {
        match self.commit(p, entry, begun, dst, fresh) {
            Ok(retired) => retired,
            Err(_) => unreachable!("the page's lock was held since its copy began"),
        }
    }

    /// Reserves the second slot of each move (a page holds two slots until
    /// its move commits); pages for which there is no capacity left go to
    /// `full`. The guard gives the reservations back on every way out.
    pub(crate) fn reserve<'a>(
        &'a self,
        guards: &mut Locked<'_>,
        full: &mut Vec<usize>,
    ) -> Reserved<'a> {
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
        reserved
    }

    /// Stats of a batch: its time is shared by the pages it moved.
    pub(crate) fn account(&self, committed: &[Tier], dst: Tier, started: Instant, failed: u64) {
        if !committed.is_empty() {
            let per_page = started.elapsed() / committed.len() as u32;
            for &src in committed {
                self.rt
                    .acct
                    .link(src, dst)
                    .record(self.rt.page_size(), per_page, Duration::ZERO);
            }
            self.rt.filled(dst);
        }
        let counters = self.rt.counters();
        Counters::add(&counters.moves, committed.len() as u64);
        Counters::add(&counters.failed_moves, failed);
    }

    /// A page's copy failed: counted as a failed move unless the
    /// destination was only full (a refusal).
    pub(crate) fn note_failed(&self, e: &Error) {
        if e.kind() != ErrorKind::OutOfCapacity {
            Counters::add(&self.rt.counters().failed_moves, 1);
        }
    }

    /// A move abandoned: its page changed since the copy began.
    pub(crate) fn note_abandoned(&self) {
        Counters::add(&self.rt.counters().abandoned, 1);
    }

    /// Pages of a byte range.
    pub(crate) fn page_range(&self, range: &Range<u64>) -> Result<Range<usize>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::invalid(format!(
                "range {}..{} is outside the buffer's {} bytes",
                range.start, range.end, self.len
            )));
        }
        if range.is_empty() {
            // No bytes, no pages (at an offset inside a page too).
            return Ok(0..0);
        }
        let page = self.rt.page_size() as u64;
        Ok((range.start / page) as usize..range.end.div_ceil(page) as usize)
    }
}

impl Table {
    /// Records an access to page `p`: its counter, and the trace if one is
    /// being recorded.
    #[inline]
    pub(crate) fn touch(&self, p: usize) {
        self.note_access(p);
        crate::hotness::touch(&self.counters, p, self.rt.sample_shift);
        self.rt.trace.record(self.id, p);
    }

    /// The buffer is dropped: no launch starts from now on, and its pages
    /// are freed ([`clear`](Self::clear)), now or when the last launch
    /// still running ends.
    pub(crate) fn drop_buffer(&self) {
        self.launches.lock().dropped = true;
        self.clear();
    }

    /// Frees every page now, when the buffer is dropped, rather than when
    /// the last background move holding the table ends: the capacity is
    /// back before `drop` returns. Moves still in flight find the pages
    /// gone (and their versions changed) and give up. Stops at the first
    /// page a kernel launch may be reading; the last launch to end calls it
    /// again.
    pub(crate) fn clear(&self) {
        for page in self.pages.iter() {
            let mut entry = page.lock();
            if self.launches.lock().any() {
                return;
            }
            self.free_cleared(entry.clear());
        }
        {
            // Under the launches lock: a launch still running keeps the
            // buffer's capacity (it calls this again when it ends).
            let launches = self.launches.lock();
            if launches.any() || self.released.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        self.rt.acct.release(self.pages.len() as u64);
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let retired = std::mem::take(&mut self.launches.get_mut().retired);
        self.free_retired(retired);
        for page in self.pages.iter() {
            // Uncontended: the table is being dropped.
            let freed = page.lock().clear();
            self.free_cleared(freed);
        }
        if !*self.released.get_mut() {
            self.rt.acct.release(self.pages.len() as u64);
        }
        self.rt.acct.give_back_id(self.id);
    }
}
