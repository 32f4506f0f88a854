//! One source of configuration defaults: the same settings given as Rust
//! `Settings` and as TOML resolve to equal configurations, a bad value
//! gives the same message both ways, and a built runtime carries every
//! setting. (The C and Python front ends have their own tests:
//! `ffi/tests/config.rs`, `python/tests/test_runtime.py`.)

use strata::config::{Config, Settings, DEFAULT_PAGE_SIZE};
use strata::device::DeviceChoice;
use strata::io::EngineChoice;
use strata::policy::PolicyKind;
use strata::sys::Topology;
use strata::tier::CxlMode;

fn no_env(_: &str) -> Option<String> {
    None
}

fn toml(text: &str) -> strata::Result<Config> {
    Config::resolve(Some(text), &no_env, &Topology::default())
}

fn rust(s: &Settings) -> strata::Result<Config> {
    Config::from_settings(s, &Topology::default())
}

/// Every setting away from its default, as Rust settings and as TOML.
fn every_setting(dir: &std::path::Path) -> (Settings, String) {
    let mut s = Settings::default();
    s.page_size = Some(16 << 10);
    s.device = Some(DeviceChoice::Sim);
    s.device_capacity = Some(256 << 10);
    s.host_capacity = Some(1 << 20);
    s.huge_pages = Some(false);
    s.numa_node = Some(0);
    s.cxl_mode = Some(CxlMode::Emulated);
    s.cxl_capacity = Some(512 << 10);
    s.cxl_bandwidth = Some(5 << 30);
    s.cxl_latency_ns = Some(250);
    s.nvme_path = Some(dir.to_path_buf());
    s.nvme_capacity = Some(2 << 20);
    s.nvme_engine = Some(EngineChoice::Psync);
    s.nvme_queue_depth = Some(8);
    s.watermark_low = Some(0.5);
    s.watermark_high = Some(0.75);
    s.policy = Some(PolicyKind::Lru);
    s.background_eviction = Some(false);
    s.sampling = Some(Some(3));
    let text = format!(
        r#"
        page_size = "16k"
        device = "sim"
        device_capacity = "256k"
        watermark_low = 0.5
        watermark_high = 0.75
        policy = "lru"
        background_eviction = false
        sampling = 3
        [host]
        capacity = "1M"
        huge_pages = false
        numa_node = 0
        [cxl]
        mode = "emulated"
        capacity = "512k"
        bandwidth = "5G"
        latency_ns = 250
        [nvme]
        path = {:?}
        capacity = "2M"
        engine = "psync"
        queue_depth = 8
        "#,
        dir.display().to_string()
    );
    (s, text)
}

#[test]
fn every_setting_resolves_alike_from_rust_and_toml() {
    let dir = tempfile::tempdir().unwrap();
    let (s, text) = every_setting(dir.path());
    let from_rust = rust(&s).unwrap();
    assert_eq!(from_rust, toml(&text).unwrap());
    assert_eq!(from_rust.to_json(), toml(&text).unwrap().to_json());
    // Each setting arrived.
    assert_eq!(from_rust.page_size, 16 << 10);
    assert_eq!(from_rust.device, DeviceChoice::Sim);
    assert_eq!(from_rust.device_capacity, Some(256 << 10));
    assert_eq!(from_rust.host.capacity, 1 << 20);
    assert!(!from_rust.host.huge_pages);
    assert_eq!(from_rust.host.numa_node, Some(0));
    let cxl = from_rust.cxl.as_ref().unwrap();
    assert_eq!(cxl.mode, CxlMode::Emulated);
    assert_eq!(cxl.capacity, 512 << 10);
    assert_eq!(cxl.bandwidth, Some((5u64 << 30) as f64));
    assert_eq!(cxl.latency_ns, 250);
    let nvme = from_rust.nvme.as_ref().unwrap();
    assert_eq!(nvme.path, dir.path());
    assert_eq!(nvme.capacity, 2 << 20);
    assert_eq!(nvme.engine, EngineChoice::Psync);
    assert_eq!(nvme.queue_depth, 8);
    assert_eq!(
        (from_rust.watermarks.low, from_rust.watermarks.high),
        (0.5, 0.75)
    );
    assert_eq!(from_rust.policy, PolicyKind::Lru);
    assert!(!from_rust.background_eviction);
    assert_eq!(from_rust.sampling, Some(3));
    let json: serde_json::Value = serde_json::from_str(&from_rust.to_json()).unwrap();
    assert_eq!(json["policy"], "lru");
    assert_eq!(json["sampling"], 3);
    assert_eq!(json["host"]["numa_node"], 0);
}

#[test]
fn unset_settings_take_the_defaults_of_an_empty_file() {
    let empty = rust(&Settings::default()).unwrap();
    // The NVMe tier's default capacity follows the free space of its
    // directory, which the tests running beside this one change between
    // two resolutions: compared within a margin, then set equal.
    let same = |mut other: Config| {
        let (a, b) = (
            empty.nvme.as_ref().unwrap().capacity,
            other.nvme.as_ref().unwrap().capacity,
        );
        assert!(a.abs_diff(b) <= a / 100, "NVMe capacity {a} against {b}");
        other.nvme.as_mut().unwrap().capacity = a;
        other
    };
    assert_eq!(empty, same(toml("").unwrap()));
    assert_eq!(
        empty,
        same(Config::resolve(None, &no_env, &Topology::default()).unwrap())
    );
    assert_eq!(empty.page_size, DEFAULT_PAGE_SIZE);
    assert!(empty.host.huge_pages && empty.host.numa_node.is_none());
    assert!(empty.background_eviction);
    assert_eq!(empty.sampling, Some(0));
    assert_eq!(empty.policy, PolicyKind::Default);
    assert_eq!(empty.nvme.as_ref().unwrap().queue_depth, 32);
    // What a program starts from (C's strata_config_init, Python's
    // keywords): no CXL or NVMe tier unless asked.
    let mut program = Settings::default();
    program.cxl_mode = Some(CxlMode::Off);
    program.nvme_capacity = Some(0);
    let c = rust(&program).unwrap();
    assert!(c.cxl.is_none() && c.nvme.is_none());
    assert_eq!(
        c,
        toml("[cxl]\nmode = \"off\"\n[nvme]\ncapacity = 0\n").unwrap()
    );
    // A capacity of 0 turns the device, CXL and NVMe tiers off alike.
    let c = toml("device_capacity = 0\n[cxl]\nmode = \"emulated\"\ncapacity = 0\n").unwrap();
    assert_eq!(c.device_capacity, Some(0));
    assert!(c.cxl.is_none());
}

#[test]
fn the_environment_still_overrides_the_file() {
    let env = |k: &str| match k {
        "STRATA_PAGE_SIZE" => Some("8k".to_owned()),
        "STRATA_POLICY" => Some("arc".to_owned()),
        "STRATA_CXL_MODE" => Some("off".to_owned()),
        _ => None,
    };
    let text = "page_size = \"16k\"\npolicy = \"lru\"\n[cxl]\nmode = \"emulated\"\n";
    let c = Config::resolve(Some(text), &env, &Topology::default()).unwrap();
    assert_eq!(c.page_size, 8 << 10);
    assert_eq!(c.policy, PolicyKind::Arc);
    assert!(c.cxl.is_none());
    let env = |k: &str| (k == "STRATA_CXL_MODE").then(|| "cxl2".to_owned());
    let e = Config::resolve(None, &env, &Topology::default()).unwrap_err();
    assert!(
        e.message().starts_with("STRATA_CXL_MODE: unknown cxl mode"),
        "{e}"
    );
}

#[test]
fn a_bad_value_gives_the_same_message_from_rust_and_toml() {
    type Spoil = fn(&mut Settings);
    let cases: [(Spoil, &str, &str); 16] = [
        (
            |s| s.page_size = Some(3000),
            "page_size = 3000",
            "power of two",
        ),
        (
            |s| s.page_size = Some(8 << 20),
            "page_size = \"8M\"",
            "outside 4K..2M",
        ),
        (
            |s| (s.watermark_low, s.watermark_high) = (Some(0.9), Some(0.5)),
            "watermark_low = 0.9\nwatermark_high = 0.5",
            "watermarks",
        ),
        (
            |s| s.sampling = Some(Some(17)),
            "sampling = 17",
            "at most 2^16",
        ),
        (
            |s| s.nvme_queue_depth = Some(0),
            "[nvme]\nqueue_depth = 0",
            "queue depth 0",
        ),
        (
            |s| s.host_capacity = Some(100),
            "[host]\ncapacity = 100",
            "holds no whole page",
        ),
        (
            |s| s.nvme_capacity = Some(100_000),
            "[nvme]\ncapacity = 100000",
            "not a multiple of the page size",
        ),
        (
            |s| s.nvme_path = Some("".into()),
            "[nvme]\npath = \"\"",
            "nvme path is empty",
        ),
        (
            |s| (s.cxl_mode, s.cxl_capacity) = (Some(CxlMode::Emulated), Some(100)),
            "[cxl]\nmode = \"emulated\"\ncapacity = 100",
            "cxl capacity 100",
        ),
        // What the tiers would refuse when opened is refused here already
        // (so a config shown as valid builds).
        (
            |s| s.host_capacity = Some(1 << 60),
            "[host]\ncapacity = 1152921504606846976",
            "too many pages",
        ),
        (
            |s| (s.cxl_mode, s.cxl_bandwidth) = (Some(CxlMode::Emulated), Some(0)),
            "[cxl]\nmode = \"emulated\"\nbandwidth = 0",
            "below 1 MB/s",
        ),
        (
            |s| (s.cxl_mode, s.cxl_latency_ns) = (Some(CxlMode::Emulated), Some(5_000_000)),
            "[cxl]\nmode = \"emulated\"\nlatency_ns = 5000000",
            "above 1 ms",
        ),
        (
            |s| (s.device, s.device_capacity) = (Some(DeviceChoice::Sim), Some(1000)),
            "device = \"sim\"\ndevice_capacity = 1000",
            "device capacity 1000 holds no whole page",
        ),
        (
            |s| (s.device, s.device_capacity) = (Some(DeviceChoice::Sim), Some(1 << 60)),
            "device = \"sim\"\ndevice_capacity = 1152921504606846976",
            "device capacity 1152921504606846976 has too many pages",
        ),
        (
            |s| (s.page_size, s.nvme_capacity) = (Some(2 << 20), Some(2 << 20)),
            "page_size = \"2M\"\n[nvme]\ncapacity = \"2M\"",
            "needs at least 2",
        ),
        (
            |s| s.policy = Some(PolicyKind::Belady),
            "policy = \"belady\"",
            "needs the whole trace",
        ),
    ];
    for (spoil, text, says) in cases {
        let mut s = Settings::default();
        spoil(&mut s);
        let from_rust = rust(&s).unwrap_err();
        let from_toml = toml(text).unwrap_err();
        assert_eq!(from_rust.message(), from_toml.message(), "{text}");
        assert_eq!(from_rust.kind(), strata::ErrorKind::InvalidArgument);
        assert!(from_rust.message().contains(says), "{from_rust}");
    }
    // Names parse to the same error wherever they come from.
    assert_eq!(
        toml("sampling = \"often\"").unwrap_err().message(),
        strata::config::parse_sampling("often")
            .unwrap_err()
            .message()
    );
    assert_eq!(
        toml("policy = \"mru\"").unwrap_err().message(),
        "mru".parse::<PolicyKind>().unwrap_err().message()
    );
    assert_eq!(
        toml("[nvme]\nengine = \"aio\"").unwrap_err().message(),
        "aio".parse::<EngineChoice>().unwrap_err().message()
    );
    assert_eq!(
        toml("device = \"tpu\"").unwrap_err().message(),
        "tpu".parse::<DeviceChoice>().unwrap_err().message()
    );
    assert_eq!(
        toml("[cxl]\nmode = \"cxl2\"").unwrap_err().message(),
        strata::config::parse_cxl_mode("cxl2")
            .unwrap_err()
            .message()
    );
}

#[test]
fn a_built_runtime_carries_every_setting() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, _) = every_setting(dir.path());
    // NUMA binding needs mbind, which some sandboxes refuse; it is covered
    // by the resolution above.
    s.numa_node = None;
    let config = rust(&s).unwrap();
    let rt = config.build().unwrap();
    assert_eq!(rt.page_size(), 16 << 10);
    assert_eq!(rt.sampling(), Some(3));
    assert_eq!(
        rt.tiers(),
        vec![
            strata::Tier::Device,
            strata::Tier::Host,
            strata::Tier::Cxl,
            strata::Tier::Nvme
        ]
    );
    let mut off = Settings::default();
    off.sampling = Some(None);
    off.nvme_capacity = Some(0);
    off.host_capacity = Some(1 << 20);
    off.device_capacity = Some(0);
    assert_eq!(rust(&off).unwrap().build().unwrap().sampling(), None);
}

#[test]
fn a_path_that_is_not_utf8_is_shown_lossily() {
    use std::os::unix::ffi::OsStrExt;
    let mut s = Settings::default();
    s.nvme_path = Some(std::ffi::OsStr::from_bytes(b"/tmp/swap-\xff").into());
    s.nvme_capacity = Some(1 << 20);
    let json: serde_json::Value = serde_json::from_str(&rust(&s).unwrap().to_json()).unwrap();
    assert_eq!(json["nvme"]["path"], "/tmp/swap-\u{fffd}");
}
