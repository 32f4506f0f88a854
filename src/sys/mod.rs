//! The operating-system layer: NUMA topology and memory tiers read from
//! sysfs, and anonymous memory arenas with huge pages and NUMA binding.
//! Only `arena.rs` contains `unsafe` code.

pub mod arena;
pub mod numa;

pub use arena::Arena;
pub use numa::{MemoryTierInfo, NumaNode, Topology};

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Free bytes (for unprivileged users) on the filesystem holding `path`,
/// or on its nearest existing ancestor.
pub fn fs_free_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated path and `st` is writable
    // storage for one statvfs, which the call fills on success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}
