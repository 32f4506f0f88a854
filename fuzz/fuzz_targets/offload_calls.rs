//! Fuzzes sequences of the offloading modules' C-ABI calls: an MoE expert
//! cache (register, fetch with any capacity, release, prefetch of any
//! layer and experts, cancel, stats, free with pins outstanding) and
//! offloaded optimizers (create with any settings, steps with gradients of
//! any length, weights, free). Every call must return a status strata
//! documents (never `STRATA_ERR_PANIC`) with a message when it fails, and
//! every fetched expert must hold the bytes it was registered with.
#![no_main]

use std::ptr::null_mut;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use strata_ffi::*;

#[path = "common.rs"]
mod common;
use common::{st, threads};

const PAGE: usize = 4096;

#[derive(Arbitrary, Debug)]
enum Op {
    Register {
        layer: u8,
        expert: u8,
        len: u16,
        seed: u8,
    },
    Fetch {
        layer: u8,
        expert: u8,
        cap: u8,
        keep: bool,
    },
    Release {
        p: u8,
    },
    Prefetch {
        layer: u8,
        experts: Vec<u8>,
    },
    Cancel {
        layer: u8,
    },
    Stats,
    MoeFree,
    OptimCreate {
        n: u16,
        chunk_shift: u8,
        fraction: u8,
        every: u8,
        cxl: bool,
    },
    OptimStep {
        o: u8,
        extra: i8,
        seed: u8,
    },
    OptimWeights {
        o: u8,
        cap: u16,
    },
    OptimFree {
        o: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    slots: u8,
    slot_pages: u8,
    host_pages: u8,
    ops: Vec<Op>,
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(17).wrapping_add(seed))
        .collect()
}

/// Starts the thread pool host-tier steps run on (it lives for the
/// process) before the first input, so the leak checker does not count it.
fn warm_up() {
    let mut oc = std::mem::MaybeUninit::<strata_optim_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(
        unsafe { strata_optim_config_init(oc.as_mut_ptr()) },
        STRATA_OK
    );
    // SAFETY: filled above.
    let mut oc = unsafe { oc.assume_init() };
    oc.chunk_bytes = 4096;
    let w = [0.5f32; 3000];
    let mut o = null_mut();
    // SAFETY: readable weights and config, a writable handle.
    assert_eq!(
        unsafe { strata_optim_create(w.as_ptr(), w.len(), &oc, &mut o) },
        STRATA_OK
    );
    let mut stats = strata_step_stats::default();
    // SAFETY: readable gradients, writable stats.
    assert_eq!(
        unsafe { strata_optim_step(o, w.as_ptr(), w.len(), &mut stats) },
        STRATA_OK
    );
    assert_eq!(strata_optim_free(o), STRATA_OK);
}

fuzz_target!(init: warm_up(), |input: Input| {
    let threads_before = threads();
    let mut c = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.device = STRATA_DEVICE_SIM;
    c.device_slots = usize::from(input.slots % 6);
    c.slot_bytes = ((1 + u64::from(input.slot_pages % 4)) * PAGE as u64).saturating_sub(7);
    c.host_bytes = u64::from(input.host_pages % 48) * PAGE as u64;
    c.page_size = PAGE;
    let mut moe = null_mut();
    // SAFETY: a readable config (no NVMe path), a writable handle.
    let mut live = st(unsafe { strata_moe_create(&c, &mut moe) }) == STRATA_OK;
    // What each registered expert holds.
    let mut experts: std::collections::HashMap<(u32, u32), Vec<u8>> = Default::default();
    let mut pins: Vec<*mut strata_expert_pin> = Vec::new();
    let mut opts: Vec<(*mut strata_optim, usize)> = Vec::new();

    for op in input.ops.into_iter().take(48) {
        match op {
            Op::Register {
                layer,
                expert,
                len,
                seed,
            } => {
                let (l, e) = (u32::from(layer % 4), u32::from(expert % 8));
                let w = pattern(seed, usize::from(len) % (5 * PAGE));
                // SAFETY: `w` is readable for its length (a dangling but
                // aligned pointer when empty, with length 0).
                let s = st(unsafe { strata_moe_register(moe, l, e, w.as_ptr().cast(), w.len()) });
                if s == STRATA_OK {
                    assert!(live, "registered into a freed cache");
                    experts.insert((l, e), w);
                }
            }
            Op::Fetch {
                layer,
                expert,
                cap,
                keep,
            } => {
                let (l, e) = (u32::from(layer % 5), u32::from(expert % 9));
                let mut addresses = vec![0u64; usize::from(cap % 8)];
                let (mut n, mut pin) = (0usize, null_mut());
                // SAFETY: `addresses` holds its length of writable u64s; `n`
                // and `pin` are writable.
                let s = st(unsafe {
                    strata_moe_fetch(
                        moe,
                        l,
                        e,
                        if addresses.is_empty() {
                            null_mut()
                        } else {
                            addresses.as_mut_ptr()
                        },
                        addresses.len(),
                        &mut n,
                        &mut pin,
                    )
                });
                if s != STRATA_OK {
                    continue;
                }
                let want = experts.get(&(l, e)).expect("fetched an expert never registered");
                assert_eq!(n, want.len().div_ceil(PAGE), "pages of expert ({l}, {e})");
                // Simulated device: each page address is host memory, held
                // by the pin.
                for (k, &a) in addresses.iter().take(n).enumerate() {
                    let part = &want[k * PAGE..((k + 1) * PAGE).min(want.len())];
                    // SAFETY: a pinned simulated device page of PAGE bytes,
                    // of which `part.len()` belong to the expert.
                    let got = unsafe { std::slice::from_raw_parts(a as *const u8, part.len()) };
                    assert!(got == part, "expert ({l}, {e}) page {k} differs");
                }
                if keep {
                    pins.push(pin);
                } else {
                    assert_eq!(st(strata_moe_release(pin)), STRATA_OK);
                }
            }
            Op::Release { p } => {
                if !pins.is_empty() {
                    let pin = pins.swap_remove(usize::from(p) % pins.len());
                    st(strata_moe_release(pin));
                }
            }
            Op::Prefetch { layer, experts: e } => {
                let e: Vec<u32> = e.iter().take(8).map(|&x| u32::from(x % 10)).collect();
                let mut started = 0usize;
                // SAFETY: `e` is readable for its length; `started` writable.
                st(unsafe {
                    strata_moe_prefetch(moe, u32::from(layer % 5), e.as_ptr(), e.len(), &mut started)
                });
            }
            Op::Cancel { layer } => {
                let mut k = 0usize;
                // SAFETY: a writable count.
                st(unsafe { strata_moe_cancel_prefetches(moe, u32::from(layer % 5), &mut k) });
            }
            Op::Stats => {
                let mut s = strata_moe_stats::default();
                // SAFETY: a writable stats struct.
                if st(unsafe { strata_moe_get_stats(moe, &mut s) }) == STRATA_OK {
                    assert!(s.hits <= s.fetches && s.late_prefetch_hits <= s.hits);
                    assert!(s.prefetches_used <= s.prefetches);
                }
            }
            Op::MoeFree => {
                // Pins still held keep the cache alive until released.
                if st(strata_moe_free(moe)) == STRATA_OK {
                    live = false;
                }
            }
            Op::OptimCreate {
                n,
                chunk_shift,
                fraction,
                every,
                cxl,
            } => {
                let n = usize::from(n % 5000);
                let w = pattern(n as u8, n).iter().map(|&b| f32::from(b) * 0.01).collect::<Vec<_>>();
                let mut oc = std::mem::MaybeUninit::<strata_optim_config>::uninit();
                // SAFETY: a writable config.
                assert_eq!(unsafe { strata_optim_config_init(oc.as_mut_ptr()) }, STRATA_OK);
                // SAFETY: filled above.
                let mut oc = unsafe { oc.assume_init() };
                oc.tier = if cxl { STRATA_TIER_CXL } else { STRATA_TIER_HOST };
                // 2 KiB (refused) to 64 KiB.
                oc.chunk_bytes = 1 << (11 + chunk_shift % 6);
                oc.importance_fraction = f64::from(fraction % 12) / 10.0;
                oc.importance_every = u64::from(every % 5);
                let mut o = null_mut();
                // SAFETY: `w` readable for `n` floats (dangling when 0), a
                // readable config, a writable handle.
                let s = st(unsafe { strata_optim_create(w.as_ptr(), n, &oc, &mut o) });
                if s == STRATA_OK {
                    opts.push((o, n));
                }
            }
            Op::OptimStep { o, extra, seed } => {
                if let Some(&(h, n)) = (!opts.is_empty()).then(|| &opts[usize::from(o) % opts.len()])
                {
                    let len = (n as i64 + i64::from(extra % 3)).max(0) as usize;
                    let g: Vec<f32> = pattern(seed, len).iter().map(|&b| f32::from(b) - 128.0).collect();
                    let mut stats = strata_step_stats::default();
                    // SAFETY: `g` readable for its length; stats writable.
                    let s = st(unsafe { strata_optim_step(h, g.as_ptr(), g.len(), &mut stats) });
                    assert!(s != STRATA_OK || len == n, "a step took {len} gradients for {n}");
                }
            }
            Op::OptimWeights { o, cap } => {
                if let Some(&(h, n)) = (!opts.is_empty()).then(|| &opts[usize::from(o) % opts.len()])
                {
                    let mut out = vec![0f32; usize::from(cap % 6000)];
                    // SAFETY: `out` writable for its length.
                    let s = st(unsafe { strata_optim_weights(h, out.as_mut_ptr(), out.len()) });
                    if s == STRATA_OK {
                        assert_eq!(out.len(), n, "weights into {} floats for {n}", out.len());
                        assert!(out[..n].iter().all(|x| x.is_finite()), "weights went non-finite");
                    }
                }
            }
            Op::OptimFree { o } => {
                if !opts.is_empty() {
                    let (h, _) = opts.swap_remove(usize::from(o) % opts.len());
                    assert_eq!(st(strata_optim_free(h)), STRATA_OK);
                }
            }
        }
    }
    for pin in pins {
        st(strata_moe_release(pin));
    }
    if live {
        assert_eq!(st(strata_moe_free(moe)), STRATA_OK);
    }
    for (h, _) in opts {
        assert_eq!(st(strata_optim_free(h)), STRATA_OK);
    }
    // The runtimes' worker threads end shortly after their last handle
    // goes; wait, so the leak checker does not take them for leaks.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while threads() > threads_before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
});
