//! Owned, aligned buffers: what the I/O engines take and hand back, so that
//! memory an in-flight operation points at can never be freed or reused
//! before the operation completes.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::sys::Arena;

/// Alignment of every [`AlignedBuf`]: the 4 KiB that O_DIRECT needs.
pub const IO_ALIGN: usize = 4096;

/// A zero-initialised buffer aligned to [`IO_ALIGN`]: from the heap, or
/// one of a [`BufPool`]'s buffers (which io_uring can use as a registered
/// buffer, saving the kernel from pinning its pages on every operation).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    home: Option<(Arc<BufPool>, u32)>,
    /// For memory lent by its owner (see [`AlignedBuf::lent`]): the owner's
    /// token, handed back by [`AlignedBuf::into_lender`]. Such a buffer
    /// frees nothing.
    lender: Option<Option<Box<dyn std::any::Any + Send + Sync>>>,
}

// SAFETY: the buffer owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]`, like a `Vec<u8>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; `len` must be a non-zero multiple of
    /// [`IO_ALIGN`].
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 || len % IO_ALIGN != 0 {
            return Err(Error::invalid(format!(
                "i/o buffer length {len} is not a non-zero multiple of {IO_ALIGN}"
            )));
        }
        let layout = Layout::from_size_align(len, IO_ALIGN)
            .map_err(|_| Error::invalid(format!("i/o buffer length {len} is too large")))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::new(
                crate::error::ErrorKind::OutOfCapacity,
                format!("allocating a {len}-byte i/o buffer failed"),
            )
        })?;
        Ok(Self {
            ptr,
            len,
            home: None,
            lender: None,
        })
    }

    /// A buffer over memory someone else owns (a host slot a read should
    /// land in directly), with `token` proving the loan (e.g. the slot).
    ///
    /// # Safety
    /// `ptr..ptr+len` is valid for reads and writes, aligned to
    /// [`IO_ALIGN`] with `len` a non-zero multiple of it, and used by nothing
    /// else until the buffer is dropped or [`into_lender`](Self::into_lender)
    /// returns the token.
    pub unsafe fn lent(
        ptr: NonNull<u8>,
        len: usize,
        token: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        debug_assert!(len > 0 && len % IO_ALIGN == 0 && ptr.as_ptr() as usize % IO_ALIGN == 0);
        Self {
            ptr,
            len,
            home: None,
            lender: Some(Some(token)),
        }
    }

    /// Whether the memory is lent (see [`AlignedBuf::lent`]).
    pub fn is_lent(&self) -> bool {
        self.lender.is_some()
    }

    /// Ends a loan: the lender's token back (`None` for a buffer that was
    /// not lent).
    pub fn into_lender(mut self) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        self.lender.as_mut().and_then(Option::take)
    }

    /// For a pool buffer: the pool's id and the buffer's index in it.
    pub fn registered_index(&self) -> Option<(u64, u32)> {
        self.home.as_ref().map(|(pool, index)| (pool.id, *index))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (buffers are never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A raw pointer to the first byte, for engines. It stays valid and
    /// does not move for as long as the buffer lives, even when the
    /// `AlignedBuf` value itself is moved.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialised bytes
        // (zeroed at allocation) owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some((pool, index)) = self.home.take() {
            pool.free.lock().push(index);
            return;
        }
        if self.lender.is_some() {
            // Lent memory is its owner's; a token not handed back is
            // dropped (what it stood for stays allocated).
            return;
        }
        // SAFETY: a buffer without a pool was allocated in `new` with
        // exactly this layout (which was valid then, so it is valid now).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, IO_ALIGN),
            )
        }
    }
}

/// A fixed set of equal buffers in one pre-faulted arena, handed out as
/// [`AlignedBuf`]s that return themselves on drop. An io_uring queue given
/// the pool registers it once; operations on its buffers then skip the
/// per-operation page pinning (`READ_FIXED`/`WRITE_FIXED`).
pub struct BufPool {
    arena: Arena,
    buf_len: usize,
    count: u32,
    id: u64,
    free: Mutex<Vec<u32>>,
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufPool({} x {} bytes)", self.count, self.buf_len)
    }
}

impl BufPool {
    /// `count` buffers of `buf_len` bytes (a multiple of [`IO_ALIGN`]).
    pub fn new(buf_len: usize, count: u32) -> Result<Arc<Self>> {
        if buf_len == 0 || buf_len % IO_ALIGN != 0 || count == 0 {
            return Err(Error::invalid(format!(
                "buffer pool of {count} x {buf_len} bytes: need at least one buffer of a non-zero multiple of {IO_ALIGN}"
            )));
        }
        let total = buf_len
            .checked_mul(count as usize)
            .ok_or_else(|| Error::invalid("buffer pool is too large"))?;
        let arena = Arena::new(total, true, None)?;
        // SAFETY: the arena is `total` (or more) bytes of our own fresh,
        // writable mapping; nothing else refers to it yet. Writing faults
        // the pages in now rather than on first I/O.
        unsafe { std::ptr::write_bytes(arena.base().as_ptr(), 0, total) };
        Ok(Arc::new(Self {
            arena,
            buf_len,
            count,
            id: crate::sys::next_id(),
            free: Mutex::new((0..count).rev().collect()),
        }))
    }

    /// A free buffer, or `None` when all are out.
    pub fn take(self: &Arc<Self>) -> Option<AlignedBuf> {
        let index = self.free.lock().pop()?;
        // SAFETY: index < count, so the buffer lies inside the arena.
        let ptr = unsafe { self.arena.base().add(index as usize * self.buf_len) };
        Some(AlignedBuf {
            ptr,
            len: self.buf_len,
            home: Some((self.clone(), index)),
            lender: None,
        })
    }

    /// The pool's id (matches [`AlignedBuf::registered_index`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Start of each buffer, in index order, with the buffer length.
    pub fn buffers(&self) -> (Vec<NonNull<u8>>, usize) {
        let base = self.arena.base();
        let ptrs = (0..self.count as usize)
            // SAFETY: every index < count lies inside the arena.
            .map(|i| unsafe { base.add(i * self.buf_len) })
            .collect();
        (ptrs, self.buf_len)
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_checked() {
        let mut b = AlignedBuf::new(8192).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % IO_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[8191] = 7;
        assert_eq!(b[8191], 7);
        assert!(AlignedBuf::new(0).is_err());
        assert!(AlignedBuf::new(100).is_err());
    }

    #[test]
    fn pool_buffers_come_back() {
        let pool = BufPool::new(8192, 2).unwrap();
        let mut a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert!(pool.take().is_none());
        assert_eq!(a.registered_index().unwrap().0, pool.id());
        assert_ne!(a.registered_index(), b.registered_index());
        a[8191] = 1;
        assert_eq!(a.as_mut_ptr() as usize % IO_ALIGN, 0);
        drop(a);
        let c = pool.take().unwrap();
        assert_eq!(c.len(), 8192);
        assert!(BufPool::new(100, 1).is_err());
    }
}
