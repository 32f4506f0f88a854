//! Hotness, traces and the balancer: counter harvest, trace recording,
//! policy selection.

use std::ffi::c_int;
use std::time::Duration;

use strata::hotness::HarvestParams;
use strata::runtime::BalancerConfig;

use crate::cast::{self, SetOpt};
use crate::enums::{self, strata_policy};
use crate::objects::{self, strata_buffer, strata_runtime};
use crate::status::{boundary, Fail, STRATA_OK};

/// What one balancer round did (`strata_balance_once`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct strata_balance_report {
    /// Pages moved into the fastest tier (device memory, or host DRAM in a
    /// runtime without a device tier).
    pub promotions: u64,
    /// Pages moved out of it.
    pub demotions: u64,
    /// Touched pages the policy left in place.
    pub bypasses: u64,
    /// Promotions put off by a rate limit or a full tier (no room, or no
    /// resident the page outscores by more than `min_accesses`).
    pub deferred: u64,
    /// Pages moved up into a tier below the fastest (NVMe into CXL, or into
    /// host DRAM under a device tier).
    pub promotions_below: u64,
    /// Pages moved down out of a tier below the fastest.
    pub demotions_below: u64,
}

/// Folds the buffer's access counters into its decayed scores
/// (`score = score * decay + count * 2^sampling`: in accesses, the
/// runtime's sampling scaled back; counts cleared) and writes up to `cap`
/// of the hottest pages not in device memory (page indices and scores, by
/// score descending, ties by page) into `hot_pages`/`hot_scores` with their
/// number in `*hot_len`, and up to `cap` of the coldest pages in device
/// memory into `cold_pages`/`cold_scores`/`*cold_len`. `decay` is in
/// (0, 1]. Thread-safe; concurrent harvests of one buffer serialize. A
/// running balancer harvests the same counters: the two share the counts.
///
/// # Safety
/// Each array is NULL (only when `cap` is 0) or holds `cap` writable
/// elements; `hot_len` and `cold_len` point to writable `size_t`s.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn strata_buffer_harvest(
    buf: *const strata_buffer,
    decay: f32,
    cap: usize,
    hot_pages: *mut u64,
    hot_scores: *mut f32,
    hot_len: *mut usize,
    cold_pages: *mut u64,
    cold_scores: *mut f32,
    cold_len: *mut usize,
) -> c_int {
    boundary("strata_buffer_harvest", || {
        cast::disjoint(
            &[
                cast::region(hot_pages, cap, "hot_pages"),
                cast::region(hot_scores, cap, "hot_scores"),
                cast::region(hot_len, 1, "hot_len"),
                cast::region(cold_pages, cap, "cold_pages"),
                cast::region(cold_scores, cap, "cold_scores"),
                cast::region(cold_len, 1, "cold_len"),
            ],
            &[],
        )?;
        // SAFETY: each as this function's contract states (and no two
        // share memory: checked above).
        let (hp, hs, hl, cp, cs, cl) = unsafe {
            (
                cast::slice_mut(hot_pages, cap, "hot_pages")?,
                cast::slice_mut(hot_scores, cap, "hot_scores")?,
                cast::out(hot_len, "hot_len")?,
                cast::slice_mut(cold_pages, cap, "cold_pages")?,
                cast::slice_mut(cold_scores, cap, "cold_scores")?,
                cast::out(cold_len, "cold_len")?,
            )
        };
        let b = objects::get(buf)?;
        let h = b.buffer.harvest(HarvestParams {
            decay,
            k: cap,
            // Scores in accesses: counts scaled by the runtime's sampling.
            shift: b.rt.rt.sampling().unwrap_or(0),
        })?;
        for (i, &(p, s)) in h.hot.iter().enumerate() {
            hp[i] = p;
            hs[i] = s;
        }
        for (i, &(p, s)) in h.cold.iter().enumerate() {
            cp[i] = p;
            cs[i] = s;
        }
        hl.set(h.hot.len());
        cl.set(h.cold.len());
        Ok(STRATA_OK)
    })
}

/// Starts recording every page access of the runtime (one in 2^`shift`,
/// `shift` ≤ 16) to the trace file `path` (created or truncated): one
/// decimal page id (buffer number << 32 | page) per line. One recording per
/// runtime at a time. Thread-safe.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_trace_start(
    rt: *const strata_runtime,
    path: *const std::ffi::c_char,
    shift: u32,
) -> c_int {
    boundary("strata_trace_start", || {
        // SAFETY: NULL or NUL-terminated (this function's contract).
        let bytes = unsafe { cast::c_str_bytes(path) }.ok_or_else(|| Fail::null("path"))?;
        let path =
            std::str::from_utf8(bytes).map_err(|_| Fail::invalid("the trace path is not UTF-8"))?;
        let r = objects::get(rt)?;
        let mut slot = r.trace.lock();
        if slot.is_some() {
            return Err(Fail::invalid("a trace is already being recorded"));
        }
        *slot = Some(r.rt.record_trace(std::path::Path::new(path), shift)?);
        Ok(STRATA_OK)
    })
}

/// Ends the recording: flushes the file and stores the number of accesses
/// it holds in `*accesses` (if not NULL). A misaligned `accesses` is
/// refused (`STRATA_ERR_INVALID_ARGUMENT`) before anything is done: the
/// recording goes on. Thread-safe.
///
/// # Safety
/// `accesses` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_trace_stop(rt: *const strata_runtime, accesses: *mut u64) -> c_int {
    boundary("strata_trace_stop", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out_opt(accesses, "accesses") }?;
        let r = objects::get(rt)?;
        let rec = r
            .trace
            .lock()
            .take()
            .ok_or_else(|| Fail::invalid("no trace is being recorded"))?;
        out.set(rec.finish()?);
        Ok(STRATA_OK)
    })
}

/// Starts (or restarts, with a fresh policy) the background balancer: every
/// `interval_us` microseconds it harvests the counters and promotes and
/// demotes pages as `policy` decides, at most `rate_limit` bytes per second
/// (0: no limit). The balancer places pages in the fastest tier (device
/// memory, or host DRAM without a device tier). Thread-safe.
#[no_mangle]
pub extern "C" fn strata_balancer_start(
    rt: *const strata_runtime,
    policy: strata_policy,
    interval_us: u64,
    rate_limit: u64,
) -> c_int {
    boundary("strata_balancer_start", || {
        if interval_us == 0 {
            return Err(Fail::invalid("interval_us must be at least 1"));
        }
        let config = BalancerConfig::default()
            .with_interval(Duration::from_micros(interval_us))
            .with_rate_limit((rate_limit > 0).then_some(rate_limit))
            .with_policy(enums::policy(policy)?);
        objects::get(rt)?.rt.start_balancer(config)?;
        Ok(STRATA_OK)
    })
}

/// Stops the background balancer (a no-op if none runs). Thread-safe.
#[no_mangle]
pub extern "C" fn strata_balancer_stop(rt: *const strata_runtime) -> c_int {
    boundary("strata_balancer_stop", || {
        objects::get(rt)?.rt.stop_balancer();
        Ok(STRATA_OK)
    })
}

/// Runs one balancer round now and stores what it did in `*report` (if not
/// NULL). A misaligned `report` is refused
/// (`STRATA_ERR_INVALID_ARGUMENT`) before the round runs. Thread-safe.
///
/// # Safety
/// `report` is NULL or points to a writable `strata_balance_report`.
#[no_mangle]
pub unsafe extern "C" fn strata_balance_once(
    rt: *const strata_runtime,
    report: *mut strata_balance_report,
) -> c_int {
    boundary("strata_balance_once", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out_opt(report, "report") }?;
        let r = objects::get(rt)?.rt.balance_once()?;
        out.set(strata_balance_report {
            promotions: r.promotions,
            demotions: r.demotions,
            bypasses: r.bypasses,
            deferred: r.deferred,
            promotions_below: r.promotions_below,
            demotions_below: r.demotions_below,
        });
        Ok(STRATA_OK)
    })
}
