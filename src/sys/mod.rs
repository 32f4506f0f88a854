//! The operating-system layer: NUMA topology and memory tiers read from
//! sysfs, and anonymous memory arenas with huge pages and NUMA binding.
//! Only `arena.rs` contains `unsafe` code.

pub(crate) mod arena;
pub(crate) mod numa;

pub(crate) use arena::Arena;
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

/// CPU time (user, system) this process has used so far, all threads.
pub fn process_cpu_time() -> (std::time::Duration, std::time::Duration) {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: `ru` is writable storage for one rusage, filled on success.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return Default::default();
    }
    // SAFETY: getrusage returned 0, so it initialised `ru`.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}
