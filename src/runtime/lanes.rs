//! The engine's machinery: a lane (a queue per priority, served by its
//! workers) per direction of each link, the runtime-wide in-flight window,
//! and the engine's per-priority figures. `mover.rs` submits to and runs
//! from these.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::request::{Priority, Source};
use super::table::Table;
use super::ticket::Ticket;
use crate::tier::Tier;

/// Batches queued or moving in the whole runtime before background and
/// prefetch submitters wait.
pub(crate) const WINDOW: usize = 16;

/// Of the window, what background batches (balance, reclaim) may hold: a
/// prefetch always finds room beside them, even while they are held back
/// for a demand.
pub(crate) const BACKGROUND_WINDOW: usize = WINDOW / 2;

/// A background batch held back for demand requests starts anyway once it
/// has waited this long, so background work (and the balancer's callers)
/// never waits without bound.
pub(crate) const MAX_HOLD: Duration = Duration::from_millis(10);

/// One batch for a lane.
pub(crate) struct Job {
    pub(crate) table: Arc<Table>,
    pub(crate) pages: Vec<usize>,
    pub(crate) dst: Tier,
    pub(crate) from: Source,
    pub(crate) priority: Priority,
    pub(crate) room: Option<Range<usize>>,
    /// Pages that find `dst` full are an `OutOfCapacity` error (prefetch)
    /// rather than a list for the caller.
    pub(crate) full_is_error: bool,
    pub(crate) ticket: Ticket,
    /// When it was queued.
    pub(crate) queued: Instant,
}

/// A lane's queue, one per priority.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) jobs: [VecDeque<Job>; 4],
    pub(crate) closed: bool,
}

impl Queue {
    /// The most urgent job; background jobs (balance, reclaim) only when
    /// `background` (no demand request is waiting anywhere) or once they
    /// have been held back for [`MAX_HOLD`].
    pub(crate) fn pop(&mut self, background: bool) -> Option<Job> {
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

    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.iter().all(VecDeque::is_empty)
    }
}

#[derive(Default)]
pub(crate) struct Lane {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) ready: Condvar,
}

/// The runtime-wide window, in batches: all of them, and the background
/// ones among them.
#[derive(Default)]
pub(crate) struct Window {
    used: Mutex<(usize, usize)>,
    freed: Condvar,
}

impl Window {
    /// Takes a place, waiting for one if `wait` (background batches wait
    /// for a place of their own share too).
    pub(crate) fn enter(&self, wait: bool, background: bool) {
        let mut used = self.used.lock();
        while wait && (used.0 >= WINDOW || (background && used.1 >= BACKGROUND_WINDOW)) {
            self.freed.wait(&mut used);
        }
        used.0 += 1;
        used.1 += usize::from(background);
    }

    pub(crate) fn leave(&self, background: bool) {
        let mut used = self.used.lock();
        used.0 -= 1;
        used.1 -= usize::from(background);
        drop(used);
        self.freed.notify_all();
    }
}

thread_local! {
    /// Set on lane threads: what they submit never waits for the window.
    pub(crate) static IN_LANE: Cell<bool> = const { Cell::new(false) };
}

/// Per-priority figures of the engine.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Batches run, per priority.
    pub(crate) batches: [AtomicU64; 4],
    /// Nanoseconds batches waited in their queue, per priority.
    pub(crate) queued_ns: [AtomicU64; 4],
    /// Nanoseconds lanes spent running batches, per priority (wall time:
    /// copies, commits, room made).
    pub(crate) busy_ns: [AtomicU64; 4],
    /// Nanoseconds of the lanes' CPU those batches took, per priority (not
    /// the time a lane waited for a core, a lock or the disk).
    pub(crate) cpu_ns: [AtomicU64; 4],
}
