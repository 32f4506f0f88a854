//! Fuzzes sequences of the offloading modules' C-ABI calls: an MoE expert
//! cache (register, fetch with any capacity, release, prefetch of any
//! layer and experts, cancel, stats, free with pins outstanding) and
//! offloaded optimizers (create with any settings, steps with gradients of
//! any length, weights, free), and embedding tables on a runtime (create
//! with any shape, write rows anywhere, pooled gathers of any indices,
//! offsets, weights and pooling, SGD and row-wise Adagrad steps on any
//! rows, reads, stats, free). Every call must return a status strata
//! documents (never `STRATA_ERR_PANIC`) with a message when it fails,
//! every fetched expert must hold the bytes it was registered with, and
//! every table must hold, gather and update exactly what a plain in-memory
//! copy of it does.
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
    IsReady {
        layer: u8,
        expert: u8,
    },
    CancelExcept {
        layer: u8,
        keep: Vec<u8>,
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
    EmbCreate {
        rows: u16,
        dim: u8,
        threads: u8,
        prefer: i8,
    },
    EmbWrite {
        e: u8,
        start: i16,
        rows: u8,
        seed: u8,
        extra: bool,
    },
    EmbForward {
        e: u8,
        indices: Vec<i16>,
        offsets: Vec<i16>,
        weights: bool,
        pooling: u8,
        padding: i16,
        extra: i8,
    },
    EmbStep {
        e: u8,
        rows: Vec<i16>,
        adagrad: bool,
        lr: i8,
        extra: i8,
    },
    EmbRead {
        e: u8,
        indices: Vec<i16>,
    },
    EmbStats {
        e: u8,
    },
    EmbFree {
        e: u8,
    },
}

/// A table through the C ABI and a plain copy of what it must hold.
struct Table {
    h: *mut strata_embedding,
    rows: usize,
    dim: usize,
    /// The rows, row by row.
    w: Vec<f32>,
    /// Row-wise Adagrad's accumulators, one per row: the C side's state
    /// and the copy's.
    state: Vec<f32>,
    want_state: Vec<f32>,
    lookups: u64,
}

#[derive(Arbitrary, Debug)]
struct Input {
    slots: u8,
    slot_pages: u8,
    host_pages: u8,
    ops: Vec<Op>,
}

/// The table `e` picks, if there is any.
fn pick(tables: &mut [Table], e: u8) -> Option<&mut Table> {
    let n = tables.len();
    (n > 0).then(|| &mut tables[usize::from(e) % n])
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
    // Embedding tables on a runtime of 2 device and 8 host pages.
    let mut rc = std::mem::MaybeUninit::<strata_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_config_init(rc.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut rc = unsafe { rc.assume_init() };
    rc.device = STRATA_DEVICE_SIM;
    rc.page_size = PAGE as u64;
    rc.device_capacity = 2 * PAGE as u64;
    rc.host_capacity = 8 * PAGE as u64;
    let mut rt = null_mut();
    // SAFETY: a readable config (no NVMe path), a writable handle.
    assert_eq!(st(unsafe { strata_runtime_create(&rc, &mut rt) }), STRATA_OK);
    let mut tables: Vec<Table> = Vec::new();

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
            Op::IsReady { layer, expert } => {
                let mut r = 7u32;
                // SAFETY: a writable flag.
                let s = st(unsafe {
                    strata_moe_is_ready(moe, u32::from(layer % 5), u32::from(expert % 10), &mut r)
                });
                assert!(s != STRATA_OK || r <= 1, "ready {r}");
            }
            Op::Cancel { layer } => {
                let mut k = 0usize;
                // SAFETY: a writable count.
                st(unsafe { strata_moe_cancel_prefetches(moe, u32::from(layer % 5), &mut k) });
            }
            Op::CancelExcept { layer, keep } => {
                let keep: Vec<u32> = keep.iter().take(8).map(|&x| u32::from(x % 10)).collect();
                let mut k = 0usize;
                // SAFETY: `keep` is readable for its length; a writable count.
                st(unsafe {
                    strata_moe_cancel_prefetches_except(moe, u32::from(layer % 5), keep.as_ptr(), keep.len(), &mut k)
                });
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
            Op::EmbCreate {
                rows,
                dim,
                threads,
                prefer,
            } => {
                let (rows, dim) = (usize::from(rows % 300), usize::from(dim % 20));
                let mut h = null_mut();
                // SAFETY: a writable handle.
                let s = st(unsafe {
                    if prefer < 0 {
                        strata_embedding_create(rt, rows as u64, dim, usize::from(threads % 6), &mut h)
                    } else if prefer >= 64 {
                        // A row cache of up to 63 rows under one of the
                        // policies (the last two need the future: refused).
                        let tier = i32::from(prefer % 5);
                        let cache = usize::from(prefer as u8 % 64);
                        let policy = i32::from(threads / 6 % 12);
                        strata_embedding_create_cached(
                            rt, rows as u64, dim, tier, usize::from(threads % 6), cache, policy, &mut h,
                        )
                    } else {
                        let tier = i32::from(prefer % 5);
                        strata_embedding_create_in(rt, rows as u64, dim, tier, usize::from(threads % 6), &mut h)
                    }
                });
                if s == STRATA_OK {
                    assert!(rows > 0 && dim > 0 && threads % 6 > 0, "made a {rows} x {dim} table");
                    tables.push(Table {
                        h,
                        rows,
                        dim,
                        w: vec![0.0; rows * dim],
                        state: vec![0.0; rows],
                        want_state: vec![0.0; rows],
                        lookups: 0,
                    });
                }
            }
            Op::EmbWrite {
                e,
                start,
                rows,
                seed,
                extra,
            } => {
                let Some(t) = pick(&mut tables, e) else { continue };
                let len = usize::from(rows % 40) * t.dim + usize::from(extra);
                let data: Vec<f32> = pattern(seed, len).iter().map(|&b| f32::from(b) / 64.0 - 2.0).collect();
                let start = i64::from(start);
                // SAFETY: `data` readable for its length.
                let s = st(unsafe { strata_embedding_write_rows(t.h, start, data.as_ptr(), data.len()) });
                let fits = start >= 0 && len % t.dim == 0 && start as usize + len / t.dim <= t.rows;
                assert_eq!(s == STRATA_OK, fits, "write of {len} floats at row {start}");
                if s == STRATA_OK {
                    let at = start as usize * t.dim;
                    t.w[at..at + len].copy_from_slice(&data);
                }
            }
            Op::EmbForward {
                e,
                indices,
                offsets,
                weights,
                pooling,
                padding,
                extra,
            } => {
                let Some(t) = pick(&mut tables, e) else { continue };
                let idx: Vec<i64> = indices.iter().take(64).map(|&i| i64::from(i)).collect();
                let off: Vec<i64> = offsets.iter().take(16).map(|&i| i64::from(i)).collect();
                let psw: Vec<f32> = (0..idx.len()).map(|i| i as f32 * 0.25 - 1.0).collect();
                let bags = strata_bags {
                    indices: idx.as_ptr(),
                    num_indices: idx.len(),
                    offsets: off.as_ptr(),
                    num_offsets: off.len(),
                    weights: if weights { psw.as_ptr() } else { std::ptr::null() },
                    pooling: i32::from(pooling % 3),
                    padding_idx: i64::from(padding),
                };
                let n = off.len().saturating_sub(1);
                let len = (n * t.dim) as i64 + i64::from(extra % 2);
                let mut out = vec![f32::NAN; len.max(0) as usize];
                let mut stats = strata_embedding_stats::default();
                // SAFETY: the arrays live for the call; `out` writable for
                // its length; stats writable.
                let s = st(unsafe {
                    strata_embedding_forward(t.h, &bags, out.as_mut_ptr(), out.len(), &mut stats)
                });
                let good = pooling % 3 < 2
                    && idx.iter().all(|&i| 0 <= i && (i as usize) < t.rows)
                    && off.first() == Some(&0)
                    && off.windows(2).all(|w| w[0] <= w[1])
                    && off.last() == Some(&(idx.len() as i64))
                    && out.len() == n * t.dim;
                assert_eq!(s == STRATA_OK, good, "gather of {idx:?} by {off:?}");
                if s != STRATA_OK {
                    assert!(out.iter().all(|x| x.is_nan()), "a refused gather wrote");
                    continue;
                }
                assert_eq!(stats.lookups, idx.len() as u64);
                t.lookups += idx.len() as u64;
                let pad = (padding >= 0).then_some(i64::from(padding));
                for b in 0..n {
                    let mut want = vec![0f32; t.dim];
                    let mut kept = 0;
                    for i in off[b] as usize..off[b + 1] as usize {
                        if Some(idx[i]) == pad {
                            continue;
                        }
                        let row = &t.w[idx[i] as usize * t.dim..(idx[i] as usize + 1) * t.dim];
                        for (o, &v) in want.iter_mut().zip(row) {
                            *o += if weights { psw[i] * v } else { v };
                        }
                        kept += 1;
                    }
                    if pooling % 3 == 1 && kept > 0 {
                        want.iter_mut().for_each(|o| *o /= kept as f32);
                    }
                    assert!(
                        out[b * t.dim..(b + 1) * t.dim].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "bag {b} differs from the plain copy's"
                    );
                }
            }
            Op::EmbStep {
                e,
                rows,
                adagrad,
                lr,
                extra,
            } => {
                let Some(t) = pick(&mut tables, e) else { continue };
                let r: Vec<i64> = rows.iter().take(32).map(|&i| i64::from(i)).collect();
                let len = (r.len() * t.dim) as i64 + i64::from(extra % 2);
                let g: Vec<f32> = (0..len.max(0) as usize).map(|i| (i % 7) as f32 - 3.0).collect();
                let lr = f32::from(lr) / 64.0;
                // SAFETY: `r` and `g` readable for their lengths; the state
                // writable for its length.
                let s = st(unsafe {
                    if adagrad {
                        strata_embedding_rowwise_adagrad(
                            t.h,
                            r.as_ptr(),
                            r.len(),
                            g.as_ptr(),
                            g.len(),
                            t.state.as_mut_ptr(),
                            t.state.len(),
                            lr,
                            1e-6,
                        )
                    } else {
                        strata_embedding_sgd(t.h, r.as_ptr(), r.len(), g.as_ptr(), g.len(), lr)
                    }
                });
                let mut sorted = r.clone();
                sorted.sort_unstable();
                sorted.dedup();
                let good = r.iter().all(|&i| 0 <= i && (i as usize) < t.rows)
                    && sorted.len() == r.len()
                    && g.len() == r.len() * t.dim;
                assert_eq!(s == STRATA_OK, good, "a step on rows {r:?}");
                if s != STRATA_OK {
                    assert_eq!(t.state, t.want_state, "a refused step changed the state");
                    continue;
                }
                for (k, &row) in r.iter().enumerate() {
                    let gk = &g[k * t.dim..(k + 1) * t.dim];
                    let scale = if adagrad {
                        let acc = &mut t.want_state[row as usize];
                        *acc += gk.iter().map(|x| x * x).sum::<f32>() / t.dim as f32;
                        lr / (acc.sqrt() + 1e-6)
                    } else {
                        lr
                    };
                    let w = &mut t.w[row as usize * t.dim..(row as usize + 1) * t.dim];
                    for (x, &gx) in w.iter_mut().zip(gk) {
                        *x -= scale * gx;
                    }
                }
                assert_eq!(t.state, t.want_state, "accumulators differ");
            }
            Op::EmbRead { e, indices } => {
                let Some(t) = pick(&mut tables, e) else { continue };
                let idx: Vec<i64> = indices.iter().take(64).map(|&i| i64::from(i)).collect();
                let mut out = vec![0f32; idx.len() * t.dim];
                // SAFETY: `idx` readable, `out` writable for their lengths.
                let s = st(unsafe {
                    strata_embedding_read_rows(t.h, idx.as_ptr(), idx.len(), out.as_mut_ptr(), out.len())
                });
                let good = idx.iter().all(|&i| 0 <= i && (i as usize) < t.rows);
                assert_eq!(s == STRATA_OK, good, "read of {idx:?}");
                if s == STRATA_OK {
                    for (k, &i) in idx.iter().enumerate() {
                        let want = &t.w[i as usize * t.dim..(i as usize + 1) * t.dim];
                        let got = &out[k * t.dim..(k + 1) * t.dim];
                        assert!(
                            got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "row {i} differs from the plain copy's"
                        );
                    }
                }
            }
            Op::EmbStats { e } => {
                let Some(t) = pick(&mut tables, e) else { continue };
                let mut s = strata_embedding_stats::default();
                // SAFETY: a writable stats struct.
                assert_eq!(st(unsafe { strata_embedding_get_stats(t.h, &mut s) }), STRATA_OK);
                assert_eq!(s.lookups, t.lookups);
                assert!(s.fast_hits <= s.lookups);
                assert!(s.cache_hits <= s.fast_hits && s.cache_fills <= s.lookups);
            }
            Op::EmbFree { e } => {
                if !tables.is_empty() {
                    let t = tables.swap_remove(usize::from(e) % tables.len());
                    assert_eq!(st(strata_embedding_free(t.h)), STRATA_OK);
                    assert_eq!(st(strata_embedding_free(t.h)), STRATA_ERR_INVALID_HANDLE);
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
    // The tables keep the runtime alive past its destruction.
    assert_eq!(st(strata_runtime_destroy(rt)), STRATA_OK);
    for t in tables {
        let mut rows = 0u64;
        // SAFETY: a writable row count.
        assert_eq!(st(unsafe { strata_embedding_shape(t.h, &mut rows, null_mut()) }), STRATA_OK);
        assert_eq!(rows, t.rows as u64);
        assert_eq!(st(strata_embedding_free(t.h)), STRATA_OK);
    }
    // The runtimes' worker threads end shortly after their last handle
    // goes; wait, so the leak checker does not take them for leaks.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while threads() > threads_before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
});
