//! The benchmark crate's calls into the OS that Rust's standard library
//! lacks — for the page cache baseline of `strata bench pages`, the CPU
//! time of the graph benchmark's balancer rounds and the heap its resident
//! kernels allocate from: the lowest layer of
//! this crate, and its only `unsafe` outside the CUDA graph kernels.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Drops `file`'s clean cached pages (`posix_fadvise(POSIX_FADV_DONTNEED)`
/// over the whole file).
pub fn fadvise_dontneed(file: &File) -> std::io::Result<()> {
    // SAFETY: a plain system call on a descriptor `file` keeps open for the
    // call; it reads and writes no memory of this process.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    match rc {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Keeps freed heap memory in the process (glibc's `mallopt`: no trim of
/// the heap's top below 512 MiB, blocks up to 32 MiB from the heap rather
/// than their own mappings). Timed kernels that allocate their working
/// arrays afresh each trial then find them warm, as GAP's trials do: with
/// glibc's thresholds, whatever the harness frees between two trials can
/// hand those arrays back to the kernel, and the next trial pays a page
/// fault for every 4 KiB of them (on a Kronecker graph of 2^17 vertices,
/// 0.24–0.55 ms of a 1.6 ms BFS). Returns whether both settings took.
pub fn keep_freed_heap() -> bool {
    // SAFETY: `mallopt` only changes the allocator's thresholds for later
    // calls; it reads and writes no memory the caller owns.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
    }
}

/// Maps `file` read-only and shared.
pub fn map_read_only(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only, and the file (the benchmark's data file,
    // written and synced before) is not written or truncated while the map
    // lives: the child process that maps it only reads.
    unsafe { memmap2::Mmap::map(file) }
}

/// CPU seconds the calling thread has run (`CLOCK_THREAD_CPUTIME_ID`):
/// unlike wall time, not inflated while the thread waits for a core.
pub fn thread_cpu_seconds() -> f64 {
    strata::sys::thread_cpu_ns() as f64 * 1e-9
}
