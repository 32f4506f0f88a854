//! An anonymous memory arena: a private mapping aligned for huge pages,
//! optionally advised to use transparent huge pages and bound to a NUMA node.
//!
//! This is one of the few modules with `unsafe` code: it hands out raw
//! pointers into the mapping, and it calls `mbind` and `madvise`.

use std::fs;
use std::ptr::NonNull;

use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, Result};

/// Alignment of every arena: a 2 MiB huge page, so each page-size slot
/// (at most 2 MiB) is naturally aligned and THP can back the arena.
pub const ARENA_ALIGN: usize = 2 << 20;

/// A page-aligned anonymous mapping. Memory is committed on first touch.
///
/// The mapping is never dereferenced as a Rust slice after construction:
/// `base` is taken once through `&mut` (so it carries write permission for
/// the whole mapping), and all access goes through it. Handing out slices
/// of the map itself would assert, each time, that no one else is writing
/// any part of it — false while slots are in use on other threads.
#[derive(Debug)]
pub struct Arena {
    // Kept only to unmap on drop.
    _map: MmapMut,
    base: NonNull<u8>,
    len: usize,
    huge_pages: bool,
    numa_node: Option<u32>,
}

// SAFETY: `base` points into `_map`, which the arena owns and which lives as
// long as it does; the arena itself never reads or writes through it, so
// moving it to another thread moves nothing thread-bound.
unsafe impl Send for Arena {}
// SAFETY: `&Arena` only exposes the address and length; who may access which
// bytes is decided by the owners of slots and buffers, not by the arena.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `len` bytes (rounded up to [`ARENA_ALIGN`]). With `huge_pages`,
    /// asks for transparent huge pages where the kernel allows it (the result
    /// is reported by [`Arena::huge_pages`]). With `numa_node`, binds the
    /// memory to that node and fails if the kernel refuses.
    pub fn new(len: usize, huge_pages: bool, numa_node: Option<u32>) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("arena size is zero"));
        }
        // The mapping is one huge page longer (room to align), and the
        // arena is lent as one slice, which may not exceed `isize::MAX`
        // bytes. Unchecked, a length near `usize::MAX` wrapped the
        // mapping's length to 0 (memmap2 then maps one page) behind an
        // arena claiming the whole length.
        let len = len
            .checked_next_multiple_of(ARENA_ALIGN)
            .filter(|&l| l <= isize::MAX as usize - ARENA_ALIGN)
            .ok_or_else(|| Error::invalid(format!("arena size {len} is too large")))?;
        let mut map = MmapOptions::new()
            .len(len + ARENA_ALIGN)
            .map_anon()
            .map_err(|e| Error::io(format!("mapping a {len}-byte arena"), e))?;
        let start = map.as_mut_ptr();
        let offset = (start as usize).next_multiple_of(ARENA_ALIGN) - start as usize;
        let huge = huge_pages
            && thp_allowed()
            && map
                .advise_range(memmap2::Advice::HugePage, offset, len)
                .is_ok();
        // SAFETY: `offset` < ARENA_ALIGN and the mapping is `len + ARENA_ALIGN`
        // bytes, so `start + offset` is inside it (and not null).
        let base = unsafe { NonNull::new_unchecked(start.add(offset)) };
        let mut arena = Self {
            _map: map,
            base,
            len,
            huge_pages: huge,
            numa_node: None,
        };
        if let Some(node) = numa_node {
            arena.bind(node)?;
        }
        Ok(arena)
    }

    fn bind(&mut self, node: u32) -> Result<()> {
        const MPOL_BIND: libc::c_long = 2;
        const MPOL_MF_STRICT: libc::c_ulong = 1;
        const BITS: usize = libc::c_ulong::BITS as usize;
        let node = node as usize;
        if node >= 1024 {
            return Err(Error::invalid(format!("NUMA node {node} is out of range")));
        }
        let mut mask = vec![0 as libc::c_ulong; node / BITS + 1];
        mask[node / BITS] |= 1 << (node % BITS);
        // SAFETY: the address range is our own mapping (aligned start, `len`
        // bytes inside it); `mask` outlives the call. The kernel reads
        // `maxnode - 1` bits, so pass one more than the mask holds (as
        // libnuma does), or the top node of each word would be dropped.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.base.as_ptr(),
                self.len,
                MPOL_BIND,
                mask.as_ptr(),
                (mask.len() * BITS + 1) as libc::c_ulong,
                MPOL_MF_STRICT,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return Err(Error::io(format!("binding arena to NUMA node {node}"), err));
        }
        self.numa_node = Some(node as u32);
        Ok(())
    }

    /// Backs every page of the arena with memory now rather than at each
    /// page's first touch (the kernel's `MADV_POPULATE_WRITE`, Linux 5.14;
    /// on an older kernel nothing happens and pages arrive at first touch,
    /// as before). The contents do not change, so the arena may be in use.
    /// Left to first touch, the zeroing of each page lands on whoever
    /// touches it first: an NVMe read into it, in the thread that submits
    /// the read. Returns whether the kernel did it.
    pub fn populate(&self) -> bool {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: `base..base+len` is our own live mapping; populating it
        // faults its pages in without writing to them (anonymous memory
        // reads as zero before, and as what was written after).
        let rc = unsafe { libc::madvise(self.base.as_ptr().cast(), self.len, MADV_POPULATE_WRITE) };
        rc == 0
    }

    /// Start of the arena (aligned to [`ARENA_ALIGN`]), valid for reads and
    /// writes of [`Arena::len`] bytes while the arena lives.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// The whole arena as a slice; `&mut self` makes the access exclusive.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `base..base+len` is our live, writable mapping, and
        // `&mut self` guarantees no other reference derived from this arena
        // is in use (every other access needs `&self` or a raw pointer whose
        // users hold a borrow of the owning store).
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.len) }
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: arenas are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether transparent huge pages were requested successfully.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The NUMA node the arena is bound to, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }
}

/// Whether the kernel lets a program ask for transparent huge pages
/// (`always` or `madvise` in sysfs).
pub fn thp_allowed() -> bool {
    fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.contains("[always]") || s.contains("[madvise]"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn aligned_and_writable() {
        let mut a = Arena::new(3 << 20, true, None).unwrap();
        assert_eq!(a.base().as_ptr() as usize % ARENA_ALIGN, 0);
        assert_eq!(a.len(), 4 << 20);
        let bytes = a.as_mut_slice();
        bytes[0] = 1;
        let last = bytes.len() - 1;
        bytes[last] = 2;
        assert_eq!(bytes[0] + bytes[bytes.len() - 1], 3);
    }

    /// Pages of `a` the kernel reports resident (mincore).
    fn resident_pages(a: &Arena) -> usize {
        let page = 4096;
        let mut vec = vec![0u8; a.len() / page];
        // SAFETY: the range is the arena's own mapping, page-aligned, and
        // `vec` has one byte per page of it.
        let rc = unsafe { libc::mincore(a.base().as_ptr().cast(), a.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn populating_backs_every_page_and_keeps_the_contents() {
        let mut a = Arena::new(4 << 20, false, None).unwrap();
        a.as_mut_slice()[..5].copy_from_slice(b"kept!");
        assert!(
            resident_pages(&a) < a.len() / 4096,
            "untouched pages are not backed yet"
        );
        if !a.populate() {
            eprintln!("skipping: this kernel has no MADV_POPULATE_WRITE");
            return;
        }
        assert_eq!(resident_pages(&a), a.len() / 4096);
        let bytes = a.as_mut_slice();
        assert_eq!(&bytes[..5], b"kept!");
        assert!(bytes[5..].iter().all(|&b| b == 0));
    }

    #[test]
    fn zero_size_is_an_error() {
        assert_eq!(
            Arena::new(0, false, None).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn a_length_the_slack_would_overflow_is_an_error() {
        // Rounded up it is a whole number of huge pages; the extra huge
        // page mapped for alignment would take it past `usize::MAX`.
        let len = usize::MAX - ARENA_ALIGN + 1;
        assert_eq!(
            Arena::new(len, false, None).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn binds_to_node_zero_or_reports_why_not() {
        match Arena::new(2 << 20, false, Some(0)) {
            Ok(mut a) => {
                assert_eq!(a.numa_node(), Some(0));
                // Where the kernel really put a touched page.
                let bytes = a.as_mut_slice();
                bytes[0] = 1;
                let mut node: libc::c_int = -1;
                const MPOL_F_NODE: libc::c_ulong = 1;
                const MPOL_F_ADDR: libc::c_ulong = 2;
                // SAFETY: `node` is a writable int; no node mask is asked
                // for (NULL, 0); `bytes` is a mapped, touched page of the
                // arena, which outlives the call.
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_get_mempolicy,
                        &mut node as *mut libc::c_int,
                        std::ptr::null_mut::<libc::c_ulong>(),
                        0 as libc::c_ulong,
                        bytes.as_mut_ptr() as *mut libc::c_void,
                        MPOL_F_NODE | MPOL_F_ADDR,
                    )
                };
                assert_eq!(r, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
                assert_eq!(node, 0, "the page is on node {node}");
            }
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                eprintln!("skipping: mbind to node 0 refused here: {e}")
            }
            Err(e) => panic!("binding to node 0: {e}"),
        }
        assert!(Arena::new(2 << 20, false, Some(5000)).is_err());
    }
}
