//! Clean copies dropped for room. A promoted page may keep its old slot
//! in the slower tier as a clean copy (`page.rs`); those slots are the
//! cheapest room a tier has — freeing one needs no I/O and loses nothing,
//! the page keeps its own slot — so room-making, a full destination and a
//! first write that finds every tier full take them before anything is
//! demoted. Each buffer is searched from where the last search stopped.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use super::registry::Registry;
use super::shared::Shared;
use crate::tier::Tier;

/// Frees up to `n` clean copies held in `tier`; returns how many. Pages
/// whose lock is taken are passed over (the caller may hold one).
pub(crate) fn drop_copies(tables: &Registry, shared: &Shared, tier: Tier, n: usize) -> usize {
    let mut dropped = 0;
    if n == 0 || shared.acct.clean_copies(tier) == 0 {
        return 0;
    }
    for table in tables.live() {
        let len = table.pages.len();
        if len == 0 {
            continue;
        }
        let mut at = table.clean_hand.load(Ordering::Relaxed) % len;
        for _ in 0..len {
            if let Some(mut entry) = table.pages[at].try_lock() {
                if table.drop_clean(&mut entry, tier) {
                    dropped += 1;
                }
            }
            at = (at + 1) % len;
            if dropped == n || shared.acct.clean_copies(tier) == 0 {
                break;
            }
        }
        table.clean_hand.store(at, Ordering::Relaxed);
        if dropped == n || shared.acct.clean_copies(tier) == 0 {
            break;
        }
    }
    dropped
}
