//! Bad input through the C ABI: each case returns its status with a message
//! naming the problem, and nothing crashes.

mod common;

use std::ffi::{c_void, CString};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use strata_ffi::*;

/// A handle value C could forge.
fn forged<T>(bits: u64) -> *mut T {
    bits as usize as *mut T
}

fn host_runtime() -> *mut strata_runtime {
    create(&config(4, 16, 0, &CString::new("/").unwrap()))
}

#[test]
fn null_pointers() {
    let rt = host_runtime();
    let buf = alloc(rt, PAGE);
    // SAFETY: every pointer below is NULL (checked by strata) or valid.
    unsafe {
        fails(
            strata_config_init(null_mut()),
            STRATA_ERR_NULL_POINTER,
            "config is NULL",
        );
        let mut out = null_mut();
        fails(
            strata_runtime_create(std::ptr::null(), &mut out),
            STRATA_ERR_NULL_POINTER,
            "config is NULL",
        );
        let c = default_config();
        fails(
            strata_runtime_create(&c, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "out is NULL",
        );
        fails(
            strata_alloc(rt, PAGE, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "out is NULL",
        );
        fails(
            strata_alloc(null_mut(), PAGE, &mut null_mut()),
            STRATA_ERR_NULL_POINTER,
            "runtime handle is NULL",
        );
        fails(
            strata_read(buf, 0, null_mut(), 10),
            STRATA_ERR_NULL_POINTER,
            "dst is NULL",
        );
        fails(
            strata_write(buf, 0, std::ptr::null(), 10),
            STRATA_ERR_NULL_POINTER,
            "src is NULL",
        );
        fails(
            strata_read(null_mut(), 0, null_mut(), 0),
            STRATA_ERR_NULL_POINTER,
            "buffer handle is NULL",
        );
        // Zero lengths never touch the pointer.
        assert_eq!(strata_read(buf, 0, null_mut(), 0), STRATA_OK);
        assert_eq!(strata_write(buf, PAGE, std::ptr::null(), 0), STRATA_OK);
        fails(
            strata_buffer_len(buf, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "len is NULL",
        );
        fails(
            strata_buffer_tier_of(buf, 0, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "tier_out",
        );
        fails(
            strata_prefetch(buf, 0, 1, STRATA_TIER_HOST, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "ticket is NULL",
        );
        fails(
            strata_buffer_pin(buf, 0, 1, STRATA_TIER_HOST, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "pin is NULL",
        );
        fails(
            strata_device_map(buf, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "map is NULL",
        );
        fails(
            strata_stats_json(rt, null_mut(), null_mut()),
            STRATA_ERR_NULL_POINTER,
            "json is NULL",
        );
        fails(
            strata_stats_json_copy(rt, null_mut(), 10, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "buf is NULL",
        );
        fails(
            strata_runtime_page_size(rt, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "out is NULL",
        );
        fails(
            strata_ticket_wait(null_mut()),
            STRATA_ERR_NULL_POINTER,
            "ticket handle is NULL",
        );
        fails(
            strata_launch_end(forged(1)),
            STRATA_ERR_INVALID_HANDLE,
            "launch",
        );
        let misaligned = (&mut [0u64; 2] as *mut u64)
            .cast::<u8>()
            .add(1)
            .cast::<u64>();
        fails(
            strata_buffer_len(buf, misaligned),
            STRATA_ERR_INVALID_ARGUMENT,
            "misaligned",
        );
        let mut len = 0usize;
        assert_eq!(
            strata_last_error_copy(null_mut(), 0, &mut len),
            STRATA_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(len, last_error().len());
        assert_eq!(
            strata_last_error_copy(null_mut(), 5, &mut len),
            STRATA_ERR_NULL_POINTER
        );
    }
    // Freeing NULL is a no-op everywhere.
    assert_eq!(strata_buffer_free(null_mut()), STRATA_OK);
    assert_eq!(strata_ticket_free(null_mut()), STRATA_OK);
    assert_eq!(strata_unpin(null_mut()), STRATA_OK);
    assert_eq!(strata_map_free(null_mut()), STRATA_OK);
    assert_eq!(strata_launch_end(null_mut()), STRATA_OK);
    assert_eq!(strata_string_free(null_mut()), STRATA_OK);
    assert_eq!(strata_dlpack_free(null_mut()), STRATA_OK);
    assert_eq!(strata_runtime_destroy(null_mut()), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// An output that shares memory with another of the call's arrays is
/// refused before anything is written: Rust would otherwise write through
/// two references to the same bytes.
#[test]
fn outputs_that_share_memory_are_refused() {
    let rt = host_runtime();
    let buf = alloc(rt, 2 * PAGE);
    assert_eq!(write(buf, 0, &[1u8; 16]), STRATA_OK);
    let mut pin = null_mut();
    // SAFETY: writable out-pointers, and arrays of the lengths passed, one
    // overlapping another on purpose (the calls must refuse them).
    unsafe {
        assert_eq!(
            strata_buffer_pin(buf, 0, 2 * PAGE, STRATA_TIER_HOST, &mut pin),
            STRATA_OK
        );
        let mut a = [7u64; 3];
        let p = a.as_mut_ptr();
        fails(
            strata_pin_addresses(pin, p, 3, p.add(1).cast()),
            STRATA_ERR_INVALID_ARGUMENT,
            "share memory",
        );
        assert_eq!(a, [7; 3], "nothing written");
        assert_eq!(strata_unpin(pin), STRATA_OK);
        let mut map = null_mut();
        assert_eq!(strata_device_map(buf, &mut map), STRATA_OK);
        let mut c = [7u32; 4];
        let p = c.as_mut_ptr();
        fails(
            strata_map_counts(map, p, 4, p.add(2).cast()),
            STRATA_ERR_INVALID_ARGUMENT,
            "share memory",
        );
        assert_eq!(c, [7; 4]);
        assert_eq!(strata_map_free(map), STRATA_OK);
        let mut text = [0u64; 8];
        let b = text.as_mut_ptr();
        fails(
            strata_stats_json_copy(rt, b.cast(), 64, b.add(1).cast()),
            STRATA_ERR_INVALID_ARGUMENT,
            "share memory",
        );
        assert_eq!(text, [0; 8]);
        let before = last_error();
        assert_eq!(
            strata_last_error_copy(b.cast(), 64, b.add(2).cast()),
            STRATA_ERR_INVALID_ARGUMENT
        );
        assert_eq!(text, [0; 8]);
        assert_eq!(last_error(), before, "the last error stays");
    }
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn freed_and_forged_handles() {
    let rt = host_runtime();
    let buf = alloc(rt, PAGE);
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    fails(
        write(buf, 0, b"late"),
        STRATA_ERR_INVALID_HANDLE,
        "was freed",
    );
    fails(
        strata_buffer_free(buf),
        STRATA_ERR_INVALID_HANDLE,
        "was freed",
    );
    // A new buffer may reuse the slot; the old handle stays dead.
    let again = alloc(rt, PAGE);
    assert_ne!(again, buf);
    fails(
        write(buf, 0, b"late"),
        STRATA_ERR_INVALID_HANDLE,
        "buffer handle",
    );
    assert_eq!(write(again, 0, b"fine"), STRATA_OK);

    // Handles of one type passed as another.
    fails(
        strata_ticket_wait(forged(again as u64)),
        STRATA_ERR_INVALID_HANDLE,
        "not a live ticket handle",
    );
    fails(
        strata_runtime_destroy(forged(again as u64)),
        STRATA_ERR_INVALID_HANDLE,
        "runtime handle",
    );
    fails(
        strata_unpin(forged(rt as u64)),
        STRATA_ERR_INVALID_HANDLE,
        "pin handle",
    );
    // Forged values: small, large, real-looking pointers.
    let local = 0u64;
    for bits in [
        1u64,
        0xdead_beef,
        u64::MAX,
        &local as *const u64 as u64,
        (rt as u64) ^ 1 << 30,
    ] {
        fails(
            write(forged(bits), 0, b"x"),
            STRATA_ERR_INVALID_HANDLE,
            "not a live buffer handle",
        );
        fails(
            strata_ticket_poll(forged(bits)),
            STRATA_ERR_INVALID_HANDLE,
            "ticket",
        );
        fails(
            strata_map_free(forged(bits)),
            STRATA_ERR_INVALID_HANDLE,
            "device map",
        );
        fails(
            strata_string_free(forged(bits)),
            STRATA_ERR_INVALID_HANDLE,
            "not a string",
        );
        fails(
            strata_dlpack_free(forged(bits)),
            STRATA_ERR_INVALID_HANDLE,
            "not a DLPack tensor",
        );
    }
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    // Destroying twice: the handle is closed, not merely stale.
    fails(
        strata_runtime_destroy(rt),
        STRATA_ERR_CLOSED,
        "was destroyed",
    );
}

#[test]
fn calls_after_the_runtime_is_destroyed() {
    let rt = host_runtime();
    let buf = alloc(rt, 2 * PAGE);
    assert_eq!(write(buf, 0, b"data"), STRATA_OK);
    let (mut ticket, mut pin, mut map, mut launch) =
        (null_mut(), null_mut(), null_mut(), null_mut());
    // SAFETY: writable out-pointers.
    unsafe {
        assert_eq!(
            strata_prefetch(buf, 0, PAGE, STRATA_TIER_DEVICE, &mut ticket),
            STRATA_OK
        );
        assert_eq!(
            strata_buffer_pin(buf, PAGE, 1, STRATA_TIER_HOST, &mut pin),
            STRATA_OK
        );
        assert_eq!(strata_device_map(buf, &mut map), STRATA_OK);
        assert_eq!(
            strata_map_prepare(map, STRATA_ACCESS_READ_WRITE, &mut launch),
            STRATA_OK
        );
    }
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    let mut out = [0u8; 4];
    fails(
        read(buf, 0, &mut out),
        STRATA_ERR_CLOSED,
        "runtime was destroyed",
    );
    fails(strata_ticket_wait(ticket), STRATA_ERR_CLOSED, "ticket");
    fails(strata_unpin(pin), STRATA_ERR_CLOSED, "pin");
    fails(strata_launch_end(launch), STRATA_ERR_CLOSED, "launch");
    fails(strata_map_free(map), STRATA_ERR_CLOSED, "device map");
    fails(strata_buffer_free(buf), STRATA_ERR_CLOSED, "buffer");
    let mut other = null_mut();
    // SAFETY: a writable out-pointer.
    fails(
        unsafe { strata_alloc(rt, PAGE, &mut other) },
        STRATA_ERR_CLOSED,
        "runtime handle",
    );
    assert!(other.is_null(), "out-pointers are left alone on error");
    let mut json = null_mut();
    // SAFETY: a writable out-pointer.
    fails(
        unsafe { strata_stats_json(rt, &mut json, null_mut()) },
        STRATA_ERR_CLOSED,
        "runtime",
    );
}

#[test]
fn out_of_range_offsets_and_overflowing_lengths() {
    let rt = host_runtime();
    let buf = alloc(rt, 100);
    let mut small = [0u8; 8];
    fails(
        read(buf, 100, &mut small),
        STRATA_ERR_INVALID_ARGUMENT,
        "exceeds the buffer's 100 bytes",
    );
    fails(
        read(buf, u64::MAX, &mut small),
        STRATA_ERR_INVALID_ARGUMENT,
        "exceeds",
    );
    fails(
        write(buf, 96, &small),
        STRATA_ERR_INVALID_ARGUMENT,
        "exceeds",
    );
    // A length larger than the caller's memory is refused before it becomes
    // a slice (the range is checked against the buffer first).
    // SAFETY: the range check fails before `small` is touched.
    unsafe {
        let s = strata_read(buf, 0, small.as_mut_ptr().cast::<c_void>(), usize::MAX);
        fails(s, STRATA_ERR_INVALID_ARGUMENT, "exceeds");
        let s = strata_write(buf, 8, small.as_ptr().cast::<c_void>(), usize::MAX - 4);
        fails(s, STRATA_ERR_INVALID_ARGUMENT, "exceeds");
    }
    fails(
        strata_evict(buf, u64::MAX, 2, STRATA_TIER_HOST),
        STRATA_ERR_INVALID_ARGUMENT,
        "overflows",
    );
    fails(
        strata_evict(buf, 0, 1 << 40, STRATA_TIER_HOST),
        STRATA_ERR_INVALID_ARGUMENT,
        "outside",
    );
    let mut t = null_mut();
    // SAFETY: writable out-pointers.
    unsafe {
        fails(
            strata_prefetch(buf, 50, u64::MAX, STRATA_TIER_HOST, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "overflows",
        );
        fails(
            strata_prefetch(buf, 0, 101, STRATA_TIER_HOST, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "outside",
        );
        assert!(t.is_null());
        let mut p = null_mut();
        fails(
            strata_buffer_pin(buf, 99, 2, STRATA_TIER_HOST, &mut p),
            STRATA_ERR_INVALID_ARGUMENT,
            "outside",
        );
        let mut tier = 0;
        fails(
            strata_buffer_tier_of(buf, 1, &mut tier),
            STRATA_ERR_INVALID_ARGUMENT,
            "beyond",
        );
        fails(
            strata_buffer_tier_of(buf, usize::MAX, &mut tier),
            STRATA_ERR_INVALID_ARGUMENT,
            "beyond",
        );
        let mut b = null_mut();
        fails(
            strata_alloc(rt, 0, &mut b),
            STRATA_ERR_INVALID_ARGUMENT,
            "zero bytes",
        );
        fails(
            strata_alloc(rt, u64::MAX, &mut b),
            STRATA_ERR_OUT_OF_CAPACITY,
            "cannot allocate",
        );
        fails(
            strata_alloc(rt, 1 << 40, &mut b),
            STRATA_ERR_OUT_OF_CAPACITY,
            "cannot allocate",
        );
    }
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn unknown_enum_values_and_flags() {
    let rt = host_runtime();
    let buf = alloc(rt, PAGE);
    for bad in [-2, 4, 99, i32::MIN, i32::MAX] {
        fails(
            strata_evict(buf, 0, 1, bad),
            STRATA_ERR_INVALID_ARGUMENT,
            "unknown tier",
        );
        let mut b = null_mut();
        // SAFETY: writable out-pointers.
        unsafe {
            fails(
                strata_alloc_in(rt, PAGE, bad, &mut b),
                STRATA_ERR_INVALID_ARGUMENT,
                "unknown tier",
            );
            let mut t = null_mut();
            fails(
                strata_prefetch(buf, 0, 1, bad, &mut t),
                STRATA_ERR_INVALID_ARGUMENT,
                "unknown tier",
            );
            let mut map = null_mut();
            assert_eq!(strata_device_map(buf, &mut map), STRATA_OK);
            let mut l = null_mut();
            fails(
                strata_map_prepare(map, bad, &mut l),
                STRATA_ERR_INVALID_ARGUMENT,
                "unknown access",
            );
            assert_eq!(strata_map_free(map), STRATA_OK);
        }
    }
    // A tier that is not configured.
    let mut b = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_alloc_in(rt, PAGE, STRATA_TIER_CXL, &mut b) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "not configured");
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);

    let mut c = config(4, 16, 0, &CString::new("/").unwrap());
    let mut out = null_mut();
    type Spoil = fn(&mut strata_config);
    let cases: [(&str, Spoil); 8] = [
        ("config version", |c| c.version = 2),
        ("unknown device", |c| c.device = 7),
        ("unknown cxl mode", |c| c.cxl_mode = -1),
        ("unknown io engine", |c| c.nvme_engine = 3),
        ("background_eviction", |c| c.background_eviction = 2),
        ("power of two", |c| c.page_size = 3000),
        ("watermarks", |c| c.watermark_low = f64::NAN),
        ("watermarks", |c| c.watermark_high = 1.5),
    ];
    for (says, spoil) in cases {
        let mut bad = c;
        spoil(&mut bad);
        // SAFETY: a readable config and a writable out-pointer.
        fails(
            unsafe { strata_runtime_create(&bad, &mut out) },
            STRATA_ERR_INVALID_ARGUMENT,
            says,
        );
        assert!(out.is_null());
    }
    c.nvme_path = c"".as_ptr();
    c.nvme_capacity = PAGE;
    // SAFETY: as above.
    fails(
        unsafe { strata_runtime_create(&c, &mut out) },
        STRATA_ERR_INVALID_ARGUMENT,
        "empty",
    );
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_runtime_from_toml(std::ptr::null(), 0, 2, &mut out) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "unknown flags");
}

#[test]
fn config_text_that_is_not_utf8_or_not_toml() {
    let mut rt = null_mut();
    let cases: [(&[u8], &str); 4] = [
        (b"page_size = \"64k\"\n\xff\xfe", "not UTF-8"),
        (b"page_size = \"3k\"", "power of two"),
        (b"[host]\ncapacty = 1", "capacty"),
        (b"page_size = ", "config"),
    ];
    for (text, says) in cases {
        // SAFETY: `text` is readable for its length; a writable out-pointer.
        let s = unsafe { strata_runtime_from_toml(text.as_ptr().cast(), text.len(), 0, &mut rt) };
        fails(s, STRATA_ERR_INVALID_ARGUMENT, says);
        assert!(rt.is_null());
    }
    // SAFETY: a NULL text with a length is refused before it is read.
    let s = unsafe { strata_runtime_from_toml(std::ptr::null(), 5, 0, &mut rt) };
    fails(s, STRATA_ERR_NULL_POINTER, "text is NULL");
}

#[test]
fn a_config_naming_an_unwritable_nvme_path() {
    // Unwritable even for root: procfs takes no files, and nothing lives
    // under a regular file or in a directory that does not exist.
    // Each with the status of its cause: nothing there (ENOENT, ENOTDIR)
    // or not allowed (EPERM).
    for (path, want) in [
        ("/proc/strata-swap", STRATA_ERR_NOT_FOUND),
        ("/proc/self", STRATA_ERR_PERMISSION_DENIED),
        ("/etc/hostname/swap", STRATA_ERR_NOT_FOUND),
        ("/nonexistent-strata/dir/swap", STRATA_ERR_NOT_FOUND),
    ] {
        let c_path = CString::new(path).unwrap();
        let c = config(4, 16, 16, &c_path);
        let mut rt = null_mut();
        // SAFETY: a readable config with a live path, a writable out-pointer.
        let s = unsafe { strata_runtime_create(&c, &mut rt) };
        assert_eq!(s, want, "{path}: {}", last_error());
        assert!(rt.is_null());
        // The message names the path (or the directory it would go in).
        let parent = std::path::Path::new(path)
            .parent()
            .unwrap()
            .to_str()
            .unwrap();
        assert!(last_error().contains(parent), "{path}: {}", last_error());
        // The same through TOML.
        let toml = format!("[nvme]\npath = {path:?}\ncapacity = \"1M\"\n[host]\ncapacity = \"1M\"");
        // SAFETY: `toml` is readable for its length; a writable out-pointer.
        let s = unsafe { strata_runtime_from_toml(toml.as_ptr().cast(), toml.len(), 0, &mut rt) };
        assert_eq!(s, want, "{path}: {}", last_error());
        assert!(rt.is_null());
        assert!(last_error().contains(parent), "{path}: {}", last_error());
    }
}

#[test]
fn many_threads_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let rt = create(&config(8, 16, 64, &path)) as u64;
    let errors = Arc::new(AtomicUsize::new(0));
    let prefetched = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let errors = errors.clone();
            let prefetched = prefetched.clone();
            std::thread::spawn(move || {
                let rt = rt as *mut strata_runtime;
                for round in 0..20u64 {
                    let buf = alloc(rt, 3 * PAGE + 7);
                    let data: Vec<u8> = (0..3 * PAGE + 7)
                        .map(|i| pattern(t * 100 + round, i))
                        .collect();
                    assert_eq!(write(buf, 0, &data), STRATA_OK, "{}", last_error());
                    let mut ticket = null_mut();
                    let to = [STRATA_TIER_DEVICE, STRATA_TIER_HOST, STRATA_TIER_NVME]
                        [(round % 3) as usize];
                    // SAFETY: a writable out-pointer.
                    let s = unsafe { strata_prefetch(buf, 0, 3 * PAGE + 7, to, &mut ticket) };
                    if s != STRATA_OK {
                        // Refused at once only for want of room.
                        assert_eq!(s, STRATA_ERR_OUT_OF_CAPACITY, "{}", last_error());
                    } else {
                        prefetched.fetch_add(1, Ordering::Relaxed);
                        let s = strata_ticket_wait(ticket);
                        // A full tier is a legitimate outcome under load.
                        assert!(
                            s == STRATA_OK || s == STRATA_ERR_OUT_OF_CAPACITY,
                            "{s}: {}",
                            last_error()
                        );
                        assert_eq!(strata_ticket_free(ticket), STRATA_OK);
                    }
                    let mut back = vec![0u8; data.len()];
                    assert_eq!(read(buf, 0, &mut back), STRATA_OK, "{}", last_error());
                    assert!(back == data, "thread {t} round {round}");
                    // Wrong calls mixed in: each fails cleanly, none disturbs others.
                    if write(forged(0x77 + t), 0, b"x") != STRATA_ERR_INVALID_HANDLE {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = stats(rt);
                    assert_eq!(strata_buffer_free(buf), STRATA_OK);
                    if strata_buffer_free(buf) != STRATA_ERR_INVALID_HANDLE {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0);
    assert!(
        prefetched.load(Ordering::Relaxed) > 0,
        "no prefetch was taken"
    );
    assert_eq!(strata_runtime_destroy(rt as *mut _), STRATA_OK);
}

#[test]
fn destroying_a_runtime_while_threads_use_it() {
    let rt = host_runtime();
    let bufs: Vec<u64> = (0..4)
        .map(|i| {
            let b = alloc(rt, 2 * PAGE);
            assert_eq!(write(b, 0, &[i as u8; 100]), STRATA_OK);
            b as u64
        })
        .collect();
    let started = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = bufs
        .iter()
        .map(|&b| {
            let started = started.clone();
            std::thread::spawn(move || {
                let b = b as *mut strata_buffer;
                let mut out = [0u8; 100];
                let mut first = true;
                // Until this thread sees its buffer closed (or a generous
                // deadline on a loaded machine).
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                // A handle swept by the destruction reads CLOSED until its
                // slot is reused by another object (other tests run in
                // parallel), then INVALID_HANDLE: both mean "gone".
                let gone = |s| s == STRATA_ERR_CLOSED || s == STRATA_ERR_INVALID_HANDLE;
                while std::time::Instant::now() < deadline {
                    let s = read(b, 0, &mut out);
                    assert!(s == STRATA_OK || gone(s), "{s}: {}", last_error());
                    if gone(s) {
                        assert!(!first, "the buffer was gone before its first read");
                        return true;
                    }
                    if first {
                        started.fetch_add(1, Ordering::SeqCst);
                        first = false;
                    }
                    let mut t = null_mut();
                    // SAFETY: a writable out-pointer.
                    let s = unsafe { strata_prefetch(b, 0, PAGE, STRATA_TIER_DEVICE, &mut t) };
                    assert!(s == STRATA_OK || gone(s), "{s}: {}", last_error());
                    if s == STRATA_OK {
                        let s = strata_ticket_wait(t);
                        assert!(s == STRATA_OK || gone(s), "{s}: {}", last_error());
                        let s = strata_ticket_free(t);
                        assert!(s == STRATA_OK || gone(s), "{s}: {}", last_error());
                    }
                }
                false
            })
        })
        .collect();
    // Destroy once every thread is busy with its buffer.
    while started.load(Ordering::SeqCst) < threads.len() {
        std::thread::yield_now();
    }
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    for t in threads {
        assert!(t.join().unwrap(), "a thread never saw its buffer closed");
    }
}
