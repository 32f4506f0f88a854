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
use std::collections::VecDeque;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accounting::Counters;
use super::background::join;
use super::batch;
use super::clean;
use super::lanes::{Counts, Job, Lane, Window, IN_LANE};
use super::registry::Registry;
use super::request::{Priority, Request};
use super::shared::Shared;
use super::table::{lost, Lost, Table, DEVICE_BATCH};
use super::ticket::Ticket;
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
    /// Batches queued or running whose tickets have not been told yet:
    /// what [`drain`](Self::drain) waits for (`in_flight` comes down
    /// before a batch's ticket is told).
    unfinished: AtomicU64,
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
                unfinished: AtomicU64::new(0),
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

    /// Waits until no move is queued or running and every ticket of one
    /// has been told how it ended (moves submitted meanwhile are waited
    /// for too: stop submitting first).
    pub(crate) fn drain(&self) {
        while self.unfinished.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Batches run, their mean queueing time in microseconds, the lanes'
    /// seconds running them and the CPU seconds they took, per priority
    /// (demand, prefetch, balance, reclaim).
    pub(crate) fn priority_report(&self) -> [(u64, f64, f64, f64); 4] {
        std::array::from_fn(|i| {
            let n = self.counts.batches[i].load(Ordering::Relaxed);
            let ns = self.counts.queued_ns[i].load(Ordering::Relaxed);
            let busy = self.counts.busy_ns[i].load(Ordering::Relaxed) as f64 / 1e9;
            let cpu = self.counts.cpu_ns[i].load(Ordering::Relaxed) as f64 / 1e9;
            let mean = if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1e3
            };
            (n, mean, busy, cpu)
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
            // waits at most for the batch its lane is running. Prefetches
            // and the balancer's moves over the device link in larger ones:
            // each batch is one transfer, waited for once.
            let device_link = matches!(
                (src, dst),
                (Tier::Host, Tier::Device) | (Tier::Device, Tier::Host)
            );
            let batch = match request.priority {
                Priority::Reclaim => (table.batch() / 8).max(1),
                Priority::Prefetch | Priority::Balance if device_link => DEVICE_BATCH,
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
        self.unfinished.fetch_add(1, Ordering::Relaxed);
        q.jobs[priority as usize].push_back(job);
        drop(q);
        lane.ready.notify_one();
    }

    /// Cancels the request of `ticket`: its batches still queued are
    /// dropped (their pages stay where they are) and finish at once; a
    /// batch already running finishes as it would. Returns the pages
    /// dropped.
    pub(crate) fn cancel(&self, ticket: &Ticket) -> usize {
        // Every lane's queue held at once (in order; no other path holds
        // two) while the flag is set: a lane pops a batch either before,
        // and runs it, or after, and finds it gone or (queued later by the
        // request's submitter) drops it at the pop.
        let mut queues: Vec<_> = self
            .lanes
            .iter()
            .flatten()
            .map(|l| l.queue.lock())
            .collect();
        ticket.set_cancelled();
        let mut dropped = Vec::new();
        for q in &mut queues {
            for jobs in q.jobs.iter_mut() {
                if jobs.iter().any(|j| j.ticket.same(ticket)) {
                    let (mine, rest): (VecDeque<Job>, VecDeque<Job>) = std::mem::take(jobs)
                        .into_iter()
                        .partition(|j| j.ticket.same(ticket));
                    *jobs = rest;
                    dropped.extend(mine);
                }
            }
        }
        drop(queues);
        dropped.into_iter().map(|job| self.drop_queued(job)).sum()
    }

    /// A queued job leaves without running: what `queue` counted is given
    /// back and its ticket told (after the job's table is dropped, as
    /// `run_job` does); returns its pages.
    fn drop_queued(&self, job: Job) -> usize {
        let pages = job.pages.len();
        self.in_flight.fetch_sub(pages as u64, Ordering::Relaxed);
        if job.priority == Priority::Demand {
            self.demand.fetch_sub(1, Ordering::AcqRel);
        }
        self.window.leave(job.priority >= Priority::Balance);
        let ticket = job.ticket.clone();
        drop(job);
        ticket.finish(Ok(Vec::new()));
        self.unfinished.fetch_sub(1, Ordering::Release);
        pages
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
            let (job, cancelled) = {
                let mut q = lane.queue.lock();
                loop {
                    let background = self.demand.load(Ordering::Acquire) == 0;
                    if let Some(job) = q.pop(background) {
                        // Read under the queue's lock: see `cancel`.
                        let cancelled = job.ticket.is_cancelled();
                        break (job, cancelled);
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
            if cancelled {
                // Queued by its request's submitter after a cancel.
                self.drop_queued(job);
                continue;
            }
            let (ticket, pages, priority) = (job.ticket.clone(), job.pages.len(), job.priority);
            let p = priority as usize;
            self.counts.batches[p].fetch_add(1, Ordering::Relaxed);
            self.counts.queued_ns[p]
                .fetch_add(job.queued.elapsed().as_nanos() as u64, Ordering::Relaxed);
            // A bug (or a panicking copy path) must not leave the ticket
            // waiting forever or kill the lane.
            let (started, cpu) = (Instant::now(), crate::sys::thread_cpu_ns());
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(job)));
            // CPU first, then wall: the CPU interval lies within the wall's.
            let cpu = crate::sys::thread_cpu_ns().saturating_sub(cpu);
            self.counts.busy_ns[p]
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.counts.cpu_ns[p].fetch_add(cpu, Ordering::Relaxed);
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
            self.unfinished.fetch_sub(1, Ordering::Release);
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
        // The job is one batch (`submit` sized it).
        let chunk = pages.len().max(1);
        let mut result = batch::move_batched(&table, &pages, dst, &wanted, chunk);
        // A full destination gives up its clean copies first: room with
        // no I/O, and nothing lost.
        if let Ok(full) = &result {
            if !full.is_empty()
                && clean::drop_copies(&self.tables, &self.shared, dst, full.len()) > 0
            {
                let full = full.clone();
                result = batch::move_batched(&table, &full, dst, &wanted, chunk);
            }
        }
        // What does not fit gets room made for it, as a pin does (not for
        // a request cancelled meanwhile: nobody wants its pages).
        let fitted = room.as_ref().filter(|_| !ticket.is_cancelled());
        if let Some(protect) = fitted {
            result = self.fit(&table, dst, protect, priority, result, &wanted);
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
        // error: counted, and its ticket says how many pages. One cancelled
        // before its room was made declined nothing: no room was sought.
        let result = match result {
            Ok(full)
                if priority == Priority::Prefetch
                    && !full.is_empty()
                    && fitted.is_some()
                    && self.has_victims(dst, &table, fitted) =>
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
            // Cancelled: what did not fit stays where it is, as asked.
            Ok(_) if ticket.is_cancelled() => Ok(Vec::new()),
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
}
