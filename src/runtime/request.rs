//! What a move request says: which pages, where to, from which tiers, at
//! which priority, and whether room is to be made for them. Every page move
//! of the runtime is one of these, submitted to the engine (`mover.rs`).
#![forbid(unsafe_code)]

use std::ops::Range;

use super::table::Table;
use crate::tier::Tier;

/// Who asked for a move; a lane serves the most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Priority {
    /// A caller waits for it: `pin`, `evict`, a launch's `prepare`, and
    /// the room they need.
    Demand = 0,
    /// `prefetch` and the room it makes.
    Prefetch = 1,
    /// The balancer's promotions and demotions.
    Balance = 2,
    /// Background eviction between the watermarks.
    Reclaim = 3,
}

/// Which of a request's pages move: checked under each page's lock when
/// its batch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// From wherever they are.
    Any,
    /// Only pages in this tier.
    Only(Tier),
    /// Only pages in tiers faster than this one.
    Above(Tier),
    /// Only pages not in this tier.
    Not(Tier),
    /// Only pages in tiers slower than this one.
    Below(Tier),
}

impl Source {
    pub(crate) fn accepts(self, tier: Tier) -> bool {
        match self {
            Source::Any => true,
            Source::Only(t) => tier == t,
            Source::Above(t) => tier < t,
            Source::Not(t) => tier != t,
            Source::Below(t) => tier > t,
        }
    }
}

/// A move request as submitted.
pub(crate) struct Request {
    pub(crate) pages: Vec<usize>,
    pub(crate) dst: Tier,
    pub(crate) from: Source,
    pub(crate) priority: Priority,
    /// Room is made in a full `dst` (as a pin makes it), never by demoting
    /// a page of this range of the same buffer; `None`: pages that find
    /// `dst` full are returned (synchronous callers) or, for a ticket,
    /// nothing is made.
    pub(crate) room: Option<Range<usize>>,
}

/// A request for room alone: free up to `pages` slots in `tier` by
/// demoting its coldest unpinned pages (CLOCK, a second chance for pages
/// touched since the hand last passed) into the first of `to` with room,
/// cascading down `to` for what does not fit. The engine expands it into
/// demotions at `priority`.
pub(crate) struct Room<'a> {
    pub(crate) tier: Tier,
    pub(crate) pages: usize,
    /// Where victims go, fastest first.
    pub(crate) to: Vec<Tier>,
    /// Pages never picked: this range of this table (a request's own).
    pub(crate) protect: Option<(&'a Table, Range<usize>)>,
    pub(crate) priority: Priority,
    /// Whether pages referenced since the clock hand last passed may be
    /// taken too (in a second pass). Off for a prefetch: it is declined
    /// rather than evict pages the policy values more than a guess.
    pub(crate) take_referenced: bool,
}
