//! The C front end of the configuration: `strata_config` reaches every
//! setting, its defaults are the configuration's, and the resolved
//! configuration (`strata_config_json`, `strata_runtime_config_json`)
//! equals what TOML and Rust give for the same settings; a bad value gives
//! `STRATA_ERR_INVALID_ARGUMENT` with the message TOML gives.

mod common;

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};

use common::*;
use strata::config::Config;
use strata::sys::Topology;
use strata_ffi::*;

/// Takes a JSON string strata handed out, and frees it.
fn take_json(status: i32, s: *mut c_char, len: usize) -> serde_json::Value {
    assert_eq!(status, STRATA_OK, "{}", last_error());
    // SAFETY: strata returned a NUL-terminated string of `len` bytes.
    let text = unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_owned();
    assert_eq!(text.len(), len);
    assert_eq!(strata_string_free(s), STRATA_OK);
    serde_json::from_str(&text).unwrap()
}

/// What `c` resolves to, without opening a tier.
fn resolved(c: &strata_config) -> serde_json::Value {
    let (mut s, mut len) = (null_mut(), 0);
    // SAFETY: a readable config (its path, if any, a live C string) and
    // writable out-pointers.
    let status = unsafe { strata_config_json(c, &mut s, &mut len) };
    take_json(status, s, len)
}

fn runtime_config(rt: *const strata_runtime) -> serde_json::Value {
    let (mut s, mut len) = (null_mut(), 0);
    // SAFETY: writable out-pointers.
    let status = unsafe { strata_runtime_config_json(rt, &mut s, &mut len) };
    take_json(status, s, len)
}

/// What Rust resolves TOML text to, without the environment.
fn rust_toml(text: &str) -> serde_json::Value {
    let c = Config::resolve(Some(text), &|_| None, &Topology::detect()).unwrap();
    serde_json::from_str(&c.to_json()).unwrap()
}

/// `other` with the NVMe tier's capacity set to `first`'s. Where no capacity
/// is given it follows the free space of the tier's directory, which the tests
/// running beside this one change between two resolutions: the two are
/// compared within a margin first.
fn free_space_equal(first: &serde_json::Value, mut other: serde_json::Value) -> serde_json::Value {
    let capacity = |v: &serde_json::Value| v["nvme"]["capacity"].as_u64().unwrap();
    let (a, b) = (capacity(first), capacity(&other));
    assert!(a.abs_diff(b) <= a / 100, "NVMe capacity {a} against {b}");
    other["nvme"]["capacity"] = a.into();
    other
}

fn from_toml(text: &str) -> *mut strata_runtime {
    let mut rt = null_mut();
    // SAFETY: `text` is readable for its length; a writable out-pointer.
    let s = unsafe { strata_runtime_from_toml(text.as_ptr().cast(), text.len(), 0, &mut rt) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    rt
}

/// Every setting away from its default, in C (with `path`) and as TOML.
fn every_setting(path: &CString, numa: bool) -> (strata_config, String) {
    let mut c = default_config();
    c.page_size = 16 << 10;
    c.device = STRATA_DEVICE_SIM;
    c.device_capacity = 256 << 10;
    c.host_capacity = 1 << 20;
    c.huge_pages = 0;
    c.numa_node = if numa { 0 } else { STRATA_NUMA_NONE };
    c.cxl_mode = STRATA_CXL_EMULATED;
    c.cxl_capacity = 512 << 10;
    c.cxl_bandwidth = 5 << 30;
    c.cxl_latency_ns = 250;
    c.nvme_path = path.as_ptr();
    c.nvme_capacity = 2 << 20;
    c.nvme_engine = STRATA_IO_PSYNC;
    c.nvme_queue_depth = 8;
    c.watermark_low = 0.5;
    c.watermark_high = 0.75;
    c.policy = STRATA_POLICY_LRU;
    c.background_eviction = 0;
    c.sampling = 3;
    let text = format!(
        "page_size = \"16k\"\ndevice = \"sim\"\ndevice_capacity = \"256k\"\n\
         watermark_low = 0.5\nwatermark_high = 0.75\npolicy = \"lru\"\n\
         background_eviction = false\nsampling = 3\n\
         [host]\ncapacity = \"1M\"\nhuge_pages = false\n{}\
         [cxl]\nmode = \"emulated\"\ncapacity = \"512k\"\nbandwidth = \"5G\"\nlatency_ns = 250\n\
         [nvme]\npath = {:?}\ncapacity = \"2M\"\nengine = \"psync\"\nqueue_depth = 8\n",
        if numa { "numa_node = 0\n" } else { "" },
        path.to_str().unwrap()
    );
    (c, text)
}

#[test]
fn every_setting_resolves_alike_from_c_toml_and_rust() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    // Resolved without opening a tier: every setting, the NUMA node included.
    let (c, text) = every_setting(&path, true);
    let from_c = resolved(&c);
    assert_eq!(from_c, rust_toml(&text));
    assert_eq!(from_c["host"]["numa_node"], 0);
    assert_eq!(from_c["policy"], "lru");
    assert_eq!(from_c["sampling"], 3);
    assert_eq!(from_c["background_eviction"], false);
    assert_eq!(from_c["cxl"]["latency_ns"], 250);
    assert_eq!(from_c["nvme"]["queue_depth"], 8);
    // Built: the runtime's configuration from the struct and from TOML.
    let (c, text) = every_setting(&path, false);
    let rt = create(&c);
    let built = runtime_config(rt);
    assert_eq!(built, resolved(&c));
    let rt2 = from_toml(&text);
    assert_eq!(built, runtime_config(rt2));
    assert_eq!(built, rust_toml(&text));
    let mut mask = 0;
    // SAFETY: a writable mask.
    assert_eq!(unsafe { strata_runtime_tiers(rt, &mut mask) }, STRATA_OK);
    assert_eq!(mask, 0b1111);
    for r in [rt, rt2] {
        assert_eq!(strata_runtime_destroy(r), STRATA_OK);
    }
    // A destroyed runtime's configuration is gone with it.
    let (mut s, mut len) = (null_mut(), 0);
    // SAFETY: writable out-pointers.
    let status = unsafe { strata_runtime_config_json(rt, &mut s, &mut len) };
    fails(status, STRATA_ERR_CLOSED, "destroyed");
}

#[test]
fn the_defaults_of_strata_config_init_are_the_configurations() {
    let c = default_config();
    assert_eq!(c.version, STRATA_CONFIG_VERSION);
    assert_eq!(c.host_capacity, STRATA_CONFIG_DEFAULT);
    // A program asks for CXL and NVMe tiers; the rest is the defaults of an
    // empty config file.
    let program = "[cxl]\nmode = \"off\"\n[nvme]\ncapacity = 0\n";
    assert_eq!(resolved(&c), rust_toml(program));
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let mut c = default_config();
    c.nvme_path = path.as_ptr();
    c.cxl_mode = STRATA_CXL_EMULATED;
    let text = format!(
        "[cxl]\nmode = \"emulated\"\n[nvme]\npath = {:?}\n",
        path.to_str().unwrap()
    );
    let from_c = resolved(&c);
    assert_eq!(from_c, free_space_equal(&from_c, rust_toml(&text)));
    // Sampling off, and every policy the header names.
    let mut c = default_config();
    c.sampling = STRATA_SAMPLING_OFF;
    assert_eq!(resolved(&c)["sampling"], serde_json::Value::Null);
    for (code, name) in [
        (STRATA_POLICY_DEFAULT, "default"),
        (STRATA_POLICY_LFU, "lfu"),
        (STRATA_POLICY_GMT, "gmt"),
        (STRATA_POLICY_LOOKAHEAD, "lookahead"),
        (STRATA_POLICY_ARC, "arc"),
        (STRATA_POLICY_S3FIFO, "s3fifo"),
        (STRATA_POLICY_SIEVE, "sieve"),
        (STRATA_POLICY_LRFU, "lrfu"),
        (STRATA_POLICY_PERFECT_LFU, "perfect-lfu"),
        (STRATA_POLICY_LFU_ADMISSION, "lfu-admission"),
    ] {
        c.policy = code;
        assert_eq!(resolved(&c)["policy"], name);
    }
    // Belady's MIN, named for trace replay, needs the future: refused for
    // a runtime's balancer, which runs online.
    c.policy = STRATA_POLICY_BELADY;
    let (mut s, mut len) = (null_mut(), 0);
    // SAFETY: a readable config and writable out-pointers.
    let status = unsafe { strata_config_json(&c, &mut s, &mut len) };
    assert_eq!(status, STRATA_ERR_INVALID_ARGUMENT);
    assert!(s.is_null());
    assert!(
        common::last_error().contains("needs the whole trace"),
        "{}",
        common::last_error()
    );
}

#[test]
fn a_bad_value_gives_the_message_toml_gives() {
    type Spoil = fn(&mut strata_config);
    let cases: [(Spoil, &str); 7] = [
        (|c| c.page_size = 3000, "page_size = 3000"),
        (
            |c| (c.watermark_low, c.watermark_high) = (0.9, 0.5),
            "watermark_low = 0.9\nwatermark_high = 0.5",
        ),
        (|c| c.sampling = 17, "sampling = 17"),
        (|c| c.host_capacity = 100, "[host]\ncapacity = 100"),
        (
            |c| (c.cxl_mode, c.cxl_capacity) = (STRATA_CXL_EMULATED, 100),
            "[cxl]\nmode = \"emulated\"\ncapacity = 100",
        ),
        (|c| c.nvme_queue_depth = 0, "[nvme]\nqueue_depth = 0"),
        (|c| c.nvme_capacity = 100_000, "[nvme]\ncapacity = 100000"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    for (spoil, text) in cases {
        let mut c = default_config();
        c.nvme_path = path.as_ptr();
        c.nvme_capacity = 1 << 20;
        spoil(&mut c);
        let want = Config::resolve(Some(text), &|_| None, &Topology::detect())
            .unwrap_err()
            .message()
            .to_owned();
        let mut rt = null_mut();
        // SAFETY: a readable config with a live path, a writable out-pointer.
        let s = unsafe { strata_runtime_create(&c, &mut rt) };
        fails(s, STRATA_ERR_INVALID_ARGUMENT, &want);
        assert_eq!(last_error(), format!("strata_runtime_create: {want}"));
        assert!(rt.is_null());
        let (mut json, mut len) = (null_mut(), 0);
        // SAFETY: as above, with writable out-pointers.
        let s = unsafe { strata_config_json(&c, &mut json, &mut len) };
        fails(s, STRATA_ERR_INVALID_ARGUMENT, &want);
        assert!(json.is_null());
        // SAFETY: `text` is readable for its length; a writable out-pointer.
        let s = unsafe { strata_runtime_from_toml(text.as_ptr().cast(), text.len(), 0, &mut rt) };
        fails(s, STRATA_ERR_INVALID_ARGUMENT, &want);
        assert_eq!(last_error(), format!("strata_runtime_from_toml: {want}"));
    }
}

#[test]
fn integers_from_c_are_checked_before_they_become_settings() {
    type Spoil = fn(&mut strata_config);
    let cases: [(Spoil, &str); 5] = [
        (|c| c.huge_pages = 2, "huge_pages 2 is not 0 or 1"),
        (|c| c.numa_node = -2, "numa_node -2 is not a node"),
        (|c| c.policy = 12, "unknown policy 12"),
        (|c| c.version = 1, "config version 1"),
        (|c| c.background_eviction = 7, "background_eviction 7"),
    ];
    for (spoil, says) in cases {
        let mut c = default_config();
        spoil(&mut c);
        let (mut json, mut len) = (null_mut(), 0);
        // SAFETY: a readable config and writable out-pointers.
        let s = unsafe { strata_config_json(&c, &mut json, &mut len) };
        fails(s, STRATA_ERR_INVALID_ARGUMENT, says);
    }
    // A struct of another layout is refused after its version alone is read.
    let old_layout: u64 = 1;
    let (mut json, mut len) = (null_mut(), 0);
    // SAFETY: the version at the start is readable (the rest of this object
    // is not a strata_config, and is never read).
    let s = unsafe { strata_config_json((&old_layout as *const u64).cast(), &mut json, &mut len) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "must be rebuilt");
    // SAFETY: NULL pointers are refused before anything is read.
    unsafe {
        fails(
            strata_config_json(null(), &mut json, &mut len),
            STRATA_ERR_NULL_POINTER,
            "config is NULL",
        );
        let c = default_config();
        fails(
            strata_config_json(&c, null_mut(), &mut len),
            STRATA_ERR_NULL_POINTER,
            "json is NULL",
        );
        fails(
            strata_runtime_config_json(null(), &mut json, &mut len),
            STRATA_ERR_NULL_POINTER,
            "",
        );
    }
    // The length is optional.
    let c = default_config();
    // SAFETY: a readable config and a writable out-pointer.
    let s = unsafe { strata_config_json(&c, &mut json, null_mut()) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(strata_string_free(json), STRATA_OK);
}
