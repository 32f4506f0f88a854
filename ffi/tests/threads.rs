//! Its own test binary: it counts the process's threads, which tests
//! running beside it would disturb.

mod common;

use std::ptr::null_mut;

use common::*;
use strata_ffi::*;

#[test]
fn destroyed_runtimes_leave_no_threads_behind() {
    let threads = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let before = threads();
    for _ in 0..50 {
        let rt = create(&config(4, 8, 16, &path));
        let buf = alloc(rt, 20 * PAGE);
        assert_eq!(write(buf, 0, &[1u8; 20 * PAGE as usize]), STRATA_OK);
        let mut t = null_mut();
        // SAFETY: a writable out-pointer.
        // Eight pages: NVMe has room for them (the result is not waited for).
        let s = unsafe { strata_prefetch(buf, 0, 8 * PAGE, STRATA_TIER_NVME, &mut t) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    }
    // A destroyed runtime joins its threads (only the last reference's
    // holder may let go a little later).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while threads() > before + 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        threads() <= before + 4,
        "{} threads before, {} after",
        before,
        threads()
    );
}
