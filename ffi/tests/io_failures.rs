//! I/O failures of the NVMe tier seen through the C ABI: a corrupted
//! page, a failing read and a failing write each give their status
//! (`STRATA_ERR_CORRUPTED`, `STRATA_ERR_IO`) from `strata_read`,
//! `strata_write` and `strata_ticket_wait`, with `strata_last_error`
//! saying what failed, and the data acknowledged before reads back after.
//!
//! The C ABI has no fault-injecting engine, so the faults are real ones
//! made from outside the library: a bit flipped in the private swap file
//! (reached through this process's descriptor of it), the swap file
//! truncated under the runtime (its reads hit end of file), and
//! `RLIMIT_FSIZE` at 0 (every write to a file fails with EFBIG; run in a
//! child process of its own, so that no other test's file writes fail).
//! ENOSPC cannot be made this way: the C ABI gives no way to choose the
//! engine's errno, so `STRATA_ERR_NO_SPACE` from an NVMe write is not
//! checked here (tests/io_failures.rs checks it through the Rust API).

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::ptr::null_mut;

use common::*;
use strata_ffi::*;

/// A directory on a filesystem with O_DIRECT (tmpfs has none).
fn nvme_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("strata-ffi-io-failures")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// No device tier, a host tier of `host_pages`, 32 NVMe pages in `path`
/// on `engine`; no background eviction, so pages stay where they are put.
fn runtime(host_pages: u64, path: &std::ffi::CString, engine: i32) -> *mut strata_runtime {
    let mut c = config(0, host_pages, 32, path);
    c.background_eviction = 0;
    c.nvme_engine = engine;
    create(&c)
}

/// A buffer of `data.len()` bytes written to `tier`, every page there.
fn written_in(rt: *const strata_runtime, tier: strata_tier, data: &[u8]) -> *mut strata_buffer {
    let mut buf = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_alloc_in(rt, data.len() as u64, tier, &mut buf) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(write(buf, 0, data), STRATA_OK, "{}", last_error());
    for p in 0..data.len() / PAGE as usize {
        assert_eq!(tier_of(buf, p), tier, "setup: page {p}");
    }
    buf
}

/// `len` bytes from `seed`, different in every page (common's `pattern`
/// repeats itself every 64 KiB, and the swap file's slots are found here
/// by their content).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `len` bytes at `offset`, which must read.
fn read_ok(buf: *const strata_buffer, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    assert_eq!(read(buf, offset, &mut out), STRATA_OK, "{}", last_error());
    out
}

/// Prefetches `offset..offset + len` into `tier` and returns what
/// `strata_ticket_wait` gives, then what `strata_ticket_poll` gives.
fn prefetch(buf: *const strata_buffer, offset: u64, len: u64, tier: strata_tier) -> (i32, i32) {
    let mut ticket = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_prefetch(buf, offset, len, tier, &mut ticket) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let waited = strata_ticket_wait(ticket);
    let polled = strata_ticket_poll(ticket);
    assert_eq!(strata_ticket_free(ticket), STRATA_OK);
    (waited, polled)
}

/// The private swap file made in `dir`, reopened through this process's
/// descriptor of it (it has no name: O_TMPFILE, or created and unlinked).
fn swap_file(dir: &Path) -> File {
    let found: Vec<_> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .map(|fd| fd.path())
        .filter(|fd| std::fs::read_link(fd).is_ok_and(|target| target.starts_with(dir)))
        .collect();
    assert_eq!(found.len(), 1, "one swap file open in {}", dir.display());
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&found[0])
        .unwrap()
}

/// Flips a bit of byte `at` of the one slot of the swap file in `dir` that
/// holds `page`.
fn corrupt_on_disk(dir: &Path, page: &[u8], at: usize) {
    let file = swap_file(dir);
    let len = file.metadata().unwrap().len() as usize;
    let mut all = vec![0; len];
    file.read_exact_at(&mut all, 0).unwrap();
    let n = page.len();
    let slots: Vec<usize> = (0..len / n)
        .filter(|&s| &all[s * n..(s + 1) * n] == page)
        .collect();
    assert_eq!(slots.len(), 1, "the page is in exactly one slot on disk");
    let offset = (slots[0] * n + at) as u64;
    file.write_all_at(&[all[slots[0] * n + at] ^ 0x20], offset)
        .unwrap();
    file.sync_all().unwrap();
}

/// One bit flipped in an NVMe page on disk: `strata_read` of it (whole, or
/// of its damaged sector) and the ticket of a prefetch give
/// `STRATA_ERR_CORRUPTED` naming the checksum, never the flipped bytes; its
/// intact sector and the other pages read; a whole-page write replaces it.
#[test]
fn a_page_corrupted_on_disk_gives_corrupted_never_its_bytes() {
    let dir = nvme_dir();
    let path = c_path(dir.path());
    let rt = runtime(4, &path, STRATA_IO_AUTO);
    let p = PAGE as usize;
    let data = bytes(1, 3 * p);
    let buf = written_in(rt, STRATA_TIER_NVME, &data);
    // Byte 5000 of page 1: its second 4 KiB sector.
    corrupt_on_disk(dir.path(), &data[p..2 * p], 5000);
    let mut bad = data[p..2 * p].to_vec();
    bad[5000] ^= 0x20;

    let mut out = vec![0u8; 3 * p];
    fails(read(buf, 0, &mut out), STRATA_ERR_CORRUPTED, "checksum");
    assert!(last_error().starts_with("strata_read"), "{}", last_error());
    assert!(out[p..2 * p] != bad[..], "the flipped page came out");
    let mut page = vec![0u8; p];
    fails(read(buf, PAGE, &mut page), STRATA_ERR_CORRUPTED, "checksum");
    assert!(page != bad, "the flipped page came out");
    let mut small = [0u8; 32];
    fails(
        read(buf, PAGE + 4990, &mut small),
        STRATA_ERR_CORRUPTED,
        "checksum",
    );

    // Intact: the other pages, and the first sector of page 1 alone.
    assert!(read_ok(buf, 0, p) == data[..p]);
    assert!(read_ok(buf, 2 * PAGE, p) == data[2 * p..]);
    assert!(read_ok(buf, PAGE + 10, 100) == data[p + 10..p + 110]);

    let (waited, polled) = prefetch(buf, PAGE, PAGE, STRATA_TIER_HOST);
    fails(waited, STRATA_ERR_CORRUPTED, "checksum");
    assert_eq!(polled, STRATA_ERR_CORRUPTED, "{}", last_error());
    assert_eq!(tier_of(buf, 1), STRATA_TIER_NVME, "a failed move stays put");
    // A partial write cannot merge into bytes that fail their checksum.
    fails(write(buf, PAGE + 7, b"x"), STRATA_ERR_CORRUPTED, "checksum");
    assert_eq!(
        strata_runtime_check(rt),
        STRATA_OK,
        "the caller's own errors are not background failures: {}",
        last_error()
    );

    // A whole-page write replaces the damaged page.
    let fresh = bytes(2, p);
    assert_eq!(write(buf, PAGE, &fresh), STRATA_OK, "{}", last_error());
    let back = read_ok(buf, 0, 3 * p);
    assert!(
        back[..p] == data[..p] && back[p..2 * p] == fresh[..] && back[2 * p..] == data[2 * p..]
    );
    let st = stats(rt);
    assert_eq!(st["lost_pages"], 0, "{st}");
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// The swap file cut to nothing under the runtime: every NVMe read hits
/// end of file, an I/O error. Once its bytes are back, every page reads.
#[test]
fn a_failing_nvme_read_is_an_io_error_and_the_data_survives() {
    let dir = nvme_dir();
    let path = c_path(dir.path());
    let rt = runtime(4, &path, STRATA_IO_AUTO);
    let p = PAGE as usize;
    let data = bytes(3, 2 * p);
    let buf = written_in(rt, STRATA_TIER_NVME, &data);

    let file = swap_file(dir.path());
    let len = file.metadata().unwrap().len();
    let mut saved = vec![0; len as usize];
    file.read_exact_at(&mut saved, 0).unwrap();
    file.set_len(0).unwrap();

    let mut out = vec![0u8; 2 * p];
    fails(read(buf, 0, &mut out), STRATA_ERR_IO, "end of file");
    assert!(last_error().starts_with("strata_read"), "{}", last_error());
    fails(read(buf, PAGE + 10, &mut out[..10]), STRATA_ERR_IO, "read");
    let (waited, polled) = prefetch(buf, 0, 2 * PAGE, STRATA_TIER_HOST);
    fails(waited, STRATA_ERR_IO, "end of file");
    assert_eq!(polled, STRATA_ERR_IO, "{}", last_error());
    assert_eq!(tier_of(buf, 0), STRATA_TIER_NVME);
    assert_eq!(tier_of(buf, 1), STRATA_TIER_NVME);

    file.set_len(len).unwrap();
    file.write_all_at(&saved, 0).unwrap();
    file.sync_all().unwrap();
    assert!(read_ok(buf, 0, 2 * p) == data, "acknowledged data lost");
    let (waited, _) = prefetch(buf, 0, 2 * PAGE, STRATA_TIER_HOST);
    assert_eq!(waited, STRATA_OK, "{}", last_error());
    assert!(read_ok(buf, 0, 2 * p) == data);
    assert_eq!(strata_runtime_check(rt), STRATA_OK, "{}", last_error());
    assert_eq!(stats(rt)["lost_pages"], 0);
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

const CHILD: &str = "STRATA_FFI_IO_FAILURES_CHILD";

/// Runs `body` in a child process running only the test `name` (this
/// binary again, with `CHILD` set), so that what it does to the process
/// (`RLIMIT_FSIZE`) touches no other test.
fn in_child(name: &str, body: impl FnOnce()) {
    if std::env::var_os(CHILD).is_some() {
        body();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(&format!("test {name} ... ok")),
        "the child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

mod fsize {
    //! `RLIMIT_FSIZE` through the C library (this crate does not depend on
    //! the libc crate). Linux's values, the same on x86_64 and aarch64.
    use std::os::raw::c_int;

    const RLIMIT_FSIZE: c_int = 1;
    const SIGXFSZ: c_int = 25;
    const SIG_IGN: usize = 1;

    #[repr(C)]
    struct Rlimit {
        cur: u64,
        max: u64,
    }

    extern "C" {
        fn getrlimit(resource: c_int, rlim: *mut Rlimit) -> c_int;
        fn setrlimit(resource: c_int, rlim: *const Rlimit) -> c_int;
        fn signal(signum: c_int, handler: usize) -> usize;
    }

    /// Sets the soft limit on the size of files this process writes:
    /// `Some(0)` fails every write to a file with EFBIG (and, ignored
    /// here, SIGXFSZ); `None` lifts it back to the hard limit.
    pub fn limit(bytes: Option<u64>) {
        let mut r = Rlimit { cur: 0, max: 0 };
        // SAFETY: a writable rlimit struct of the C layout.
        assert_eq!(unsafe { getrlimit(RLIMIT_FSIZE, &mut r) }, 0);
        r.cur = bytes.unwrap_or(r.max);
        // SAFETY: SIG_IGN is a valid disposition for SIGXFSZ.
        unsafe { signal(SIGXFSZ, SIG_IGN) };
        // SAFETY: a readable rlimit struct of the C layout.
        assert_eq!(unsafe { setrlimit(RLIMIT_FSIZE, &r) }, 0);
    }
}

/// Every NVMe write refused (EFBIG): a write to an NVMe page, whole or in
/// part, fails with `STRATA_ERR_IO` and the page reads back its old
/// content; a pin whose room-making demotion fails is a background failure
/// that `strata_runtime_check` returns once. When writes work again,
/// everything does.
#[test]
fn a_write_the_disk_refuses_keeps_the_old_content() {
    in_child("a_write_the_disk_refuses_keeps_the_old_content", || {
        let dir = nvme_dir();
        let path = c_path(dir.path());
        let rt = runtime(4, &path, STRATA_IO_PSYNC);
        let p = PAGE as usize;
        let host_data = bytes(4, 4 * p);
        let full = written_in(rt, STRATA_TIER_HOST, &host_data);
        let data = bytes(5, 2 * p);
        let buf = written_in(rt, STRATA_TIER_NVME, &data);
        let next = bytes(6, 2 * p);

        fsize::limit(Some(0));
        fails(write(buf, 0, &next[..p]), STRATA_ERR_IO, "too large");
        assert!(last_error().starts_with("strata_write"), "{}", last_error());
        fails(write(buf, PAGE + 3, &next[..100]), STRATA_ERR_IO, "write");
        // Reads need no write.
        assert!(read_ok(buf, 0, 2 * p) == data, "acknowledged data lost");
        assert_eq!(strata_runtime_check(rt), STRATA_OK, "{}", last_error());

        // The host tier is full: pinning a page there demotes one of
        // `full`'s, and that write fails.
        let mut pin = null_mut();
        // SAFETY: a writable out-pointer.
        let s = unsafe { strata_buffer_pin(buf, 0, PAGE, STRATA_TIER_HOST, &mut pin) };
        assert_ne!(s, STRATA_OK, "pinned with no room made");
        fails(strata_runtime_check(rt), STRATA_ERR_IO, "making room");
        assert_eq!(
            strata_runtime_check(rt),
            STRATA_OK,
            "returned twice: {}",
            last_error()
        );
        fsize::limit(None);

        assert!(read_ok(buf, 0, 2 * p) == data, "acknowledged data lost");
        assert!(
            read_ok(full, 0, 4 * p) == host_data,
            "acknowledged data lost"
        );
        assert_eq!(tier_of(buf, 0), STRATA_TIER_NVME);
        assert_eq!(write(buf, 0, &next), STRATA_OK, "{}", last_error());
        assert!(read_ok(buf, 0, 2 * p) == next);
        // SAFETY: a writable out-pointer.
        let s = unsafe { strata_buffer_pin(buf, 0, PAGE, STRATA_TIER_HOST, &mut pin) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        assert_eq!(strata_unpin(pin), STRATA_OK);
        assert!(read_ok(full, 0, 4 * p) == host_data);
        assert!(read_ok(buf, 0, 2 * p) == next);
        assert_eq!(strata_runtime_check(rt), STRATA_OK, "{}", last_error());
        assert_eq!(stats(rt)["lost_pages"], 0);
        assert_eq!(strata_buffer_free(buf), STRATA_OK);
        assert_eq!(strata_buffer_free(full), STRATA_OK);
        assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    });
}
