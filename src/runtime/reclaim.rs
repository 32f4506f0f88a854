//! Background eviction: a thread that keeps each tier (but the slowest)
//! between its low and high [`Watermarks`](super::Watermarks), so first
//! writes and promotions find free slots without waiting for an eviction.
//! When a tier rises above its high watermark the thread submits a
//! request for room in it (at reclaim priority), which the engine expands
//! into demotions cascading down (device → host → CXL → NVMe) until the
//! tier is back at its low watermark. The victims are the engine's choice
//! (`victims.rs`); this module only watches and submits.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::background::{join, Wake};
use super::mover::Engine;
use super::request::{Priority, Room};
use super::tiers::Watermarks;
use crate::error::{Error, Result};

/// How often the reclaimer looks even when nobody woke it.
const PERIOD: Duration = Duration::from_millis(50);

/// The running reclaimer; stops when dropped.
pub(crate) struct Reclaimer {
    wake: Arc<Wake>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Reclaimer {
    /// Runs `round` whenever `wake` is woken, and every [`PERIOD`] anyway,
    /// until stopped; arms `wake`.
    pub(crate) fn start(wake: Arc<Wake>, round: impl Fn() + Send + 'static) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (wake.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("strata-reclaim".into())
            .spawn(move || loop {
                w.wait(PERIOD);
                if s.load(Ordering::Acquire) {
                    return;
                }
                round();
            })
            .map_err(|e| Error::io("starting the reclaim thread", e))?;
        wake.arm();
        Ok(Self {
            wake,
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Ends the thread (after its round, if one is running).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.wake();
        if let Some(t) = self.thread.lock().take() {
            join(t);
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One round over every tier but the slowest, fastest first (so a cascade
/// completes in one round): room is requested in each tier above its high
/// watermark, down to its low one. A failed demotion is kept for
/// `Runtime::check`.
pub(crate) fn pass(engine: &Engine) {
    let rt = engine.shared();
    let tiers = rt.tiers.list();
    let Some((_, upper)) = tiers.split_last() else {
        return;
    };
    for &tier in upper {
        if !rt.tiers.above_high(tier, &rt.watermarks) {
            continue;
        }
        let store = rt.store(tier).expect("configured");
        let low = Watermarks::pages(rt.watermarks.low, store.capacity_pages());
        let room = Room {
            tier,
            pages: store.used_pages().saturating_sub(low) as usize,
            to: rt.tiers.below(tier),
            protect: None,
            priority: Priority::Reclaim,
            take_referenced: true,
        };
        engine.make_room(&room, &mut |what, e| rt.note_background(what, e));
    }
}
