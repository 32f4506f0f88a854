//! Runtimes: made from a config struct or TOML text, destroyed with
//! everything made through them; their resolved configuration and stats as
//! JSON.
//!
//! `strata_config` is a partial configuration: `strata_config_init` leaves
//! every capacity at `STRATA_CONFIG_DEFAULT` and the other fields at the
//! values `strata::config` defines as defaults; `settings` turns it into
//! `strata::config::Settings`, which `Config::from_settings` merges over the
//! defaults and checks, as for TOML and Python.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use parking_lot::Mutex;
use strata::config::{self, Config, Settings};
use strata::device::DeviceChoice;
use strata::io::EngineChoice;
use strata::runtime::Watermarks;
use strata::sys::Topology;

use crate::cast::{self, SetOpt};
use crate::enums::*;
use crate::handle::{Owner, Quarantine};
use crate::objects::{
    self, strata_runtime, RtObj, BUFFERS, LAUNCHES, MAPS, PINS, RUNTIMES, TICKETS,
};
use crate::status::{boundary, Fail, R, STRATA_ERR_CLOSED, STRATA_ERR_INVALID_HANDLE, STRATA_OK};

/// The layout of `strata_config` this library reads: its size in bytes, so
/// that each layout has its own number (the first layout, which ended at
/// `watermark_high`, was 1). Set by `strata_config_init`.
pub const STRATA_CONFIG_VERSION: u32 = 120;

const _: () = assert!(std::mem::size_of::<strata_config>() == STRATA_CONFIG_VERSION as usize);

/// A capacity, rate or latency in `strata_config` left to its default (the
/// value `strata_config_init` writes there).
pub const STRATA_CONFIG_DEFAULT: u64 = u64::MAX;

/// `strata_config.numa_node`: no NUMA binding (the default).
pub const STRATA_NUMA_NONE: i32 = -1;

/// `strata_config.sampling`: no access counting.
pub const STRATA_SAMPLING_OFF: u32 = u32::MAX;

/// Flag for `strata_runtime_from_toml`: `STRATA_*` environment variables
/// override the text (and with NULL text, `$STRATA_CONFIG` names a file), as
/// for the `strata` command.
pub const STRATA_TOML_USE_ENV: u32 = 1;

/// How to build a runtime: a partial configuration. Fill it with
/// `strata_config_init`, then change the fields you want; what you leave
/// keeps the default of the configuration (the same as TOML's and
/// Python's). Capacities are in bytes; `STRATA_CONFIG_DEFAULT` leaves one
/// to its default, and a device, CXL or NVMe capacity of 0 turns that tier
/// off (the host tier is always present). A program gets a CXL tier only
/// when `cxl_mode` asks for one and an NVMe tier only with an `nvme_path`.
/// `strata_config_json` shows what a config resolves to.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct strata_config {
    /// `STRATA_CONFIG_VERSION` (set by `strata_config_init`).
    pub version: u32,
    /// `STRATA_DEVICE_*` (default `STRATA_DEVICE_AUTO`).
    pub device: strata_device,
    /// Page size of every tier: a power of two, 4 KiB … 2 MiB (default 64
    /// KiB, which `STRATA_CONFIG_DEFAULT` also leaves it to).
    pub page_size: u64,
    /// The device tier's size: the simulated GPU's (default 1 GiB), or a
    /// cap on a real one (default: all the GPU's free memory less a
    /// reserve). 0: no device tier.
    pub device_capacity: u64,
    /// Host DRAM tier capacity (default: a quarter of physical memory).
    pub host_capacity: u64,
    /// `STRATA_CXL_*` (default `STRATA_CXL_OFF`: no CXL tier).
    pub cxl_mode: strata_cxl_mode,
    /// `STRATA_IO_*`: the NVMe tier's engine (default `STRATA_IO_AUTO`).
    pub nvme_engine: strata_io_engine,
    /// CXL tier capacity (default: the CXL node's memory, else half the
    /// host tier). 0: no CXL tier.
    pub cxl_capacity: u64,
    /// NVMe tier: a directory (a private swap file is made in it), a new
    /// file name, or a block device; NULL for no NVMe tier. Read during
    /// the call it is passed to only.
    pub nvme_path: *const c_char,
    /// NVMe tier capacity: a whole number of pages, at least two (default:
    /// 16 GiB or half the free space under `nvme_path`, whichever is less;
    /// on a block device its size).
    /// 0: no NVMe tier.
    pub nvme_capacity: u64,
    /// NVMe operations in flight per queue, at least 1 (default 32).
    pub nvme_queue_depth: u32,
    /// 1: background eviction keeps tiers between the watermarks (the
    /// default); 0: off.
    pub background_eviction: u32,
    /// Background eviction demotes pages from a tier above `watermark_high`
    /// of its capacity until it is at `watermark_low` (0 < low <= high <= 1;
    /// default 0.85 and 0.95).
    pub watermark_low: f64,
    /// See `watermark_low`.
    pub watermark_high: f64,
    /// 1: ask for transparent huge pages for the host tier (the default);
    /// 0: do not.
    pub huge_pages: u32,
    /// Bind the host tier to this NUMA node; `STRATA_NUMA_NONE` (the
    /// default): no binding.
    pub numa_node: i32,
    /// The balancer's placement policy, `STRATA_POLICY_*` (default
    /// `STRATA_POLICY_DEFAULT`).
    pub policy: strata_policy,
    /// Access counting: 1 in 2^`sampling` accesses, 0 … 16 (default 0:
    /// every access); `STRATA_SAMPLING_OFF`: none.
    pub sampling: u32,
    /// Emulated CXL: bandwidth cap in bytes/s (default: half of this
    /// machine's measured memcpy bandwidth).
    pub cxl_bandwidth: u64,
    /// Emulated CXL: added latency per transfer in nanoseconds (default
    /// 100).
    pub cxl_latency_ns: u64,
}

/// Strings handed to C (stats and config JSON), so that `strata_string_free`
/// can tell its own from anything else.
static STRINGS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// Strings C freed, held back so that a second free of one is refused
/// rather than freeing a newer string at the same address.
static FREED_STRINGS: Mutex<Quarantine<CString>> = Mutex::new(Quarantine::new());

/// The resolved configuration of each live runtime, by its owner number.
static CONFIGS: Mutex<BTreeMap<Owner, Config>> = Mutex::new(BTreeMap::new());

fn flag(v: u32, what: &str) -> R<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(Fail::invalid(format!("{what} {v} is not 0 or 1"))),
    }
}

fn set(v: u64) -> Option<u64> {
    (v != STRATA_CONFIG_DEFAULT).then_some(v)
}

/// Reads `*config`: its version first, so that a struct of another layout
/// is refused before more of it is read.
///
/// # Safety
/// `config` is NULL or points to a readable `strata_config` (or, for a
/// struct of another layout, at least to its `version`).
unsafe fn read_config(config: *const strata_config) -> R<strata_config> {
    // SAFETY: as this function's contract states.
    unsafe {
        cast::read_versioned(
            config,
            STRATA_CONFIG_VERSION,
            "config",
            "strata_config_init",
        )
    }
}

/// The partial configuration `c` states; integers are checked here before
/// they become Rust values, every other check is `Config`'s.
fn settings(c: &strata_config) -> R<Settings> {
    let mut s = Settings::default();
    s.page_size = set(c.page_size);
    s.device = Some(device(c.device)?);
    s.device_capacity = set(c.device_capacity);
    s.host_capacity = set(c.host_capacity);
    s.huge_pages = Some(flag(c.huge_pages, "huge_pages")?);
    s.numa_node = match c.numa_node {
        STRATA_NUMA_NONE => None,
        n => Some(u32::try_from(n).map_err(|_| {
            Fail::invalid(format!(
                "numa_node {n} is not a node (a node number, or STRATA_NUMA_NONE)"
            ))
        })?),
    };
    s.cxl_mode = Some(cxl_mode(c.cxl_mode)?);
    s.cxl_capacity = set(c.cxl_capacity);
    s.cxl_bandwidth = set(c.cxl_bandwidth);
    s.cxl_latency_ns = set(c.cxl_latency_ns);
    s.nvme_engine = Some(io_engine(c.nvme_engine)?);
    s.nvme_queue_depth = Some(u64::from(c.nvme_queue_depth));
    // SAFETY: `nvme_path` is NULL or a NUL-terminated string (the contract
    // of every function that takes a strata_config).
    match unsafe { cast::c_str_bytes(c.nvme_path) } {
        None => s.nvme_capacity = Some(0),
        Some(path) => {
            s.nvme_path = Some(PathBuf::from(std::ffi::OsStr::from_bytes(path)));
            s.nvme_capacity = set(c.nvme_capacity);
        }
    }
    s.background_eviction = Some(flag(c.background_eviction, "background_eviction")?);
    s.watermark_low = Some(c.watermark_low);
    s.watermark_high = Some(c.watermark_high);
    s.policy = Some(policy(c.policy)?);
    s.sampling = Some(match c.sampling {
        STRATA_SAMPLING_OFF => None,
        k => Some(k),
    });
    Ok(s)
}

fn resolve(c: &strata_config) -> R<Config> {
    Ok(Config::from_settings(&settings(c)?, &Topology::detect())?)
}

fn register(config: Config, out: cast::Out<*mut strata_runtime>) -> R {
    let obj = RtObj::new(config.build()?);
    let owner = obj.owner;
    CONFIGS.lock().insert(owner, config);
    let bits = match RUNTIMES.insert(obj, 0) {
        Ok(bits) => bits,
        Err(e) => {
            CONFIGS.lock().remove(&owner);
            return Err(e);
        }
    };
    out.set(objects::ptr(bits));
    Ok(STRATA_OK)
}

/// Hands `text` to C as a string it frees with `strata_string_free`.
fn hand_out(text: String, json: cast::Out<*mut c_char>, len: Option<cast::Out<usize>>) -> R {
    let n = text.len();
    let s = CString::new(text).map_err(|_| Fail::invalid("the JSON holds a NUL"))?;
    let p = cast::string_into_raw(s);
    STRINGS.lock().insert(p.addr());
    json.set(p);
    len.set(n);
    Ok(STRATA_OK)
}

fn device_code(d: DeviceChoice) -> strata_device {
    match d {
        DeviceChoice::Auto => STRATA_DEVICE_AUTO,
        DeviceChoice::Cuda => STRATA_DEVICE_CUDA,
        DeviceChoice::Sim => STRATA_DEVICE_SIM,
    }
}

fn engine_code(e: EngineChoice) -> strata_io_engine {
    match e {
        EngineChoice::Auto => STRATA_IO_AUTO,
        EngineChoice::Uring => STRATA_IO_URING,
        EngineChoice::Psync => STRATA_IO_PSYNC,
    }
}

/// Fills `*config` with the defaults of the configuration (those of TOML
/// and Python): version `STRATA_CONFIG_VERSION`; every capacity, the CXL
/// bandwidth and latency at `STRATA_CONFIG_DEFAULT`; 64 KiB pages;
/// `STRATA_DEVICE_AUTO`; `STRATA_CXL_OFF` and no NVMe path (a program asks
/// for those tiers); `STRATA_IO_AUTO` with queue depth 32; background
/// eviction on between 0.85 and 0.95; huge pages on; `STRATA_NUMA_NONE`;
/// `STRATA_POLICY_DEFAULT`; sampling 0 (every access). Thread-safe.
///
/// # Safety
/// `config` is NULL or points to a writable `strata_config` of this
/// header's layout: the call writes the whole struct, so a program built
/// against an older `strata.h` must be rebuilt before it loads this
/// library (`strata_runtime_create` refuses an older version, but only
/// after this call).
#[no_mangle]
pub unsafe extern "C" fn strata_config_init(config: *mut strata_config) -> c_int {
    boundary("strata_config_init", || {
        let watermarks = Watermarks::default();
        let value = strata_config {
            version: STRATA_CONFIG_VERSION,
            device: device_code(DeviceChoice::default()),
            page_size: config::DEFAULT_PAGE_SIZE as u64,
            device_capacity: STRATA_CONFIG_DEFAULT,
            host_capacity: STRATA_CONFIG_DEFAULT,
            cxl_mode: STRATA_CXL_OFF,
            nvme_engine: engine_code(EngineChoice::default()),
            cxl_capacity: STRATA_CONFIG_DEFAULT,
            nvme_path: std::ptr::null(),
            nvme_capacity: STRATA_CONFIG_DEFAULT,
            nvme_queue_depth: config::DEFAULT_NVME_QUEUE_DEPTH as u32,
            background_eviction: u32::from(config::DEFAULT_BACKGROUND_EVICTION),
            watermark_low: watermarks.low,
            watermark_high: watermarks.high,
            huge_pages: u32::from(config::DEFAULT_HUGE_PAGES),
            numa_node: STRATA_NUMA_NONE,
            policy: STRATA_POLICY_DEFAULT,
            sampling: config::DEFAULT_SAMPLING.unwrap_or(STRATA_SAMPLING_OFF),
            cxl_bandwidth: STRATA_CONFIG_DEFAULT,
            cxl_latency_ns: STRATA_CONFIG_DEFAULT,
        };
        // SAFETY: NULL or a writable strata_config (this function's contract).
        unsafe { cast::out(config, "config") }?.set(value);
        Ok(STRATA_OK)
    })
}

/// Creates a runtime from `*config` and stores its handle in `*out`. Every
/// field is checked (`STRATA_ERR_INVALID_ARGUMENT` names the first bad one,
/// with the message TOML and Python give for the same value); opening a
/// tier can fail with its own status (an NVMe path that cannot be written:
/// `STRATA_ERR_PERMISSION_DENIED`, `_NOT_FOUND`, `_UNSUPPORTED`…;
/// `STRATA_DEVICE_CUDA` without a GPU: `STRATA_ERR_NO_DEVICE`). `*out` is
/// left unchanged on error. The config is not referenced after the call.
/// Thread-safe; the runtime may be used from any thread and must be freed
/// with `strata_runtime_destroy`.
///
/// # Safety
/// `config` is NULL or points to a readable `strata_config` whose
/// `nvme_path` is NULL or a NUL-terminated string; `out` is NULL or points
/// to a writable `strata_runtime *`.
#[no_mangle]
pub unsafe extern "C" fn strata_runtime_create(
    config: *const strata_config,
    out: *mut *mut strata_runtime,
) -> c_int {
    boundary("strata_runtime_create", || {
        // SAFETY: NULL or a writable pointer (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        // SAFETY: NULL or a readable config (this function's contract).
        let config = unsafe { read_config(config) }?;
        register(resolve(&config)?, out)
    })
}

/// The configuration `*config` resolves to, every default applied and
/// checked as `strata_runtime_create` does, without opening any tier: a
/// NUL-terminated JSON object (as `strata_runtime_config_json`) stored in
/// `*json`, its length (without the NUL) in `*len` if `len` is not NULL;
/// the caller frees it with `strata_string_free`. A bad field gives the
/// status and message `strata_runtime_create` would; what only opening the
/// tiers finds out (a NUMA node the kernel will not bind, memory or a file
/// the machine cannot give) is `strata_runtime_create`'s alone.
/// Thread-safe.
///
/// # Safety
/// `config` is NULL or points to a readable `strata_config` whose
/// `nvme_path` is NULL or a NUL-terminated string; `json` is NULL or points
/// to a writable `char *`; `len` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_config_json(
    config: *const strata_config,
    json: *mut *mut c_char,
    len: *mut usize,
) -> c_int {
    boundary("strata_config_json", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(json, "json") }?;
        // SAFETY: NULL or writable (this function's contract).
        let len = unsafe { cast::out_opt(len, "len") }?;
        // SAFETY: NULL or a readable config (this function's contract).
        let config = unsafe { read_config(config) }?;
        hand_out(resolve(&config)?.to_json(), out, len)
    })
}

/// Creates a runtime from TOML text (the format of the `strata` command's
/// config file: `page_size`, `device`, `device_capacity`, watermarks,
/// `policy`, `background_eviction`, `sampling`, `[host]`, `[cxl]`,
/// `[nvme]`; see the README) and stores its handle in
/// `*out`. `text` holds `len` bytes, which need not be NUL-terminated and
/// must be UTF-8 (else `STRATA_ERR_INVALID_ARGUMENT`); NULL with `len` 0
/// means an empty file: every default (an NVMe tier in the temporary
/// directory, a device tier on `auto`). `flags` is 0 or
/// `STRATA_TOML_USE_ENV`; other bits are refused. Otherwise as
/// `strata_runtime_create`. Thread-safe.
///
/// # Safety
/// `text` is NULL or points to `len` readable bytes; `out` is NULL or
/// points to a writable `strata_runtime *`.
#[no_mangle]
pub unsafe extern "C" fn strata_runtime_from_toml(
    text: *const c_char,
    len: usize,
    flags: u32,
    out: *mut *mut strata_runtime,
) -> c_int {
    boundary("strata_runtime_from_toml", || {
        // SAFETY: NULL or a writable pointer (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        if flags & !STRATA_TOML_USE_ENV != 0 {
            return Err(Fail::invalid(format!(
                "unknown flags {:#x} (only STRATA_TOML_USE_ENV is defined)",
                flags & !STRATA_TOML_USE_ENV
            )));
        }
        let text = if text.is_null() && len == 0 {
            None
        } else {
            // SAFETY: `len` readable bytes (this function's contract).
            let bytes = unsafe { cast::bytes(text.cast(), len, "text") }?;
            Some(std::str::from_utf8(bytes).map_err(|e| {
                Fail::invalid(format!(
                    "config text is not UTF-8: invalid byte at offset {}",
                    e.valid_up_to()
                ))
            })?)
        };
        let use_env = flags & STRATA_TOML_USE_ENV != 0;
        let config = match (text, use_env) {
            (None, true) => Config::load(None)?,
            (text, true) => Config::resolve(text, &|k| std::env::var(k).ok(), &Topology::detect())?,
            (text, false) => Config::resolve(text, &|_| None, &Topology::detect())?,
        };
        register(config, out)
    })
}

/// The resolved configuration the runtime was built from, as a
/// NUL-terminated JSON object: `page_size`, `device`, `device_capacity`
/// (null: the default), `host` (`capacity`, `page_size`, `huge_pages`,
/// `numa_node`), `cxl` and `nvme` (null without the tier), `watermarks`
/// (`low`, `high`), `policy` (its name), `background_eviction`, `sampling`
/// (the shift; null: none); the same object for the same settings from C,
/// TOML, Python and Rust. Stored in `*json`, its length (without the NUL)
/// in `*len` if `len` is not NULL; the caller frees it with
/// `strata_string_free`. Thread-safe.
///
/// # Safety
/// `json` is NULL or points to a writable `char *`; `len` is NULL or points
/// to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_runtime_config_json(
    rt: *const strata_runtime,
    json: *mut *mut c_char,
    len: *mut usize,
) -> c_int {
    boundary("strata_runtime_config_json", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(json, "json") }?;
        // SAFETY: NULL or writable (this function's contract).
        let len = unsafe { cast::out_opt(len, "len") }?;
        let owner = objects::get(rt)?.owner;
        let text = CONFIGS
            .lock()
            .get(&owner)
            .map(Config::to_json)
            .ok_or_else(|| Fail::new(STRATA_ERR_CLOSED, "the runtime was destroyed"))?;
        hand_out(text, out, len)
    })
}

/// Returns the first failure of the runtime's background work (background
/// eviction, the balancer: an I/O error demoting a page, a panic in a
/// round) since the last check as its status (`STRATA_ERR_IO`, …, with the
/// message in `strata_last_error`), and clears it; `STRATA_OK` if there was
/// none. Pages a failed background move touched stay readable where they
/// were. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_runtime_check(rt: *const strata_runtime) -> c_int {
    boundary("strata_runtime_check", || {
        objects::get(rt)?.rt.check()?;
        Ok(STRATA_OK)
    })
}

/// Destroys a runtime and frees everything made through it that C still
/// holds: buffers, pins, tickets, device maps and launches. From then on
/// the runtime's own handle and the handles of those objects give
/// `STRATA_ERR_CLOSED` to every call, this one included (destroying twice
/// is `STRATA_ERR_CLOSED`), and calls in flight that would make new
/// objects through them fail the same way. (strata remembers a closed
/// handle until about 65,536 later objects of its type have come and gone;
/// after that it reads `STRATA_ERR_INVALID_HANDLE`, as any stale handle.) Calls
/// already running on other threads finish first with the objects they
/// use; a DLPack tensor exported from one of its buffers keeps its pages
/// (and the tiers under them) alive until its deleter runs. Embedding
/// tables, expert caches and optimizers are not freed: those made on this
/// runtime (`strata_embedding_create*`, `strata_moe_create_on`,
/// `strata_optim_create_on`) keep it alive and go on working until their
/// own free function ends them. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_runtime_destroy(rt: *mut strata_runtime) -> c_int {
    boundary("strata_runtime_destroy", || {
        let Some(obj) = objects::close(rt)? else {
            return Ok(STRATA_OK);
        };
        obj.close();
        let owner = obj.owner;
        CONFIGS.lock().remove(&owner);
        // Dropped here, outside the tables' locks; guards first.
        drop(LAUNCHES.sweep(owner));
        drop(PINS.sweep(owner));
        drop(MAPS.sweep(owner));
        drop(TICKETS.sweep(owner));
        drop(BUFFERS.sweep(owner));
        drop(obj);
        Ok(STRATA_OK)
    })
}

/// Stores the runtime's page size in `*out`. Thread-safe.
///
/// # Safety
/// `out` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_runtime_page_size(
    rt: *const strata_runtime,
    out: *mut usize,
) -> c_int {
    boundary("strata_runtime_page_size", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        out.set(objects::with(rt, |r| r.rt.page_size())?);
        Ok(STRATA_OK)
    })
}

/// Stores in `*mask` the configured tiers as bits `1 << STRATA_TIER_*`.
/// Thread-safe.
///
/// # Safety
/// `mask` is NULL or points to a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_runtime_tiers(rt: *const strata_runtime, mask: *mut u32) -> c_int {
    boundary("strata_runtime_tiers", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(mask, "mask") }?;
        let tiers = objects::get(rt)?.rt.tiers();
        out.set(
            tiers
                .into_iter()
                .fold(0, |m, t| m | 1 << tier_code(Some(t))),
        );
        Ok(STRATA_OK)
    })
}

/// Current use and traffic as a NUL-terminated JSON object (the Rust
/// `Stats`: `backend`, `page_size`, per-tier `used_pages`/`free_pages`/
/// `pinned_pages`, `moves`, `faults`, `links`, …). The string is stored in
/// `*json` and its length (without the NUL) in `*len` if `len` is not NULL;
/// the caller owns it and frees it with `strata_string_free`. Thread-safe.
///
/// # Safety
/// `json` is NULL or points to a writable `char *`; `len` is NULL or points
/// to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_stats_json(
    rt: *const strata_runtime,
    json: *mut *mut c_char,
    len: *mut usize,
) -> c_int {
    boundary("strata_stats_json", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(json, "json") }?;
        // SAFETY: NULL or writable (this function's contract).
        let len = unsafe { cast::out_opt(len, "len") }?;
        hand_out(objects::get(rt)?.rt.stats_json(), out, len)
    })
}

/// Writes the stats JSON (see `strata_stats_json`) into `buf` of `cap`
/// bytes, NUL-terminated, and its length (without the NUL) into `*len` if
/// `len` is not NULL. When it does not fit, `buf` gets a truncated,
/// NUL-terminated prefix and the call returns `STRATA_ERR_BUFFER_TOO_SMALL`
/// (call again with `*len + 1` bytes). `buf` may be NULL when `cap` is 0;
/// NULL with `cap` > 0 is `STRATA_ERR_NULL_POINTER`. On any other error
/// neither `buf` nor `*len` is changed. Thread-safe.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes; `len` is NULL or points
/// to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_stats_json_copy(
    rt: *const strata_runtime,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> c_int {
    boundary("strata_stats_json_copy", || {
        // Both outputs are checked before the stats are read, and apart.
        cast::disjoint(
            &[cast::region(buf, cap, "buf"), cast::region(len, 1, "len")],
            &[],
        )?;
        // SAFETY: NULL or writable (this function's contract).
        let len = unsafe { cast::out_opt(len, "len") }?;
        // SAFETY: NULL or `cap` writable bytes (this function's contract).
        let buf = unsafe { cast::text_out(buf, cap, "buf") }?;
        let text = objects::get(rt)?.rt.stats_json();
        len.set(text.len());
        let status = buf.write(text.as_bytes());
        if status != STRATA_OK {
            return Err(Fail::new(
                status,
                format!(
                    "the stats need {} bytes, the buffer has {cap}",
                    text.len() + 1
                ),
            ));
        }
        Ok(STRATA_OK)
    })
}

/// Frees a string strata returned (`strata_stats_json`,
/// `strata_runtime_config_json`, `strata_config_json`). NULL is a no-op; a
/// pointer strata did not return, or one already freed, is refused with
/// `STRATA_ERR_INVALID_HANDLE` (and never freed) — a freed one while
/// strata still holds its memory back: until 256 later strings (or 4 MiB
/// of them) were freed, after which its address may be a newer string's.
/// Thread-safe.
// Safe to call with any pointer: it is freed only if found in the registry
// of strings strata handed out.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
#[no_mangle]
pub extern "C" fn strata_string_free(s: *mut c_char) -> c_int {
    boundary("strata_string_free", || {
        if s.is_null() {
            return Ok(STRATA_OK);
        }
        let known = STRINGS.lock().remove(&s.addr());
        if !known {
            return Err(Fail::new(
                STRATA_ERR_INVALID_HANDLE,
                format!("{s:p} is not a string strata returned, or it was freed already"),
            ));
        }
        // SAFETY: registered by the call that returned it (stats or config
        // JSON) from `string_into_raw`, and removed from the registry just
        // now, so it is taken back exactly once.
        let s = unsafe { cast::string_from_raw(s) };
        let n = s.as_bytes().len() + 1;
        let gone = FREED_STRINGS.lock().hold(s, n);
        drop(gone);
        Ok(STRATA_OK)
    })
}
