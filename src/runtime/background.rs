//! Bookkeeping of work nobody waits for (background eviction, the
//! balancer, room made for a demand move, slots given back): its failures
//! are counted and the first is kept for `Runtime::check` and
//! `Runtime::shutdown` (record, then check); a panicking round is
//! caught and recorded, and its thread lives on. Also the wake-up signal of
//! a background thread, the thread that runs the balancer's rounds, and
//! the join that never waits for itself.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};

/// Failures of background work.
#[derive(Default)]
pub(crate) struct Background {
    /// Failures of background work (reclaimer, balancer), panics included.
    errors: AtomicU64,
    /// The first failure since the last check.
    first: Mutex<Option<Error>>,
}

impl Background {
    /// Background work (`what`) failed: counted, and the first failure
    /// kept. A full tier is a refusal, not a failure.
    pub(crate) fn note(&self, what: &str, e: Error) {
        if e.kind() == ErrorKind::OutOfCapacity {
            return;
        }
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.keep(e.context(what.to_string()));
    }

    /// Keeps `e` for the next check if no earlier failure is kept (failures
    /// counted elsewhere: a slot a store refused to take back).
    pub(crate) fn keep(&self, e: Error) {
        self.first.lock().get_or_insert(e);
    }

    /// Runs one round of background work, recording its panic as a
    /// failure: the thread that runs it lives on.
    pub(crate) fn run(&self, what: &str, work: impl FnOnce()) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
            self.note(
                what,
                Error::new(
                    ErrorKind::Io,
                    "a background round panicked; the thread goes on",
                ),
            );
        }
    }

    /// The first failure since the last call, which this clears.
    pub(crate) fn take(&self) -> Option<Error> {
        self.first.lock().take()
    }

    /// Failures counted so far.
    pub(crate) fn count(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

/// Wakes a background thread early; unarmed (no thread listens) until
/// [`arm`](Self::arm).
#[derive(Default)]
pub(crate) struct Wake {
    armed: AtomicBool,
    woken: Mutex<bool>,
    cv: Condvar,
}

impl Wake {
    /// A thread listens from now on.
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Whether a thread listens.
    #[inline]
    pub(crate) fn armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }

    pub(crate) fn wake(&self) {
        *self.woken.lock() = true;
        self.cv.notify_one();
    }

    /// Waits until woken or `period` passed, and clears the wake-up.
    pub(crate) fn wait(&self, period: Duration) {
        let mut woken = self.woken.lock();
        if !*woken {
            self.cv.wait_for(&mut woken, period);
        }
        *woken = false;
    }
}

/// Waits for a runtime thread to end, unless it is the calling thread (the
/// last reference to the runtime can be dropped on one of its own threads).
pub(crate) fn join(handle: std::thread::JoinHandle<()>) {
    if handle.thread().id() != std::thread::current().id() {
        let _ = handle.join();
    }
}

/// The balancer's background thread; stops when dropped.
pub(crate) struct BalancerThread {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BalancerThread {
    /// Runs `round` every `interval` until dropped, or until `round`
    /// returns false (the runtime is gone). `round` gets the stop flag to
    /// check once it holds the runtime.
    pub(crate) fn start(
        interval: Duration,
        round: impl Fn(&AtomicBool) -> bool + Send + 'static,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("strata-balancer".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    // Woken early by `drop` (or spuriously: an early round).
                    std::thread::park_timeout(interval);
                    if !round(&s) {
                        return;
                    }
                }
            })
            .map_err(|e| Error::io("starting the balancer thread", e))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for BalancerThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            join(t);
        }
    }
}
