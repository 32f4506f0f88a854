//! The migration engine: every page move of the runtime is a request
//! submitted here. Demand paths (`pin`, `evict`, a kernel launch's
//! `prepare`, room made for them), `prefetch`, the balancer and background
//! eviction all submit; synchronous callers submit and wait.
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
//! - Copy-then-commit lives in `table.rs` (the copy engines) and `page.rs`
//!   (the one commit); this module only schedules.
//!
//! Requests come back through [`Ticket`]s; errors of background work
//! surface at the ticket's `wait` or `poll` (and background eviction's and
//! the balancer's at `Runtime::check` and `Runtime::shutdown`). A panic in
//! one move fails that request and leaves its lane running.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::table::Table;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

/// Batches queued or moving in the whole runtime before background and
/// prefetch submitters wait.
const WINDOW: usize = 16;

/// Of the window, what background batches (balance, reclaim) may hold: a
/// prefetch always finds room beside them, even while they are held back
/// for a demand.
const BACKGROUND_WINDOW: usize = WINDOW / 2;

/// A background batch held back for demand requests starts anyway once it
/// has waited this long, so background work (and the balancer's callers)
/// never waits without bound.
const MAX_HOLD: Duration = Duration::from_millis(10);

/// Who asked for a move; a lane serves the most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Priority {
    /// A caller waits for it: `pin`, `evict`, a launch's `prepare`, and
    /// the room they need.
    Demand = 0,
    /// `prefetch` and the room it makes.
    Prefetch = 1,
    /// The balancer's promotions and demotions.
    Balance = 2,
    /// Background eviction between the watermarks.
    Reclaim = 3,
}

/// Which of a request's pages move: checked under each page's lock when
/// its batch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// From wherever they are.
    Any,
    /// Only pages in this tier.
    Only(Tier),
    /// Only pages in tiers faster than this one.
    Above(Tier),
    /// Only pages not in this tier.
    Not(Tier),
    /// Only pages in tiers slower than this one.
    Below(Tier),
}

impl Source {
    fn accepts(self, tier: Tier) -> bool {
        match self {
            Source::Any => true,
            Source::Only(t) => tier == t,
            Source::Above(t) => tier < t,
            Source::Not(t) => tier != t,
            Source::Below(t) => tier > t,
        }
    }
}

/// What a ticket waits for.
#[derive(Debug, Default)]
struct TicketState {
    inner: Mutex<Progress>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct Progress {
    /// Batches not finished.
    open: usize,
    error: Option<Error>,
    /// Pages that found the destination full (synchronous callers decide
    /// what to do with them).
    full: Vec<usize>,
}

/// The handle of an asynchronous request: `wait` for it, or `poll` it.
/// Dropping a ticket does not cancel the request.
#[derive(Debug, Clone)]
#[must_use = "a ticket carries the request's error, if any"]
pub struct Ticket {
    state: Arc<TicketState>,
}

impl Ticket {
    pub(crate) fn new() -> Self {
        Self {
            state: Arc::default(),
        }
    }

    pub(crate) fn done(result: Result<()>) -> Self {
        let t = Self::new();
        if let Err(e) = result {
            t.state.inner.lock().error = Some(e);
        }
        t
    }

    fn add(&self) {
        self.state.inner.lock().open += 1;
    }

    /// One batch finished; the first error is kept.
    fn finish(&self, result: Result<Vec<usize>>) {
        let mut s = self.state.inner.lock();
        s.open -= 1;
        match result {
            Ok(full) => s.full.extend(full),
            Err(e) => {
                s.error.get_or_insert(e);
            }
        }
        if s.open == 0 {
            self.state.done.notify_all();
        }
    }

    fn result(s: &Progress) -> Result<()> {
        s.error.clone().map_or(Ok(()), Err)
    }

    /// Waits for the request and returns its result.
    pub fn wait(self) -> Result<()> {
        let mut s = self.state.inner.lock();
        while s.open > 0 {
            self.state.done.wait(&mut s);
        }
        Self::result(&s)
    }

    /// Waits for the request: the pages that found the destination full,
    /// or its first error.
    pub(crate) fn wait_full(self) -> Result<Vec<usize>> {
        let mut s = self.state.inner.lock();
        while s.open > 0 {
            self.state.done.wait(&mut s);
        }
        Self::result(&s)?;
        Ok(std::mem::take(&mut s.full))
    }

    /// Waits at most `timeout`: the result, or `None` if still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let mut s = self.state.inner.lock();
        // A timeout beyond any representable instant waits for good.
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            while s.open > 0 {
                self.state.done.wait(&mut s);
            }
            return Some(Self::result(&s));
        };
        while s.open > 0 {
            if self.state.done.wait_until(&mut s, deadline).timed_out() && s.open > 0 {
                return None;
            }
        }
        Some(Self::result(&s))
    }

    /// The result if the request has finished.
    pub fn poll(&self) -> Option<Result<()>> {
        let s = self.state.inner.lock();
        (s.open == 0).then(|| Self::result(&s))
    }
}

/// A move request as submitted.
pub(crate) struct Request {
    pub(crate) pages: Vec<usize>,
    pub(crate) dst: Tier,
    pub(crate) from: Source,
    pub(crate) priority: Priority,
    /// Room is made in a full `dst` (as a pin makes it), never by demoting
    /// a page of this range of the same buffer; `None`: pages that find
    /// `dst` full are returned (synchronous callers) or, for a ticket,
    /// nothing is made.
    pub(crate) room: Option<Range<usize>>,
}

/// One batch for a lane.
struct Job {
    table: Arc<Table>,
    pages: Vec<usize>,
    dst: Tier,
    from: Source,
    priority: Priority,
    room: Option<Range<usize>>,
    /// Pages that find `dst` full are an `OutOfCapacity` error (prefetch)
    /// rather than a list for the caller.
    full_is_error: bool,
    ticket: Ticket,
    /// When it was queued.
    queued: Instant,
}

/// A lane's queue, one per priority.
#[derive(Default)]
struct Queue {
    jobs: [VecDeque<Job>; 4],
    closed: bool,
}

impl Queue {
    /// The most urgent job; background jobs (balance, reclaim) only when
    /// `background` (no demand request is waiting anywhere) or once they
    /// have been held back for [`MAX_HOLD`].
    fn pop(&mut self, background: bool) -> Option<Job> {
        if let Some(job) = self.jobs[..Priority::Balance as usize]
            .iter_mut()
            .find_map(VecDeque::pop_front)
        {
            return Some(job);
        }
        self.jobs[Priority::Balance as usize..]
            .iter_mut()
            .find(|q| {
                q.front()
                    .is_some_and(|j| background || j.queued.elapsed() >= MAX_HOLD)
            })
            .and_then(VecDeque::pop_front)
    }

    fn is_empty(&self) -> bool {
        self.jobs.iter().all(VecDeque::is_empty)
    }
}

#[derive(Default)]
struct Lane {
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// The runtime-wide window, in batches: all of them, and the background
/// ones among them.
#[derive(Default)]
struct Window {
    used: Mutex<(usize, usize)>,
    freed: Condvar,
}

impl Window {
    /// Takes a place, waiting for one if `wait` (background batches wait
    /// for a place of their own share too).
    fn enter(&self, wait: bool, background: bool) {
        let mut used = self.used.lock();
        while wait && (used.0 >= WINDOW || (background && used.1 >= BACKGROUND_WINDOW)) {
            self.freed.wait(&mut used);
        }
        used.0 += 1;
        used.1 += usize::from(background);
    }

    fn leave(&self, background: bool) {
        let mut used = self.used.lock();
        used.0 -= 1;
        used.1 -= usize::from(background);
        drop(used);
        self.freed.notify_all();
    }
}

thread_local! {
    /// Set on lane threads: what they submit never waits for the window.
    static IN_LANE: Cell<bool> = const { Cell::new(false) };
}

/// Per-priority figures of the engine.
#[derive(Debug, Default)]
struct Counts {
    /// Batches run, per priority.
    batches: [AtomicU64; 4],
    /// Nanoseconds batches waited in their queue, per priority.
    queued_ns: [AtomicU64; 4],
    /// Nanoseconds lanes spent running batches, per priority (wall time:
    /// copies, commits, room made).
    busy_ns: [AtomicU64; 4],
}

/// The engine.
pub(crate) struct Mover {
    /// Indexed by `src * 4 + dst`; `None` for a direction between tiers
    /// not both configured.
    lanes: Vec<Option<Arc<Lane>>>,
    window: Arc<Window>,
    /// Pages queued or moving.
    pub(crate) in_flight: Arc<AtomicU64>,
    /// Demand batches queued or moving, in any lane: while there are any,
    /// no lane starts a background batch (its I/O would queue at the disk
    /// ahead of the demand's).
    demand: Arc<AtomicU64>,
    counts: Arc<Counts>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for Mover {
    fn drop(&mut self) {
        // Closing the queues ends the workers once they are empty; wait
        // for them, so that a dropped runtime leaves no thread behind.
        for lane in self.lanes.iter().flatten() {
            lane.queue.lock().closed = true;
            lane.ready.notify_all();
        }
        for w in self.workers.drain(..) {
            super::join(w);
        }
    }
}

fn lane_index(src: Tier, dst: Tier) -> usize {
    src as usize * 4 + dst as usize
}

impl Mover {
    /// Starts the lanes of every direction between two of `tiers`.
    pub(crate) fn start(tiers: &[Tier]) -> Result<Self> {
        // Built in place: if a thread cannot start, dropping the half-made
        // engine closes the lanes started so far and joins their threads.
        let mut mover = Self {
            lanes: (0..16).map(|_| None).collect(),
            window: Arc::new(Window::default()),
            in_flight: Arc::new(AtomicU64::new(0)),
            demand: Arc::new(AtomicU64::new(0)),
            counts: Arc::new(Counts::default()),
            workers: Vec::new(),
        };
        for &src in tiers {
            for &dst in tiers.iter().filter(|&&t| t != src) {
                let lane = Arc::new(Lane::default());
                mover.lanes[lane_index(src, dst)] = Some(lane.clone());
                let count = if src == Tier::Nvme || dst == Tier::Nvme {
                    2
                } else {
                    1
                };
                for w in 0..count {
                    let (lane, window, in_flight, counts, demand) = (
                        lane.clone(),
                        mover.window.clone(),
                        mover.in_flight.clone(),
                        mover.counts.clone(),
                        mover.demand.clone(),
                    );
                    let w = std::thread::Builder::new()
                        .name(format!("strata-mover-{src}-{dst}-{w}"))
                        .spawn(move || {
                            IN_LANE.with(|c| c.set(true));
                            work(&lane, &window, &in_flight, &demand, &counts);
                        })
                        .map_err(|e| Error::io("starting a mover thread", e))?;
                    mover.workers.push(w);
                }
            }
        }
        Ok(mover)
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
        let Request {
            pages,
            dst,
            from,
            priority,
            room,
        } = request;
        if table.rt.store(dst).is_none() {
            ticket.add();
            ticket.finish(Err(Error::invalid(format!(
                "the {dst} tier is not configured"
            ))));
            return;
        }
        let mut by_tier: [Vec<usize>; 4] = Default::default();
        for p in pages {
            let Some(entry) = table.pages.get(p).map(|e| e.lock()) else {
                continue;
            };
            match entry.tier() {
                Some(t) if t != dst && entry.pins == 0 && from.accepts(t) => {
                    by_tier[t as usize].push(p)
                }
                None if matches!(entry.loc, super::table::Lost) => {
                    ticket.add();
                    ticket.finish(Err(super::table::lost(p)));
                }
                _ => {}
            }
        }
        let windowed = priority != Priority::Demand && !IN_LANE.with(Cell::get);
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
            let batch = match priority {
                Priority::Reclaim => (table.batch() / 8).max(1),
                _ => table.batch(),
            };
            for chunk in pages.chunks(batch) {
                self.window.enter(windowed, priority >= Priority::Balance);
                ticket.add();
                self.in_flight
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                if priority == Priority::Demand {
                    self.demand.fetch_add(1, Ordering::AcqRel);
                }
                let job = Job {
                    table: table.clone(),
                    pages: chunk.to_vec(),
                    dst,
                    from,
                    priority,
                    room: room.clone(),
                    full_is_error,
                    ticket: ticket.clone(),
                    queued: Instant::now(),
                };
                let mut q = lane.queue.lock();
                if q.closed {
                    drop(q);
                    // The lanes close only when the runtime is shutting down.
                    self.in_flight
                        .fetch_sub(job.pages.len() as u64, Ordering::Relaxed);
                    if priority == Priority::Demand {
                        self.demand.fetch_sub(1, Ordering::AcqRel);
                    }
                    self.window.leave(priority >= Priority::Balance);
                    job.ticket.finish(Err(Error::new(
                        ErrorKind::Closed,
                        "the runtime's mover has stopped",
                    )));
                    continue;
                }
                q.jobs[priority as usize].push_back(job);
                drop(q);
                lane.ready.notify_one();
            }
        }
    }

    /// Submits `request` and waits for it: the pages that found `dst` full
    /// (with no room made, or not enough), or the first error.
    pub(crate) fn run(&self, table: &Arc<Table>, request: Request) -> Result<Vec<usize>> {
        let ticket = Ticket::new();
        self.submit(table, request, false, &ticket);
        ticket.wait_full()
    }
}

/// A lane's worker: the most urgent batch first, until the queue closes and
/// is empty.
fn work(lane: &Lane, window: &Window, in_flight: &AtomicU64, demand: &AtomicU64, counts: &Counts) {
    loop {
        let job = {
            let mut q = lane.queue.lock();
            loop {
                let background = demand.load(Ordering::Acquire) == 0;
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
        counts.batches[priority as usize].fetch_add(1, Ordering::Relaxed);
        counts.queued_ns[priority as usize]
            .fetch_add(job.queued.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // A bug (or a panicking engine) must not leave the ticket waiting
        // forever or kill the lane.
        let started = Instant::now();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(job)));
        counts.busy_ns[priority as usize]
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        in_flight.fetch_sub(pages as u64, Ordering::Relaxed);
        if priority == Priority::Demand {
            demand.fetch_sub(1, Ordering::AcqRel);
        }
        window.leave(priority >= Priority::Balance);
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
fn run(job: Job) -> Result<Vec<usize>> {
    let Job {
        table,
        pages,
        dst,
        from,
        priority,
        room,
        full_is_error,
        ..
    } = job;
    let wanted = |t: Tier| from.accepts(t);
    let mut result = table.move_batched(&pages, dst, &wanted);
    // What does not fit gets room made for it, as a pin does: the coldest
    // pages of `dst` that this request does not cover are demoted (a few
    // rounds, as demotions may race other moves), then it moves.
    if let Some(protect) = &room {
        for _ in 0..3 {
            let full = match &result {
                Ok(full) if !full.is_empty() => full.clone(),
                _ => break,
            };
            let (made, failure) = super::reclaim::make_room_for(
                &table.rt,
                dst,
                full.len(),
                &table,
                protect,
                priority,
            );
            if let Some(e) = failure {
                if priority == Priority::Demand {
                    // A pin or a launch does not fail for another page's
                    // demotion: recorded, and the room found is what it is.
                    table.rt.note_background("making room for a demand move", e);
                } else {
                    result = Err(e.context(format!("making room in the {dst} tier")));
                }
                break;
            }
            if made == 0 {
                break;
            }
            result = table.move_batched(&full, dst, &wanted);
        }
    }
    // The requester's own pages (a prefetch's, a pin's) get the second
    // chance a read gives: the next room-making (or the reclaimer) takes
    // colder pages first. Demotions (evict, room made for others) do not.
    if result.is_ok() && room.is_some() {
        for &p in &pages {
            let mut entry = table.pages[p].lock();
            if entry.tier() == Some(dst) {
                entry.referenced = true;
            }
        }
    }
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
    // The table goes before the ticket completes: a waiter that then drops
    // the buffer gets its slots and reservation back at once.
    drop(table);
    result
}
