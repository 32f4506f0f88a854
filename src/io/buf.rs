//! Owned, aligned buffers: what the I/O engines take and hand back, so that
//! memory an in-flight operation points at can never be freed or reused
//! before the operation completes.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Alignment of every [`AlignedBuf`]: the 4 KiB that O_DIRECT needs.
pub const IO_ALIGN: usize = 4096;

/// A zero-initialised heap buffer aligned to [`IO_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
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
        Ok(Self { ptr, len })
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
        // SAFETY: allocated in `new` with exactly this layout (which was
        // valid then, so it is valid now).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, IO_ALIGN),
            )
        }
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
}
