//! What the runtime counts: capacity promised to buffers and held by moves,
//! the event counters behind [`Stats`](super::Stats), pinned pages and
//! moves per link, and the numbers buffers go by.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::link::LinkCounter;
use crate::tier::Tier;

/// Capacity spoken for, in pages.
#[derive(Debug, Default)]
struct Reservations {
    /// Promised to live buffers (every page of every allocation).
    promised: u64,
    /// Second slots held by moves until they commit (and by old copies
    /// kept for kernel launches).
    moving: u64,
}

/// Event counters, read by `Runtime::stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) moves: AtomicU64,
    pub(crate) failed_moves: AtomicU64,
    pub(crate) first_writes: AtomicU64,
    /// Moves dropped because a write changed the page meanwhile.
    pub(crate) abandoned: AtomicU64,
    /// Pages an access had to move first (pins, launches).
    pub(crate) faults: AtomicU64,
    /// Pages demoted to make room (background eviction, pins, launches).
    pub(crate) reclaimed_pages: AtomicU64,
    /// Balancer decisions carried out.
    pub(crate) promotions: AtomicU64,
    /// Of the promotions, those a read carried out.
    pub(crate) promotions_on_read: AtomicU64,
    pub(crate) demotions: AtomicU64,
    pub(crate) bypasses: AtomicU64,
    /// Read-backs of CUDA kernels' access counters that failed.
    pub(crate) lost_counts: AtomicU64,
    /// Pages whose data was lost to I/O errors, with their slots.
    pub(crate) lost_pages: AtomicU64,
    /// Slots a store refused to take back.
    pub(crate) failed_frees: AtomicU64,
    /// Promotions into the fastest tier whose page was accessed there
    /// before it left, and those whose page left without an access.
    pub(crate) promotions_paid: AtomicU64,
    pub(crate) promotions_unpaid: AtomicU64,
    /// Prefetched pages declined: room only among pages valued more.
    pub(crate) prefetches_declined: AtomicU64,
    /// Balancer promotions held back: their buffer's did not pay.
    pub(crate) held_back: AtomicU64,
    /// Promotions that kept the page's old slot as its clean copy.
    pub(crate) clean_kept: AtomicU64,
    /// Demotions that needed no copy: the page went back to its clean copy.
    pub(crate) clean_demotions: AtomicU64,
    /// Clean copies dropped for their tier's room.
    pub(crate) clean_dropped: AtomicU64,
    /// Clean copies dropped because their page was written (or pinned
    /// writable).
    pub(crate) clean_invalidated: AtomicU64,
}

impl Counters {
    /// Adds `n` to `counter`.
    #[inline]
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads `counter`.
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The runtime's books.
pub(crate) struct Accounting {
    /// Slots across every tier.
    total_pages: u64,
    reserved: Mutex<Reservations>,
    /// Signalled when a move gives back its second slot.
    slot_freed: Condvar,
    pub(crate) counters: Counters,
    /// Pinned pages per tier (indexed by `Tier as usize`).
    pub(crate) pinned: [AtomicU64; 4],
    /// Clean copies held per tier (indexed by `Tier as usize`): slots a
    /// room-maker may free with no I/O.
    clean: [AtomicU64; 4],
    /// Page moves per link, indexed by `from * 4 + to`.
    links: [LinkCounter; 16],
    /// Numbers buffers for trace page ids and the balancer's page keys
    /// (`buffer << 32 | page`): unique among the buffers alive, recycled
    /// when a buffer's table is gone, so they never wrap onto a live one.
    buffer_ids: Mutex<BufferIds>,
}

impl Accounting {
    pub(crate) fn new(total_pages: u64) -> Self {
        Self {
            total_pages,
            reserved: Mutex::new(Reservations::default()),
            slot_freed: Condvar::new(),
            counters: Counters::default(),
            pinned: Default::default(),
            clean: Default::default(),
            links: Default::default(),
            buffer_ids: Mutex::new(BufferIds::default()),
        }
    }

    /// Slots across every tier.
    pub(crate) fn total_pages(&self) -> u64 {
        self.total_pages
    }

    /// Pages promised to live buffers.
    pub(crate) fn promised(&self) -> u64 {
        self.reserved.lock().promised
    }

    /// Promises `pages` to a new buffer and numbers it; `refused(promised)`
    /// says why when they do not fit.
    pub(crate) fn promise(&self, pages: u64, refused: impl FnOnce(u64) -> Error) -> Result<u32> {
        let mut r = self.reserved.lock();
        if r.promised + pages > self.total_pages {
            return Err(refused(r.promised));
        }
        // Numbered under the reservation's lock: a refusal takes neither.
        let id = self.buffer_ids.lock().take().ok_or_else(|| {
            Error::new(
                ErrorKind::OutOfCapacity,
                "2^32 buffers are alive in this runtime: free some first",
            )
        })?;
        r.promised += pages;
        Ok(id)
    }

    /// Gives back a dropped buffer's promise.
    pub(crate) fn release(&self, pages: u64) {
        let mut r = self.reserved.lock();
        debug_assert!(r.promised >= pages, "releasing more than was promised");
        r.promised = r.promised.saturating_sub(pages);
    }

    /// A dropped buffer's number may be used again.
    pub(crate) fn give_back_id(&self, id: u32) {
        self.buffer_ids.lock().give_back(id);
    }

    /// Reserves one page of capacity for the second slot a move holds until
    /// it commits, so that moves can never take a slot that a promised,
    /// not yet written page is owed. Allocations do not count these (a
    /// move in the background never makes an allocation fail); a first
    /// write that finds every tier full while moves hold slots waits for
    /// them (see [`wait_for_moves`](Self::wait_for_moves)).
    pub(crate) fn reserve_move(&self, report: impl FnOnce() -> String) -> Result<()> {
        let mut r = self.reserved.lock();
        if r.promised + r.moving >= self.total_pages {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "no capacity to spare for a move: every page is promised ({})",
                    report()
                ),
            ));
        }
        r.moving += 1;
        Ok(())
    }

    /// Move reservations [`reserve_move`](Self::reserve_move) would grant
    /// now.
    pub(crate) fn spare_for_moves(&self) -> u64 {
        let r = self.reserved.lock();
        self.total_pages.saturating_sub(r.promised + r.moving)
    }

    /// Gives back move reservations.
    pub(crate) fn release_moves(&self, pages: u64) {
        {
            let mut r = self.reserved.lock();
            debug_assert!(r.moving >= pages, "releasing more than moves hold");
            r.moving = r.moving.saturating_sub(pages);
        }
        self.slot_freed.notify_all();
    }

    /// Waits (at most `timeout`) until a move gives back its second slot;
    /// false at once if no move holds one.
    pub(crate) fn wait_for_moves(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut r = self.reserved.lock();
        let held = r.moving;
        if held == 0 {
            return false;
        }
        while r.moving >= held {
            if self.slot_freed.wait_until(&mut r, deadline).timed_out() {
                break;
            }
        }
        true
    }

    /// A promotion kept its old slot in `tier` as the page's clean copy.
    pub(crate) fn clean_kept(&self, tier: Tier) {
        self.clean[tier as usize].fetch_add(1, Ordering::Relaxed);
        Counters::add(&self.counters.clean_kept, 1);
    }

    /// A clean copy in `tier` was let go of (its slot freed).
    pub(crate) fn clean_released(&self, tier: Tier) {
        self.clean[tier as usize].fetch_sub(1, Ordering::Relaxed);
    }

    /// Clean copies held in `tier`.
    pub(crate) fn clean_copies(&self, tier: Tier) -> u64 {
        self.clean[tier as usize].load(Ordering::Relaxed)
    }

    /// The counter of page moves from `from` to `to`.
    pub(crate) fn link(&self, from: Tier, to: Tier) -> &LinkCounter {
        &self.links[from as usize * 4 + to as usize]
    }
}

/// Buffer numbers: fresh ones while there are, but never more than
/// [`BufferIds::HELD`] freed ones waiting (the oldest freed is reused
/// first), so a number is reused late and the list stays small.
#[derive(Debug, Default)]
struct BufferIds {
    next: u64,
    free: VecDeque<u32>,
}

impl BufferIds {
    /// Freed numbers held back before the oldest is reused.
    const HELD: usize = 1 << 16;

    fn take(&mut self) -> Option<u32> {
        if self.free.len() >= Self::HELD {
            return self.free.pop_front();
        }
        if let Ok(id) = u32::try_from(self.next) {
            self.next += 1;
            return Some(id);
        }
        self.free.pop_front()
    }

    fn give_back(&mut self, id: u32) {
        self.free.push_back(id);
    }
}

#[cfg(test)]
mod buffer_id_tests {
    use super::BufferIds;

    #[test]
    fn ids_never_wrap_onto_a_live_buffer() {
        let mut ids = BufferIds::default();
        assert_eq!(
            (ids.take(), ids.take(), ids.take()),
            (Some(0), Some(1), Some(2))
        );
        ids.give_back(1);
        // Fresh numbers first, so a freed one is reused as late as possible.
        assert_eq!(ids.take(), Some(3));
        ids.next = u64::from(u32::MAX);
        assert_eq!(ids.take(), Some(u32::MAX));
        // Past 2^32 only freed numbers come back, oldest freed first.
        ids.give_back(3);
        assert_eq!(
            (ids.take(), ids.take(), ids.take()),
            (Some(1), Some(3), None)
        );
        // However many buffers come and go, the freed list stays bounded.
        let mut ids = BufferIds::default();
        for _ in 0..3 * BufferIds::HELD {
            let id = ids.take().unwrap();
            ids.give_back(id);
        }
        assert!(ids.free.len() <= BufferIds::HELD);
        assert_eq!(ids.next, BufferIds::HELD as u64);
    }
}
