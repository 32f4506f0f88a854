//! Intrusive doubly linked lists over one node arena: O(1) push, remove and
//! move without an allocation per operation. Several lists (a window and the
//! two segments of a segmented LRU) may share one arena, so a node moves
//! between them by index.

#![forbid(unsafe_code)]

/// "No node": the end of a list.
pub(crate) const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Node {
    prev: u32,
    next: u32,
    /// The page (or group) the node stands for.
    pub key: u64,
    /// A small tag the owner uses (which list, a flag).
    pub tag: u8,
}

/// Nodes of every list of one policy, with a free list for reuse.
#[derive(Default, Debug)]
pub(crate) struct Arena {
    nodes: Vec<Node>,
    free: Vec<u32>,
}

impl Arena {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            nodes: Vec::with_capacity(n),
            free: Vec::new(),
        }
    }

    /// A new unlinked node.
    pub fn alloc(&mut self, key: u64, tag: u8) -> u32 {
        let node = Node {
            prev: NIL,
            next: NIL,
            key,
            tag,
        };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                let i = u32::try_from(self.nodes.len()).expect("fewer than 2^32 nodes");
                assert!(i != NIL, "fewer than 2^32 - 1 nodes");
                self.nodes.push(node);
                i
            }
        }
    }

    /// Returns an unlinked node to the free list.
    pub fn release(&mut self, i: u32) {
        self.free.push(i);
    }

    pub fn get(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    pub fn get_mut(&mut self, i: u32) -> &mut Node {
        &mut self.nodes[i as usize]
    }
}

/// One list: most recent at the head, least recent at the tail.
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    pub fn len(&self) -> usize {
        self.len
    }

    /// The least recent node.
    pub fn back(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The node after `i` towards the tail.
    #[cfg(test)]
    pub fn next_of(arena: &Arena, i: u32) -> Option<u32> {
        let n = arena.get(i).next;
        (n != NIL).then_some(n)
    }

    /// The node before `i` towards the head.
    pub fn prev_of(arena: &Arena, i: u32) -> Option<u32> {
        let p = arena.get(i).prev;
        (p != NIL).then_some(p)
    }

    /// The most recent node.
    #[cfg(test)]
    pub fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Links an unlinked node at the head.
    pub fn push_front(&mut self, arena: &mut Arena, i: u32) {
        let old = self.head;
        {
            let n = arena.get_mut(i);
            n.prev = NIL;
            n.next = old;
        }
        if old != NIL {
            arena.get_mut(old).prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Unlinks a node of this list.
    pub fn remove(&mut self, arena: &mut Arena, i: u32) {
        let Node { prev, next, .. } = *arena.get(i);
        if prev != NIL {
            arena.get_mut(prev).next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            arena.get_mut(next).prev = prev;
        } else {
            self.tail = prev;
        }
        let n = arena.get_mut(i);
        n.prev = NIL;
        n.next = NIL;
        self.len -= 1;
    }

    /// Moves a node of this list to the head.
    pub fn move_to_front(&mut self, arena: &mut Arena, i: u32) {
        if self.head != i {
            self.remove(arena, i);
            self.push_front(arena, i);
        }
    }

    /// Unlinks and returns the least recent node.
    pub fn pop_back(&mut self, arena: &mut Arena) -> Option<u32> {
        let t = self.back()?;
        self.remove(arena, t);
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(l: &List, a: &Arena) -> Vec<u64> {
        let mut v = Vec::new();
        let mut i = l.front();
        while let Some(n) = i {
            v.push(a.get(n).key);
            i = List::next_of(a, n);
        }
        v
    }

    #[test]
    fn push_move_remove_pop() {
        let mut a = Arena::default();
        let mut l = List::default();
        let n: Vec<u32> = (0..4).map(|k| a.alloc(k, 0)).collect();
        for &i in &n {
            l.push_front(&mut a, i);
        }
        assert_eq!(keys(&l, &a), [3, 2, 1, 0]);
        l.move_to_front(&mut a, n[1]);
        assert_eq!(keys(&l, &a), [1, 3, 2, 0]);
        l.remove(&mut a, n[2]);
        assert_eq!(keys(&l, &a), [1, 3, 0]);
        assert_eq!(l.pop_back(&mut a), Some(n[0]));
        assert_eq!(l.len(), 2);
        a.release(n[0]);
        assert_eq!(a.alloc(9, 1), n[0]);
        assert_eq!(List::prev_of(&a, n[3]), Some(n[1]));
    }
}
