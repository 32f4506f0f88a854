//! The offloaded optimizer: Adam/AdamW with its states in host, CXL or
//! NVMe tiers, streamed in chunks.

use std::ffi::{c_char, c_int};

use parking_lot::Mutex;
use strata::offload::optim::{AdamParams, Importance, OffloadedAdam, OptimConfig, StateTier};

use crate::cast::{self, SetOpt};
use crate::enums::{
    self, strata_tier, strata_updater, STRATA_TIER_CXL, STRATA_TIER_HOST, STRATA_TIER_NVME,
    STRATA_UPDATE_CPU,
};
use crate::objects::{self, strata_optim, OPTIMS};
use crate::status::{boundary, Fail, STRATA_OK};

/// The layout of `strata_optim_config` this library reads: its size in
/// bytes, set by `strata_optim_config_init` (the first layout had no
/// version and began with `tier`).
pub const STRATA_OPTIM_CONFIG_VERSION: u32 = 72;

const _: () =
    assert!(std::mem::size_of::<strata_optim_config>() == STRATA_OPTIM_CONFIG_VERSION as usize);

/// The layout of `strata_moe_config` this library reads: its size in bytes,
/// set by `strata_moe_config_init` (the first layout had no version and
/// began with `device`).
pub const STRATA_MOE_CONFIG_VERSION: u32 = 56;

const _: () =
    assert!(std::mem::size_of::<strata_moe_config>() == STRATA_MOE_CONFIG_VERSION as usize);

/// How to build an offloaded optimizer (`strata_optim_create`). Start from
/// `strata_optim_config_init`, then change the fields you want.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct strata_optim_config {
    /// `STRATA_OPTIM_CONFIG_VERSION` (set by `strata_optim_config_init`;
    /// the create calls refuse another).
    pub version: u32,
    /// Where the states live: `STRATA_TIER_HOST`, `_CXL` (a CPU-less NUMA
    /// node, else emulated) or `_NVME`.
    pub tier: strata_tier,
    /// For `STRATA_TIER_NVME`: a directory on a disk (not tmpfs).
    pub nvme_path: *const c_char,
    /// Bytes of one chunk of one state array (a power of two, 4 KiB–2 MiB).
    pub chunk_bytes: usize,
    /// Learning rate (finite, at least 0, as `eps` and `weight_decay`;
    /// `strata_optim_create` refuses others).
    pub lr: f32,
    /// First-moment decay, in [0, 1).
    pub beta1: f32,
    /// Second-moment decay, in [0, 1).
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay (AdamW); 0 for Adam.
    pub weight_decay: f32,
    /// Importance-aware mode: share of each chunk kept resident and
    /// updated every step, chosen by |gradient| at each flush (0 turns the
    /// mode off; otherwise in (0, 1]).
    pub importance_fraction: f64,
    /// Importance-aware mode: the rest is updated, and the state in its
    /// tier read and written, every this many steps.
    pub importance_every: u64,
    /// Where the update runs: `STRATA_UPDATE_CPU` or `STRATA_UPDATE_CUDA`
    /// (a GPU; `STRATA_ERR_NO_DEVICE` from `strata_optim_create` where there
    /// is none).
    pub updater: strata_updater,
}

/// What one step did (`strata_optim_step`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct strata_step_stats {
    /// Wall seconds of the step.
    pub seconds: f64,
    /// State bytes read.
    pub bytes_read: u64,
    /// State bytes written.
    pub bytes_written: u64,
    /// Seconds the update waited for I/O.
    pub io_wait_seconds: f64,
}

/// Fills `*config` with the defaults: version
/// `STRATA_OPTIM_CONFIG_VERSION`, host states, 1 MiB chunks, Adam with lr
/// 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay, plain mode, the update
/// on the CPU.
///
/// # Safety
/// `config` is NULL or points to a writable `strata_optim_config`.
#[no_mangle]
pub unsafe extern "C" fn strata_optim_config_init(config: *mut strata_optim_config) -> c_int {
    boundary("strata_optim_config_init", || {
        let d = AdamParams::default();
        // SAFETY: NULL or writable (this function's contract).
        unsafe { cast::out(config, "config") }?.set(strata_optim_config {
            version: STRATA_OPTIM_CONFIG_VERSION,
            tier: STRATA_TIER_HOST,
            nvme_path: std::ptr::null(),
            chunk_bytes: 1 << 20,
            lr: d.lr,
            beta1: d.beta1,
            beta2: d.beta2,
            eps: d.eps,
            weight_decay: d.weight_decay,
            importance_fraction: 0.0,
            importance_every: 1,
            updater: STRATA_UPDATE_CPU,
        });
        Ok(STRATA_OK)
    })
}

/// Reads `*config`, its version first.
///
/// # Safety
/// `config` is NULL or points to a readable `strata_optim_config` (or, for
/// a struct of another layout, at least to its `version`).
unsafe fn read_optim(config: *const strata_optim_config) -> Result<strata_optim_config, Fail> {
    // SAFETY: as this function's contract states.
    unsafe {
        cast::read_versioned(
            config,
            STRATA_OPTIM_CONFIG_VERSION,
            "config",
            "strata_optim_config_init",
        )
    }
}

/// Reads `*config`, its version first.
///
/// # Safety
/// `config` is NULL or points to a readable `strata_moe_config` (or, for a
/// struct of another layout, at least to its `version`).
unsafe fn read_moe(config: *const strata_moe_config) -> Result<strata_moe_config, Fail> {
    // SAFETY: as this function's contract states.
    unsafe {
        cast::read_versioned(
            config,
            STRATA_MOE_CONFIG_VERSION,
            "config",
            "strata_moe_config_init",
        )
    }
}

/// The optimizer's configuration from the C struct; with `read_path`, an
/// NVMe tier reads `nvme_path` (which must then be set).
///
/// # Safety
/// With `read_path`, `c.nvme_path` is NULL or NUL-terminated.
unsafe fn optim_config(c: &strata_optim_config, read_path: bool) -> Result<OptimConfig, Fail> {
    let tier = match c.tier {
        STRATA_TIER_HOST => StateTier::Host,
        STRATA_TIER_CXL => StateTier::Cxl,
        STRATA_TIER_NVME if !read_path => StateTier::Nvme(std::path::PathBuf::new()),
        STRATA_TIER_NVME => {
            // SAFETY: NULL or NUL-terminated (this function's contract).
            let bytes =
                unsafe { cast::c_str_bytes(c.nvme_path) }.ok_or_else(|| Fail::null("nvme_path"))?;
            let p =
                std::str::from_utf8(bytes).map_err(|_| Fail::invalid("nvme_path is not UTF-8"))?;
            StateTier::Nvme(p.into())
        }
        t => {
            return Err(Fail::invalid(format!(
                "unknown state tier {t} (use STRATA_TIER_HOST, _CXL or _NVME)"
            )));
        }
    };
    let importance = if c.importance_fraction == 0.0 {
        None
    } else {
        Some(Importance {
            fraction: c.importance_fraction,
            every: c.importance_every,
        })
    };
    let config = OptimConfig {
        tier,
        chunk_bytes: c.chunk_bytes,
        adam: AdamParams {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
        },
        importance,
        updater: enums::updater(c.updater)?,
    };
    Ok(config)
}

/// Creates an optimizer for the `n` fp32 master weights at `weights`
/// (copied into the state tier, with zeroed moments) and stores its handle
/// in `*out`; free it with `strata_optim_free`. Thread-safe; one optimizer
/// serializes its own calls.
///
/// # Safety
/// `config` points to a readable `strata_optim_config` (or, for a struct of
/// another layout, at least to its `version`, which is refused) whose
/// `nvme_path` is NULL or NUL-terminated; `weights` points to `n` readable floats; `out`
/// points to a writable handle.
#[no_mangle]
pub unsafe extern "C" fn strata_optim_create(
    weights: *const f32,
    n: usize,
    config: *const strata_optim_config,
    out: *mut *mut strata_optim,
) -> c_int {
    boundary("strata_optim_create", || {
        // SAFETY: as this function's contract states.
        let (c, w, out) = unsafe {
            (
                read_optim(config)?,
                cast::slice(weights, n, "weights")?,
                cast::out(out, "out")?,
            )
        };
        // SAFETY: `nvme_path` is NULL or NUL-terminated (this function's
        // contract).
        let config = unsafe { optim_config(&c, true) }?;
        let opt = OffloadedAdam::new(w, config)?;
        // Not a runtime's child: owner 0 is never swept.
        let bits = OPTIMS.insert(Mutex::new(opt), 0)?;
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// Creates an optimizer whose states live in a buffer of the runtime `rt`,
/// shared with the caller's buffers and other offload objects: the states
/// take their place in `config->tier` of `rt` (for `STRATA_TIER_NVME` the
/// runtime's own NVMe tier: `nvme_path` is not read) under the same
/// budgets, and move like any buffer's pages. `config->chunk_bytes` must be
/// `rt`'s page size and `config->updater` `STRATA_UPDATE_CPU`; a tier `rt`
/// lacks is `STRATA_ERR_INVALID_ARGUMENT`. The optimizer keeps the runtime
/// alive until `strata_optim_free`. Thread-safe; one optimizer serializes
/// its own calls.
///
/// # Safety
/// `config` points to a readable `strata_optim_config` (or, for a struct of
/// another layout, at least to its `version`, which is refused); `weights`
/// points to `n` readable floats; `out` points to a writable handle.
#[no_mangle]
pub unsafe extern "C" fn strata_optim_create_on(
    rt: *const objects::strata_runtime,
    weights: *const f32,
    n: usize,
    config: *const strata_optim_config,
    out: *mut *mut strata_optim,
) -> c_int {
    boundary("strata_optim_create_on", || {
        // SAFETY: as this function's contract states.
        let (c, w, out) = unsafe {
            (
                read_optim(config)?,
                cast::slice(weights, n, "weights")?,
                cast::out(out, "out")?,
            )
        };
        // SAFETY: the path is not read.
        let config = unsafe { optim_config(&c, false) }?;
        let runtime = objects::get(rt)?;
        let opt = OffloadedAdam::on(&runtime.rt, w, config)?;
        // Not a runtime's child: owner 0 is never swept.
        let bits = OPTIMS.insert(Mutex::new(opt), 0)?;
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// One step with the `n` gradients at `grads` (`n` = the weights' count);
/// stores what it did in `*stats` if not NULL. A misaligned `stats` (or a
/// bad `grads`) is refused before the step: the weights stay as they were.
/// Thread-safe (steps of one optimizer serialize).
///
/// # Safety
/// `grads` points to `n` readable floats; `stats` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_optim_step(
    opt: *const strata_optim,
    grads: *const f32,
    n: usize,
    stats: *mut strata_step_stats,
) -> c_int {
    boundary("strata_optim_step", || {
        // SAFETY: as this function's contract states.
        let (g, out) = unsafe {
            (
                cast::slice(grads, n, "grads")?,
                cast::out_opt(stats, "stats")?,
            )
        };
        let o = objects::get(opt)?;
        let s = o.lock().step(g)?;
        out.set(strata_step_stats {
            seconds: s.seconds,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            io_wait_seconds: s.io_wait_seconds,
        });
        Ok(STRATA_OK)
    })
}

/// Copies the current fp32 master weights into `out` (`n` = their count).
/// Thread-safe.
///
/// # Safety
/// `out` points to `n` writable floats.
#[no_mangle]
pub unsafe extern "C" fn strata_optim_weights(
    opt: *const strata_optim,
    out: *mut f32,
    n: usize,
) -> c_int {
    boundary("strata_optim_weights", || {
        // SAFETY: as this function's contract states.
        let dst = unsafe { cast::slice_mut(out, n, "out") }?;
        let w = objects::get(opt)?.lock().weights()?;
        if w.len() != n {
            return Err(Fail::invalid(format!(
                "the optimizer holds {} weights, the buffer {n}",
                w.len()
            )));
        }
        dst.copy_from_slice(&w);
        Ok(STRATA_OK)
    })
}

/// Ends an optimizer. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_optim_free(opt: *mut strata_optim) -> c_int {
    boundary("strata_optim_free", || {
        drop(objects::remove(opt)?);
        Ok(STRATA_OK)
    })
}

/// How to build an MoE expert cache (`strata_moe_create`). Start from
/// `strata_moe_config_init`, then change the fields you want.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct strata_moe_config {
    /// `STRATA_MOE_CONFIG_VERSION` (set by `strata_moe_config_init`; the
    /// create calls refuse another).
    pub version: u32,
    /// `STRATA_DEVICE_AUTO`, `_CUDA` or `_SIM`.
    pub device: crate::enums::strata_device,
    /// Experts the device holds at once.
    pub device_slots: usize,
    /// Bytes of the largest expert (one slot).
    pub slot_bytes: u64,
    /// Host memory for the experts.
    pub host_bytes: u64,
    /// An NVMe tier for experts beyond the host budget: a directory (NULL:
    /// none).
    pub nvme_path: *const c_char,
    /// Its capacity in bytes: a whole number of pages, at least two.
    pub nvme_capacity: u64,
    /// Runtime page size (a power of two, 4 KiB–2 MiB).
    pub page_size: usize,
}

/// What an expert cache reports (`strata_moe_get_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct strata_moe_stats {
    /// Calls to `strata_moe_fetch`.
    pub fetches: u64,
    /// Fetches that found the expert resident or on its way.
    pub hits: u64,
    /// Hits on a prefetch still in flight (they waited for the rest).
    pub late_prefetch_hits: u64,
    /// Prefetches started.
    pub prefetches: u64,
    /// Prefetched experts fetched before they were evicted.
    pub prefetches_used: u64,
    /// Prefetches cancelled before they finished (`strata_moe_cancel_prefetches`).
    pub prefetches_cancelled: u64,
    /// Bytes moved into device memory.
    pub bytes_moved: u64,
    /// Time fetches waited, seconds (modelled on the simulated device).
    pub stall_seconds: f64,
    /// 1 when `stall_seconds` is modelled (simulated device).
    pub stall_modelled: c_int,
    /// Fetches of an expert whose pages the shared runtime had moved out of
    /// device memory meanwhile (misses; `strata_moe_create_on` only).
    pub displaced: u64,
    /// Misses whose read `strata_moe_read_ahead` started before their fetch
    /// (not hits, not prefetches).
    pub reads_ahead: u64,
    /// Predictions not prefetched because the expert they would evict is
    /// worth more (the reuse estimate's eviction only).
    pub prefetches_declined: u64,
}

/// Fills `*config` with the defaults: version `STRATA_MOE_CONFIG_VERSION`,
/// simulated device, 8 slots of 1 MiB, 64 MiB of host memory, no NVMe, 64
/// KiB pages.
///
/// # Safety
/// `config` is NULL or points to a writable `strata_moe_config`.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_config_init(config: *mut strata_moe_config) -> c_int {
    boundary("strata_moe_config_init", || {
        // SAFETY: NULL or writable (this function's contract).
        unsafe { cast::out(config, "config") }?.set(strata_moe_config {
            version: STRATA_MOE_CONFIG_VERSION,
            device: crate::enums::STRATA_DEVICE_SIM,
            device_slots: 8,
            slot_bytes: 1 << 20,
            host_bytes: 64 << 20,
            nvme_path: std::ptr::null(),
            nvme_capacity: 0,
            page_size: 64 << 10,
        });
        Ok(STRATA_OK)
    })
}

/// Creates an expert cache and stores its handle in `*out`; free it with
/// `strata_moe_free`. Thread-safe.
///
/// # Safety
/// `config` points to a readable config (or, for a struct of another
/// layout, at least to its `version`, which is refused) whose `nvme_path`
/// is NULL or NUL-terminated; `out` points to a writable handle.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_create(
    config: *const strata_moe_config,
    out: *mut *mut objects::strata_moe,
) -> c_int {
    boundary("strata_moe_create", || {
        // SAFETY: as this function's contract states.
        let (c, out) = unsafe { (read_moe(config)?, cast::out(out, "out")?) };
        let mut cfg =
            strata::offload::moe::MoeConfig::new(c.device_slots, c.slot_bytes, c.host_bytes);
        cfg.device = crate::enums::device(c.device)?;
        cfg.page_size = c.page_size;
        // SAFETY: NULL or NUL-terminated (this function's contract).
        if let Some(bytes) = unsafe { cast::c_str_bytes(c.nvme_path) } {
            let p =
                std::str::from_utf8(bytes).map_err(|_| Fail::invalid("nvme_path is not UTF-8"))?;
            cfg.nvme = Some(strata::tier::NvmeConfig::new(
                p,
                c.nvme_capacity,
                c.page_size,
            ));
        }
        let cache = strata::offload::moe::ExpertCache::new(cfg)?;
        let bits = objects::MOES.insert(parking_lot::RwLock::new(std::sync::Arc::new(cache)), 0)?;
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// Creates an expert cache on the runtime `rt`, shared with the caller's
/// buffers (and other offload objects): the experts' pages take their place
/// in `rt`'s host tier (cascading to NVMe) under the same budgets, and
/// `config->device_slots` slots of `config->slot_bytes` in `rt`'s device
/// tier are the cache's (a fetch makes room by demoting the coldest pages
/// of any buffer). `config->device`, `host_bytes`, `nvme_path`,
/// `nvme_capacity` and `page_size` are the runtime's own and not read.
/// `STRATA_ERR_INVALID_ARGUMENT` without a device tier,
/// `STRATA_ERR_OUT_OF_CAPACITY` when the slots exceed it. The cache keeps
/// the runtime alive until `strata_moe_free`. Thread-safe.
///
/// # Safety
/// `config` points to a readable config (or, for a struct of another
/// layout, at least to its `version`, which is refused); `out` points to a
/// writable handle.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_create_on(
    rt: *const objects::strata_runtime,
    config: *const strata_moe_config,
    out: *mut *mut objects::strata_moe,
) -> c_int {
    boundary("strata_moe_create_on", || {
        // SAFETY: as this function's contract states.
        let (c, out) = unsafe { (read_moe(config)?, cast::out(out, "out")?) };
        let runtime = objects::get(rt)?;
        let cfg = strata::offload::moe::MoeConfig::new(c.device_slots, c.slot_bytes, 0);
        let cache = strata::offload::moe::ExpertCache::on(&runtime.rt, cfg)?;
        let bits = objects::MOES.insert(parking_lot::RwLock::new(std::sync::Arc::new(cache)), 0)?;
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// Registers expert `expert` of `layer` with `len` bytes of weights (at most
/// the slot size), copied into host memory (or NVMe). Not while any expert
/// of the cache is pinned. Thread-safe.
///
/// # Safety
/// `weights` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_register(
    moe: *const objects::strata_moe,
    layer: u32,
    expert: u32,
    weights: *const std::ffi::c_void,
    len: usize,
) -> c_int {
    boundary("strata_moe_register", || {
        // SAFETY: as this function's contract states.
        let w = unsafe { cast::bytes(weights, len, "weights") }?;
        let m = objects::get(moe)?;
        let mut cache = m.write();
        let cache = std::sync::Arc::get_mut(&mut cache).ok_or_else(|| {
            Fail::invalid("experts of this cache are pinned: release them before registering")
        })?;
        cache.register(layer, expert, w)?;
        Ok(STRATA_OK)
    })
}

/// Makes expert `expert` of `layer` resident in device memory and pins it
/// until `strata_moe_release`; blocks only on a miss or an unfinished
/// prefetch. Up to `cap` page addresses (device addresses, in order; one
/// when the expert fits a page) go to `addresses`, their number to `*n`.
/// The expert's memory is read-only: experts are never written back (an
/// evicted expert drops onto the copy it was read from), so a write
/// through these addresses is lost. `STRATA_ERR_NOT_FOUND` for an expert
/// not registered. Thread-safe.
///
/// # Safety
/// `addresses` holds `cap` writable `uint64_t`s (NULL when `cap` is 0); `n`
/// and `out` are writable; nothing writes through the addresses.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_fetch(
    moe: *const objects::strata_moe,
    layer: u32,
    expert: u32,
    addresses: *mut u64,
    cap: usize,
    n: *mut usize,
    out: *mut *mut objects::strata_expert_pin,
) -> c_int {
    boundary("strata_moe_fetch", || {
        cast::disjoint(
            &[
                cast::region(addresses, cap, "addresses"),
                cast::region(n, 1, "n"),
                cast::region(out, 1, "out"),
            ],
            &[],
        )?;
        // SAFETY: as this function's contract states (no two outputs share
        // memory: checked above).
        let (dst, n, out) = unsafe {
            (
                cast::slice_mut(addresses, cap, "addresses")?,
                cast::out(n, "n")?,
                cast::out(out, "out")?,
            )
        };
        let cache = objects::get(moe)?.read().clone();
        let pin = cache.fetch_owned(layer, expert)?;
        let a = pin.addresses().to_vec();
        // Registered before any output is written: if it fails, the pin is
        // released and the outputs are as they were.
        let bits = objects::EXPERT_PINS.insert(pin, 0)?;
        let k = a.len().min(cap);
        dst[..k].copy_from_slice(&a[..k]);
        n.set(a.len());
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// Unpins a fetched expert. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_moe_release(pin: *mut objects::strata_expert_pin) -> c_int {
    boundary("strata_moe_release", || {
        drop(objects::remove(pin)?);
        Ok(STRATA_OK)
    })
}

/// Whether a fetch of `expert` of `layer` needs no read of its own: the
/// expert is in device memory (or on its way there), or read in place
/// from host memory. Stores 1 or 0 in `*ready`. A lookahead that caps its
/// predictions caps those not ready: `strata_moe_prefetch` skips the
/// others. An expert not registered is `STRATA_ERR_NOT_FOUND`. Thread-safe.
///
/// # Safety
/// `ready` points to a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_is_ready(
    moe: *const objects::strata_moe,
    layer: u32,
    expert: u32,
    ready: *mut u32,
) -> c_int {
    boundary("strata_moe_is_ready", || {
        // SAFETY: writable (this function's contract).
        let out = unsafe { cast::out(ready, "ready") }?;
        out.set(u32::from(
            objects::get(moe)?.read().is_ready(layer, expert)?,
        ));
        Ok(STRATA_OK)
    })
}

/// Starts moving `n` experts of `layer` (a router's predictions) into
/// device memory in the background; stores how many moves started in
/// `*started` if not NULL. A misaligned `started`, or an expert not
/// registered (`STRATA_ERR_NOT_FOUND`), is refused before any move
/// starts. Thread-safe.
///
/// # Safety
/// `experts` points to `n` readable `uint32_t`s; `started` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_prefetch(
    moe: *const objects::strata_moe,
    layer: u32,
    experts: *const u32,
    n: usize,
    started: *mut usize,
) -> c_int {
    // SAFETY: this function's contract is `start_moves`'.
    unsafe {
        start_moves("strata_moe_prefetch", moe, experts, n, started, |c, e| {
            c.prefetch(layer, e)
        })
    }
}

/// The body of `strata_moe_prefetch` and `strata_moe_read_ahead`: `start`
/// on the cache and the `n` experts, its count stored in `*started` if not
/// NULL (a misaligned `started` refused before anything starts).
///
/// # Safety
/// `experts` points to `n` readable `uint32_t`s; `started` is NULL or
/// writable.
unsafe fn start_moves(
    name: &'static str,
    moe: *const objects::strata_moe,
    experts: *const u32,
    n: usize,
    started: *mut usize,
    start: impl FnOnce(&strata::offload::moe::ExpertCache, &[u32]) -> strata::Result<usize>,
) -> c_int {
    boundary(name, || {
        // SAFETY: as this function's contract states.
        let (e, out) = unsafe {
            (
                cast::slice(experts, n, "experts")?,
                cast::out_opt(started, "started")?,
            )
        };
        out.set(start(&objects::get(moe)?.read(), e)?);
        Ok(STRATA_OK)
    })
}

/// Starts the reads of `n` experts of `layer` that the caller is about to
/// fetch (a layer's routed experts), so that they run while it computes
/// on the experts it has; each fetch then waits only for the rest of its
/// read. These are misses in the stats (`reads_ahead`), not prefetches.
/// Experts already resident, and those no unprotected slot can be freed
/// for, are skipped. Fetch the layer's resident experts first: one left
/// unpinned may be the victim that makes room for another's read. Stores
/// how many reads started in `*started` if not NULL; a misaligned
/// `started`, or an expert not registered (`STRATA_ERR_NOT_FOUND`), is
/// refused before any read starts.
/// Thread-safe.
///
/// # Safety
/// `experts` points to `n` readable `uint32_t`s; `started` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_read_ahead(
    moe: *const objects::strata_moe,
    layer: u32,
    experts: *const u32,
    n: usize,
    started: *mut usize,
) -> c_int {
    // SAFETY: this function's contract is `start_moves`'.
    unsafe {
        start_moves("strata_moe_read_ahead", moe, experts, n, started, |c, e| {
            c.read_ahead(layer, e)
        })
    }
}

/// Cancels the prefetches of `layer` that no fetch has used and whose
/// transfer has not finished (call it once the layer has run: they can
/// only be late or wrong); their slots are freed and a later fetch moves
/// the expert whole. Stores how many were cancelled in `*cancelled` if not
/// NULL; a misaligned `cancelled` is refused before anything is cancelled.
/// Thread-safe.
///
/// # Safety
/// `cancelled` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_cancel_prefetches(
    moe: *const objects::strata_moe,
    layer: u32,
    cancelled: *mut usize,
) -> c_int {
    boundary("strata_moe_cancel_prefetches", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out_opt(cancelled, "cancelled") }?;
        out.set(objects::get(moe)?.read().cancel_prefetches(layer)?);
        Ok(STRATA_OK)
    })
}

/// `strata_moe_cancel_prefetches` for the experts of `layer` not among the
/// `n` of `keep` — call it as soon as the layer's router has picked `keep`:
/// a wrong guess's read still queued then never runs. Finished prefetches
/// no fetch used stay resident, no longer protected. Stores how many were
/// cancelled in `*cancelled` if not NULL; a misaligned `cancelled`, or an
/// expert of `keep` not registered (`STRATA_ERR_NOT_FOUND`), is refused
/// before anything is cancelled. Thread-safe.
///
/// # Safety
/// `keep` points to `n` readable `uint32_t`s (NULL when `n` is 0);
/// `cancelled` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_cancel_prefetches_except(
    moe: *const objects::strata_moe,
    layer: u32,
    keep: *const u32,
    n: usize,
    cancelled: *mut usize,
) -> c_int {
    // SAFETY: this function's contract is `start_moves`'.
    unsafe {
        start_moves(
            "strata_moe_cancel_prefetches_except",
            moe,
            keep,
            n,
            cancelled,
            |c, k| c.cancel_prefetches_except(layer, k),
        )
    }
}

/// Stores the cache's counters in `*stats`. Thread-safe.
///
/// # Safety
/// `stats` points to a writable `strata_moe_stats`.
#[no_mangle]
pub unsafe extern "C" fn strata_moe_get_stats(
    moe: *const objects::strata_moe,
    stats: *mut strata_moe_stats,
) -> c_int {
    boundary("strata_moe_get_stats", || {
        // SAFETY: writable (this function's contract).
        let out = unsafe { cast::out(stats, "stats") }?;
        let s = objects::get(moe)?.read().stats();
        out.set(strata_moe_stats {
            fetches: s.fetches,
            hits: s.hits,
            late_prefetch_hits: s.late_prefetch_hits,
            prefetches: s.prefetches,
            prefetches_used: s.prefetches_used,
            prefetches_cancelled: s.prefetches_cancelled,
            bytes_moved: s.bytes_moved,
            stall_seconds: s.stall_seconds,
            stall_modelled: s.stall_modelled as c_int,
            displaced: s.displaced,
            reads_ahead: s.reads_ahead,
            prefetches_declined: s.prefetches_declined,
        });
        Ok(STRATA_OK)
    })
}

/// Ends an expert cache. Pins still held keep it alive until released.
/// NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_moe_free(moe: *mut objects::strata_moe) -> c_int {
    boundary("strata_moe_free", || {
        drop(objects::remove(moe)?);
        Ok(STRATA_OK)
    })
}
