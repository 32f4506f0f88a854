//! Background eviction: a thread that keeps each tier (but the slowest)
//! between its low and high watermarks, so first writes and promotions find
//! free slots without waiting for an eviction. When a tier rises above its
//! high watermark it demotes pages, cascading down (device → host → CXL →
//! NVMe), until the tier is back at its low watermark.
//!
//! Victims are chosen by a CLOCK hand per buffer: a page touched since the
//! hand last passed gets a second chance. Pages that are pinned, covered by
//! a kernel launch, or busy (their lock taken) are skipped. The placement
//! policies of the balancer refine this choice; the reclaimer only
//! guarantees headroom.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use super::mover::{Priority, Request, Source, Ticket};
use super::table::Table;
use super::Inner;
use crate::error::{Error, Result};
use crate::tier::Tier;

/// How often the reclaimer looks even when nobody woke it.
const PERIOD: Duration = Duration::from_millis(50);

/// Fractions of a tier's capacity: above `high` the reclaimer demotes pages
/// until use is at `low`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Watermarks {
    /// Where reclaim stops.
    pub low: f64,
    /// Where reclaim starts.
    pub high: f64,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self {
            low: 0.85,
            high: 0.95,
        }
    }
}

impl Watermarks {
    /// Reclaim starting at `high` and stopping at `low` (shares of a tier's
    /// capacity; checked when the runtime is built: `0 < low <= high <= 1`).
    pub fn new(low: f64, high: f64) -> Self {
        Self { low, high }
    }

    /// `0 < low <= high <= 1`, or an error naming the values.
    pub fn check(&self) -> Result<()> {
        if self.low > 0.0 && self.low <= self.high && self.high <= 1.0 {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "watermarks low {} and high {} must satisfy 0 < low <= high <= 1",
                self.low, self.high
            )))
        }
    }

    fn pages(fraction: f64, capacity: u32) -> u32 {
        (fraction * capacity as f64).floor() as u32
    }
}

/// The running reclaimer; stops when dropped.
pub(crate) struct Reclaimer {
    wake: Arc<(Mutex<bool>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Reclaimer {
    pub(crate) fn start(rt: Weak<Inner>) -> Result<Self> {
        let wake = Arc::new((Mutex::new(false), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (wake.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("strata-reclaim".into())
            .spawn(move || loop {
                {
                    let mut woken = w.0.lock();
                    if !*woken {
                        w.1.wait_for(&mut woken, PERIOD);
                    }
                    *woken = false;
                }
                if s.load(Ordering::Acquire) {
                    return;
                }
                // None while the runtime is still being built.
                if let Some(rt) = rt.upgrade() {
                    rt.background("background eviction", || pass(&rt));
                }
            })
            .map_err(|e| Error::io("starting the reclaim thread", e))?;
        Ok(Self {
            wake,
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(crate) fn wake(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_one();
    }

    /// Ends the thread (after its round, if one is running).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = self.thread.lock().take() {
            super::join(t);
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `tier` is above its high watermark.
pub(crate) fn above_high(rt: &Inner, tier: Tier) -> bool {
    rt.store(tier)
        .is_some_and(|s| s.used_pages() > Watermarks::pages(rt.watermarks.high, s.capacity_pages()))
}

/// One round over every tier but the slowest, fastest first (so a cascade
/// completes in one round).
fn pass(rt: &Inner) {
    let tiers: Vec<Tier> = rt.stores().map(|s| s.tier()).collect();
    let Some((_, upper)) = tiers.split_last() else {
        return;
    };
    for &tier in upper {
        if !above_high(rt, tier) {
            continue;
        }
        let store = rt.store(tier).expect("configured");
        let low = Watermarks::pages(rt.watermarks.low, store.capacity_pages());
        let need = store.used_pages().saturating_sub(low) as usize;
        let slower = rt.tiers_below(tier);
        let moved = reclaim(rt, tier, need, &slower, Priority::Reclaim);
        rt.counters
            .reclaimed_pages
            .fetch_add(moved as u64, Ordering::Relaxed);
    }
}

/// Frees `pages` slots in the memory tiers for a kernel launch by moving
/// pages of buffers not in a launch to NVMe, slowest memory tier first.
/// Returns how many moved.
pub(crate) fn make_room(rt: &Inner, pages: usize) -> usize {
    if rt.store(Tier::Nvme).is_none() {
        return 0;
    }
    let mut moved = 0;
    let memory: Vec<Tier> = rt
        .stores()
        .map(|s| s.tier())
        .filter(|&t| t != Tier::Nvme)
        .collect();
    for &tier in memory.iter().rev() {
        if moved >= pages {
            break;
        }
        moved += reclaim(rt, tier, pages - moved, &[Tier::Nvme], Priority::Demand);
    }
    rt.counters
        .reclaimed_pages
        .fetch_add(moved as u64, Ordering::Relaxed);
    moved
}

/// Frees up to `pages` slots in `tier` for a move request into it (a
/// prefetch, a pin), demoting the coldest unpinned pages (CLOCK, as the
/// reclaimer) to slower tiers at the request's `priority`, never one of the
/// `protect` pages of `table` (the request's own). Returns how many moved,
/// and the first failure of those demotions (the request reports it; the
/// pages stay readable).
pub(crate) fn make_room_for(
    rt: &Inner,
    tier: Tier,
    pages: usize,
    table: &Table,
    protect: &std::ops::Range<usize>,
    priority: Priority,
) -> (usize, Option<Error>) {
    let slower = rt.tiers_below(tier);
    let mut failure = None;
    let moved = reclaim_except(
        rt,
        tier,
        pages,
        &slower,
        Some((table, protect)),
        priority,
        &mut |_, e| {
            if e.kind() != crate::error::ErrorKind::OutOfCapacity {
                failure.get_or_insert(e);
            }
        },
    );
    rt.counters
        .reclaimed_pages
        .fetch_add(moved as u64, Ordering::Relaxed);
    (moved, failure)
}

/// Demotes up to `need` pages out of `tier` into the first of `slower`
/// with room; returns how many moved.
/// A failed demotion is kept for `Runtime::check`.
fn reclaim(rt: &Inner, tier: Tier, need: usize, slower: &[Tier], priority: Priority) -> usize {
    reclaim_except(rt, tier, need, slower, None, priority, &mut |what, e| {
        rt.note_background(what, e)
    })
}

/// As [`reclaim`], never picking the pages of `protect`'s table in its
/// range; failed demotions go to `failed` (what, error).
fn reclaim_except(
    rt: &Inner,
    tier: Tier,
    need: usize,
    slower: &[Tier],
    protect: Option<(&Table, &std::ops::Range<usize>)>,
    priority: Priority,
    failed: &mut dyn FnMut(&str, Error),
) -> usize {
    // Weak references, upgraded one at a time: a buffer dropped meanwhile
    // gives its capacity back at once, not after this pass.
    let tables: Vec<Weak<Table>> = {
        let mut list = rt.tables.lock();
        list.retain(|t| t.strong_count() > 0);
        list.clone()
    };
    let mut moved = 0;
    // The first pass gives referenced pages a second chance; the second
    // takes them too. Each buffer's victims are submitted batch by batch
    // without waiting (the engine's window bounds what is queued, and its
    // lanes serve demand first), then waited for together.
    for second_chance in [true, false] {
        for table in &tables {
            let Some(table) = table.upgrade() else {
                continue;
            };
            let keep = protect
                .filter(|(t, _)| std::ptr::eq(*t, &*table))
                .map(|(_, r)| r.clone());
            let mut taken: HashSet<usize> = HashSet::new();
            let mut pending: Vec<Vec<usize>> = Vec::new();
            let mut queued = 0;
            while moved + queued < need {
                let victims = pick(
                    &table,
                    tier,
                    (need - moved - queued).min(table.batch()),
                    second_chance,
                    keep.as_ref(),
                    &taken,
                );
                if victims.is_empty() {
                    break;
                }
                queued += victims.len();
                taken.extend(victims.iter().copied());
                pending.push(victims);
            }
            if !pending.is_empty() {
                moved += demote(&table, pending, tier, slower, priority, failed);
            }
        }
        if moved >= need {
            break;
        }
    }
    moved
}

/// Up to `n` pages of `table` resident in `tier`, from the clock hand on
/// (at most one turn of it), none in `keep`.
fn pick(
    table: &Table,
    tier: Tier,
    n: usize,
    second_chance: bool,
    keep: Option<&std::ops::Range<usize>>,
    taken: &HashSet<usize>,
) -> Vec<usize> {
    let len = table.pages.len();
    let launched = {
        let l = table.launches.lock();
        l.read_only + l.read_write > 0
    };
    // Kernels may be reading any page of a launched buffer.
    if len == 0 || launched {
        return Vec::new();
    }
    let start = table.hand.load(Ordering::Relaxed) % len;
    let mut victims = Vec::new();
    let mut at = start;
    for _ in 0..len {
        if keep.is_some_and(|k| k.contains(&at)) || taken.contains(&at) {
            at = (at + 1) % len;
            continue;
        }
        if let Some(mut entry) = table.pages[at].try_lock() {
            if entry.pins == 0 && entry.tier() == Some(tier) {
                if second_chance && entry.referenced {
                    entry.referenced = false;
                } else {
                    victims.push(at);
                }
            }
        }
        at = (at + 1) % len;
        if victims.len() == n {
            break;
        }
    }
    table.hand.store(at, Ordering::Relaxed);
    victims
}

/// Moves the batches of `victims` out of `tier` to the first slower tier
/// with room, through the engine at `priority`: every batch is submitted
/// before any is waited for; what found a tier full cascades further down.
/// Returns how many moved.
fn demote(
    table: &Arc<Table>,
    victims: Vec<Vec<usize>>,
    tier: Tier,
    slower: &[Tier],
    priority: Priority,
    failed: &mut dyn FnMut(&str, Error),
) -> usize {
    let Some((&first, rest)) = slower.split_first() else {
        return 0;
    };
    let request = |pages: Vec<usize>, dst: Tier| Request {
        pages,
        dst,
        from: Source::Only(tier),
        priority,
        room: None,
    };
    let tickets: Vec<(usize, Ticket)> = victims
        .into_iter()
        .map(|batch| {
            let ticket = Ticket::new();
            let n = batch.len();
            table
                .rt
                .mover
                .submit(table, request(batch, first), false, &ticket);
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
        let full = match table.rt.mover.run(table, request(left.clone(), dst)) {
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
