//! Helpers for the tests that call the C ABI from Rust, as C would.
#![allow(dead_code)]

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use strata_ffi::*;

pub const PAGE: u64 = 64 << 10;

/// This thread's last error message.
pub fn last_error() -> String {
    // SAFETY: strata_last_error returns a NUL-terminated string valid until
    // the next strata call on this thread; it is copied at once.
    unsafe { CStr::from_ptr(strata_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts that `status` is `want` and that the last error says `says`.
#[track_caller]
pub fn fails(status: i32, want: i32, says: &str) {
    assert_eq!(
        status,
        want,
        "status {status}, last error: {}",
        last_error()
    );
    let message = last_error();
    assert!(
        message.to_lowercase().contains(&says.to_lowercase()),
        "last error {message:?} does not mention {says:?}"
    );
}

/// The defaults from strata_config_init.
pub fn default_config() -> strata_config {
    let mut c = std::mem::MaybeUninit::<strata_config>::uninit();
    // SAFETY: a writable strata_config.
    assert_eq!(unsafe { strata_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: strata_config_init filled every field.
    unsafe { c.assume_init() }
}

/// A simulated device of `device_pages`, a host tier of `host_pages` and an
/// NVMe tier in `dir` of `nvme_pages` (none if 0). `path` keeps the C
/// string alive while the config is used.
pub fn config(
    device_pages: u64,
    host_pages: u64,
    nvme_pages: u64,
    path: &CString,
) -> strata_config {
    let mut c = default_config();
    c.device = STRATA_DEVICE_SIM;
    c.device_capacity = device_pages * PAGE;
    c.host_capacity = host_pages * PAGE;
    if nvme_pages > 0 {
        c.nvme_path = path.as_ptr();
        c.nvme_capacity = nvme_pages * PAGE;
    }
    c
}

pub fn c_path(dir: &Path) -> CString {
    CString::new(dir.as_os_str().as_bytes()).unwrap()
}

/// A runtime from a config, or the test fails with the message.
pub fn create(c: &strata_config) -> *mut strata_runtime {
    let mut rt = std::ptr::null_mut();
    // SAFETY: a readable config whose path (if any) is a live C string, and a
    // writable out-pointer.
    let status = unsafe { strata_runtime_create(c, &mut rt) };
    assert_eq!(status, STRATA_OK, "{}", last_error());
    rt
}

pub fn alloc(rt: *const strata_runtime, bytes: u64) -> *mut strata_buffer {
    let mut buf = std::ptr::null_mut();
    // SAFETY: a writable out-pointer.
    let status = unsafe { strata_alloc(rt, bytes, &mut buf) };
    assert_eq!(status, STRATA_OK, "{}", last_error());
    buf
}

pub fn write(buf: *const strata_buffer, offset: u64, data: &[u8]) -> i32 {
    // SAFETY: `data` is readable for its length.
    unsafe { strata_write(buf, offset, data.as_ptr().cast(), data.len()) }
}

pub fn read(buf: *const strata_buffer, offset: u64, out: &mut [u8]) -> i32 {
    // SAFETY: `out` is writable for its length and ours alone.
    unsafe { strata_read(buf, offset, out.as_mut_ptr().cast(), out.len()) }
}

pub fn tier_of(buf: *const strata_buffer, page: usize) -> strata_tier {
    let mut t = -2;
    // SAFETY: a writable strata_tier.
    let status = unsafe { strata_buffer_tier_of(buf, page, &mut t) };
    assert_eq!(status, STRATA_OK, "{}", last_error());
    t
}

pub fn stats(rt: *const strata_runtime) -> serde_json::Value {
    let mut s = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: writable out-pointers.
    let status = unsafe { strata_stats_json(rt, &mut s, &mut len) };
    assert_eq!(status, STRATA_OK, "{}", last_error());
    // SAFETY: strata_stats_json returned a NUL-terminated string of `len` bytes.
    let text = unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_owned();
    assert_eq!(text.len(), len);
    assert_eq!(strata_string_free(s), STRATA_OK);
    serde_json::from_str(&text).unwrap()
}

/// A deterministic byte for position `i` of buffer `seed`.
pub fn pattern(seed: u64, i: u64) -> u8 {
    (i.wrapping_mul(2654435761)
        .wrapping_add(seed.wrapping_mul(40503))
        >> 7) as u8
}
