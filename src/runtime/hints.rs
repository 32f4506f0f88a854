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
    /// The prefetches since the last round, with their pages' sum (kept
    /// to [`MAX_HINTS`]: later ones are dropped).
    prefetches: Mutex<(Vec<Hinted>, usize)>,
    /// The moves reads started for pages the balancer marked
    /// ([`BalancerConfig::promote_on_read`]), until
    /// [`settle_read_promotions`] counts them and keeps their failures.
    pub(crate) read_promotions: Mutex<Vec<ReadPromotion>>,
}

/// A prefetch's pages. Of a request cancelled before the round takes
/// them, only those that came are hinted: the others stay where they are,
/// and a policy told of them would hold pages that never came, and may let
/// a resident go for them.
struct Hinted {
    tier: Tier,
    id: u32,
    pages: std::ops::Range<usize>,
    ticket: Ticket,
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
    /// Notes that `pages` of buffer `id` were prefetched into `tier` by the
    /// request of `ticket`.
    pub(crate) fn add(&self, tier: Tier, id: u32, pages: std::ops::Range<usize>, ticket: &Ticket) {
        if !self.on.load(Ordering::Relaxed) || pages.is_empty() {
            return;
        }
        let mut held = self.prefetches.lock();
        let room = MAX_HINTS.saturating_sub(held.1);
        if room == 0 {
            return;
        }
        let pages = pages.start..pages.end.min(pages.start + room);
        held.1 += pages.len();
        held.0.push(Hinted {
            tier,
            id,
            pages,
            ticket: ticket.clone(),
        });
    }

    /// The pages hinted since the last call, as (tier, page id). Of a
    /// cancelled request, only the pages that came (`came(tier, id)`: a
    /// batch already moving finishes, and a request cancelled after it
    /// finished moved everything).
    pub(crate) fn take(&self, came: &dyn Fn(Tier, u64) -> bool) -> Vec<(Tier, u64)> {
        let (taken, pages) = std::mem::take(&mut *self.prefetches.lock());
        let mut hints = Vec::with_capacity(pages);
        for h in &taken {
            let id = (h.id as u64) << 32;
            let pages = h.pages.clone().map(|p| (h.tier, id | p as u64));
            if h.ticket.is_cancelled() {
                hints.extend(pages.filter(|&(t, p)| came(t, p)));
            } else {
                hints.extend(pages);
            }
        }
        hints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> Hints {
        let h = Hints::default();
        h.on.store(true, Ordering::Relaxed);
        h
    }

    #[test]
    fn a_cancelled_prefetch_hints_only_the_pages_that_came() {
        let h = on();
        let (kept, cancelled) = (Ticket::new(), Ticket::new());
        h.add(Tier::Device, 1, 0..2, &kept);
        h.add(Tier::Device, 2, 5..8, &cancelled);
        cancelled.set_cancelled();
        // Of the cancelled request, page 6 came (its batch was moving).
        let came = |t: Tier, p: u64| t == Tier::Device && p == (2 << 32 | 6);
        assert_eq!(
            h.take(&came),
            vec![
                (Tier::Device, 1 << 32),
                (Tier::Device, 1 << 32 | 1),
                (Tier::Device, 2 << 32 | 6)
            ]
        );
        assert!(h.take(&came).is_empty(), "taken once");
    }

    #[test]
    fn hints_are_kept_only_while_a_balancer_listens_and_to_a_bound() {
        let all = |_: Tier, _: u64| true;
        let h = Hints::default();
        h.add(Tier::Host, 0, 0..4, &Ticket::new());
        assert!(h.take(&all).is_empty(), "no balancer, no hints");
        let h = on();
        h.add(Tier::Host, 0, 0..MAX_HINTS - 1, &Ticket::new());
        h.add(Tier::Host, 1, 0..4, &Ticket::new());
        h.add(Tier::Host, 2, 0..4, &Ticket::new());
        let taken = h.take(&all);
        assert_eq!(taken.len(), MAX_HINTS);
        assert_eq!(taken.last(), Some(&(Tier::Host, 1 << 32)));
    }
}
