//! Page-table entries and the transitions of a page's state machine. No
//! I/O and no slot allocation happen here: the copy engines (`table.rs`)
//! copy bytes and allocate slots, and this module decides, under the page's
//! lock, what a page becomes. Every move ends in [`Entry::commit`], so the
//! rules are written once:
//!
//! - a write that races a move wins: every write bumps the version, and a
//!   move whose copy began at another version is abandoned (its fresh slot
//!   given back);
//! - a pinned page never moves: a move neither begins nor commits while a
//!   pin covers the page (and a writable pin bumps the version, so a copy
//!   taken before it does not commit after it ends either; a read-only pin
//!   changes nothing a copy holds);
//! - a clean copy is never served stale: a page promoted out of a slower
//!   tier may keep its old slot there as a *clean copy*
//!   ([`Entry::clean`]), which a demotion back to that tier takes instead
//!   of writing ([`Entry::drop_to_clean`]); every write drops it first
//!   ([`Entry::note_write`]), so it only ever holds the page's current
//!   bytes, and the page's own slot always does;
//! - a committed page is never lost: the entry owns exactly one slot from
//!   commit to the next commit or clear (and at most one clean copy beside
//!   it, which may be dropped at any time); the only state without a slot is
//!   [`Lost`], entered by [`Entry::take_for_read`] while a read of its NVMe
//!   slot is in flight under the lock, and left by
//!   [`Entry::put_back`] or a commit when the read completes, or put back
//!   when the I/O engine fails with the read in flight (the read never
//!   changes the slot). A page left `Lost` reads as such, never as zeros.
//!
//! The transitions are generic over the slot type, so `tests/` (and the
//! loom model in this module's tests) can check them with plain numbers.
#![forbid(unsafe_code)]

use crate::error::{Error, ErrorKind};
use crate::tier::{Slot, Tier};

/// Where a page is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Loc<S = Slot> {
    /// Never written: reads as zeros, holds no slot.
    Zero,
    /// In a slot of a tier.
    Resident { tier: Tier, slot: S },
    /// Its slot is in an NVMe read of a batched move. Only seen under the
    /// page lock — unless the I/O engine failed with the read in flight,
    /// when the page stays this way and reads say so (never zeros).
    Lost,
}

pub(crate) use Loc::{Lost, Resident, Zero};

/// One more holder of a count that keeps memory in place (a page's pins, a
/// buffer's views and launches). A count that wrapped to zero would let the
/// runtime move or free what a holder still reads, and guards can be leaked
/// in safe code (`mem::forget`), so this aborts rather than wrap, as `Arc`
/// does with its count: reached only by leaking 2^32 guards.
pub(crate) fn one_more(count: &mut u32) {
    *count = count
        .checked_add(1)
        .unwrap_or_else(|| std::process::abort());
}

/// One page-table entry.
#[derive(Debug)]
pub(crate) struct Entry<S = Slot> {
    pub(crate) loc: Loc<S>,
    /// Live pins covering the page: while non-zero it never moves.
    pub(crate) pins: u32,
    /// Bumped by every write, every pin and every committed move.
    pub(crate) version: u32,
    /// Set by accesses, cleared by the reclaimer's clock hand.
    pub(crate) referenced: bool,
    /// The balancer wants the page in this tier, and the next read takes
    /// it there: one whole-page read from NVMe instead of the read's range
    /// and a separate promotion (see [`Entry::mark_promotion`]). Cleared
    /// when the page moves or is freed.
    pub(crate) promote_on_read: Option<Tier>,
    /// A copy of the page's current bytes in a tier slower than the one it
    /// is resident in: the slot it was promoted out of, kept until that
    /// tier needs the room ([`take_clean`](Self::take_clean)), the page
    /// is written ([`note_write`](Self::note_write)) or the page goes back
    /// there ([`drop_to_clean`](Self::drop_to_clean), a demotion with no
    /// copy). Only ever set while the page is resident.
    pub(crate) clean: Option<(Tier, S)>,
}

/// Slots a transition let go of, for the caller to free: the page's old
/// slot and a clean copy that is no longer of use.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "the slots must be freed"]
pub(crate) struct Freed<S> {
    pub(crate) old: Option<(Tier, S)>,
    pub(crate) clean: Option<(Tier, S)>,
}

impl<S> Freed<S> {
    fn none() -> Self {
        Self {
            old: None,
            clean: None,
        }
    }

    /// Every slot to free.
    #[cfg(test)]
    fn into_slots(self) -> impl Iterator<Item = (Tier, S)> {
        self.old.into_iter().chain(self.clean)
    }
}

/// A move begun by [`Entry::begin_move`]: what its commit checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Begun {
    /// The tier the copy was taken from.
    pub(crate) src: Tier,
    /// The page's version when the copy was taken.
    pub(crate) version: u32,
}

impl<S> Default for Entry<S> {
    fn default() -> Self {
        Self {
            loc: Zero,
            pins: 0,
            version: 0,
            referenced: false,
            promote_on_read: None,
            clean: None,
        }
    }
}

impl<S> Entry<S> {
    /// The tier the page is resident in.
    pub(crate) fn tier(&self) -> Option<Tier> {
        match &self.loc {
            Resident { tier, .. } => Some(*tier),
            Zero | Lost => None,
        }
    }

    /// The resident slot.
    pub(crate) fn slot(&self) -> Option<&S> {
        match &self.loc {
            Resident { slot, .. } => Some(slot),
            Zero | Lost => None,
        }
    }

    /// Records a change of the page's bytes (a write through the runtime,
    /// or a pin whose holder may write through its address): a move whose
    /// copy was taken before it will not commit, and the clean copy (if
    /// any) no longer matches, so it comes back for the caller to free —
    /// before the write is acknowledged, so it is never served.
    #[must_use = "a dropped clean copy must be freed"]
    pub(crate) fn note_write(&mut self) -> Option<(Tier, S)> {
        self.version = self.version.wrapping_add(1);
        self.clean.take()
    }

    /// A read-only kernel launch maps the page: a move whose copy was taken
    /// before it will not commit (the launch reads the page's slot), and
    /// the clean copy stays, as kernels do not change the bytes.
    pub(crate) fn note_mapped(&mut self) {
        self.version = self.version.wrapping_add(1);
    }

    /// Takes the clean copy, for its tier's room. The page keeps its own
    /// slot, so nothing is lost.
    pub(crate) fn take_clean(&mut self) -> Option<(Tier, S)> {
        self.clean.take()
    }

    /// A demotion into the tier of the clean copy that needs no copy: the
    /// page becomes resident in its clean copy, and its old slot comes back
    /// for the caller to free. `None` (nothing changes) when the page is
    /// pinned or has no clean copy in `dst`.
    pub(crate) fn drop_to_clean(&mut self, dst: Tier) -> Option<(Tier, S)> {
        if self.pins != 0 || !matches!(&self.clean, Some((t, _)) if *t == dst) {
            return None;
        }
        let (tier, slot) = self.clean.take().expect("checked above");
        let Resident {
            tier: old_tier,
            slot: old,
        } = std::mem::replace(&mut self.loc, Resident { tier, slot })
        else {
            unreachable!("a clean copy is only kept for a resident page")
        };
        self.version = self.version.wrapping_add(1);
        self.promote_on_read = None;
        Some((old_tier, old))
    }

    /// Whether the page may begin a move to `dst`: resident in another
    /// tier that `wanted` accepts, and not pinned. The copy engine then
    /// copies the bytes (with or without the lock) and calls
    /// [`commit`](Self::commit) under the lock.
    pub(crate) fn begin_move(&self, dst: Tier, wanted: impl Fn(Tier) -> bool) -> Option<Begun> {
        match &self.loc {
            Resident { tier, .. } if *tier != dst && self.pins == 0 && wanted(*tier) => {
                Some(Begun {
                    src: *tier,
                    version: self.version,
                })
            }
            _ => None,
        }
    }

    /// Installs `fresh` (a slot of `dst` holding the copy taken at `begun`)
    /// if the page is as it was then — same tier, same version, unpinned —
    /// and returns the slots let go of for the caller to free (or retire).
    /// When the page changed meanwhile the move is abandoned and `fresh`
    /// comes back as the error, for the caller to free.
    ///
    /// With `keep` a promotion (into a faster tier) keeps the old slot as
    /// the page's clean copy instead of letting it go, unless the page has
    /// one already. A move into a tier at or below the clean copy's lets
    /// the clean copy go too (it would be below the page's own slot).
    pub(crate) fn commit(
        &mut self,
        begun: Begun,
        dst: Tier,
        fresh: S,
        keep: bool,
    ) -> Result<Freed<S>, S> {
        let unchanged =
            self.version == begun.version && self.pins == 0 && self.tier() == Some(begun.src);
        if !unchanged {
            return Err(fresh);
        }
        let Resident {
            tier: src,
            slot: old,
        } = std::mem::replace(
            &mut self.loc,
            Resident {
                tier: dst,
                slot: fresh,
            },
        )
        else {
            unreachable!("checked resident")
        };
        self.version = self.version.wrapping_add(1);
        self.promote_on_read = None;
        let mut freed = Freed::none();
        if matches!(&self.clean, Some((t, _)) if *t <= dst) {
            freed.clean = self.clean.take();
        }
        if keep && dst < src && self.clean.is_none() {
            self.clean = Some((src, old));
        } else {
            freed.old = Some((src, old));
        }
        Ok(freed)
    }

    /// Marks the page for promotion into `dst` at its next read, if it is
    /// resident in a tier `wanted` accepts (not `dst`) and unpinned; true
    /// when it is marked now.
    pub(crate) fn mark_promotion(&mut self, dst: Tier, wanted: impl Fn(Tier) -> bool) -> bool {
        let ok = self.begin_move(dst, wanted).is_some();
        if ok {
            self.promote_on_read = Some(dst);
        }
        ok
    }

    /// The tier a read should move the page into first, if it is marked
    /// and may still move there; the mark is taken either way.
    pub(crate) fn take_promotion(&mut self) -> Option<Tier> {
        let dst = self.promote_on_read.take()?;
        self.begin_move(dst, |_| true).map(|_| dst)
    }

    /// Takes the resident slot out of the entry for an NVMe read that
    /// carries it (the page lock held until the read completes); the page
    /// reads as [`Lost`] meanwhile. `None` when it is not resident.
    pub(crate) fn take_for_read(&mut self) -> Option<(Begun, S)> {
        let begun = Begun {
            src: self.tier()?,
            version: self.version,
        };
        let Resident { slot, .. } = std::mem::replace(&mut self.loc, Lost) else {
            unreachable!("checked resident")
        };
        Some((begun, slot))
    }

    /// Puts back the slot taken by [`take_for_read`](Self::take_for_read):
    /// the move did not happen. The next step is a [`commit`](Self::commit)
    /// of the new copy, or nothing.
    pub(crate) fn put_back(&mut self, begun: Begun, slot: S) {
        debug_assert!(matches!(self.loc, Lost), "put back onto a slot");
        self.loc = Resident {
            tier: begun.src,
            slot,
        };
    }

    /// Adds a pin: the page stays in its slot until [`unpin`](Self::unpin).
    /// With `writable`, whoever holds the address may write through it: a
    /// move that copied the page before this pin must not commit, and the
    /// clean copy comes back for the caller to free (a read-only pin keeps
    /// both: the bytes do not change). True for the page's first pin.
    pub(crate) fn pin(&mut self, writable: bool) -> (bool, Option<(Tier, S)>) {
        one_more(&mut self.pins);
        let stale = if writable { self.note_write() } else { None };
        (self.pins == 1, stale)
    }

    /// Removes a pin; true when it was the last.
    pub(crate) fn unpin(&mut self) -> bool {
        debug_assert!(self.pins > 0, "unpin of an unpinned page");
        self.pins = self.pins.saturating_sub(1);
        self.pins == 0
    }

    /// Empties the entry (the buffer is freed): the slots it held.
    pub(crate) fn clear(&mut self) -> Freed<S> {
        let clean = self.note_write();
        self.promote_on_read = None;
        let old = match std::mem::replace(&mut self.loc, Zero) {
            Resident { tier, slot } => Some((tier, slot)),
            Zero | Lost => None,
        };
        Freed { old, clean }
    }
}

/// A page-table entry behind its lock, and where the page was when that
/// lock was last let go, readable without it ([`seen`](Self::seen)).
///
/// A batched NVMe read holds its pages' locks until its reads end, so a
/// caller that only wants to know where pages are (a buffer's residency,
/// a harvest, the balancer's scan) would wait out reads of pages that are
/// not its own. The seen state is written by every guard as it lets go,
/// so it is always the state some lock holder left: the page's state now,
/// or — while a move holds the lock — just before it began.
#[derive(Debug)]
pub(crate) struct Page<S = Slot> {
    entry: parking_lot::Mutex<Entry<S>>,
    seen: std::sync::atomic::AtomicU8,
}

/// [`Page::seen`]'s encoding: a tier's number, or one of these.
const SEEN_ZERO: u8 = 0;
const SEEN_LOST: u8 = 1;
const SEEN_TIER: u8 = 2;

impl<S> Default for Page<S> {
    fn default() -> Self {
        Self {
            entry: Default::default(),
            seen: std::sync::atomic::AtomicU8::new(SEEN_ZERO),
        }
    }
}

impl<S> Page<S> {
    /// Locks the entry; the guard records where the page is as it lets go.
    pub(crate) fn lock(&self) -> PageGuard<'_, S> {
        self.guard(self.entry.lock())
    }

    /// [`lock`](Self::lock) if no one holds it.
    pub(crate) fn try_lock(&self) -> Option<PageGuard<'_, S>> {
        self.entry.try_lock().map(|g| self.guard(g))
    }

    /// [`lock`](Self::lock), waiting at most `timeout`.
    pub(crate) fn try_lock_for(&self, timeout: std::time::Duration) -> Option<PageGuard<'_, S>> {
        self.entry.try_lock_for(timeout).map(|g| self.guard(g))
    }

    fn guard<'a>(&'a self, entry: parking_lot::MutexGuard<'a, Entry<S>>) -> PageGuard<'a, S> {
        PageGuard {
            entry,
            seen: &self.seen,
        }
    }

    /// Where the page was when its lock was last let go, without waiting
    /// for it: `Zero` (never written), `Resident` in a tier, or `Lost`.
    /// A move or read in flight shows as the state before it.
    pub(crate) fn seen(&self) -> Loc<()> {
        match self.seen.load(std::sync::atomic::Ordering::Acquire) {
            SEEN_ZERO => Zero,
            SEEN_LOST => Lost,
            n => Resident {
                tier: Tier::ALL[usize::from(n - SEEN_TIER)],
                slot: (),
            },
        }
    }

    /// The tier of [`seen`](Self::seen), if resident.
    pub(crate) fn seen_tier(&self) -> Option<Tier> {
        match self.seen() {
            Resident { tier, .. } => Some(tier),
            Zero | Lost => None,
        }
    }
}

/// A locked [`Page`]: the entry, and on letting go, where it left the page.
#[derive(Debug)]
pub(crate) struct PageGuard<'a, S = Slot> {
    entry: parking_lot::MutexGuard<'a, Entry<S>>,
    seen: &'a std::sync::atomic::AtomicU8,
}

impl<S> std::ops::Deref for PageGuard<'_, S> {
    type Target = Entry<S>;
    fn deref(&self) -> &Entry<S> {
        &self.entry
    }
}

impl<S> std::ops::DerefMut for PageGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut Entry<S> {
        &mut self.entry
    }
}

impl<S> Drop for PageGuard<'_, S> {
    fn drop(&mut self) {
        // Before the lock itself goes (fields drop after this): whoever
        // takes the lock next finds the seen state already written.
        let seen = match &self.entry.loc {
            Zero => SEEN_ZERO,
            Lost => SEEN_LOST,
            Resident { tier, .. } => SEEN_TIER + *tier as u8,
        };
        self.seen.store(seen, std::sync::atomic::Ordering::Release);
    }
}

/// The error of a read of a [`Lost`] page.
pub(crate) fn lost(p: usize) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("page {p} was lost: the i/o engine failed while the page was moving"),
    )
}

#[cfg(test)]
#[path = "page_tests.rs"]
mod tests;
