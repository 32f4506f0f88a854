//! A buffer's page table and the moves that change it.
//!
//! One lock per page, held for one page's read, write or move. Several
//! page locks are only ever held together by a batched move, which takes
//! them in ascending page order, so batches cannot deadlock.
//!
//! Every change to a page's bytes or place bumps its `version`. A move to
//! NVMe copies the page out under its lock, then releases the lock for the
//! write, and commits only if the version is unchanged: a write that races
//! the move wins, and the move is abandoned (its fresh slot freed). Moves
//! into memory tiers copy under the lock (a memcpy, or the page's NVMe read,
//! which an access would have to wait for anyway).
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::map::MapShared;
use super::{Inner, Placement};
use crate::error::{Error, ErrorKind, Result};
use crate::tier::{DeviceStore, HostStore, NvmeStore, PageStore, Slot, Tier};

/// Pages moved together: their NVMe I/O is in flight at once.
pub(crate) const BATCH: usize = 32;

/// Move reservations (see `Inner::reserve_move`), given back on drop.
struct Reserved<'a> {
    rt: &'a Inner,
    pages: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.rt.release_moves(self.pages);
    }
}

pub(crate) use super::page::{lost, Begun, Entry, Loc, Lost, Resident, Zero};

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
    pub(crate) rt: Arc<Inner>,
    /// The buffer's number in this runtime (trace page ids).
    pub(crate) id: u32,
    pub(crate) len: u64,
    placement: Placement,
    pub(crate) pages: Box<[Mutex<Entry>]>,
    pub(crate) launches: Mutex<Launches>,
    pub(crate) map: Mutex<Option<Arc<MapShared>>>,
    /// The reclaimer's clock hand.
    pub(crate) hand: AtomicUsize,
    /// Whether the pages' promise was given back (by `clear`).
    released: AtomicBool,
    /// Per-page access counts since the last harvest (see `hotness`).
    pub(crate) counters: Box<[AtomicU32]>,
    /// Per-page decayed scores, updated by harvests.
    pub(crate) scores: Mutex<Vec<f32>>,
}

impl Table {
    pub(crate) fn new(rt: Arc<Inner>, id: u32, len: u64, pages: u64, placement: Placement) -> Self {
        Self {
            rt,
            id,
            len,
            placement,
            pages: (0..pages).map(|_| Mutex::new(Entry::default())).collect(),
            launches: Mutex::new(Launches::default()),
            map: Mutex::new(None),
            hand: AtomicUsize::new(0),
            released: AtomicBool::new(false),
            counters: (0..pages).map(|_| AtomicU32::new(0)).collect(),
            scores: Mutex::new(vec![0.0; pages as usize]),
        }
    }

    pub(crate) fn store(&self, tier: Tier) -> &dyn PageStore {
        self.rt
            .store(tier)
            .expect("entries only name configured tiers")
    }

    fn nvme(&self) -> Option<&NvmeStore> {
        self.rt
            .store(Tier::Nvme)
            .and_then(|s| s.as_any().downcast_ref::<NvmeStore>())
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
    /// reservation (see `Inner::reserve_move`) until it is freed, so
    /// promised pages still find room.
    fn free_old(&self, tier: Tier, slot: Slot) -> bool {
        if tier != Tier::Nvme {
            let mut l = self.launches.lock();
            if l.any() {
                l.retired.push((tier, slot));
                return true;
            }
        }
        // Freeing fails only for a slot of another store, which the page
        // table never holds.
        let _ = self.store(tier).free(slot);
        false
    }

    /// Frees retired slots and their reservations.
    pub(crate) fn free_retired(&self, retired: Vec<(Tier, Slot)>) {
        let n = retired.len() as u64;
        for (tier, slot) in retired {
            let _ = self.store(tier).free(slot);
        }
        self.rt.release_moves(n);
    }

    /// Points the device map (if any) at page `p`'s new home.
    fn remap(&self, p: usize, entry: &Entry) {
        if let Some(map) = &*self.map.lock() {
            if let Resident { tier, slot } = &entry.loc {
                map.set(
                    p,
                    self.store(*tier).kernel_address(slot),
                    *tier == Tier::Device,
                );
            }
        }
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
                        && self.rt.wait_for_moves(Duration::from_millis(50)) => {}
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
            return match store.write_page(&mut slot, page) {
                Ok(()) => {
                    self.rt
                        .counters
                        .first_writes
                        .fetch_add(1, Ordering::Relaxed);
                    self.rt.filled(tier);
                    Ok(Resident { tier, slot })
                }
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

    /// Moves the page under `entry` into `dst` (copy, then commit), the
    /// lock held throughout. `Ok(false)` when there was nothing to move.
    pub(crate) fn move_locked(&self, p: usize, entry: &mut Entry, dst: Tier) -> Result<bool> {
        // A pinned page is left alone by the callers; the check is theirs.
        let Some(begun) = entry.begin_move(dst, |src| self.may_move(src, dst)) else {
            return Ok(false);
        };
        let src = begun.src;
        let slot = entry.slot().expect("begun moves are resident");
        let from = self.store(src);
        let to = self
            .rt
            .store(dst)
            .ok_or_else(|| Error::invalid(format!("the {dst} tier is not configured")))?;
        let started = Instant::now();
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
        match moved {
            Ok(fresh) => {
                // The lock was held throughout: the commit cannot be refused.
                let retired = self.commit_locked(p, entry, begun, dst, fresh);
                if !retired {
                    self.rt.release_moves(1);
                }
                self.account(&[src], dst, started, 0);
                Ok(true)
            }
            Err(e) => {
                self.rt.release_moves(1);
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

    /// Moves the pages of `pages` whose tier satisfies `wanted` into `dst`,
    /// [`BATCH`] at a time, with the NVMe reads or writes of a batch in
    /// flight together. Returns the pages that found `dst` full; any other
    /// failure is returned as an error after the batch (its pages stay
    /// where they were).
    pub(crate) fn move_batched(
        &self,
        pages: &[usize],
        dst: Tier,
        wanted: &dyn Fn(Tier) -> bool,
    ) -> Result<Vec<usize>> {
        let mut full = Vec::new();
        let mut first_err = None;
        for chunk in pages.chunks(self.batch()) {
            if let Err(e) = self.move_chunk(chunk, dst, wanted, &mut full) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(full), Err)
    }

    /// Pages per batch: never more than one NVMe session keeps in flight.
    pub(crate) fn batch(&self) -> usize {
        self.nvme()
            .map_or(BATCH, |n| n.queue_depth().min(BATCH))
            .max(1)
    }

    fn move_chunk(
        &self,
        chunk: &[usize],
        dst: Tier,
        wanted: &dyn Fn(Tier) -> bool,
        full: &mut Vec<usize>,
    ) -> Result<()> {
        if self.rt.store(dst).is_none() {
            return Err(Error::invalid(format!("the {dst} tier is not configured")));
        }
        let mut sorted = chunk.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        // Ascending page order, the only order in which more than one page
        // lock is ever held, so two batches cannot deadlock.
        let mut guards: Vec<(usize, MutexGuard<'_, Entry>)> = Vec::new();
        let mut first_err = None;
        for &p in &sorted {
            let entry = self.pages[p].lock();
            if matches!(entry.loc, Lost) {
                first_err.get_or_insert(lost(p));
            }
            let movable = entry.pins == 0
                && entry
                    .tier()
                    .is_some_and(|t| t != dst && wanted(t) && self.may_move(t, dst));
            if movable {
                guards.push((p, entry));
            }
        }
        let res = if dst == Tier::Nvme {
            self.demote_to_nvme(guards, full)
        } else {
            self.move_into_memory(guards, dst, full)
        };
        match (first_err, res) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok(()),
        }
    }

    /// Moves locked pages into a memory tier: NVMe-sourced pages are read
    /// together, then every page is copied and committed under its lock.
    fn move_into_memory(
        &self,
        mut guards: Vec<(usize, MutexGuard<'_, Entry>)>,
        dst: Tier,
        full: &mut Vec<usize>,
    ) -> Result<()> {
        let mut first_err: Option<Error> = None;
        let from_nvme = |e: &Entry| {
            matches!(
                e.loc,
                Resident {
                    tier: Tier::Nvme,
                    ..
                }
            )
        };
        let nvme = match self.nvme() {
            Some(n) if guards.iter().any(|(_, e)| from_nvme(e)) => n,
            _ => {
                // Host↔device pages move with their copies queued together.
                let (pairs, mut rest): (Vec<_>, Vec<_>) = guards.into_iter().partition(|(_, e)| {
                    matches!(
                        (e.tier(), dst),
                        (Some(Tier::Host), Tier::Device) | (Some(Tier::Device), Tier::Host)
                    )
                });
                if let Err(e) = self.move_host_device(pairs, dst, full) {
                    first_err.get_or_insert(e);
                }
                // The rest page by page, under the locks held.
                for (p, entry) in rest.iter_mut() {
                    match self.move_locked(*p, entry, dst) {
                        Ok(_) => {}
                        Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                return first_err.map_or(Ok(()), Err);
            }
        };
        let to = self.store(dst);
        // Reads into host memory land in the page's new slot directly.
        let direct = (dst == Tier::Host)
            .then(|| to.as_any().downcast_ref::<HostStore>())
            .flatten();
        let started = Instant::now();
        let mut reserved = self.reserve(&mut guards, full);

        // From here on nothing returns early: a slot taken out of its entry
        // for a read must be put back (or the page marked lost).

        // 1. NVMe-sourced pages read together; the others move in place.
        let mut committed: Vec<Tier> = Vec::new();
        let mut failed = 0u64;
        // Each read's page, as it was when its slot was taken.
        let mut begun: Vec<Option<Begun>> = vec![None; guards.len()];
        match nvme.session() {
            Err(e) => {
                first_err.get_or_insert(e);
            }
            Ok(mut session) => {
                for (i, (p, entry)) in guards.iter_mut().enumerate() {
                    if !from_nvme(entry) {
                        // Its reservation is taken again by move_locked.
                        reserved.pages -= 1;
                        self.rt.release_moves(1);
                        match self.move_locked(*p, entry, dst) {
                            Ok(_) => {}
                            Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                            Err(e) => {
                                first_err.get_or_insert(e);
                            }
                        }
                        continue;
                    }
                    // Into host memory: straight into the page's new slot.
                    if let Some(host) = direct {
                        let fresh = match host.alloc() {
                            Ok(f) => f,
                            Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                                full.push(*p);
                                continue;
                            }
                            Err(e) => {
                                first_err.get_or_insert(e);
                                continue;
                            }
                        };
                        let (b, slot) = entry.take_for_read().expect("checked resident");
                        begun[i] = Some(b);
                        if let Err((e, slot, fresh)) =
                            session.submit_read_into(slot, host, fresh, i as u64)
                        {
                            entry.put_back(b, slot);
                            let _ = host.free(fresh);
                            first_err.get_or_insert(e);
                        }
                        continue;
                    }
                    // The slot travels with its read and comes back in the
                    // completion; the page lock keeps everyone else out.
                    let buf = match nvme.buffer() {
                        Ok(b) => b,
                        Err(e) => {
                            first_err.get_or_insert(e);
                            continue;
                        }
                    };
                    let (b, slot) = entry.take_for_read().expect("checked resident");
                    begun[i] = Some(b);
                    if let Err(r) = session.submit_read(slot, buf, i as u64) {
                        entry.put_back(b, r.slot);
                        first_err.get_or_insert(r.error);
                    }
                }
                // Each page is installed as its read completes, while the
                // others are still in flight. Every slot in a read must come
                // back to its page: after an engine error, keep reaping (a
                // few times) what is in flight.
                let mut done = Vec::new();
                let mut engine_errors = 0;
                while session.in_flight() > 0 && engine_errors < 4 {
                    let reaped = session.reap(1, &mut done);
                    for c in done.drain(..) {
                        let i = c.tag as usize;
                        let (p, entry) = &mut guards[i];
                        let b = begun[i].expect("every read was begun");
                        entry.put_back(b, c.slot);
                        let installed = if c.buf.is_lent() {
                            // Read straight into its new host slot.
                            let fresh = crate::tier::nvme::lent_host_slot(c.buf)
                                .expect("a lent buffer carries its slot");
                            match c.result {
                                Ok(()) => {
                                    // From NVMe: freed, never retired.
                                    self.commit_locked(*p, entry, b, Tier::Host, fresh);
                                    Ok(())
                                }
                                Err(e) => {
                                    let _ = to.free(fresh);
                                    Err(e)
                                }
                            }
                        } else {
                            c.result
                                .and_then(|()| self.install(*p, entry, b, dst, to, &c.buf))
                        };
                        match installed {
                            Ok(()) => committed.push(Tier::Nvme),
                            Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                            Err(e) => {
                                failed += 1;
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                    if let Err(e) = reaped {
                        // Reads never reaped keep their pages marked lost.
                        engine_errors += 1;
                        first_err.get_or_insert(e);
                    }
                }
                // Reads still in flight never came back: their pages stay
                // lost (reads of them fail with `Io`), and their NVMe slots
                // went with the requests. The stats say so.
                let never_reaped = session.in_flight() as u64;
                if never_reaped > 0 {
                    self.rt.note_lost_pages(never_reaped);
                }
                if direct.is_some() {
                    // Direct reads never reaped hold their new host slots
                    // (leaked with the request): those keep their
                    // reservations, so promised pages still find room.
                    reserved.pages -= session.in_flight() as u64;
                }
            }
        }
        self.account(&committed, dst, started, failed);
        drop(reserved);
        first_err.map_or(Ok(()), Err)
    }

    /// Moves locked pages between host and device (all one way) with one
    /// batched transfer, then commits them.
    fn move_host_device(
        &self,
        mut guards: Vec<(usize, MutexGuard<'_, Entry>)>,
        dst: Tier,
        full: &mut Vec<usize>,
    ) -> Result<()> {
        if guards.is_empty() {
            return Ok(());
        }
        let (Some(device), Some(host)) = (
            self.rt
                .store(Tier::Device)
                .and_then(|s| s.as_any().downcast_ref::<DeviceStore>()),
            self.rt
                .store(Tier::Host)
                .and_then(|s| s.as_any().downcast_ref::<HostStore>()),
        ) else {
            unreachable!("both tiers hold pages")
        };
        let started = Instant::now();
        let mut reserved = self.reserve(&mut guards, full);
        let to = self.store(dst);
        let mut fresh: Vec<(usize, Slot)> = Vec::with_capacity(guards.len());
        let mut first_err = None;
        for (i, (p, _)) in guards.iter().enumerate() {
            match to.alloc() {
                Ok(s) => fresh.push((i, s)),
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let copied = (|| -> Result<()> {
            if dst == Tier::Device {
                let sources: Vec<&[u8]> = fresh
                    .iter()
                    .map(|(i, _)| {
                        let Resident { slot, .. } = &guards[*i].1.loc else {
                            unreachable!("checked resident")
                        };
                        host.bytes(slot)
                    })
                    .collect::<Result<_>>()?;
                let mut items: Vec<(&mut Slot, &[u8])> = fresh
                    .iter_mut()
                    .zip(sources)
                    .map(|((_, s), b)| (s, b))
                    .collect();
                device.write_many(&mut items)
            } else {
                let mut items: Vec<(&Slot, &mut [u8])> = Vec::with_capacity(fresh.len());
                for (i, s) in fresh.iter_mut() {
                    let Resident { slot, .. } = &guards[*i].1.loc else {
                        unreachable!("checked resident")
                    };
                    items.push((slot, host.bytes_mut(s)?));
                }
                device.read_many(&mut items)
            }
        })();
        let mut committed = Vec::new();
        let failed = if let Err(e) = copied {
            for (_, s) in fresh.drain(..) {
                let _ = to.free(s);
            }
            first_err.get_or_insert(e);
            guards.len() as u64
        } else {
            0
        };
        for (i, slot) in fresh {
            let (p, entry) = &mut guards[i];
            let begun = entry
                .begin_move(dst, |_| true)
                .expect("checked movable under the lock held since");
            if self.commit_locked(*p, entry, begun, dst, slot) {
                reserved.pages -= 1;
            }
            committed.push(begun.src);
        }
        self.account(&committed, dst, started, failed);
        drop(reserved);
        first_err.map_or(Ok(()), Err)
    }

    /// Writes a page just read from NVMe into a fresh slot of `dst` and
    /// commits it there (the page's lock is held by the caller).
    fn install(
        &self,
        p: usize,
        entry: &mut Entry,
        begun: Begun,
        dst: Tier,
        to: &dyn PageStore,
        bytes: &[u8],
    ) -> Result<()> {
        let mut slot = to.alloc()?;
        if let Err(e) = to.write_new(&mut slot, bytes) {
            let _ = to.free(slot);
            return Err(e);
        }
        // From NVMe: freed, never retired.
        self.commit_locked(p, entry, begun, dst, slot);
        Ok(())
    }

    /// Commits a move begun at `begun`, the one commit of every copy
    /// engine: installs `fresh` (see [`Entry::commit`]), frees or retires
    /// the old slot, and points the device map at the page's new home.
    /// `Ok(true)` when the old slot was retired (it keeps the move's
    /// reservation); `Err(fresh)` when the page changed since the copy (the
    /// move is abandoned: the caller frees `fresh`).
    fn commit(
        &self,
        p: usize,
        entry: &mut Entry,
        begun: Begun,
        dst: Tier,
        fresh: Slot,
    ) -> std::result::Result<bool, Slot> {
        let old = entry.commit(begun, dst, fresh)?;
        let retired = self.free_old(begun.src, old);
        self.remap(p, entry);
        Ok(retired)
    }

    /// [`commit`](Self::commit) of a copy taken with the page's lock held
    /// since: nothing can have changed it.
    fn commit_locked(
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

    /// Moves locked memory-tier pages to NVMe: each page is copied out under
    /// its lock, the locks are released for the writes, and a page commits
    /// only if no one changed it meanwhile.
    fn demote_to_nvme(
        &self,
        mut guards: Vec<(usize, MutexGuard<'_, Entry>)>,
        full: &mut Vec<usize>,
    ) -> Result<()> {
        let nvme = self.nvme().expect("the destination tier is configured");
        let started = Instant::now();
        let mut first_err: Option<Error> = None;
        let mut reserved = self.reserve(&mut guards, full);

        // 1. Each page copied out under its lock and its write submitted at
        // once; the locks go when all are submitted, before the writes end.
        let mut failed = 0u64;
        let mut session = match nvme.session() {
            Ok(s) => s,
            Err(e) => {
                self.account(&[], Tier::Nvme, started, guards.len() as u64);
                return Err(e);
            }
        };
        let mut meta: Vec<(usize, Begun)> = Vec::with_capacity(guards.len());
        for (p, entry) in guards.iter() {
            let Resident { tier, slot } = &entry.loc else {
                unreachable!("checked resident")
            };
            let fresh = match nvme.alloc() {
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                    full.push(*p);
                    continue;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let copied = nvme.buffer().and_then(|mut buf| {
                self.store(*tier)
                    .with_page(slot, &mut |b| {
                        buf.copy_from_slice(b);
                        Ok(())
                    })
                    .map(|()| buf)
            });
            let buf = match copied {
                Ok(buf) => buf,
                Err(e) => {
                    let _ = nvme.free(fresh);
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let tag = meta.len() as u64;
            meta.push((
                *p,
                Begun {
                    src: *tier,
                    version: entry.version,
                },
            ));
            if let Err(r) = session.submit_write(fresh, buf, tag) {
                let _ = nvme.free(r.slot);
                failed += 1;
                first_err.get_or_insert(r.error);
            }
        }
        drop(guards);

        // 2. The writes complete with no page lock held.
        let mut written: Vec<(usize, Begun, Slot)> = Vec::new();
        let mut done = Vec::new();
        let reaped = session.reap(session.in_flight(), &mut done);
        for c in done {
            let (p, begun) = meta[c.tag as usize];
            match c.result {
                Ok(()) => written.push((p, begun, c.slot)),
                Err(e) => {
                    let _ = nvme.free(c.slot);
                    failed += 1;
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Err(e) = reaped {
            // Writes still in flight: their fresh slots stay allocated
            // (leaked) and keep their reservations, so promised pages still
            // find room; the pages keep their old copies.
            reserved.pages -= session.in_flight() as u64;
            first_err.get_or_insert(e);
        }
        drop(session);

        // 3. Commit, in ascending order, what no one touched meanwhile.
        written.sort_unstable_by_key(|w| w.0);
        let mut committed = Vec::new();
        for (p, begun, slot) in written {
            // Never wait long for a page lock while holding reservations: a
            // first write holding it may be waiting for a slot to free up.
            let Some(mut entry) = self.pages[p].try_lock_for(Duration::from_millis(2)) else {
                let _ = nvme.free(slot);
                self.rt.counters.abandoned.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            // A launch that began since the copy keeps the page where it is.
            let committed_now = if self.may_move(begun.src, Tier::Nvme) {
                self.commit(p, &mut entry, begun, Tier::Nvme, slot)
            } else {
                Err(slot)
            };
            match committed_now {
                Ok(retired) => {
                    if retired {
                        reserved.pages -= 1;
                    }
                    committed.push(begun.src);
                }
                Err(slot) => {
                    let _ = nvme.free(slot);
                    self.rt.counters.abandoned.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.account(&committed, Tier::Nvme, started, failed);
        drop(reserved);
        first_err.map_or(Ok(()), Err)
    }

    /// Reserves the second slot of each move (see `move_locked`); pages for
    /// which there is no capacity left go to `full`. The guard gives the
    /// reservations back on every way out.
    fn reserve<'a>(
        &'a self,
        guards: &mut Vec<(usize, MutexGuard<'_, Entry>)>,
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
    fn account(&self, committed: &[Tier], dst: Tier, started: Instant, failed: u64) {
        if !committed.is_empty() {
            let per_page = started.elapsed() / committed.len() as u32;
            for &src in committed {
                self.rt
                    .link(src, dst)
                    .record(self.rt.page_size(), per_page, Duration::ZERO);
            }
            self.rt.filled(dst);
        }
        self.rt
            .counters
            .moves
            .fetch_add(committed.len() as u64, Ordering::Relaxed);
        self.rt
            .counters
            .failed_moves
            .fetch_add(failed, Ordering::Relaxed);
    }

    /// Pages of a byte range.
    pub(crate) fn page_range(&self, range: &Range<u64>) -> Result<Range<usize>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::invalid(format!(
                "range {}..{} is outside the buffer's {} bytes",
                range.start, range.end, self.len
            )));
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
        crate::hotness::touch(&self.counters, p, self.rt.sample_shift);
        self.rt.trace.record(self.id, p);
    }

    /// Frees every page now, when the buffer is dropped, rather than when
    /// the last background move holding the table ends: the capacity is
    /// back before `drop` returns. Moves still in flight find the pages
    /// gone (and their versions changed) and give up. Stops at the first
    /// page a kernel launch may be reading; `Drop` frees the rest later.
    pub(crate) fn clear(&self) {
        for page in self.pages.iter() {
            let mut entry = page.lock();
            if self.launches.lock().any() {
                return;
            }
            if let Some((tier, slot)) = entry.clear() {
                // A store refuses only slots that are not its own, which the
                // page table never holds.
                let _ = self.store(tier).free(slot);
            }
        }
        {
            // Under the launches lock, so a `prepare` either sees the buffer
            // freed or keeps it alive (see `DeviceMap::prepare`).
            let launches = self.launches.lock();
            if launches.any() || self.released.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        self.rt.release(self.pages.len() as u64);
    }

    /// Whether the buffer was dropped and its pages freed.
    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let retired = std::mem::take(&mut self.launches.get_mut().retired);
        self.free_retired(retired);
        for entry in self.pages.iter_mut() {
            if let Resident { tier, slot } = std::mem::replace(&mut entry.get_mut().loc, Zero) {
                let _ = self.rt.store(tier).map(|s| s.free(slot));
            }
        }
        if !*self.released.get_mut() {
            self.rt.release(self.pages.len() as u64);
        }
        self.rt.buffer_ids.lock().give_back(self.id);
    }
}
