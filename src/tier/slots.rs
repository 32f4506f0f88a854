//! Slots: fixed-size, page-aligned pieces of a store, handed out by an O(1)
//! thread-safe allocator as owned tokens.
//!
//! A [`Slot`] is neither `Copy` nor `Clone`: whoever holds it owns the bytes
//! behind it, so a store can hand out `&[u8]` for `&Slot` and `&mut [u8]` for
//! `&mut Slot` without data races, and a slot cannot be freed twice.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};

static NEXT_STORE_ID: AtomicU32 = AtomicU32::new(1);

/// A unique id for a store, so a slot can't be used with the wrong store.
pub(crate) fn next_store_id() -> u32 {
    NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed)
}

/// Ownership of one slot of one store. Return it with the store's `free`.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a slot that is dropped instead of freed stays allocated"]
pub struct Slot {
    store: u32,
    index: u32,
}

impl Slot {
    /// The slot's index within its store (byte offset = index × page size).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The id of the store this slot belongs to.
    pub fn store_id(&self) -> u32 {
        self.store
    }
}

/// Free list plus a bump pointer, so creating a huge store costs nothing
/// until its slots are used.
#[derive(Debug)]
struct FreeList {
    never_used: u32,
    free: Vec<u32>,
}

/// An O(1) allocator of `capacity` slot indices.
///
/// A mutex with a critical section of a few instructions: uncontended it
/// costs one atomic swap each way, which measures well under the 100 ns
/// budget (benches/slots.rs), and unlike a lock-free stack it has no ABA
/// problem to defend against.
#[derive(Debug)]
pub struct SlotAllocator {
    store: u32,
    capacity: u32,
    list: Mutex<FreeList>,
    used: AtomicU32,
}

impl SlotAllocator {
    /// An allocator of `capacity` slots for the store `store`.
    pub fn new(store: u32, capacity: u32) -> Self {
        Self {
            store,
            capacity,
            list: Mutex::new(FreeList {
                never_used: 0,
                free: Vec::new(),
            }),
            used: AtomicU32::new(0),
        }
    }

    /// Takes a free slot, or `None` when all are in use.
    pub fn alloc(&self) -> Option<Slot> {
        let index = {
            let mut list = self.list.lock();
            match list.free.pop() {
                Some(i) => i,
                None if list.never_used < self.capacity => {
                    list.never_used += 1;
                    list.never_used - 1
                }
                None => return None,
            }
        };
        self.used.fetch_add(1, Ordering::Relaxed);
        Some(Slot {
            store: self.store,
            index,
        })
    }

    /// Returns a slot. A slot of another store is refused and handed back.
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
        self.list.lock().free.push(slot.index);
        self.used.fetch_sub(1, Ordering::Relaxed);
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

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Slots currently allocated.
    pub fn used(&self) -> u32 {
        self.used.load(Ordering::Relaxed)
    }

    /// The store id slots of this allocator carry.
    pub fn store_id(&self) -> u32 {
        self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn hands_out_each_slot_once() {
        let a = SlotAllocator::new(7, 100);
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
        let a = SlotAllocator::new(1, 4);
        let b = SlotAllocator::new(2, 4);
        let s = b.alloc().unwrap();
        let (err, s) = a.free(s).unwrap_err();
        assert!(err.message().contains("belongs to store 2"));
        assert!(a.check(&s).is_err());
        b.free(s).unwrap();
    }

    #[test]
    fn concurrent_alloc_free_never_duplicates() {
        let a = std::sync::Arc::new(SlotAllocator::new(3, 64));
        let owned = std::sync::Arc::new(Mutex::new(HashSet::new()));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let a = a.clone();
                let owned = owned.clone();
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        if let Some(s) = a.alloc() {
                            assert!(owned.lock().insert(s.index()), "slot handed out twice");
                            owned.lock().remove(&s.index());
                            a.free(s).unwrap();
                        }
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
