//! The asynchronous mover: one worker ("lane") per link between two
//! configured tiers, each fed by a bounded queue of batches — the in-flight
//! window. A full window blocks the submitter (explicit back-pressure).
//! Requests come back through [`Ticket`]s; errors of background work
//! surface at the ticket's `wait` or `poll`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, Sender};
use parking_lot::{Condvar, Mutex};

use super::table::Table;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

/// Batches queued per lane before submitters wait.
const WINDOW: usize = 8;

/// What a ticket waits for.
#[derive(Debug, Default)]
struct TicketState {
    inner: Mutex<(usize, Option<Error>)>,
    done: Condvar,
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
            t.state.inner.lock().1 = Some(e);
        }
        t
    }

    fn add(&self) {
        self.state.inner.lock().0 += 1;
    }

    /// One part of the request finished; the first error is kept.
    fn finish(&self, result: Result<()>) {
        let mut s = self.state.inner.lock();
        s.0 -= 1;
        if let Err(e) = result {
            s.1.get_or_insert(e);
        }
        if s.0 == 0 {
            self.state.done.notify_all();
        }
    }

    fn result(s: &(usize, Option<Error>)) -> Result<()> {
        s.1.clone().map_or(Ok(()), Err)
    }

    /// Waits for the request and returns its result.
    pub fn wait(self) -> Result<()> {
        let mut s = self.state.inner.lock();
        while s.0 > 0 {
            self.state.done.wait(&mut s);
        }
        Self::result(&s)
    }

    /// Waits at most `timeout`: the result, or `None` if still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let mut s = self.state.inner.lock();
        // A timeout beyond any representable instant waits for good.
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            while s.0 > 0 {
                self.state.done.wait(&mut s);
            }
            return Some(Self::result(&s));
        };
        while s.0 > 0 {
            if self.state.done.wait_until(&mut s, deadline).timed_out() && s.0 > 0 {
                return None;
            }
        }
        Some(Self::result(&s))
    }

    /// The result if the request has finished.
    pub fn poll(&self) -> Option<Result<()>> {
        let s = self.state.inner.lock();
        (s.0 == 0).then(|| Self::result(&s))
    }
}

/// One batch for a lane.
pub(crate) struct Job {
    pub(crate) table: Arc<Table>,
    pub(crate) pages: Vec<usize>,
    pub(crate) dst: Tier,
    pub(crate) ticket: Ticket,
    /// The whole request's pages: room in `dst` is never made by demoting
    /// one of them.
    pub(crate) request: std::ops::Range<usize>,
}

/// The lanes.
pub(crate) struct Mover {
    /// Indexed by `lane(a, b)`; `None` for links between tiers not both
    /// configured.
    lanes: Vec<Option<Sender<Job>>>,
    /// Pages queued or moving.
    pub(crate) in_flight: Arc<AtomicU64>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for Mover {
    fn drop(&mut self) {
        // Closing the queues ends the workers; wait for them, so that a
        // dropped runtime leaves no thread behind.
        self.lanes.clear();
        for w in self.workers.drain(..) {
            super::join(w);
        }
    }
}

/// One lane per unordered pair of tiers.
fn lane(a: Tier, b: Tier) -> usize {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    lo as usize * 4 + hi as usize
}

impl Mover {
    /// Starts a lane for each link between two of `tiers`.
    pub(crate) fn start(tiers: &[Tier]) -> Result<Self> {
        let mut lanes: Vec<Option<Sender<Job>>> = (0..16).map(|_| None).collect();
        let in_flight = Arc::new(AtomicU64::new(0));
        let mut workers = Vec::new();
        for (i, &a) in tiers.iter().enumerate() {
            for &b in &tiers[i + 1..] {
                let (tx, rx) = bounded::<Job>(WINDOW);
                // Two workers on NVMe links, so one batch's I/O is in flight
                // while the other's completes and commits.
                let count = if b == Tier::Nvme { 2 } else { 1 };
                for w in 0..count {
                    let (rx, in_flight) = (rx.clone(), in_flight.clone());
                    let w = std::thread::Builder::new()
                        .name(format!("strata-mover-{a}-{b}-{w}"))
                        .spawn(move || {
                            // Ends when the runtime drops its senders.
                            for job in rx {
                                let (ticket, pages) = (job.ticket.clone(), job.pages.len());
                                // A bug (or a panicking engine) must not leave
                                // the ticket waiting forever or kill the lane.
                                let ran =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        run(job, &in_flight)
                                    }));
                                if ran.is_err() {
                                    in_flight.fetch_sub(pages as u64, Ordering::Relaxed);
                                    ticket.finish(Err(Error::new(
                                        ErrorKind::Io,
                                        "a page move panicked; its pages stay where they were",
                                    )));
                                }
                            }
                        })
                        .map_err(|e| Error::io("starting a mover thread", e))?;
                    workers.push(w);
                }
                lanes[lane(a, b)] = Some(tx);
            }
        }
        Ok(Self {
            lanes,
            in_flight,
            workers,
        })
    }

    /// Waits until no move is queued or running (moves submitted
    /// meanwhile are waited for too: stop submitting first).
    pub(crate) fn drain(&self) {
        while self.in_flight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Queues `pages` (all resident in `src` when looked at) for a move to
    /// `dst`, in batches of `batch`; blocks while the lane's window is full.
    pub(crate) fn submit(
        &self,
        table: &Arc<Table>,
        src: Tier,
        pages: Vec<usize>,
        dst: Tier,
        ticket: &Ticket,
        request: std::ops::Range<usize>,
    ) {
        let Some(tx) = self.lanes[lane(src, dst)].as_ref() else {
            ticket.add();
            ticket.finish(Err(Error::invalid(format!(
                "no link between the {src} and {dst} tiers"
            ))));
            return;
        };
        for chunk in pages.chunks(table.batch()) {
            ticket.add();
            self.in_flight
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            let job = Job {
                table: table.clone(),
                pages: chunk.to_vec(),
                dst,
                ticket: ticket.clone(),
                request: request.clone(),
            };
            if let Err(e) = tx.send(job) {
                // The lane is gone only when the runtime is shutting down.
                let job = e.into_inner();
                self.in_flight
                    .fetch_sub(job.pages.len() as u64, Ordering::Relaxed);
                job.ticket.finish(Err(Error::new(
                    ErrorKind::Closed,
                    "the runtime's mover has stopped",
                )));
            }
        }
    }
}

fn run(job: Job, in_flight: &AtomicU64) {
    let Job {
        table,
        pages,
        dst,
        ticket,
        request,
    } = job;
    // What does not fit gets room made for it, as a pin does: the coldest
    // pages of `dst` that this request does not cover are demoted (a few
    // rounds, as demotions may race other moves), then it moves.
    let mut result = table.move_batched(&pages, dst, &|_| true);
    for _ in 0..3 {
        let full = match &result {
            Ok(full) if !full.is_empty() => full.clone(),
            _ => break,
        };
        let (made, failure) =
            super::reclaim::make_room_for_prefetch(&table.rt, dst, full.len(), &table, &request);
        if let Some(e) = failure {
            result = Err(e.context(format!("making room in the {dst} tier for a prefetch")));
            break;
        }
        if made == 0 {
            break;
        }
        result = table.move_batched(&full, dst, &|_| true);
    }
    // Pages just brought in get the second chance a read gives: the next
    // prefetch's room-making (or the reclaimer) takes colder pages first.
    if result.is_ok() {
        for &p in &pages {
            let mut entry = table.pages[p].lock();
            if entry.tier() == Some(dst) {
                entry.referenced = true;
            }
        }
    }
    let result = result.and_then(|full| match full.first() {
        None => Ok(()),
        Some(&p) => Err(Error::new(
            ErrorKind::OutOfCapacity,
            format!(
                "page {p} cannot move to the {dst} tier: it is full ({})",
                table.rt.capacity_report()
            ),
        )),
    });
    // The table goes before the ticket completes: a waiter that then drops
    // the buffer gets its slots and reservation back at once.
    drop(table);
    in_flight.fetch_sub(pages.len() as u64, Ordering::Relaxed);
    ticket.finish(result);
}
