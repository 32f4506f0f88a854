//! Room-making, the part of the engine that frees slots for a request:
//! clean copies dropped first (no I/O), then the coldest unpinned pages
//! demoted, picked by CLOCK (`victims.rs`) and submitted to the engine's
//! own lanes at the request's priority. Requests carry their room
//! ([`Room`], or a move request's `room`), so the reclaimer and the
//! balancer only submit, and nothing above the engine makes room itself.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use super::accounting::Counters;
use super::batch;
use super::clean;
use super::mover::Engine;
use super::request::{Priority, Request, Room};
use super::table::{Loc, Table};
use super::ticket::Ticket;
use super::victims;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

impl Engine {
    /// Makes room for the pages of a batch that found `dst` full
    /// (`result`'s list): the coldest pages of `dst` that the request does
    /// not cover (`protect`) are demoted, a few rounds as demotions may
    /// race other moves, and the pages move again. Returns the batch's
    /// result after.
    pub(super) fn fit(
        &self,
        table: &Table,
        dst: Tier,
        protect: &Range<usize>,
        priority: Priority,
        mut result: Result<Vec<usize>>,
        wanted: &dyn Fn(Tier) -> bool,
    ) -> Result<Vec<usize>> {
        // A prefetch gets one turn of the clock hand: a second would
        // take the pages whose second chance the first gave.
        let rounds = if priority == Priority::Prefetch { 1 } else { 3 };
        for _ in 0..rounds {
            let full = match &result {
                Ok(full) if !full.is_empty() => full.clone(),
                _ => break,
            };
            let (made, failure) = self.make_room_for(table, dst, full.len(), protect, priority);
            if let Some(e) = failure {
                if priority == Priority::Demand {
                    // A pin or a launch does not fail for another page's
                    // demotion: recorded, and the room found is what it is.
                    self.shared()
                        .note_background("making room for a demand move", e);
                } else {
                    result = Err(e.context(format!("making room in the {dst} tier")));
                }
                break;
            }
            if made == 0 {
                break;
            }
            result = batch::move_batched(table, &full, dst, wanted, table.batch());
        }
        result
    }

    /// Whether room-making for a request of `table` protecting `protect`
    /// was held back by the victims' value rather than by space: `tier`
    /// holds a page it could demote (referenced or not), and the tiers
    /// below have a free slot to take it. (With the tiers below full, the
    /// request is short of capacity, not declined.)
    pub(super) fn has_victims(
        &self,
        tier: Tier,
        table: &Table,
        protect: Option<&Range<usize>>,
    ) -> bool {
        let tiers = &self.shared().tiers;
        tiers.free_pages(&tiers.below(tier)) > 0
            && self.tables().live().iter().any(|t| {
                let keep = protect.filter(|_| std::ptr::eq(&**t, table));
                victims::exists(t, tier, keep)
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
            to: self.shared().tiers.below(tier),
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
        if self.shared().tiers.nvme().is_none() {
            return 0;
        }
        let mut moved = 0;
        for &tier in self.shared().tiers.memory().iter().rev() {
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
            moved += self.make_room(&room, &mut |what, e| self.shared().note_background(what, e));
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
                    let tiers = order.map_or_else(|| self.shared().tiers.list(), <[Tier]>::to_vec);
                    let dropped = tiers
                        .iter()
                        .any(|&t| clean::drop_copies(self.tables(), self.shared(), t, 1) > 0);
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
        let dropped = clean::drop_copies(self.tables(), self.shared(), room.tier, room.pages);
        let need = room.pages - dropped;
        if need == 0 {
            return dropped;
        }
        let tables = self.tables().weak();
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
        Counters::add(&self.shared().counters().reclaimed_pages, moved as u64);
        dropped + moved
    }

    /// Moves the batches of `victims` out of `room.tier` to the first tier
    /// of `room.to` with room: every batch is submitted before any is
    /// waited for; what found a tier full cascades further down. Returns
    /// how many of them left the tier: not a page the move passed over
    /// (pinned or moved meanwhile) or whose write-out it abandoned to a
    /// racing write.
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
        let all: Vec<usize> = victims.iter().flatten().copied().collect();
        let tickets: Vec<Ticket> = victims
            .into_iter()
            .map(|batch| {
                let ticket = Ticket::new();
                self.submit(table, request(batch, first), false, &ticket);
                ticket
            })
            .collect();
        let mut left = Vec::new();
        for ticket in tickets {
            // The pages stay readable (or are counted lost); the error goes
            // to whoever asked for the room.
            match ticket.wait_full() {
                Ok(full) => left.extend(full),
                Err(e) => failed(&format!("demoting pages from {tier} to {first}"), e),
            }
        }
        for &dst in rest {
            if left.is_empty() {
                break;
            }
            left = match self.run(table, request(left.clone(), dst)) {
                Ok(full) => full,
                Err(e) => {
                    failed(&format!("demoting pages from {tier} to {dst}"), e);
                    break;
                }
            };
        }
        // The room made is what left the tier, counted where it is now.
        all.iter()
            .filter(|&&p| table.pages[p].lock().tier() != Some(tier))
            .count()
    }
}
