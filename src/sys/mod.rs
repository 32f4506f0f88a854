//! The operating-system layer: NUMA topology and memory tiers read from
//! sysfs, and anonymous memory arenas with huge pages and NUMA binding.
//! Its `unsafe` code is the arena (`arena.rs`) and the system calls
//! probing filesystems and process and thread times here (`statvfs`,
//! `statfs`, `getrusage`, `clock_gettime`), each with its `// SAFETY:`
//! comment.

pub(crate) mod arena;
pub(crate) mod numa;

pub(crate) use arena::Arena;

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A process-unique id (64 bits: it never wraps): of a slot allocator, of
/// a pool of I/O buffers.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
pub use numa::{MemoryTierInfo, NumaNode, Topology};

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `path` if it exists, else its nearest existing ancestor; "." for an
/// empty or relative path none of whose ancestors exist.
fn existing_ancestor(path: &Path) -> &Path {
    path.ancestors()
        .find(|p| !p.as_os_str().is_empty() && p.exists())
        .unwrap_or(Path::new("."))
}

/// The kernel's estimate of the memory available to start new work
/// without swapping (`MemAvailable` in `/proc/meminfo`); `None` where it
/// cannot be read.
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Free bytes (for unprivileged users) on the filesystem holding `path`,
/// or on its nearest existing ancestor.
pub fn fs_free_bytes(path: &Path) -> Option<u64> {
    let existing = existing_ancestor(path);
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

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// "tmpfs" or "ramfs" when `path` (or, for a name not yet created, its
/// nearest existing ancestor) lives in RAM; `None` for a disk, a
/// device node (`/dev` is a devtmpfs, which reports tmpfs's magic), or when it
/// cannot be told.
pub fn ram_filesystem(path: &Path) -> Option<&'static str> {
    let existing = existing_ancestor(path);
    if existing == path {
        use std::os::unix::fs::FileTypeExt;
        let device = |t: std::fs::FileType| t.is_block_device() || t.is_char_device();
        if std::fs::metadata(path).is_ok_and(|m| device(m.file_type())) {
            return None;
        }
    }
    let c = CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated path and `st` is writable
    // storage for one statfs, which the call fills on success.
    let rc = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // f_type's type differs between targets
    match st.f_type as i64 {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        _ => None,
    }
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

/// Nanoseconds of CPU the calling thread has run
/// (`CLOCK_THREAD_CPUTIME_ID`): unlike wall time, not inflated while the
/// thread waits for a core or for I/O. 0 where the clock fails.
pub fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec that outlives the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_from_its_line() {
        let text =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(parse_mem_available(text), Some(12345678 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
        assert!(mem_available_bytes().is_some_and(|b| b > 0));
    }
}
