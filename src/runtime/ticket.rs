//! The handle of an asynchronous move request.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// What a ticket waits for.
#[derive(Debug, Default)]
struct TicketState {
    inner: Mutex<Progress>,
    done: Condvar,
    /// Cancelled: batches not started are dropped (see `Engine::cancel`).
    cancelled: AtomicBool,
}

#[derive(Debug, Default)]
struct Progress {
    /// Batches not finished.
    open: usize,
    error: Option<Error>,
    /// Pages that found the destination full (synchronous callers decide
    /// what to do with them).
    full: Vec<usize>,
    /// Pages of a prefetch declined: their room would have cost pages
    /// valued more.
    declined: usize,
}

/// The handle of an asynchronous request: `wait` for it, or `poll` it.
/// Dropping a ticket does not cancel the request;
/// [`Buffer::cancel`](crate::runtime::Buffer::cancel) does.
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

    pub(crate) fn add(&self) {
        self.state.inner.lock().open += 1;
    }

    /// Marks the request cancelled (its batches not started yet are
    /// dropped: `Engine::cancel`).
    pub(crate) fn set_cancelled(&self) {
        self.state.cancelled.store(true, Ordering::Release);
    }

    /// Whether the request was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.state.cancelled.load(Ordering::Acquire)
    }

    /// Whether `other` is a handle of the same request.
    pub(crate) fn same(&self, other: &Ticket) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// `n` pages of the request were declined (see [`declined`](Self::declined)).
    pub(crate) fn note_declined(&self, n: usize) {
        self.state.inner.lock().declined += n;
    }

    /// Pages of a prefetch that were declined so far: the tier was full and
    /// making room would have demoted pages referenced since the clock hand
    /// last passed (pages valued more than a prefetch's guess). They stay
    /// where they are, readable; the request still succeeds. 0 for any
    /// other request.
    pub fn declined(&self) -> usize {
        self.state.inner.lock().declined
    }

    /// One batch finished; the first error is kept.
    pub(crate) fn finish(&self, result: Result<Vec<usize>>) {
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
