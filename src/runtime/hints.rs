//! What the balancer hears between rounds: prefetches (as hints for its
//! policies' `Policy::hint`), and the moves reads started for pages it
//! marked for promotion at their next read, until they are settled.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Weak;

use parking_lot::Mutex;

use super::accounting::Counters;
use super::shared::Shared;
use super::table::Table;
use super::ticket::Ticket;
use crate::tier::Tier;

/// Hinted pages waiting for the balancer's next round: prefetches tell the
/// policies what is about to be used (`Policy::hint`).
#[derive(Default)]
pub(crate) struct Hints {
    /// Whether a balancer is configured (no hints are kept otherwise).
    pub(crate) on: AtomicBool,
    pages: Mutex<Vec<(Tier, u64)>>,
    /// The moves reads started for pages the balancer marked
    /// ([`BalancerConfig::promote_on_read`]), until
    /// [`settle_read_promotions`] counts them and keeps their failures.
    pub(crate) read_promotions: Mutex<Vec<ReadPromotion>>,
}

/// A move a read started for a page the balancer marked.
pub(crate) struct ReadPromotion {
    pub(crate) ticket: Ticket,
    pub(crate) table: Weak<Table>,
    pub(crate) page: usize,
    pub(crate) dst: Tier,
}

/// Counts a promotion a read carried out.
pub(crate) fn count_read_promotion(rt: &Shared) {
    Counters::add(&rt.counters().promotions, 1);
    Counters::add(&rt.counters().promotions_on_read, 1);
}

/// Settles the moves reads started (all of them when `wait`, else those
/// done): a page that arrived counts as a promotion; a failure other than a
/// full tier is kept for `Runtime::check`.
pub(crate) fn settle_read_promotions(rt: &Shared, hints: &Hints, wait: bool) {
    let started = std::mem::take(&mut *hints.read_promotions.lock());
    let mut open = Vec::new();
    for ReadPromotion {
        ticket,
        table,
        page,
        dst,
    } in started
    {
        let result = match (ticket.poll(), wait) {
            (Some(r), _) => r,
            (None, true) => ticket.wait(),
            (None, false) => {
                open.push(ReadPromotion {
                    ticket,
                    table,
                    page,
                    dst,
                });
                continue;
            }
        };
        match result {
            Err(e) => {
                if e.kind() != crate::error::ErrorKind::OutOfCapacity {
                    rt.note_background("a promotion a read started", e);
                }
            }
            Ok(()) => {
                let arrived = table.upgrade().is_some_and(|t| {
                    t.pages
                        .get(page)
                        .is_some_and(|e| e.lock().tier() == Some(dst))
                });
                if arrived {
                    count_read_promotion(rt);
                }
            }
        }
    }
    if !open.is_empty() {
        hints.read_promotions.lock().extend(open);
    }
}

/// Hints kept between rounds, at most; later ones are dropped.
const MAX_HINTS: usize = 1 << 16;

impl Hints {
    /// Notes that `pages` of buffer `id` were prefetched into `tier`.
    pub(crate) fn add(&self, tier: Tier, id: u32, pages: std::ops::Range<usize>) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut v = self.pages.lock();
        let room = MAX_HINTS.saturating_sub(v.len());
        v.extend(
            pages
                .take(room)
                .map(|p| (tier, (id as u64) << 32 | p as u64)),
        );
    }

    pub(crate) fn take(&self) -> Vec<(Tier, u64)> {
        std::mem::take(&mut *self.pages.lock())
    }
}
