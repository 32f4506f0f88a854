//! Runtimes: made from a config struct or TOML text, destroyed with
//! everything made through them; stats as JSON.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use parking_lot::Mutex;
use strata::config::Config;
use strata::runtime::{RuntimeBuilder, Watermarks};
use strata::sys::Topology;
use strata::tier::{CxlBacking, CxlConfig, CxlMode, NvmeConfig};
use strata::Runtime;

use crate::cast::{self, SetOpt};
use crate::enums::*;
use crate::objects::{
    self, strata_runtime, RtObj, BUFFERS, LAUNCHES, MAPS, PINS, RUNTIMES, TICKETS,
};
use crate::status::{boundary, Fail, R, STRATA_ERR_INVALID_HANDLE, STRATA_OK};

/// The layout version of `strata_config` this library reads.
pub const STRATA_CONFIG_VERSION: u32 = 1;

/// Flag for `strata_runtime_from_toml`: `STRATA_*` environment variables
/// override the text (and with NULL text, `$STRATA_CONFIG` names a file), as
/// for the `strata` command.
pub const STRATA_TOML_USE_ENV: u32 = 1;

/// How to build a runtime. Fill it with `strata_config_init`, then change
/// fields. Capacities are in bytes; a tier with capacity 0 is absent, except
/// the host tier, which is always present.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct strata_config {
    /// `STRATA_CONFIG_VERSION` (set by `strata_config_init`).
    pub version: u32,
    /// `STRATA_DEVICE_*`.
    pub device: strata_device,
    /// Page size of every tier: a power of two, 4 KiB … 2 MiB.
    pub page_size: u64,
    /// The device tier's size: the simulated GPU's, or a cap on a real one
    /// (`UINT64_MAX`: all the GPU's free memory less a reserve). 0: none.
    pub device_capacity: u64,
    /// Host DRAM tier capacity.
    pub host_capacity: u64,
    /// `STRATA_CXL_*`.
    pub cxl_mode: strata_cxl_mode,
    /// `STRATA_IO_*`: the NVMe tier's engine.
    pub nvme_engine: strata_io_engine,
    /// CXL tier capacity (0 with `STRATA_CXL_AUTO`: the node's memory).
    pub cxl_capacity: u64,
    /// NVMe tier: a directory (a private swap file is made in it), a new
    /// file name, or a block device; NULL for no NVMe tier. Read during
    /// `strata_runtime_create` only.
    pub nvme_path: *const c_char,
    /// NVMe tier capacity: a whole number of pages.
    pub nvme_capacity: u64,
    /// NVMe operations in flight per queue (default 32).
    pub nvme_queue_depth: u32,
    /// 1: background eviction keeps tiers between the watermarks; 0: off.
    pub background_eviction: u32,
    /// Background eviction demotes pages from a tier above `watermark_high`
    /// of its capacity until it is at `watermark_low` (0 < low <= high <= 1).
    pub watermark_low: f64,
    /// See `watermark_low`.
    pub watermark_high: f64,
}

/// Strings handed to C (stats JSON), so that `strata_string_free` can tell
/// its own from anything else.
static STRINGS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn builder(c: &strata_config) -> R<RuntimeBuilder> {
    if c.version != STRATA_CONFIG_VERSION {
        return Err(Fail::invalid(format!(
            "config version {} is not {STRATA_CONFIG_VERSION}: fill the struct with strata_config_init",
            c.version
        )));
    }
    let page = usize::try_from(c.page_size)
        .map_err(|_| Fail::invalid(format!("page size {} is too large", c.page_size)))?;
    let background = match c.background_eviction {
        0 => false,
        1 => true,
        v => {
            return Err(Fail::invalid(format!(
                "background_eviction {v} is not 0 or 1"
            )))
        }
    };
    let mut b = Runtime::builder()
        .page_size(page)
        .device(device(c.device)?, c.device_capacity)
        .host(c.host_capacity)
        .watermarks(Watermarks::new(c.watermark_low, c.watermark_high))
        .background_eviction(background);
    match cxl_mode(c.cxl_mode)? {
        CxlMode::Off => {}
        CxlMode::Emulated => b = b.cxl(CxlConfig::new(CxlMode::Emulated, c.cxl_capacity, page)),
        // As the config file's `auto`: the first CPU-less node, if any.
        CxlMode::Auto => {
            if let CxlBacking::Node { memory_bytes, .. } =
                CxlMode::Auto.backing(&Topology::detect())
            {
                let capacity = if c.cxl_capacity > 0 {
                    c.cxl_capacity
                } else {
                    memory_bytes
                };
                b = b.cxl(CxlConfig::new(CxlMode::Auto, capacity, page));
            }
        }
    }
    let engine = io_engine(c.nvme_engine)?;
    // SAFETY: `nvme_path` is NULL or a NUL-terminated string (the contract
    // of `strata_runtime_create`).
    if let Some(path) = unsafe { cast::c_str_bytes(c.nvme_path) } {
        if path.is_empty() {
            return Err(Fail::invalid(
                "nvme_path is empty (NULL means no NVMe tier)",
            ));
        }
        if c.nvme_queue_depth == 0 {
            return Err(Fail::invalid("nvme_queue_depth is 0"));
        }
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(path));
        let mut nvme = NvmeConfig::new(path, c.nvme_capacity, page);
        nvme.engine = engine;
        nvme.queue_depth = c.nvme_queue_depth as usize;
        b = b.nvme(nvme);
    }
    Ok(b)
}

fn register(rt: Runtime, out: cast::Out<*mut strata_runtime>) -> R {
    let bits = RUNTIMES.insert(RtObj::new(rt), 0)?;
    out.set(objects::ptr(bits));
    Ok(STRATA_OK)
}

/// Fills `*config` with the defaults: version `STRATA_CONFIG_VERSION`, 64 KiB
/// pages, `STRATA_DEVICE_AUTO` with no device tier (set `device_capacity`),
/// a 256 MiB host tier, no CXL or NVMe tier, `STRATA_IO_AUTO` with queue
/// depth 32, background eviction on between 0.85 and 0.95. Thread-safe.
///
/// # Safety
/// `config` is NULL or points to a writable `strata_config`.
#[no_mangle]
pub unsafe extern "C" fn strata_config_init(config: *mut strata_config) -> c_int {
    boundary("strata_config_init", || {
        let defaults = Watermarks::default();
        let value = strata_config {
            version: STRATA_CONFIG_VERSION,
            device: STRATA_DEVICE_AUTO,
            page_size: strata::config::DEFAULT_PAGE_SIZE as u64,
            device_capacity: 0,
            host_capacity: 256 << 20,
            cxl_mode: STRATA_CXL_OFF,
            nvme_engine: STRATA_IO_AUTO,
            cxl_capacity: 0,
            nvme_path: std::ptr::null(),
            nvme_capacity: 0,
            nvme_queue_depth: 32,
            background_eviction: 1,
            watermark_low: defaults.low,
            watermark_high: defaults.high,
        };
        // SAFETY: NULL or a writable strata_config (this function's contract).
        unsafe { cast::out(config, "config") }?.set(value);
        Ok(STRATA_OK)
    })
}

/// Creates a runtime from `*config` and stores its handle in `*out`. Every
/// field is checked (`STRATA_ERR_INVALID_ARGUMENT` names the first bad one);
/// opening a tier can fail with its own status (an NVMe path that cannot be
/// written: `STRATA_ERR_PERMISSION_DENIED`, `_NOT_FOUND`, `_UNSUPPORTED`…;
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
        let config = unsafe { cast::read_in(config, "config") }?;
        register(builder(&config)?.build()?, out)
    })
}

/// Creates a runtime from TOML text (the format of the `strata` command's
/// config file: `page_size`, `device`, `device_capacity`, `[host]`,
/// `[cxl]`, `[nvme]`, watermarks; see the README) and stores its handle in
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
        register(RuntimeBuilder::from_config(&config).build()?, out)
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
/// (and the tiers under them) alive until its deleter runs. Expert caches
/// and optimizers are not made through a runtime and are not affected.
/// NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_runtime_destroy(rt: *mut strata_runtime) -> c_int {
    boundary("strata_runtime_destroy", || {
        let Some(obj) = objects::close(rt)? else {
            return Ok(STRATA_OK);
        };
        obj.close();
        let owner = obj.owner;
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
        let text = objects::get(rt)?.rt.stats_json();
        let n = text.len();
        let s = CString::new(text).map_err(|_| Fail::invalid("stats JSON holds a NUL"))?;
        let p = cast::string_into_raw(s);
        STRINGS.lock().insert(p.addr());
        out.set(p);
        len.set(n);
        Ok(STRATA_OK)
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
        // Both outputs are checked before the stats are read.
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

/// Frees a string strata returned (`strata_stats_json`). NULL is a no-op; a
/// pointer strata did not return, or one already freed, is refused with
/// `STRATA_ERR_INVALID_HANDLE` (and never freed). Thread-safe.
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
        // SAFETY: registered above by strata_stats_json from
        // `string_into_raw`, and removed from the registry just now, so it
        // is taken back exactly once.
        drop(unsafe { cast::string_from_raw(s) });
        Ok(STRATA_OK)
    })
}
