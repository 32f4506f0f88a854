//! Slots: fixed-size, page-aligned pieces of a store, handed out by an O(1)
//! thread-safe allocator as owned tokens.
//!
//! A [`Slot`] is neither `Copy` nor `Clone`: whoever holds it owns the bytes
//! behind it, so a store can hand out `&[u8]` for `&Slot` and `&mut [u8]` for
//! `&mut Slot` without data races, and a slot cannot be freed twice.
#![forbid(unsafe_code)]

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Ownership of one slot of one store. Return it with the store's `free`.
///
/// Only a [`SlotAllocator`] makes slots, each index once until it is freed,
/// and every allocator has a unique id: so holding a `Slot` (or `&mut Slot`)
/// is proof of exclusive access to its bytes.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a slot that is dropped instead of freed stays allocated"]
pub struct Slot {
    store: u64,
    index: u32,
}

impl Slot {
    /// The slot's index within its store (byte offset = index × page size).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The id of the store this slot belongs to.
    pub fn store_id(&self) -> u64 {
        self.store
    }
}

/// Free list plus a bump pointer, so creating a huge store costs nothing
/// until its slots are used.
#[derive(Debug)]
struct FreeList {
    never_used: u32,
    free: Vec<u32>,
    in_use: u32,
    /// Reserve slots taken by copy-then-commit writes still in progress:
    /// until the write ends one of the `in_use` slots is about to be given
    /// back, so `alloc` does not count it.
    borrowed: u32,
}

/// An O(1) allocator of `capacity` slot indices.
///
/// A mutex with a critical section of a few instructions: uncontended it
/// costs one atomic swap each way, which measures well under the 100 ns
/// budget (benches/slots.rs), and unlike a lock-free stack it has no ABA
/// problem to defend against.
///
/// A `reserve` of slots can be held back from [`SlotAllocator::alloc`] for
/// [`SlotAllocator::alloc_reserve`], so that a full store can still write a
/// page's new copy before it frees the old one.
#[derive(Debug)]
pub struct SlotAllocator {
    store: u64,
    capacity: u32,
    reserve: u32,
    list: Mutex<FreeList>,
}

impl SlotAllocator {
    /// An allocator of `capacity` slots with a fresh store id.
    pub fn new(capacity: u32) -> Self {
        Self::with_reserve(capacity, 0)
    }

    /// An allocator of `capacity` slots, `reserve` of which only
    /// [`SlotAllocator::alloc_reserve`] hands out.
    pub fn with_reserve(capacity: u32, reserve: u32) -> Self {
        Self {
            // Minted here: no caller can make a second allocator with an
            // existing store's id and forge slots of that store.
            store: crate::sys::next_id(),
            capacity,
            reserve: reserve.min(capacity),
            list: Mutex::new(FreeList {
                never_used: 0,
                free: Vec::new(),
                in_use: 0,
                borrowed: 0,
            }),
        }
    }

    /// Takes a free slot, or `None` when all but the reserve are in use.
    pub fn alloc(&self) -> Option<Slot> {
        let mut list = self.list.lock();
        if list.in_use - list.borrowed >= self.capacity - self.reserve {
            return None;
        }
        Some(self.take(&mut list))
    }

    /// Takes a free slot, the reserve included, for a copy-then-commit
    /// write (`None` while `reserve` such writes are in progress, or with no
    /// free slot at all): the write ends with [`SlotAllocator::end_borrow`], which frees
    /// either the new slot (the write failed) or the old one (it committed).
    /// Meanwhile `alloc` does not count the extra slot, so the write never
    /// makes an allocation fail.
    pub fn alloc_reserve(&self) -> Option<Slot> {
        let mut list = self.list.lock();
        // At most `reserve` writes borrow at once, so ordinary slots plus
        // borrowed ones never exceed the capacity.
        if list.borrowed >= self.reserve || list.in_use >= self.capacity {
            return None;
        }
        list.borrowed += 1;
        Some(self.take(&mut list))
    }

    /// Ends a copy-then-commit write begun with `alloc_reserve`, freeing
    /// `slot` (the old copy or the failed new one) in the same step.
    /// Refused, the slot handed back, when no write is in progress.
    pub fn end_borrow(&self, slot: Slot) -> Result<(), (Error, Slot)> {
        if let Err(e) = self.check(&slot) {
            return Err((e, slot));
        }
        let mut list = self.list.lock();
        if list.borrowed == 0 {
            return Err((no_borrow(), slot));
        }
        list.free.push(slot.index);
        list.in_use -= 1;
        list.borrowed -= 1;
        Ok(())
    }

    /// Ends a copy-then-commit write begun with `alloc_reserve` without
    /// freeing `slot` (the old copy or the failed new one), which a write
    /// that may still land keeps out of use for good: it stays allocated as
    /// an ordinary slot, and the reserve is whole again.
    pub fn end_borrow_keeping(&self, slot: Slot) -> Result<(), (Error, Slot)> {
        if let Err(e) = self.check(&slot) {
            return Err((e, slot));
        }
        let mut list = self.list.lock();
        if list.borrowed == 0 {
            return Err((no_borrow(), slot));
        }
        list.borrowed -= 1;
        Ok(())
    }

    fn take(&self, list: &mut FreeList) -> Slot {
        let index = match list.free.pop() {
            Some(i) => i,
            None => {
                list.never_used += 1;
                list.never_used - 1
            }
        };
        list.in_use += 1;
        Slot {
            store: self.store,
            index,
        }
    }

    /// Returns a slot. A slot of another store is refused and handed back,
    /// and so is one that can only be a write's reserve slot (every slot in
    /// use is one): [`SlotAllocator::end_borrow`] ends a write.
    pub fn free(&self, slot: Slot) -> Result<(), (Error, Slot)> {
        if slot.store != self.store || slot.index >= self.capacity {
            return Err((
                Error::invalid(format!(
                    "slot {} belongs to store {}, not to store {}",
                    slot.index, slot.store, self.store
                )),
                slot,
            ));
        }
        let mut list = self.list.lock();
        // With every slot in use held by a write, this one is a write's:
        // freed here, `in_use` would drop below `borrowed`, and `alloc`'s
        // count of ordinary slots would wrap.
        if list.in_use == list.borrowed {
            return Err((
                Error::invalid(format!(
                    "slot {} is held by a copy-then-commit write: end it with end_borrow",
                    slot.index
                )),
                slot,
            ));
        }
        list.free.push(slot.index);
        list.in_use -= 1;
        Ok(())
    }

    /// Checks that `slot` was handed out by this allocator.
    pub fn check(&self, slot: &Slot) -> Result<()> {
        if slot.store == self.store && slot.index < self.capacity {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "slot {} of store {} used with store {}",
                slot.index, slot.store, self.store
            )))
        }
    }

    /// Number of slots [`SlotAllocator::alloc`] can hand out (the reserve
    /// excluded).
    pub fn capacity(&self) -> u32 {
        self.capacity - self.reserve
    }

    /// Number of slots, the reserve included.
    pub fn total(&self) -> u32 {
        self.capacity
    }

    /// Slots currently allocated.
    pub fn used(&self) -> u32 {
        self.list.lock().in_use
    }

    /// Slots allocated, less those held by copy-then-commit writes in
    /// progress (see [`SlotAllocator::alloc_reserve`]).
    pub fn used_ordinary(&self) -> u32 {
        let list = self.list.lock();
        list.in_use - list.borrowed
    }

    /// The store id slots of this allocator carry.
    pub fn store_id(&self) -> u64 {
        self.store
    }
}

/// `end_borrow` with no write in progress: ending it would wrap the count
/// of borrows, and with it `alloc`'s count of ordinary slots.
fn no_borrow() -> Error {
    Error::invalid(
        "no copy-then-commit write is in progress (no slot was taken with alloc_reserve)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn hands_out_each_slot_once() {
        let a = SlotAllocator::new(100);
        let slots: Vec<Slot> = (0..100).map(|_| a.alloc().unwrap()).collect();
        assert!(a.alloc().is_none());
        let distinct: HashSet<u32> = slots.iter().map(|s| s.index()).collect();
        assert_eq!(distinct.len(), 100);
        assert_eq!(a.used(), 100);
        for s in slots {
            a.free(s).unwrap();
        }
        assert_eq!(a.used(), 0);
        assert!(a.alloc().is_some());
    }

    #[test]
    fn refuses_foreign_slots() {
        let a = SlotAllocator::new(4);
        let b = SlotAllocator::new(4);
        assert_ne!(a.store_id(), b.store_id());
        let s = b.alloc().unwrap();
        let (err, s) = a.free(s).unwrap_err();
        assert!(err
            .message()
            .contains(&format!("belongs to store {}", b.store_id())));
        assert!(a.check(&s).is_err());
        b.free(s).unwrap();
    }

    #[test]
    fn reserve_is_only_for_alloc_reserve() {
        let a = SlotAllocator::with_reserve(3, 1);
        assert_eq!(a.capacity(), 2);
        let s1 = a.alloc().unwrap();
        let s2 = a.alloc().unwrap();
        assert!(a.alloc().is_none());
        let s3 = a.alloc_reserve().unwrap();
        assert!(a.alloc_reserve().is_none());
        // A copy-then-commit write of s1's page into s3 commits: s1 goes
        // back and the reserve is whole again.
        a.end_borrow(s1).unwrap();
        assert_eq!(a.used(), 2);
        assert!(a.alloc().is_none(), "two in use, one held in reserve");
        assert!(a.alloc_reserve().is_some_and(|s| a.end_borrow(s).is_ok()));
        for s in [s2, s3] {
            a.free(s).unwrap();
        }
        assert_eq!(a.used(), 0);
        // While a write holds a reserve slot, an allocation still finds the
        // slot its page will give back.
        let b = SlotAllocator::with_reserve(3, 1);
        let old = b.alloc().unwrap();
        let new = b.alloc_reserve().unwrap();
        let other = b.alloc().expect("the write does not take an ordinary slot");
        b.end_borrow(old).unwrap();
        for s in [new, other] {
            b.free(s).unwrap();
        }
    }

    #[test]
    fn misplaced_ends_of_borrows_are_refused() {
        let a = SlotAllocator::with_reserve(3, 1);
        // No copy-then-commit write is in progress: nothing to end.
        let s = a.alloc().unwrap();
        let (e, s) = a.end_borrow(s).unwrap_err();
        assert!(e.message().contains("no copy-then-commit write"), "{e}");
        let (_, s) = a.end_borrow_keeping(s).unwrap_err();
        assert_eq!((a.used(), a.used_ordinary()), (1, 1));
        a.free(s).unwrap();
        // A write's reserve slot, the only slot in use, given back with
        // `free` instead of `end_borrow`.
        let r = a.alloc_reserve().unwrap();
        let (e, r) = a.free(r).unwrap_err();
        assert!(e.message().contains("end_borrow"), "{e}");
        assert_eq!((a.used(), a.used_ordinary()), (1, 0));
        a.end_borrow(r).unwrap();
        assert_eq!((a.used(), a.used_ordinary()), (0, 0));
        // Whole again: two ordinary slots and the reserve.
        let held: Vec<Slot> = (0..2).map(|_| a.alloc().unwrap()).collect();
        assert!(a.alloc().is_none());
        let r = a.alloc_reserve().unwrap();
        a.end_borrow(r).unwrap();
        for s in held {
            a.free(s).unwrap();
        }
    }

    #[test]
    fn concurrent_alloc_free_never_duplicates() {
        // Each thread holds up to 4 slots at a time, long enough for the
        // others to run, and records what it holds in a shared set: a slot
        // handed out twice would be inserted twice.
        let a = std::sync::Arc::new(SlotAllocator::new(12));
        let owned = std::sync::Arc::new(Mutex::new(HashSet::new()));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let a = a.clone();
                let owned = owned.clone();
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..3000 {
                        if (i + t) % 3 != 0 {
                            if let Some(s) = a.alloc() {
                                assert!(owned.lock().insert(s.index()), "slot handed out twice");
                                held.push(s);
                            }
                        }
                        if held.len() > 3 || (i + t) % 3 == 0 {
                            if let Some(s) = held.pop() {
                                owned.lock().remove(&s.index());
                                a.free(s).unwrap();
                            }
                        }
                        std::thread::yield_now();
                    }
                    for s in held {
                        owned.lock().remove(&s.index());
                        a.free(s).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(a.used(), 0);
    }
}
