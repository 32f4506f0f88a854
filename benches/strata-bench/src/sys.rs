//! The benchmark crate's two calls into the OS that Rust's standard
//! library lacks, for the page cache baseline of `strata bench pages`:
//! the lowest layer of this crate, and its only `unsafe` outside the CUDA
//! graph kernels.

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

/// Maps `file` read-only and shared.
pub fn map_read_only(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only, and the file (the benchmark's data file,
    // written and synced before) is not written or truncated while the map
    // lives: the child process that maps it only reads.
    unsafe { memmap2::Mmap::map(file) }
}
