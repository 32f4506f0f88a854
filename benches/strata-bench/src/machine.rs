//! What this machine can give a benchmark before it starts: memory it may
//! allocate (so a size that cannot fit is refused in one line instead of
//! aborting on a failed allocation minutes in) and whether a directory
//! meant for the NVMe tier is really RAM.

use std::fmt;
use std::path::Path;

use strata::error::{Error, Result};

/// Memory this process may still allocate, and what limits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// "this machine" (`MemAvailable`) or "this cgroup" (its limit less its
    /// usage, v1 `memory.limit_in_bytes` or v2 `memory.max`).
    pub limited_by: &'static str,
}

/// Memory available now: the smaller of `MemAvailable` and every memory
/// cgroup limit (less usage) on this process's path; `None` where neither
/// can be read (not Linux), which [`check_memory`] takes as no limit.
pub fn available_memory() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let mut best = meminfo
        .as_deref()
        .and_then(mem_available)
        .map(|bytes| Available {
            bytes,
            limited_by: "this machine",
        });
    if let Some(c) = cgroup_available() {
        if best.is_none_or(|b| c < b.bytes) {
            best = Some(Available {
                bytes: c,
                limited_by: "this cgroup",
            });
        }
    }
    best
}

fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb.saturating_mul(1024))
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The tightest (limit − usage) over this process's memory cgroup and its
/// ancestors, v2 (`memory.max`, "max" is none) and v1
/// (`memory.limit_in_bytes`, a huge value is none).
fn cgroup_available() -> Option<u64> {
    let table = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<u64> = None;
    let mut consider = |dir: &Path, limit_file: &str, usage_file: &str| {
        let Some(limit) = read_u64(&dir.join(limit_file)) else {
            return;
        };
        // v1 writes "no limit" as the largest page-aligned i64.
        if limit >= 1 << 62 {
            return;
        }
        let usage = read_u64(&dir.join(usage_file)).unwrap_or(0);
        let free = limit.saturating_sub(usage);
        best = Some(best.map_or(free, |b| b.min(free)));
    };
    for line in table.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, limit_file, usage_file) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // Inside a container the cgroup's own directory is often mounted
        // as the root, so the root counts too.
        let rel = Path::new(path.trim_start_matches('/'));
        for dir in rel.ancestors() {
            consider(&Path::new(root).join(dir), limit_file, usage_file);
        }
    }
    best
}

/// A byte count for a person: binary units, one decimal (`21.3 GiB`,
/// `145.5 TiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Refuses, as bad input, a run whose memory estimate `bytes` exceeds
/// what [`available_memory`] reports: "`what` needs about X of memory
/// (`detail`); this machine has Y available". `what` names the flag and
/// value responsible (`--params 10000000000000`). Estimates are upper
/// bounds of the peak, computed with saturating arithmetic by the caller.
pub fn check_memory(what: impl fmt::Display, detail: &str, bytes: u64) -> Result<()> {
    check_memory_against(what, detail, bytes, available_memory())
}

/// [`check_memory`] against a given availability (for tests).
pub fn check_memory_against(
    what: impl fmt::Display,
    detail: &str,
    bytes: u64,
    available: Option<Available>,
) -> Result<()> {
    match available {
        Some(a) if bytes > a.bytes => Err(Error::invalid(format!(
            "{what} needs about {} of memory ({detail}); {} has {} available",
            human_bytes(bytes),
            a.limited_by,
            human_bytes(a.bytes)
        ))),
        _ => Ok(()),
    }
}

/// Saturating product of several factors, for memory estimates.
pub fn product(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |acc, &f| acc.saturating_mul(f))
}

/// "tmpfs" or "ramfs" when `path` lives in RAM: [`strata::sys::ram_filesystem`].
pub fn ram_filesystem(path: &Path) -> Option<&'static str> {
    strata::sys::ram_filesystem(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let m = "MemTotal:       24684084 kB\nMemAvailable:   23553608 kB\n";
        assert_eq!(mem_available(m), Some(23553608 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn refuses_what_does_not_fit_in_one_line() {
        let a = Some(Available {
            bytes: 21 << 30,
            limited_by: "this machine",
        });
        check_memory_against("--x 1", "y", 1 << 30, a).unwrap();
        check_memory_against("--x 1", "y", u64::MAX, None).unwrap();
        let e = check_memory_against("--params 10", "states", 160 << 40, a).unwrap_err();
        assert_eq!(
            e.message(),
            "--params 10 needs about 160.0 TiB of memory (states); this machine has 21.0 GiB available"
        );
        assert_eq!(product(&[u64::MAX, 3]), u64::MAX);
    }

    #[test]
    fn tmpfs_is_ram() {
        if Path::new("/dev/shm").exists() {
            assert_eq!(
                ram_filesystem(Path::new("/dev/shm/strata-new-file")),
                Some("tmpfs")
            );
        }
        assert_eq!(ram_filesystem(Path::new("/proc")), None);
    }
}
