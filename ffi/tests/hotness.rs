//! Counter harvest, trace recording and the balancer through the C ABI.

mod common;

use std::ffi::CString;

use common::*;
use strata_ffi::*;

#[test]
fn harvest_trace_and_balancer() {
    let dir = tempfile::tempdir().unwrap();
    let none = CString::new("").unwrap();
    let rt = create(&config(4, 32, 0, &none));
    let buf = alloc(rt, 16 * PAGE);
    let trace = c_path(&dir.path().join("t.trace"));
    // SAFETY: a NUL-terminated path.
    let started = unsafe { strata_trace_start(rt, trace.as_ptr(), 0) };
    assert_eq!(started, STRATA_OK);
    // SAFETY: as above.
    let again = unsafe { strata_trace_start(rt, trace.as_ptr(), 0) };
    fails(again, STRATA_ERR_INVALID_ARGUMENT, "already");
    assert_eq!(write(buf, 0, &vec![1; 16 * PAGE as usize]), STRATA_OK);
    let mut out = [0u8; 8];
    for _ in 0..10 {
        assert_eq!(read(buf, 9 * PAGE, &mut out), STRATA_OK);
    }
    let mut n = 0u64;
    // SAFETY: a writable u64.
    assert_eq!(unsafe { strata_trace_stop(rt, &mut n) }, STRATA_OK);
    assert_eq!(n, 16 + 10);
    let text = std::fs::read_to_string(dir.path().join("t.trace")).unwrap();
    assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 26);
    // SAFETY: NULL out-pointer is allowed.
    let stopped = unsafe { strata_trace_stop(rt, std::ptr::null_mut()) };
    fails(stopped, STRATA_ERR_INVALID_ARGUMENT, "no trace");

    // Hot pages are those not in device memory: make sure page 9 is not
    // (background eviction may free a device slot while the pages are
    // first written, and page 9 may land there).
    assert_eq!(
        strata_evict(buf, 9 * PAGE, PAGE, STRATA_TIER_HOST),
        STRATA_OK
    );
    let (mut hp, mut hs, mut cp, mut cs) = ([0u64; 2], [0f32; 2], [0u64; 2], [0f32; 2]);
    let (mut hl, mut cl) = (0usize, 0usize);
    let (hpp, hsp, cpp, csp) = (
        hp.as_mut_ptr(),
        hs.as_mut_ptr(),
        cp.as_mut_ptr(),
        cs.as_mut_ptr(),
    );
    let (hlp, clp) = (&mut hl as *mut usize, &mut cl as *mut usize);
    // A harvest of up to 2 pages into the arrays above, `cold_pages` given.
    // SAFETY: every pointer is to an array of 2 or a length that outlives
    // the calls, which nothing else touches meanwhile.
    let harvest = |decay: f32, cold_pages: *mut u64| unsafe {
        strata_buffer_harvest(buf, decay, 2, hpp, hsp, hlp, cold_pages, csp, clp)
    };
    let s = harvest(0.5, cpp);
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(
        (hl, hp[0], hs[0]),
        (2, 9, 11.0),
        "page 9: 1 write + 10 reads"
    );
    assert!(cl >= 1, "device pages are reported cold");
    // A bad decay is refused before anything is read.
    fails(harvest(0.0, cpp), STRATA_ERR_INVALID_ARGUMENT, "decay");
    // The hot and the cold pages given one array: refused before any slice
    // of them is made.
    fails(
        harvest(0.5, hpp),
        STRATA_ERR_INVALID_ARGUMENT,
        "share memory",
    );

    fails(
        strata_balancer_start(rt, 99, 1000, 0),
        STRATA_ERR_INVALID_ARGUMENT,
        "policy",
    );
    assert_eq!(
        strata_balancer_start(rt, STRATA_POLICY_LFU, 1_000_000, 0),
        STRATA_OK
    );
    // As page 9 above: page 12 may have been first written into a device
    // slot that background eviction freed; it must start in host memory.
    assert_eq!(
        strata_evict(buf, 12 * PAGE, PAGE, STRATA_TIER_HOST),
        STRATA_OK
    );
    for _ in 0..10 {
        assert_eq!(read(buf, 12 * PAGE, &mut out), STRATA_OK);
    }
    let mut report = strata_balance_report::default();
    // SAFETY: a writable report.
    assert_eq!(unsafe { strata_balance_once(rt, &mut report) }, STRATA_OK);
    assert!(report.promotions >= 1, "{report:?}");
    assert_eq!(tier_of(buf, 12), STRATA_TIER_DEVICE);
    assert_eq!(strata_balancer_stop(rt), STRATA_OK);
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}
