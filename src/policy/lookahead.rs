//! Lookahead: honours prefetch hints and a window of known future accesses,
//! and falls back to LRU for everything else.
//!
//! Resident pages fall in three groups, evicted in this order:
//! 1. pages with no known use within the next `window` accesses and no
//!    pending hint, least recently used first;
//! 2. pages with a known use within the window, the farthest first (Belady's
//!    rule, restricted to what the window shows);
//! 3. hinted pages not yet accessed since their hint, oldest hint first.
//!
//! A miss is not admitted when group 1 is empty, group 2 is not, and the
//! missing page is used later than every page of group 2, or not at all
//! within the window (hinted pages, group 3, are not weighed against it). With no future (the runtime's case: `window` 0) the policy is LRU plus
//! hints: a hint loads the page and protects it until its access.
//!
//! O(log n) per access: a `BTreeSet` of next-use positions for group 2, and
//! one of the pages of group 1 whose next use is known but beyond the window,
//! moved to group 2 as the window reaches them.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use super::base::{next_uses, page_map, Outcome, PageMap, Policy, NEVER};
use super::list::{Arena, List};

/// The window trace replay uses: twice the capacity, in accesses.
pub fn default_window(capacity: usize) -> usize {
    2 * capacity
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Group {
    Far,
    Near,
    Hinted,
}

#[derive(Clone, Copy)]
struct Entry {
    /// The node in `far` or `hinted`.
    node: u32,
    /// Position of the next use, or `NEVER` (none known).
    next: usize,
    group: Group,
}

/// Prefetch hints, a window of the future, LRU otherwise.
pub struct Lookahead {
    capacity: usize,
    window: usize,
    trace: Vec<u64>,
    next: Vec<usize>,
    pos: usize,
    map: PageMap<Entry>,
    arena: Arena,
    far: List,
    hinted: List,
    /// Next uses of group 2 pages.
    near: BTreeSet<usize>,
    /// Known next uses of group 1 pages, beyond the window.
    pending: BTreeSet<usize>,
}

impl Lookahead {
    /// Hints only: LRU for pages without a pending hint.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity >= 1, "a cache of 0 pages");
        Self::with_future(capacity, &[], 0)
    }

    /// Sees `window` accesses ahead in `trace`, the sequence of accesses
    /// that will follow (its accesses must then follow the trace).
    pub fn with_future(capacity: usize, trace: &[u64], window: usize) -> Self {
        Self {
            capacity,
            window,
            trace: trace.to_vec(),
            next: next_uses(trace),
            pos: 0,
            map: page_map(capacity),
            arena: Arena::with_capacity(capacity),
            far: List::default(),
            hinted: List::default(),
            near: BTreeSet::new(),
            pending: BTreeSet::new(),
        }
    }

    /// The window, in accesses.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The last position the window shows: pages used at or before it are
    /// group 2. `pos` is the position of the access being decided.
    fn horizon(&self) -> usize {
        self.pos.saturating_add(self.window)
    }

    /// Takes `page` out of whatever group holds it.
    fn detach(&mut self, e: Entry) {
        match e.group {
            Group::Far => {
                self.far.remove(&mut self.arena, e.node);
                if e.next != NEVER {
                    self.pending.remove(&e.next);
                }
            }
            Group::Near => {
                self.near.remove(&e.next);
            }
            Group::Hinted => self.hinted.remove(&mut self.arena, e.node),
        }
    }

    /// Files a resident page under its next use `next`.
    fn attach(&mut self, page: u64, node: u32, next: usize) {
        let group = if next != NEVER && next <= self.horizon() {
            self.near.insert(next);
            Group::Near
        } else {
            if next != NEVER {
                self.pending.insert(next);
            }
            self.far.push_front(&mut self.arena, node);
            Group::Far
        };
        self.map.insert(page, Entry { node, next, group });
    }

    /// Moves pages whose next use the window now reaches into group 2.
    fn advance(&mut self) {
        let horizon = self.horizon();
        while let Some(&next) = self.pending.first() {
            if next > horizon {
                break;
            }
            self.pending.pop_first();
            let page = self.trace[next];
            let e = self.map.get_mut(&page).expect("pending pages are resident");
            e.group = Group::Near;
            let node = e.node;
            self.far.remove(&mut self.arena, node);
            self.near.insert(next);
        }
    }

    /// Frees one slot for a page used next at `next`; `None` when the
    /// newcomer should rather stay out (only if `may_bypass`).
    fn make_room(&mut self, next: usize, may_bypass: bool) -> Result<Option<u64>, ()> {
        if self.map.len() < self.capacity {
            return Ok(None);
        }
        let victim = if let Some(node) = self.far.back() {
            self.arena.get(node).key
        } else if let Some(&farthest) = self.near.last() {
            if may_bypass && (next == NEVER || next > farthest) {
                return Err(());
            }
            self.trace[farthest]
        } else {
            let node = self.hinted.back().expect("a full cache has a page");
            self.arena.get(node).key
        };
        let e = self.map.remove(&victim).expect("victim is resident");
        self.detach(e);
        self.arena.release(e.node);
        Ok(Some(victim))
    }
}

impl Policy for Lookahead {
    fn name(&self) -> &'static str {
        "lookahead"
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    /// # Panics
    /// With a future, if `page` is not the next page of the trace.
    fn access(&mut self, page: u64) -> Outcome {
        let i = self.pos;
        let next = if self.trace.is_empty() {
            NEVER
        } else {
            assert!(
                self.trace.get(i) == Some(&page),
                "lookahead: access {i} to page {page} does not follow the trace"
            );
            self.next[i]
        };
        self.advance();
        let access = if let Some(e) = self.map.get(&page).copied() {
            self.detach(e);
            self.attach(page, e.node, next);
            Outcome::Hit
        } else if let Ok(evicted) = self.make_room(next, true) {
            let node = self.arena.alloc(page, 0);
            self.attach(page, node, next);
            Outcome::Miss { evicted }
        } else {
            Outcome::Bypass
        };
        self.pos += 1;
        access
    }

    fn hint(&mut self, page: u64) -> Outcome {
        if let Some(e) = self.map.get(&page).copied() {
            self.detach(e);
            self.hinted.push_front(&mut self.arena, e.node);
            self.map.insert(
                page,
                Entry {
                    group: Group::Hinted,
                    next: NEVER,
                    ..e
                },
            );
            return Outcome::Hit;
        }
        let evicted = self.make_room(NEVER, false).unwrap_or(None);
        let node = self.arena.alloc(page, 0);
        self.hinted.push_front(&mut self.arena, node);
        self.map.insert(
            page,
            Entry {
                node,
                next: NEVER,
                group: Group::Hinted,
            },
        );
        Outcome::Miss { evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_future_it_is_lru_plus_hints() {
        let mut p = Lookahead::new(2);
        p.access(1);
        p.access(2);
        assert_eq!(p.hint(3), Outcome::Miss { evicted: Some(1) });
        // 3 is protected until used: 2 goes first.
        assert_eq!(p.access(4), Outcome::Miss { evicted: Some(2) });
        assert!(p.access(3).is_hit());
        assert_eq!(p.access(5), Outcome::Miss { evicted: Some(4) });
        assert_eq!(p.hint(5), Outcome::Hit);
    }

    #[test]
    fn evicts_by_next_use_within_the_window() {
        // With a window covering the whole trace it is Belady's MIN.
        let t = [1, 2, 3, 1, 2, 3, 1, 2];
        let mut p = Lookahead::with_future(2, &t, 100);
        let misses = t.iter().filter(|&&x| !p.access(x).is_hit()).count();
        let mut b = super::super::belady::Belady::new(2, &t);
        let opt = t.iter().filter(|&&x| !b.access(x).is_hit()).count();
        assert_eq!(misses, opt);
        // With no window it is LRU: every access of this loop misses.
        let mut p = Lookahead::with_future(2, &t, 0);
        assert!(t.iter().all(|&x| !p.access(x).is_hit()));
    }
}
