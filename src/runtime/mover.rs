//! The migration engine: every page move of the runtime is a request
//! submitted here. Demand paths (`pin`, `evict`, a kernel launch's
//! `prepare`), `prefetch`, the balancer and background eviction all
//! submit; synchronous callers submit and wait. Room-making is part of a
//! request (or a request of its own, [`Room`]): the engine expands it into
//! demotions itself, so nothing above it ever calls back into a lane.
//!
//! - One lane (worker threads and a queue) per direction of each link
//!   between two configured tiers, so promotions never queue behind
//!   demotions. NVMe lanes have two workers: one batch's I/O is in flight
//!   while the other's completes and commits.
//! - Each lane serves its queue by [`Priority`]: demand before prefetch
//!   before balance before reclaim. A running batch is never preempted, so
//!   a demand request waits for the batch its lane is running (which, for
//!   a prefetch making room, includes that room's demotions).
//! - While a demand batch is queued or moving in any lane, no lane starts
//!   a background batch (balance, reclaim) that has waited less than
//!   10 ms: their I/O would queue at the disk ahead of the demand's.
//!   Background eviction runs in batches an eighth the size of the others.
//! - One in-flight window for the whole runtime, counted in batches:
//!   background and prefetch submitters wait while it is full, and
//!   background batches may hold half of it at most (a prefetch always
//!   finds a place beside them); demand requests (bounded by their
//!   callers' threads) and requests made from inside a lane (room for a
//!   prefetch) never wait for it, so the window cannot deadlock and cannot
//!   delay a demand.
//! - Copy-then-commit lives in the copy paths behind `batch.rs` and in
//!   `page.rs` (the one commit); this module only schedules, and picks the
//!   victims of room-making (`victims.rs`).
//!
//! Requests come back through [`Ticket`]s; errors of background work
//! surface at the ticket's `wait` or `poll` (and background eviction's and
//! the balancer's at `Runtime::check` and `Runtime::shutdown`). A panic in
//! one move fails that request and leaves its lane running.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::collections::HashSet;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accounting::Counters;
use super::background::join;
use super::batch;
use super::clean;
use super::lanes::{Counts, Job, Lane, Window, IN_LANE};
use super::registry::Registry;
use super::request::{Priority, Request, Room};
use super::shared::Shared;
use super::table::{lost, Loc, Lost, Table};
use super::ticket::Ticket;
use super::victims;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

/// What the lanes' workers share with the submitters.
pub(crate) struct Engine {
    /// Indexed by `src * 4 + dst`; `None` for a direction between tiers
    /// not both configured.
    lanes: Vec<Option<Lane>>,
    window: Window,
    /// Pages queued or moving.
    in_flight: AtomicU64,
    /// Demand batches queued or moving, in any lane: while there are any,
    /// no lane starts a background batch (its I/O would queue at the disk
    /// ahead of the demand's).
    demand: AtomicU64,
    counts: Counts,
    /// Every live buffer's page table (room-making's victims).
    tables: Registry,
    shared: Arc<Shared>,
}

/// The engine and its workers; dropping it closes the lanes and joins them.
pub(crate) struct Mover {
    engine: Arc<Engine>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Deref for Mover {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        // Closing the queues ends the workers once they are empty; wait
        // for them, so that a dropped runtime leaves no thread behind.
        for lane in self.engine.lanes.iter().flatten() {
            lane.queue.lock().closed = true;
            lane.ready.notify_all();
        }
        for w in self.workers.drain(..) {
            join(w);
        }
    }
}

fn lane_index(src: Tier, dst: Tier) -> usize {
    src as usize * 4 + dst as usize
}

impl Mover {
    /// Starts the lanes of every direction between two configured tiers.
    pub(crate) fn start(shared: Arc<Shared>) -> Result<Self> {
        let tiers = shared.tiers.list();
        let mut lanes: Vec<Option<Lane>> = (0..16).map(|_| None).collect();
        for &src in &tiers {
            for &dst in tiers.iter().filter(|&&t| t != src) {
                lanes[lane_index(src, dst)] = Some(Lane::default());
            }
        }
        // Built in place: if a thread cannot start, dropping the half-made
        // engine closes the lanes started so far and joins their threads.
        let mut mover = Self {
            engine: Arc::new(Engine {
                lanes,
                window: Window::default(),
                in_flight: AtomicU64::new(0),
                demand: AtomicU64::new(0),
                counts: Counts::default(),
                tables: Registry::default(),
                shared,
            }),
            workers: Vec::new(),
        };
        for &src in &tiers {
            for &dst in tiers.iter().filter(|&&t| t != src) {
                let count = if src == Tier::Nvme || dst == Tier::Nvme {
                    2
                } else {
                    1
                };
                for w in 0..count {
                    let engine = mover.engine.clone();
                    let index = lane_index(src, dst);
                    let w = std::thread::Builder::new()
                        .name(format!("strata-mover-{src}-{dst}-{w}"))
                        .spawn(move || {
                            IN_LANE.with(|c| c.set(true));
                            let lane = engine.lanes[index].as_ref().expect("started above");
                            engine.work(lane);
                        })
                        .map_err(|e| Error::io("starting a mover thread", e))?;
                    mover.workers.push(w);
                }
            }
        }
        Ok(mover)
    }
}

impl Engine {
    /// What the page tables share.
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Every live buffer's page table.
    pub(crate) fn tables(&self) -> &Registry {
        &self.tables
    }

    /// Pages queued or moving.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Waits until no move is queued or running (moves submitted
    /// meanwhile are waited for too: stop submitting first).
    pub(crate) fn drain(&self) {
        while self.in_flight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Batches run, their mean queueing time in microseconds and the
    /// lanes' seconds running them, per priority (demand, prefetch,
    /// balance, reclaim).
    pub(crate) fn priority_report(&self) -> [(u64, f64, f64); 4] {
        std::array::from_fn(|i| {
            let n = self.counts.batches[i].load(Ordering::Relaxed);
            let ns = self.counts.queued_ns[i].load(Ordering::Relaxed);
            let busy = self.counts.busy_ns[i].load(Ordering::Relaxed) as f64 / 1e9;
            let mean = if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1e3
            };
            (n, mean, busy)
        })
    }

    /// Submits `request` on `table`'s pages; the ticket completes when
    /// every batch has run. Pages are grouped by the tier they are in now
    /// (each batch re-checks its pages under their locks); pages never
    /// written, already in `dst` or pinned are left alone, and a lost page
    /// is the ticket's error. Blocks while the window is full, unless the
    /// request is a demand or comes from a lane. With `full_is_error`,
    /// pages that find `dst` full are an `OutOfCapacity` error.
    pub(crate) fn submit(
        &self,
        table: &Arc<Table>,
        request: Request,
        full_is_error: bool,
        ticket: &Ticket,
    ) {
        let dst = request.dst;
        if table.rt.store(dst).is_none() {
            ticket.add();
            ticket.finish(Err(Error::invalid(format!(
                "the {dst} tier is not configured"
            ))));
            return;
        }
        let mut by_tier: [Vec<usize>; 4] = Default::default();
        for &p in &request.pages {
            let Some(entry) = table.pages.get(p).map(|e| e.lock()) else {
                continue;
            };
            match entry.tier() {
                Some(t) if t != dst && entry.pins == 0 && request.from.accepts(t) => {
                    by_tier[t as usize].push(p)
                }
                None if matches!(entry.loc, Lost) => {
                    ticket.add();
                    ticket.finish(Err(lost(p)));
                }
                _ => {}
            }
        }
        for (src, pages) in Tier::ALL.into_iter().zip(by_tier) {
            if pages.is_empty() {
                continue;
            }
            let Some(lane) = self.lanes[lane_index(src, dst)].as_ref() else {
                ticket.add();
                ticket.finish(Err(Error::invalid(format!(
                    "no link from the {src} to the {dst} tier"
                ))));
                continue;
            };
            // Background eviction in smaller batches: a demand request
            // waits at most for the batch its lane is running.
            let batch = match request.priority {
                Priority::Reclaim => (table.batch() / 8).max(1),
                _ => table.batch(),
            };
            for chunk in pages.chunks(batch) {
                let job = Job {
                    table: table.clone(),
                    pages: chunk.to_vec(),
                    dst,
                    from: request.from,
                    priority: request.priority,
                    room: request.room.clone(),
                    full_is_error,
                    ticket: ticket.clone(),
                    queued: Instant::now(),
                };
                self.queue(lane, job);
            }
        }
    }

    /// Takes a place in the window (unless the job is a demand or comes
    /// from a lane) and queues `job` on `lane`.
    fn queue(&self, lane: &Lane, mut job: Job) {
        let priority = job.priority;
        let background = priority >= Priority::Balance;
        let windowed = priority != Priority::Demand && !IN_LANE.with(Cell::get);
        self.window.enter(windowed, background);
        job.ticket.add();
        let pages = job.pages.len() as u64;
        self.in_flight.fetch_add(pages, Ordering::Relaxed);
        if priority == Priority::Demand {
            self.demand.fetch_add(1, Ordering::AcqRel);
        }
        job.queued = Instant::now();
        let mut q = lane.queue.lock();
        if q.closed {
            drop(q);
            // The lanes close only when the runtime is shutting down.
            self.in_flight.fetch_sub(pages, Ordering::Relaxed);
            if priority == Priority::Demand {
                self.demand.fetch_sub(1, Ordering::AcqRel);
            }
            self.window.leave(background);
            job.ticket.finish(Err(Error::new(
                ErrorKind::Closed,
                "the runtime's mover has stopped",
            )));
            return;
        }
        q.jobs[priority as usize].push_back(job);
        drop(q);
        lane.ready.notify_one();
    }

    /// Submits `request` and waits for it: the pages that found `dst` full
    /// (with no room made, or not enough), or the first error.
    pub(crate) fn run(&self, table: &Arc<Table>, request: Request) -> Result<Vec<usize>> {
        let ticket = Ticket::new();
        self.submit(table, request, false, &ticket);
        ticket.wait_full()
    }

    /// A lane's worker: the most urgent batch first, until the queue closes
    /// and is empty.
    fn work(&self, lane: &Lane) {
        loop {
            let job = {
                let mut q = lane.queue.lock();
                loop {
                    let background = self.demand.load(Ordering::Acquire) == 0;
                    if let Some(job) = q.pop(background) {
                        break job;
                    }
                    if q.closed && q.is_empty() {
                        return;
                    }
                    if q.is_empty() {
                        lane.ready.wait(&mut q);
                    } else {
                        // Background work held back for a demand elsewhere:
                        // look again shortly.
                        lane.ready.wait_for(&mut q, Duration::from_micros(100));
                    }
                }
            };
            let (ticket, pages, priority) = (job.ticket.clone(), job.pages.len(), job.priority);
            let p = priority as usize;
            self.counts.batches[p].fetch_add(1, Ordering::Relaxed);
            self.counts.queued_ns[p]
                .fetch_add(job.queued.elapsed().as_nanos() as u64, Ordering::Relaxed);
            // A bug (or a panicking copy path) must not leave the ticket
            // waiting forever or kill the lane.
            let started = Instant::now();
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(job)));
            self.counts.busy_ns[p]
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.in_flight.fetch_sub(pages as u64, Ordering::Relaxed);
            if priority == Priority::Demand {
                self.demand.fetch_sub(1, Ordering::AcqRel);
            }
            self.window.leave(priority >= Priority::Balance);
            match ran {
                Ok(result) => ticket.finish(result),
                Err(_) => ticket.finish(Err(Error::new(
                    ErrorKind::Io,
                    "a page move panicked; its pages stay where they were",
                ))),
            }
        }
    }

    /// Runs one batch: the pages that found `dst` full, or the first error.
    fn run_job(&self, job: Job) -> Result<Vec<usize>> {
        let Job {
            table,
            pages,
            dst,
            from,
            priority,
            room,
            full_is_error,
            ticket,
            ..
        } = job;
        let wanted = |t: Tier| from.accepts(t);
        let mut result = batch::move_batched(&table, &pages, dst, &wanted);
        // A full destination gives up its clean copies first: room with
        // no I/O, and nothing lost.
        if let Ok(full) = &result {
            if !full.is_empty()
                && clean::drop_copies(&self.tables, &self.shared, dst, full.len()) > 0
            {
                let full = full.clone();
                result = batch::move_batched(&table, &full, dst, &wanted);
            }
        }
        // What does not fit gets room made for it, as a pin does: the
        // coldest pages of `dst` that this request does not cover are
        // demoted (a few rounds, as demotions may race other moves), then
        // it moves.
        if let Some(protect) = &room {
            // A prefetch gets one turn of the clock hand: a second would
            // take the pages whose second chance the first gave.
            let rounds = if priority == Priority::Prefetch { 1 } else { 3 };
            for _ in 0..rounds {
                let full = match &result {
                    Ok(full) if !full.is_empty() => full.clone(),
                    _ => break,
                };
                let (made, failure) =
                    self.make_room_for(&table, dst, full.len(), protect, priority);
                if let Some(e) = failure {
                    if priority == Priority::Demand {
                        // A pin or a launch does not fail for another page's
                        // demotion: recorded, and the room found is what it is.
                        self.shared
                            .note_background("making room for a demand move", e);
                    } else {
                        result = Err(e.context(format!("making room in the {dst} tier")));
                    }
                    break;
                }
                if made == 0 {
                    break;
                }
                result = batch::move_batched(&table, &full, dst, &wanted);
            }
        }
        // The requester's own pages (a prefetch's, a pin's) get the second
        // chance a read gives: the next room-making (or the reclaimer)
        // takes colder pages first. Demotions (evict, room made for
        // others) do not.
        if result.is_ok() && room.is_some() {
            for &p in &pages {
                let mut entry = table.pages[p].lock();
                if entry.tier() == Some(dst) {
                    entry.referenced = true;
                }
            }
        }
        // A prefetch that found no room but in pages valued more than it
        // (referenced since the hand last passed) is declined, not an
        // error: counted, and its ticket says how many pages.
        let result = match result {
            Ok(full)
                if priority == Priority::Prefetch
                    && !full.is_empty()
                    && room.is_some()
                    && self.has_victims(dst, &table, room.as_ref()) =>
            {
                Counters::add(
                    &self.shared.counters().prefetches_declined,
                    full.len() as u64,
                );
                ticket.note_declined(full.len());
                Ok(Vec::new())
            }
            other => other,
        };
        let result = match result {
            Ok(full) if full_is_error && !full.is_empty() => Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "page {} cannot move to the {dst} tier: it is full ({})",
                    full[0],
                    table.rt.capacity_report()
                ),
            )),
            other => other,
        };
        // The table goes before the ticket completes: a waiter that then
        // drops the buffer gets its slots and reservation back at once.
        drop(table);
        result
    }

    /// Whether `tier` holds any page room-making could demote for a
    /// request of `table` protecting `protect`, referenced or not.
    fn has_victims(&self, tier: Tier, table: &Table, protect: Option<&Range<usize>>) -> bool {
        self.tables.live().iter().any(|t| {
            let keep = protect.filter(|_| std::ptr::eq(&**t, table));
            !victims::pick(t, tier, 1, false, keep, &HashSet::new()).is_empty()
        })
    }

    /// Frees up to `pages` slots in `tier` for a move request into it (a
    /// prefetch, a pin), demoting the coldest unpinned pages to slower
    /// tiers at the request's `priority`, never one of the `protect` pages
    /// of `table` (the request's own). Returns how many moved, and the
    /// first failure of those demotions (the request reports it; the pages
    /// stay readable).
    pub(crate) fn make_room_for(
        &self,
        table: &Table,
        tier: Tier,
        pages: usize,
        protect: &Range<usize>,
        priority: Priority,
    ) -> (usize, Option<Error>) {
        let mut failure = None;
        let room = Room {
            tier,
            pages,
            to: self.shared.tiers.below(tier),
            protect: Some((table, protect.clone())),
            priority,
            take_referenced: priority != Priority::Prefetch,
        };
        let moved = self.make_room(&room, &mut |_, e| {
            if e.kind() != ErrorKind::OutOfCapacity {
                failure.get_or_insert(e);
            }
        });
        (moved, failure)
    }

    /// Frees `pages` slots in the memory tiers for a kernel launch by
    /// moving pages of buffers not in a launch to NVMe, slowest memory tier
    /// first, at demand priority (failures are kept for `Runtime::check`).
    /// Returns how many moved.
    pub(crate) fn make_room_for_launch(&self, pages: usize) -> usize {
        if self.shared.tiers.nvme().is_none() {
            return 0;
        }
        let mut moved = 0;
        for &tier in self.shared.tiers.memory().iter().rev() {
            if moved >= pages {
                break;
            }
            let room = Room {
                tier,
                pages: pages - moved,
                to: vec![Tier::Nvme],
                protect: None,
                priority: Priority::Demand,
                take_referenced: true,
            };
            moved += self.make_room(&room, &mut |what, e| self.shared.note_background(what, e));
        }
        moved
    }

    /// Puts never-written page `p` of `table` in a slot (its lock held by
    /// the caller; see `Table::first_write`): when every tier is full, the
    /// clean copies in the tiers of `order` (placement order when `None`)
    /// give up their slots, one per try (each one dropped is a write a
    /// later demotion may need).
    pub(crate) fn first_write(
        &self,
        table: &Table,
        bytes: &[u8],
        order: Option<&[Tier]>,
    ) -> Result<Loc> {
        loop {
            match table.first_write(bytes, order) {
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                    let tiers = order.map_or_else(|| self.shared.tiers.list(), <[Tier]>::to_vec);
                    let dropped = tiers
                        .iter()
                        .any(|&t| clean::drop_copies(&self.tables, &self.shared, t, 1) > 0);
                    if !dropped {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }

    /// Expands `room` into demotions: victims picked buffer by buffer
    /// (referenced pages get a second chance in a first pass, not in the
    /// second), each buffer's submitted batch by batch without waiting
    /// (the window bounds what is queued, and the lanes serve demand
    /// first), then waited for together. Failed demotions go to `failed`
    /// (what, error). Returns how many pages moved, counted as reclaimed.
    pub(crate) fn make_room(&self, room: &Room<'_>, failed: &mut dyn FnMut(&str, Error)) -> usize {
        // Clean copies first: their room costs no I/O.
        let dropped = clean::drop_copies(&self.tables, &self.shared, room.tier, room.pages);
        let need = room.pages - dropped;
        if need == 0 {
            return dropped;
        }
        let tables = self.tables.weak();
        let mut moved = 0;
        let passes: &[bool] = if room.take_referenced {
            &[true, false]
        } else {
            &[true]
        };
        for &second_chance in passes {
            for table in &tables {
                if moved >= need {
                    break;
                }
                let Some(table) = table.upgrade() else {
                    continue;
                };
                let keep = room
                    .protect
                    .as_ref()
                    .filter(|(t, _)| std::ptr::eq(*t, &*table))
                    .map(|(_, r)| r.clone());
                let mut taken: HashSet<usize> = HashSet::new();
                let mut pending: Vec<Vec<usize>> = Vec::new();
                let mut queued = 0;
                while moved + queued < need {
                    let n = (need - moved - queued).min(table.batch());
                    let victims =
                        victims::pick(&table, room.tier, n, second_chance, keep.as_ref(), &taken);
                    if victims.is_empty() {
                        break;
                    }
                    // Short: the hand went a whole turn. In the pass that
                    // gives second chances, the pages it cleared keep
                    // theirs for this request.
                    let turned = victims.len() < n;
                    queued += victims.len();
                    taken.extend(victims.iter().copied());
                    pending.push(victims);
                    if turned && second_chance {
                        break;
                    }
                }
                if !pending.is_empty() {
                    moved += self.demote(&table, pending, room, failed);
                }
            }
            if moved >= need {
                break;
            }
        }
        Counters::add(&self.shared.counters().reclaimed_pages, moved as u64);
        dropped + moved
    }

    /// Moves the batches of `victims` out of `room.tier` to the first tier
    /// of `room.to` with room: every batch is submitted before any is
    /// waited for; what found a tier full cascades further down. Returns
    /// how many moved.
    fn demote(
        &self,
        table: &Arc<Table>,
        victims: Vec<Vec<usize>>,
        room: &Room<'_>,
        failed: &mut dyn FnMut(&str, Error),
    ) -> usize {
        let tier = room.tier;
        let Some((&first, rest)) = room.to.split_first() else {
            return 0;
        };
        let request = |pages: Vec<usize>, dst: Tier| Request {
            pages,
            dst,
            from: super::request::Source::Only(tier),
            priority: room.priority,
            room: None,
        };
        let tickets: Vec<(usize, Ticket)> = victims
            .into_iter()
            .map(|batch| {
                let ticket = Ticket::new();
                let n = batch.len();
                self.submit(table, request(batch, first), false, &ticket);
                (n, ticket)
            })
            .collect();
        let mut moved = 0;
        let mut left = Vec::new();
        for (n, ticket) in tickets {
            // The pages stay readable (or are counted lost); the error goes
            // to whoever asked for the room.
            match ticket.wait_full() {
                Ok(full) => {
                    moved += n - full.len();
                    left.extend(full);
                }
                Err(e) => failed(&format!("demoting pages from {tier} to {first}"), e),
            }
        }
        for &dst in rest {
            if left.is_empty() {
                break;
            }
            let full = match self.run(table, request(left.clone(), dst)) {
                Ok(full) => full,
                Err(e) => {
                    failed(&format!("demoting pages from {tier} to {dst}"), e);
                    break;
                }
            };
            moved += left.len() - full.len();
            left = full;
        }
        moved
    }
}
