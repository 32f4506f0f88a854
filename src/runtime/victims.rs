//! Choosing pages to demote when room is made: a CLOCK hand per buffer,
//! giving a page touched since the hand last passed a second chance.
//! Pages that are pinned, covered by a kernel launch, or busy (their lock
//! taken) are skipped. The balancer's placement policies refine this
//! choice; room-making only guarantees headroom.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::Ordering;

use super::table::Table;
use crate::tier::Tier;

/// Up to `n` pages of `table` resident in `tier`, from the clock hand on
/// (at most one turn of it), none in `keep` or `taken`.
pub(crate) fn pick(
    table: &Table,
    tier: Tier,
    n: usize,
    second_chance: bool,
    keep: Option<&Range<usize>>,
    taken: &HashSet<usize>,
) -> Vec<usize> {
    let len = table.pages.len();
    if len == 0 || launched(table) {
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

/// Whether `table` has a page resident in `tier` that room-making could
/// take (unpinned, not launched, not in `keep`), referenced or not; the
/// clock hand stays where it is.
pub(crate) fn exists(table: &Table, tier: Tier, keep: Option<&Range<usize>>) -> bool {
    !launched(table)
        && table.pages.iter().enumerate().any(|(at, page)| {
            !keep.is_some_and(|k| k.contains(&at))
                && page
                    .try_lock()
                    .is_some_and(|e| e.pins == 0 && e.tier() == Some(tier))
        })
}

/// Whether kernels run on `table`: they may be reading any of its pages,
/// so none is a victim.
fn launched(table: &Table) -> bool {
    let l = table.launches.lock();
    l.read_only + l.read_write > 0
}
