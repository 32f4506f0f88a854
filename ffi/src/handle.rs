//! Handle tables: what C holds is 64 bits — a type tag, a generation and a
//! slot index — never a pointer to Rust memory. A lookup checks all three,
//! so a freed, forged or mistyped handle is an error
//! (`STRATA_ERR_INVALID_HANDLE`), never undefined behaviour; a handle whose
//! runtime was destroyed (and a destroyed runtime's own) is
//! `STRATA_ERR_CLOSED`.
//!
//! Each slot remembers which of its last [`HISTORY`] objects were closed
//! rather than freed, and a freed slot is reused only once [`HELD_BACK`]
//! others are free too (oldest first; the table grows meanwhile), so that a
//! closed handle keeps reading `STRATA_ERR_CLOSED` until about
//! `HISTORY × HELD_BACK` (65,536) later objects of its type have come and
//! gone (then it reads `STRATA_ERR_INVALID_HANDLE`, like any stale handle:
//! either way it is refused).
//!
//! Lookups clone an `Arc` under a read lock and run the call unlocked, so a
//! blocking call (a ticket wait, an NVMe read) never holds the table, and an
//! object freed by one thread while another uses it lives until that call
//! ends.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{const_rwlock, RwLock};

use crate::status::{
    Fail, R, STRATA_ERR_CLOSED, STRATA_ERR_INVALID_HANDLE, STRATA_ERR_OUT_OF_CAPACITY,
};

const INDEX_BITS: u32 = 24;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
const TAG_SHIFT: u32 = 56;
/// How many past objects of a slot it remembers as closed or freed.
pub(crate) const HISTORY: u32 = 64;
/// Free slots held back before the oldest is reused.
pub(crate) const HELD_BACK: usize = 1024;
/// The tag of runtime handles (whose closed message differs).
pub(crate) const RUNTIME_TAG: u8 = 1;

/// The owner of objects created through a runtime, for sweeping them when
/// the runtime is destroyed. Every runtime gets a fresh one.
pub(crate) type Owner = u64;

struct Slot<T> {
    /// The generation of the live object, or of the next one once freed.
    generation: u32,
    /// Bit `i`: the object of generation `generation - 1 - i` was closed
    /// (removed by its runtime's destruction, or a runtime destroyed), so
    /// that its handle reads `STRATA_ERR_CLOSED`; clear: freed.
    closed: u64,
    live: Option<(Arc<T>, Owner)>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    /// Free slots, reused oldest first.
    free: VecDeque<u32>,
}

/// One table per handle type.
pub(crate) struct Handles<T> {
    tag: u8,
    name: &'static str,
    /// [`HELD_BACK`], or fewer in tests of the reuse itself.
    held_back: usize,
    slots: RwLock<Slots<T>>,
}

fn decode(bits: u64) -> (u8, u32, usize) {
    (
        (bits >> TAG_SHIFT) as u8,
        (bits >> INDEX_BITS) as u32,
        (bits & INDEX_MASK) as usize,
    )
}

fn encode(tag: u8, generation: u32, index: usize) -> u64 {
    (tag as u64) << TAG_SHIFT | (generation as u64) << INDEX_BITS | index as u64
}

impl<T> Handles<T> {
    pub(crate) const fn new(tag: u8, name: &'static str) -> Self {
        Self::with_held_back(tag, name, HELD_BACK)
    }

    const fn with_held_back(tag: u8, name: &'static str, held_back: usize) -> Self {
        Self {
            tag,
            name,
            held_back,
            slots: const_rwlock(Slots {
                slots: Vec::new(),
                free: VecDeque::new(),
            }),
        }
    }

    /// The object behind a handle.
    #[inline]
    pub(crate) fn get(&self, bits: u64) -> R<Arc<T>> {
        let (tag, generation, index) = decode(bits);
        if tag == self.tag {
            let slots = self.slots.read();
            if let Some(Slot {
                generation: g,
                live: Some((obj, _)),
                ..
            }) = slots.slots.get(index)
            {
                if *g == generation {
                    return Ok(obj.clone());
                }
            }
        }
        Err(self.not_live(bits))
    }

    /// Runs `f` on the object behind a handle under the table's read lock,
    /// without taking a reference (two atomic operations fewer than
    /// [`get`](Self::get)). Only for calls that never block: a writer (an
    /// alloc or a free of this type) waits until `f` returns.
    #[inline]
    pub(crate) fn with<U>(&self, bits: u64, f: impl FnOnce(&T) -> U) -> R<U> {
        let (tag, generation, index) = decode(bits);
        if tag == self.tag {
            let slots = self.slots.read();
            if let Some(Slot {
                generation: g,
                live: Some((obj, _)),
                ..
            }) = slots.slots.get(index)
            {
                if *g == generation {
                    return Ok(f(obj));
                }
            }
        }
        Err(self.not_live(bits))
    }

    #[cold]
    fn not_live(&self, bits: u64) -> Fail {
        let name = self.name;
        if bits == 0 {
            return Fail::null(&format!("the {name} handle"));
        }
        let (tag, generation, index) = decode(bits);
        if tag == self.tag {
            let slots = self.slots.read();
            if let Some(slot) = slots.slots.get(index) {
                if generation < slot.generation {
                    let age = slot.generation - generation - 1;
                    if age < HISTORY && slot.closed >> age & 1 == 1 {
                        let what = if self.tag == RUNTIME_TAG {
                            "it was destroyed"
                        } else {
                            "its runtime was destroyed"
                        };
                        return Fail::new(
                            STRATA_ERR_CLOSED,
                            format!("the {name} handle {bits:#x} is closed: {what}"),
                        );
                    }
                }
                if generation < slot.generation || slot.live.is_none() {
                    return Fail::new(
                        STRATA_ERR_INVALID_HANDLE,
                        format!("the {name} handle {bits:#x} was freed"),
                    );
                }
            }
        }
        Fail::new(
            STRATA_ERR_INVALID_HANDLE,
            format!("{bits:#x} is not a live {name} handle"),
        )
    }

    /// Registers an object; returns its handle's bits.
    pub(crate) fn insert(&self, obj: T, owner: Owner) -> R<u64> {
        let obj = Arc::new(obj);
        let mut s = self.slots.write();
        let reuse = if s.free.len() > self.held_back {
            s.free.pop_front()
        } else {
            None
        };
        let index = match reuse.or_else(|| {
            // The table is full: reuse what there is.
            (s.slots.len() as u64 > INDEX_MASK)
                .then(|| s.free.pop_front())
                .flatten()
        }) {
            Some(i) => i as usize,
            None => {
                if s.slots.len() as u64 > INDEX_MASK {
                    return Err(Fail::new(
                        STRATA_ERR_OUT_OF_CAPACITY,
                        format!(
                            "{} {} handles are live: free some first",
                            INDEX_MASK + 1,
                            self.name
                        ),
                    ));
                }
                s.slots.push(Slot {
                    generation: 1,
                    closed: 0,
                    live: None,
                });
                s.slots.len() - 1
            }
        };
        let slot = &mut s.slots[index];
        slot.live = Some((obj, owner));
        Ok(encode(self.tag, slot.generation, index))
    }

    fn vacate(slots: &mut Slots<T>, index: usize, closed: bool) -> Option<Arc<T>> {
        let slot = &mut slots.slots[index];
        let (obj, _) = slot.live.take()?;
        slot.closed = slot.closed << 1 | u64::from(closed);
        slot.generation = match slot.generation.wrapping_add(1) {
            0 => 1,
            g => g,
        };
        slots.free.push_back(index as u32);
        Some(obj)
    }

    /// Removes an object: `None` for the NULL handle (freeing NULL is a
    /// no-op). The caller drops the object after the table is unlocked.
    pub(crate) fn remove(&self, bits: u64) -> R<Option<Arc<T>>> {
        self.take(bits, false)
    }

    /// As [`remove`](Self::remove), but the handle reads
    /// `STRATA_ERR_CLOSED` from now on (a destroyed runtime's).
    pub(crate) fn close(&self, bits: u64) -> R<Option<Arc<T>>> {
        self.take(bits, true)
    }

    fn take(&self, bits: u64, closed: bool) -> R<Option<Arc<T>>> {
        if bits == 0 {
            return Ok(None);
        }
        let (tag, generation, index) = decode(bits);
        if tag == self.tag {
            let mut s = self.slots.write();
            if s.slots
                .get(index)
                .is_some_and(|slot| slot.generation == generation)
            {
                if let Some(obj) = Self::vacate(&mut s, index, closed) {
                    return Ok(Some(obj));
                }
            }
        }
        Err(self.not_live(bits))
    }

    /// Removes every object of `owner` (its runtime is being destroyed);
    /// their handles read `STRATA_ERR_CLOSED` from now on (for as long as
    /// their slot remembers them: see the module's comment).
    pub(crate) fn sweep(&self, owner: Owner) -> Vec<Arc<T>> {
        let mut s = self.slots.write();
        let mine: Vec<usize> = s
            .slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| matches!(&slot.live, Some((_, o)) if *o == owner))
            .map(|(i, _)| i)
            .collect();
        mine.into_iter()
            .filter_map(|i| Self::vacate(&mut s, i, true))
            .collect()
    }

    /// Live objects (for tests).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.slots
            .read()
            .slots
            .iter()
            .filter(|s| s.live.is_some())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_forged_and_closed_handles_are_told_apart() {
        let t: Handles<u32> = Handles::new(7, "thing");
        let a = t.insert(1, 10).unwrap();
        assert_eq!(*t.get(a).unwrap(), 1);
        assert_eq!(
            t.get(0).unwrap_err().status,
            crate::status::STRATA_ERR_NULL_POINTER
        );
        assert_eq!(
            t.get(a ^ 1 << 60).unwrap_err().status,
            STRATA_ERR_INVALID_HANDLE
        );
        assert_eq!(t.get(a + 1).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
        assert!(t.remove(a).unwrap().is_some());
        let e = t.get(a).unwrap_err();
        assert_eq!(e.status, STRATA_ERR_INVALID_HANDLE);
        assert!(e.message.contains("freed"), "{}", e.message);
        assert_eq!(t.remove(a).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
        assert!(t.remove(0).unwrap().is_none());
        // The slot is reused under a new generation; the old handle stays dead.
        let b = t.insert(2, 11).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.get(a).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
        let c = t.insert(3, 10).unwrap();
        assert_eq!(t.sweep(10).len(), 1);
        assert_eq!(t.get(c).unwrap_err().status, STRATA_ERR_CLOSED);
        assert_eq!(*t.get(b).unwrap(), 2);
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn freed_slots_are_held_back_before_reuse() {
        let t: Handles<u32> = Handles::new(7, "thing");
        let first = t.insert(0, 1).unwrap();
        assert!(t.remove(first).unwrap().is_some());
        for i in 0..HELD_BACK as u32 {
            let x = t.insert(i, 1).unwrap();
            assert_ne!(x & INDEX_MASK, first & INDEX_MASK, "reused after {i}");
            assert!(t.remove(x).unwrap().is_some());
        }
        // With HELD_BACK + 1 free, the oldest (the first) comes back.
        let again = t.insert(9, 1).unwrap();
        assert_eq!(again & INDEX_MASK, first & INDEX_MASK);
        assert_eq!(t.get(first).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
    }

    #[test]
    fn a_closed_handle_stays_closed_while_its_slot_is_reused() {
        let t: Handles<u32> = Handles::with_held_back(7, "thing", 0);
        let a = t.insert(1, 10).unwrap();
        assert_eq!(t.sweep(10).len(), 1);
        // `close` is `remove` that leaves the handle closed; twice is closed.
        let r = t.insert(2, 0).unwrap();
        assert!(t.close(r).unwrap().is_some());
        assert_eq!(t.close(r).unwrap_err().status, STRATA_ERR_CLOSED);
        // Later objects in the same slots, closed or freed, do not make the
        // first handles forget, for HISTORY - 2 more reuses of each slot.
        let mut freed = Vec::new();
        for i in 0..HISTORY - 2 {
            let x = t.insert(i, 11).unwrap();
            let y = t.insert(i, 12).unwrap();
            assert!(t.remove(x).unwrap().is_some());
            assert_eq!(t.sweep(12).len(), 1);
            assert_eq!(t.get(y).unwrap_err().status, STRATA_ERR_CLOSED);
            freed.push(x);
        }
        assert_eq!(t.get(a).unwrap_err().status, STRATA_ERR_CLOSED);
        assert_eq!(t.get(r).unwrap_err().status, STRATA_ERR_CLOSED);
        for x in freed {
            assert_eq!(t.get(x).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
        }
        // Then they read as any stale handle.
        for i in 0..4 {
            let x = t.insert(i, 11).unwrap();
            assert!(t.remove(x).unwrap().is_some());
        }
        assert_eq!(t.get(a).unwrap_err().status, STRATA_ERR_INVALID_HANDLE);
    }
}

/// Freed blocks (strings, DLPack tensors) held back: the last
/// [`HELD_FREED`] of a kind, at most [`HELD_FREED_BYTES`] in all.
pub(crate) const HELD_FREED: usize = 256;
/// See [`HELD_FREED`].
pub(crate) const HELD_FREED_BYTES: usize = 4 << 20;

/// Memory C freed (a string, a DLPack tensor), held back before it goes
/// to the allocator, as the handle tables hold back their slots: while a
/// block is held no new string or tensor can take its address, so a second
/// free of the old pointer finds it unregistered and is refused, rather
/// than freeing what then lives there. The oldest block is let go once
/// [`HELD_FREED`] are held or they pass [`HELD_FREED_BYTES`].
pub(crate) struct Quarantine<T> {
    held: VecDeque<(T, usize)>,
    bytes: usize,
}

impl<T> Quarantine<T> {
    pub(crate) const fn new() -> Self {
        Self {
            held: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Holds `block` (`bytes` long); returns the blocks let go, for the
    /// caller to free (outside its lock).
    #[must_use]
    pub(crate) fn hold(&mut self, block: T, bytes: usize) -> Vec<T> {
        self.held.push_back((block, bytes));
        self.bytes += bytes;
        let mut out = Vec::new();
        while self.held.len() > HELD_FREED || (self.bytes > HELD_FREED_BYTES && self.held.len() > 1)
        {
            let (b, n) = self.held.pop_front().expect("not empty");
            self.bytes -= n;
            out.push(b);
        }
        out
    }
}

#[cfg(test)]
mod quarantine_tests {
    use super::*;

    #[test]
    fn the_oldest_blocks_go_first_by_count_and_by_bytes() {
        let mut q = Quarantine::new();
        for i in 0..HELD_FREED {
            assert!(q.hold(i, 1).is_empty());
        }
        assert_eq!(q.hold(HELD_FREED, 1), vec![0]);
        // A block past the byte bound lets the others go, never itself.
        let gone = q.hold(usize::MAX, HELD_FREED_BYTES + 1);
        assert_eq!(gone.len(), HELD_FREED);
        assert_eq!(gone[0], 1);
        assert_eq!(q.held.len(), 1);
        assert_eq!(q.hold(7, 1), vec![usize::MAX]);
    }
}
