//! The balancer's pages: page ids (`buffer << 32 | page`) resolved to
//! their buffers, promotion marks, and the move requests the balancer
//! submits for them (at balance priority, through the engine).
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::mover::Engine;
use super::page::Page;
use super::request::{Priority, Request, Source};
use super::table::Table;
use crate::tier::Tier;

/// Page ids (`buffer << 32 | page`) to their buffers' tables.
pub(crate) type ById<'a> = HashMap<u32, &'a Arc<Table>>;

/// Up to `n` pages in `fast` the policy does not hold, coldest-scored first.
pub(crate) fn strangers(
    tables: &[Arc<Table>],
    held: &HashSet<u64>,
    n: usize,
    fast: Tier,
) -> Vec<u64> {
    scored_strangers(tables, held, n, fast)
        .into_iter()
        .map(|x| x.1)
        .collect()
}

/// [`strangers`] with their decayed scores, coldest first.
pub(crate) fn scored_strangers(
    tables: &[Arc<Table>],
    held: &HashSet<u64>,
    n: usize,
    fast: Tier,
) -> Vec<(f32, u64)> {
    if n == 0 {
        return Vec::new();
    }
    let mut v: Vec<(f32, u64)> = Vec::new();
    for t in tables {
        let scores = t.scores.lock();
        for (p, e) in t.pages.iter().enumerate() {
            let id = (t.id as u64) << 32 | p as u64;
            if !held.contains(&id) && e.seen_tier() == Some(fast) {
                v.push((scores[p], id));
            }
        }
    }
    if v.len() > n {
        v.select_nth_unstable_by(n, |a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        v.truncate(n);
    }
    v.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    v
}

/// Page id `p`'s decayed score (0 when its buffer is gone).
pub(crate) fn score_of(by_id: &ById<'_>, p: u64) -> f32 {
    by_id
        .get(&((p >> 32) as u32))
        .and_then(|t| t.scores.lock().get((p & 0xFFFF_FFFF) as usize).copied())
        .unwrap_or(0.0)
}

/// Page id `p`'s page-table entry, if its buffer is alive.
fn entry<'a>(by_id: &ById<'a>, p: u64) -> Option<&'a Page> {
    by_id
        .get(&((p >> 32) as u32))
        .and_then(|t| t.pages.get((p & 0xFFFF_FFFF) as usize))
}

/// The tier page id `p` is in now, or — while a move of it is in flight —
/// was in before it began (see [`Page::seen`]: the balancer's scans never
/// wait for another page's read).
pub(crate) fn tier_of(by_id: &ById<'_>, p: u64) -> Option<Tier> {
    entry(by_id, p).and_then(Page::seen_tier)
}

/// Whether page id `p` is in tier `tier` now.
fn is_in(by_id: &ById<'_>, p: u64, tier: Tier) -> bool {
    tier_of(by_id, p) == Some(tier)
}

/// Moves `pages` (ids) out of `fast` (any tier with tiers below), cascading down; returns how many
/// left it (pages not there to begin with do not count).
pub(crate) fn demote_pages(engine: &Engine, by_id: &ById<'_>, pages: &[u64], fast: Tier) -> u64 {
    let slower = engine.shared().tiers.below(fast);
    let there: Vec<u64> = pages
        .iter()
        .copied()
        .filter(|&p| is_in(by_id, p, fast))
        .collect();
    let mut left = there.clone();
    for &dst in &slower {
        if left.is_empty() {
            break;
        }
        for (t, ps) in group(by_id, &left) {
            // The pages stay readable; the error is kept for Runtime::check.
            let request = Request {
                pages: ps,
                dst,
                from: Source::Only(fast),
                priority: Priority::Balance,
                room: None,
            };
            if let Err(e) = engine.run(t, request) {
                engine
                    .shared()
                    .note_background("the balancer's demotions", e);
            }
        }
        left.retain(|&p| is_in(by_id, p, fast));
    }
    (there.len() - left.len()) as u64
}

/// Whether page `p` (an id) is in `fast` with a clean copy below it: its
/// demotion takes the copy back, no write.
pub(crate) fn leaves_free(by_id: &ById<'_>, p: u64, fast: Tier) -> bool {
    entry(by_id, p).is_some_and(|e| {
        let e = e.lock();
        e.tier() == Some(fast) && e.clean.is_some()
    })
}

/// Marks page `p` (an id) on NVMe for promotion into `fast` at its next
/// read; false when it is not on NVMe (or pinned, or gone).
pub(crate) fn mark(by_id: &ById<'_>, p: u64, fast: Tier) -> bool {
    entry(by_id, p).is_some_and(|e| e.lock().mark_promotion(fast, |src| src == Tier::Nvme))
}

/// Whether page `p` (an id) still carries the mark of [`mark`]: not when
/// a read took it or a move cleared it, and not when the policy no longer
/// `holds` the page (the mark is taken back).
pub(crate) fn still_marked(by_id: &ById<'_>, p: u64, fast: Tier, holds: bool) -> bool {
    let Some(e) = entry(by_id, p) else {
        return false;
    };
    let mut e = e.lock();
    if e.promote_on_read != Some(fast) {
        return false;
    }
    if !holds {
        e.promote_on_read = None;
    }
    holds
}

/// Moves `pages` (ids) into `dst`; returns how many arrived.
pub(crate) fn move_pages(
    engine: &Engine,
    by_id: &ById<'_>,
    pages: &[u64],
    dst: Tier,
    from: Source,
) -> u64 {
    for (t, ps) in group(by_id, pages) {
        let request = Request {
            pages: ps,
            dst,
            from,
            priority: Priority::Balance,
            room: None,
        };
        if let Err(e) = engine.run(t, request) {
            engine.shared().note_background("the balancer's moves", e);
        }
    }
    pages.iter().filter(|&&p| is_in(by_id, p, dst)).count() as u64
}

/// Page ids grouped by buffer, as indices.
fn group<'a>(
    by_id: &HashMap<u32, &'a Arc<Table>>,
    pages: &[u64],
) -> Vec<(&'a Arc<Table>, Vec<usize>)> {
    let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for &p in pages {
        groups
            .entry((p >> 32) as u32)
            .or_default()
            .push((p & 0xFFFF_FFFF) as usize);
    }
    groups
        .into_iter()
        .filter_map(|(id, ps)| {
            let t = by_id.get(&id)?;
            let ps = ps.into_iter().filter(|&p| p < t.pages.len()).collect();
            Some((*t, ps))
        })
        .collect()
}
