//! The table against a naive in-memory reference on a host-only runtime
//! (rows straddling pages), its refusals, and the mapped gather beside
//! the buffer one on the simulated device.

use super::*;
use crate::device::DeviceChoice;

const PAGE: usize = 4096;

fn host(pages: u64) -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .host(pages * PAGE as u64)
        .build()
        .unwrap()
}

/// A simulated device of 8 pages over 64 of host memory, no background
/// eviction.
fn sim() -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 8 * PAGE as u64)
        .host(64 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap()
}

/// A deterministic value of element `d` of row `r`.
fn value(r: u64, d: usize) -> f32 {
    (crate::hotness::mix(r << 16 ^ d as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

fn filled(rt: &Runtime, rows: u64, dim: usize) -> (EmbeddingTable, Vec<f32>) {
    let t = EmbeddingTable::new(rt, rows, dim).unwrap();
    let w: Vec<f32> = (0..rows)
        .flat_map(|r| (0..dim).map(move |d| value(r, d)))
        .collect();
    t.write_rows(0, &w).unwrap();
    (t, w)
}

/// The pooled bags computed directly from `w`.
fn naive(w: &[f32], dim: usize, bags: &Bags<'_>) -> Vec<f32> {
    let mut out = vec![0f32; bags.len() * dim];
    for b in 0..bags.len() {
        let dst = &mut out[b * dim..(b + 1) * dim];
        let mut n = 0;
        for i in bags.offsets[b] as usize..bags.offsets[b + 1] as usize {
            let r = bags.indices[i];
            if Some(r) == bags.padding_idx {
                continue;
            }
            let wt = bags.weights.map_or(1.0, |w| w[i]);
            for (o, v) in dst
                .iter_mut()
                .zip(&w[r as usize * dim..(r as usize + 1) * dim])
            {
                *o += wt * v;
            }
            n += 1;
        }
        if bags.pooling == Pooling::Mean && n > 0 {
            dst.iter_mut().for_each(|o| *o /= n as f32);
        }
    }
    out
}

#[test]
fn gather_pools_as_the_reference_does() {
    // 20-byte rows: every 205th row straddles a page boundary.
    let (rows, dim) = (1000u64, 5usize);
    let rt = host(8);
    let (t, w) = filled(&rt, rows, dim);
    let idx: Vec<i64> = (0..300).map(|i| (i * 37 % 1000) as i64).collect();
    // Empty bags first, in the middle and last.
    let offsets = [0i64, 0, 10, 10, 150, 299, 300, 300];
    let weights: Vec<f32> = (0..300).map(|i| i as f32 / 100.0 - 1.0).collect();
    for bags in [
        Bags::new(&idx, &offsets),
        Bags::new(&idx, &offsets).pooling(Pooling::Mean),
        Bags::new(&idx, &offsets).weights(&weights),
        Bags::new(&idx, &offsets)
            .pooling(Pooling::Mean)
            .padding_idx(Some(idx[5])),
    ] {
        let mut out = vec![f32::NAN; bags.len() * dim];
        let l = t.gather(&bags, &mut out).unwrap();
        assert_eq!(l.lookups, 300);
        // One tier: every lookup is in the fastest.
        assert_eq!(l.fast_hits, 300);
        let want = naive(&w, dim, &bags);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        assert!(
            out[..dim].iter().all(|&x| x == 0.0),
            "an empty bag is zeros"
        );
    }
    assert_eq!(t.stats().lookups, 1200);
    t.reset_stats();
    assert_eq!(t.stats(), Lookups::default());
    let mut rows_out = vec![0f32; 3 * dim];
    t.read_rows(&[204, 205, 999], &mut rows_out).unwrap();
    assert_eq!(&rows_out[..dim], &w[204 * dim..205 * dim]);
    assert_eq!(&rows_out[2 * dim..], &w[999 * dim..]);
    assert_eq!(t.stats().lookups, 0, "read_rows is not counted");
}

#[test]
fn bad_input_is_refused_before_any_work() {
    let rt = host(8);
    let (t, w) = filled(&rt, 100, 4);
    let mut out = vec![0f32; 4];
    let e = t
        .gather(&Bags::new(&[1, 100], &[0, 2]), &mut out)
        .unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::IndexOutOfRange {
            index: 100,
            rows: 100
        }
    ));
    assert!(e.is_out_of_range());
    assert_eq!(
        e.to_string(),
        "index 100 is out of range for an embedding table of 100 rows"
    );
    let e = t.gather(&Bags::new(&[-1], &[0, 1]), &mut out).unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::IndexOutOfRange { index: -1, .. }
    ));
    for (offsets, why) in [
        (&[1i64, 2][..], "offsets must start at 0"),
        (&[][..], "offsets must start at 0"),
        (&[0, 2, 1, 2][..], "non-decreasing"),
        (
            &[0, 1][..],
            "the last offset 1 is not the number of indices 2",
        ),
    ] {
        let bags = Bags::new(&[1, 2], offsets);
        let mut out = vec![0f32; bags.len() * 4];
        let e = t.gather(&bags, &mut out).unwrap_err();
        assert!(matches!(e, EmbeddingError::Offsets(_)), "{e}");
        assert!(e.to_string().contains(why), "{e}");
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidArgument);
    }
    let e = t
        .gather(&Bags::new(&[1, 2], &[0, 2]).weights(&[1.0]), &mut out)
        .unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::Length {
            what: "weights",
            len: 1,
            want: 2,
            ..
        }
    ));
    let e = t
        .gather(&Bags::new(&[1, 2], &[0, 2]), &mut [0f32; 5])
        .unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::Length {
            what: "out",
            len: 5,
            want: 4,
            ..
        }
    ));
    assert_eq!(t.stats().lookups, 0, "refused calls count nothing");
    let e = t.read_rows(&[0, 1], &mut out).unwrap_err();
    assert!(matches!(e, EmbeddingError::Length { what: "out", .. }));
    // Updates.
    let g = [1f32; 8];
    let e = t.sgd(&[3, 3], &g, 0.1).unwrap_err();
    assert!(matches!(e, EmbeddingError::RepeatedRow { row: 3 }));
    assert!(e.to_string().starts_with("rows repeat"), "{e}");
    let e = t.sgd(&[105], &g[..4], 0.1).unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::IndexOutOfRange { index: 105, .. }
    ));
    let e = t.sgd(&[1, 2], &g[..7], 0.1).unwrap_err();
    assert!(matches!(e, EmbeddingError::Length { what: "grads", .. }));
    let e = t.sgd(&[1], &g[..4], f32::NAN).unwrap_err();
    assert!(matches!(e, EmbeddingError::Invalid(_)));
    let mut state = vec![0f32; 99];
    let e = t
        .rowwise_adagrad(&[1], &g[..4], &mut state, 0.1, 1e-8)
        .unwrap_err();
    assert!(matches!(e, EmbeddingError::Length { what: "state", .. }));
    let mut state = vec![0f32; 100];
    let e = t
        .rowwise_adagrad(&[1], &g[..4], &mut state, 0.1, -1.0)
        .unwrap_err();
    assert!(matches!(e, EmbeddingError::Invalid(_)));
    assert!(state.iter().all(|&s| s == 0.0));
    // Rows out of range, and a partial row.
    let e = t.write_rows(99, &[0.0; 8]).unwrap_err();
    assert!(matches!(
        e,
        EmbeddingError::RowsOutOfRange {
            start: 99,
            end: 101,
            rows: 100
        }
    ));
    assert!(t.write_rows(-1, &[0.0; 4]).unwrap_err().is_out_of_range());
    assert!(matches!(
        t.write_rows(0, &[0.0; 3]).unwrap_err(),
        EmbeddingError::Invalid(_)
    ));
    assert!(t.tier_of_row(100).unwrap_err().is_out_of_range());
    // Nothing changed.
    let mut all = vec![0f32; 400];
    let idx: Vec<i64> = (0..100).collect();
    t.read_rows(&idx, &mut all).unwrap();
    assert_eq!(all, w);
    // As a strata error: the kind, and the message kept.
    let e: crate::error::Error = EmbeddingError::RepeatedRow { row: 3 }.into();
    assert_eq!(e.kind(), crate::error::ErrorKind::InvalidArgument);
    assert!(e.message().starts_with("rows repeat"));
}

#[test]
fn shapes_and_options_are_checked() {
    let rt = host(8);
    for (rows, dim) in [(0, 4), (4, 0)] {
        assert!(matches!(
            EmbeddingTable::new(&rt, rows, dim).unwrap_err(),
            EmbeddingError::Invalid(_)
        ));
    }
    assert!(matches!(
        EmbeddingTable::new(&rt, u64::MAX, 4).unwrap_err(),
        EmbeddingError::Invalid(_)
    ));
    for threads in [0, MAX_THREADS + 1] {
        let o = TableOptions {
            threads,
            ..Default::default()
        };
        assert!(EmbeddingTable::with_options(&rt, 4, 4, o).is_err());
    }
    // Larger than the runtime: the runtime's own error.
    let e = EmbeddingTable::new(&rt, 1 << 20, 4).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::OutOfCapacity);
    let t = EmbeddingTable::new(&rt, 10, 3).unwrap();
    assert_eq!((t.rows(), t.dim(), t.fast_tier()), (10, 3, Tier::Host));
    assert_eq!(t.tier_of_row(9).unwrap(), None, "never written");
}

#[test]
fn sgd_and_rowwise_adagrad_update_rows_in_place() {
    let (rows, dim) = (700u64, 6usize);
    let rt = host(8);
    let (t, mut w) = filled(&rt, rows, dim);
    let touched: Vec<i64> = vec![699, 3, 204, 205, 0, 341];
    let grads: Vec<f32> = (0..touched.len() * dim).map(|i| (i as f32).sin()).collect();
    t.sgd(&touched, &grads, 0.5).unwrap();
    for (k, &r) in touched.iter().enumerate() {
        for d in 0..dim {
            w[r as usize * dim + d] -= 0.5 * grads[k * dim + d];
        }
    }
    let mut state = vec![0f32; rows as usize];
    let mut want_state = state.clone();
    for _ in 0..2 {
        t.rowwise_adagrad(&touched, &grads, &mut state, 0.1, 1e-6)
            .unwrap();
        for (k, &r) in touched.iter().enumerate() {
            let g = &grads[k * dim..(k + 1) * dim];
            let acc = &mut want_state[r as usize];
            *acc += g.iter().map(|x| x * x).sum::<f32>() / dim as f32;
            let s = 0.1 / (acc.sqrt() + 1e-6);
            for d in 0..dim {
                w[r as usize * dim + d] -= s * g[d];
            }
        }
    }
    assert_eq!(state, want_state);
    let idx: Vec<i64> = (0..rows as i64).collect();
    let mut all = vec![0f32; w.len()];
    t.read_rows(&idx, &mut all).unwrap();
    for (a, b) in all.iter().zip(&w) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }
}

/// Row-wise Adagrad with eps 0 (allowed) leaves a row whose gradients
/// were all zero as it was, not NaN.
#[test]
fn rowwise_adagrad_with_eps_zero_leaves_zero_gradient_rows_alone() {
    let (rows, dim) = (16u64, 4usize);
    let rt = host(8);
    let (t, w) = filled(&rt, rows, dim);
    let mut state = vec![0f32; rows as usize];
    t.rowwise_adagrad(&[7], &[0.0; 4], &mut state, 0.1, 0.0)
        .unwrap();
    let mut got = vec![0f32; dim];
    t.read_rows(&[7], &mut got).unwrap();
    assert_eq!(got, w[7 * dim..8 * dim]);
}

#[test]
fn mapped_gather_equals_the_buffer_gather_and_counts_device_hits() {
    let (rows, dim) = (2048u64, 16usize); // 64 B rows: 64 a page, 32 pages
    let rt = sim();
    let (t, w) = filled(&rt, rows, dim);
    assert_eq!(t.fast_tier(), Tier::Device);
    // The pages were written in parallel: 8 of them (any) on the device.
    let r = t.buffer().residency();
    assert_eq!(
        (r.pages[Tier::Device as usize], r.pages[Tier::Host as usize]),
        (8, 24)
    );
    let idx: Vec<i64> = (0..512).map(|i| (i * 131 % 2048) as i64).collect();
    let offsets: Vec<i64> = (0..=64).map(|b| b * 8).collect();
    let bags = Bags::new(&idx, &offsets).pooling(Pooling::Mean);
    let (mut a, mut b) = (vec![0f32; 64 * dim], vec![0f32; 64 * dim]);
    let la = t.gather(&bags, &mut a).unwrap();
    let lb = t.gather_mapped(&bags, 7, &mut b).unwrap();
    assert_eq!(a, b);
    assert_eq!(la, lb);
    let on_device = idx
        .iter()
        .filter(|&&r| t.tier_of_row(r).unwrap() == Some(Tier::Device))
        .count() as u64;
    assert!(on_device > 0);
    assert_eq!(lb.fast_hits, on_device);
    assert_eq!(a, naive(&w, dim, &bags));
    // The launch has ended: writes go through again.
    t.write_rows(0, &w[..dim]).unwrap();
}

/// The fused backward is the per-row update of the bags' gradients summed
/// per row in lookup order: bitwise, for sum and mean, weights and
/// padding, and a row repeated within and across bags.
#[test]
fn fused_backward_equals_summing_the_bags_gradients_then_updating() {
    let (rows, dim) = (300u64, 5usize);
    let idx: Vec<i64> = vec![7, 250, 7, 0, 3, 250, 250, 9, 7];
    let offsets: Vec<i64> = vec![0, 3, 3, 6, 9];
    let weights: Vec<f32> = (0..idx.len()).map(|i| 0.25 + i as f32 * 0.5).collect();
    let grad: Vec<f32> = (0..4 * dim).map(|i| (i as f32 * 0.7).cos()).collect();
    for (pooling, weighted, padding) in [
        (Pooling::Sum, false, None),
        (Pooling::Sum, true, Some(3)),
        (Pooling::Mean, false, Some(9)),
    ] {
        let mut bags = Bags::new(&idx, &offsets)
            .pooling(pooling)
            .padding_idx(padding);
        if weighted {
            bags = bags.weights(&weights);
        }
        // The reference: each lookup's share, summed per row in order.
        let mut sums: std::collections::BTreeMap<i64, Vec<f32>> = Default::default();
        for b in 0..bags.len() {
            let (lo, hi) = (offsets[b] as usize, offsets[b + 1] as usize);
            let kept = (lo..hi).filter(|&i| Some(idx[i]) != padding).count();
            for i in lo..hi {
                if Some(idx[i]) == padding {
                    continue;
                }
                let mut share = 1.0f32;
                if pooling == Pooling::Mean {
                    share /= kept as f32;
                }
                if weighted {
                    share *= weights[i];
                }
                let g = sums.entry(idx[i]).or_insert_with(|| vec![0.0; dim]);
                for (x, &y) in g.iter_mut().zip(&grad[b * dim..(b + 1) * dim]) {
                    *x += y * share;
                }
            }
        }
        let touched: Vec<i64> = sums.keys().copied().collect();
        let flat: Vec<f32> = sums.values().flatten().copied().collect();
        let rt = host(8);
        let (fused, _) = filled(&rt, rows, dim);
        let (plain, _) = filled(&rt, rows, dim);
        let (mut s1, mut s2) = (vec![0f32; rows as usize], vec![0f32; rows as usize]);
        for _ in 0..2 {
            let update = Update::RowwiseAdagrad {
                lr: 0.1,
                eps: 1e-6,
                state: &mut s1,
            };
            fused.backward(&bags, &grad, update).unwrap();
            plain
                .rowwise_adagrad(&touched, &flat, &mut s2, 0.1, 1e-6)
                .unwrap();
        }
        fused
            .backward(&bags, &grad, Update::Sgd { lr: 0.5 })
            .unwrap();
        plain.sgd(&touched, &flat, 0.5).unwrap();
        assert_eq!(s1, s2);
        let all: Vec<i64> = (0..rows as i64).collect();
        let (mut a, mut b) = (
            vec![0f32; rows as usize * dim],
            vec![0f32; rows as usize * dim],
        );
        fused.read_rows(&all, &mut a).unwrap();
        plain.read_rows(&all, &mut b).unwrap();
        assert_eq!(a, b, "{pooling:?} weighted {weighted} padding {padding:?}");
    }
    // A gradient of the wrong length is refused, naming it.
    let rt = host(8);
    let (t, _) = filled(&rt, rows, dim);
    let e = t
        .backward(
            &Bags::new(&idx, &offsets),
            &grad[1..],
            Update::Sgd { lr: 0.1 },
        )
        .unwrap_err();
    assert!(e.to_string().contains("grad"), "{e}");
}

/// A table whose pages stay in host memory and whose device holds a row
/// cache of `cached` rows under `policy`.
fn row_cached(
    rows: u64,
    dim: usize,
    cached: usize,
    policy: crate::policy::PolicyKind,
) -> (Runtime, EmbeddingTable, Vec<f32>) {
    let rt = sim();
    let options = TableOptions {
        placement: Placement::Prefer(Tier::Host),
        row_cache: Some(RowCacheOptions {
            rows: cached,
            policy,
        }),
        ..TableOptions::default()
    };
    let t = EmbeddingTable::with_options(&rt, rows, dim, options).unwrap();
    let w: Vec<f32> = (0..rows)
        .flat_map(|r| (0..dim).map(move |d| value(r, d)))
        .collect();
    t.write_rows(0, &w).unwrap();
    (rt, t, w)
}

/// The row cache serves the rows it holds from device memory, fills a
/// missed row with the miss's own read (nothing else crosses the link),
/// keeps what its policy keeps, and pools exactly what the table holds.
#[test]
fn the_row_cache_serves_hot_rows_from_device_memory_and_pools_exactly() {
    use crate::policy::{lru::Lru, Policy, PolicyKind};
    let (rows, dim, cached) = (2048u64, 16usize, 100usize);
    let (rt, t, w) = row_cached(rows, dim, cached, PolicyKind::Lru);
    assert_eq!(t.buffer().residency().pages[Tier::Device as usize], 0);
    assert_eq!(t.row_cache_len(), Some((0, cached)));
    // Skewed lookups: a few hot rows (spread over many pages) and a tail.
    let idx: Vec<i64> = (0..4096u64)
        .map(|i| {
            let h = crate::hotness::mix(i);
            (if h % 4 != 0 { h % 40 * 37 } else { h % rows }) as i64
        })
        .collect();
    let offsets: Vec<i64> = (0..=256).map(|b| b * 16).collect();
    let bags = Bags::new(&idx, &offsets).weights(&[0.5; 4096][..]);
    let links = || rt.stats().device_links.unwrap();
    let before = links();
    let mut out = vec![0f32; 256 * dim];
    let l = t.gather_mapped(&bags, 3, &mut out).unwrap();
    let after = links();
    assert_eq!(
        out,
        naive(&w, dim, &bags),
        "pooled bitwise as the table holds"
    );
    // What an LRU of the same rows serves, lookup by lookup.
    let mut lru = Lru::new(cached);
    let want = idx
        .iter()
        .filter(|&&r| lru.access(r as u64).is_hit())
        .count() as u64;
    assert!(want > 2000, "the hot rows are hits ({want})");
    assert_eq!((l.cache_hits, l.fast_hits), (want, want));
    assert_eq!(
        l.cache_fills,
        4096 - want,
        "every miss fills a slot (LRU admits all)"
    );
    assert_eq!(
        (after.0.bytes, after.1.bytes),
        (before.0.bytes, before.1.bytes),
        "fills are the misses' own reads: no move crosses the link"
    );
    assert_eq!(t.row_cache_len(), Some((cached, cached)));
    assert_eq!(t.stats().cache_hits, want);
    // The same bags again: the cache is warm, the output the same.
    let mut again = vec![0f32; 256 * dim];
    let l2 = t.gather_mapped(&bags, 3, &mut again).unwrap();
    assert_eq!(again, out);
    assert!(l2.cache_hits >= l.cache_hits);
}

/// A write to the table reaches the cached copies before it returns: rows
/// written, and sparse updates (SGD, row-wise Adagrad, the fused
/// backward, held in the cache); no gather after them reads an old value.
#[test]
fn writes_reach_the_row_caches_copies_before_they_return() {
    use crate::policy::PolicyKind;
    let (rows, dim) = (512u64, 8usize);
    let (_rt, t, mut w) = row_cached(rows, dim, 64, PolicyKind::Default);
    let idx: Vec<i64> = (0..64).map(|i| i * 7 % 512).collect();
    let offsets: Vec<i64> = (0..=64).collect();
    let bags = Bags::new(&idx, &offsets);
    let mut out = vec![0f32; 64 * dim];
    // Twice, so that the default policy (which may admit on a second
    // look) caches them.
    t.gather_mapped(&bags, 1, &mut out).unwrap();
    t.gather_mapped(&bags, 1, &mut out).unwrap();
    assert!(t.stats().cache_hits > 0, "{:?}", t.stats());
    // Rows written.
    let new: Vec<f32> = (0..dim).map(|d| 100.0 + d as f32).collect();
    t.write_rows(7, &new).unwrap();
    w[7 * dim..8 * dim].copy_from_slice(&new);
    t.gather_mapped(&bags, 1, &mut out).unwrap();
    assert_eq!(out, naive(&w, dim, &bags));
    // SGD on cached and uncached rows.
    let upd: Vec<i64> = vec![0, 7, 14, 300];
    let grads: Vec<f32> = (0..upd.len() * dim).map(|i| i as f32 * 0.25).collect();
    t.sgd(&upd, &grads, 0.5).unwrap();
    for (k, &r) in upd.iter().enumerate() {
        for d in 0..dim {
            w[r as usize * dim + d] -= 0.5 * grads[k * dim + d];
        }
    }
    t.gather_mapped(&bags, 1, &mut out).unwrap();
    assert_eq!(out, naive(&w, dim, &bags));
    // Row-wise Adagrad through the fused backward.
    let mut state = vec![0f32; rows as usize];
    let grad = vec![1.0f32; 64 * dim];
    t.backward(
        &bags,
        &grad,
        Update::RowwiseAdagrad {
            lr: 0.1,
            eps: 1e-8,
            state: &mut state,
        },
    )
    .unwrap();
    let mut fresh = vec![0f32; rows as usize * dim];
    let all: Vec<i64> = (0..rows as i64).collect();
    t.read_rows(&all, &mut fresh).unwrap();
    t.gather_mapped(&bags, 1, &mut out).unwrap();
    assert_eq!(out, naive(&fresh, dim, &bags));
    assert_ne!(fresh, w, "the update changed rows");
}

#[test]
fn a_row_cache_needs_rows_that_fit_a_page_and_room_in_its_tier() {
    // Without a device, the cache lives in host memory and gathers read
    // through it.
    let rt = host(16);
    let options = TableOptions {
        row_cache: Some(RowCacheOptions::new(8)),
        ..TableOptions::default()
    };
    let t = EmbeddingTable::with_options(&rt, 16, 4, options).unwrap();
    let w: Vec<f32> = (0..16 * 4).map(|i| i as f32).collect();
    t.write_rows(0, &w).unwrap();
    let idx = [3i64, 5, 3, 3, 9];
    let bags = Bags::new(&idx, &[0, 2, 5]);
    for _ in 0..3 {
        let mut out = vec![0f32; 2 * 4];
        t.gather(&bags, &mut out).unwrap();
        assert_eq!(out, naive(&w, 4, &bags));
    }
    assert!(t.stats().cache_hits > 0, "{:?}", t.stats());
    let rt = sim();
    let e = EmbeddingTable::with_options(&rt, 16, PAGE, options).unwrap_err();
    assert!(e.to_string().contains("does not fit in a page"), "{e}");
    let none = TableOptions {
        row_cache: Some(RowCacheOptions::new(0)),
        ..TableOptions::default()
    };
    assert!(EmbeddingTable::with_options(&rt, 16, 4, none).is_err());
    // More rows than the device holds: refused when the table is made.
    let big = TableOptions {
        row_cache: Some(RowCacheOptions::new(100_000)),
        ..TableOptions::default()
    };
    assert!(EmbeddingTable::with_options(&rt, 16, 4, big).is_err());
}

/// A table of 512 rows × 8 on NVMe whose engine injects the faults of the
/// plan returned, with a row cache of 32 rows under LRU in host memory
/// (no device), and the rows written.
fn faulty_cached(
    dir: &std::path::Path,
) -> (
    Runtime,
    Arc<crate::io::fault::FaultPlan>,
    EmbeddingTable,
    Vec<f32>,
) {
    use crate::io::fault::{FaultEngine, FaultPlan};
    use crate::tier::NvmeConfig;
    let plan = FaultPlan::new();
    let engine = crate::io::engine(crate::io::EngineChoice::Psync).unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(16 * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 256 * PAGE as u64, PAGE))
        .nvme_engine(Arc::new(FaultEngine::new(engine, plan.clone())))
        .background_eviction(false)
        .build()
        .unwrap();
    let options = TableOptions {
        placement: Placement::Prefer(Tier::Nvme),
        row_cache: Some(RowCacheOptions {
            rows: 32,
            policy: crate::policy::PolicyKind::Lru,
        }),
        ..TableOptions::default()
    };
    let t = EmbeddingTable::with_options(&rt, 512, 8, options).unwrap();
    let w: Vec<f32> = (0..512)
        .flat_map(|r| (0..8).map(move |d| value(r, d)))
        .collect();
    t.write_rows(0, &w).unwrap();
    (rt, plan, t, w)
}

/// A gather whose table read fails leaves no row cached in a slot it did
/// not fill: the gather after it pools what the table holds.
#[test]
fn a_failed_read_leaves_the_row_cache_holding_no_row_it_did_not_fill() {
    use crate::io::fault::Fault;
    use crate::io::IoOp;
    let dir = tempfile::tempdir().unwrap();
    let (_rt, plan, t, w) = faulty_cached(dir.path());
    let dim = 8usize;
    assert!(t.tier_of_row(0).unwrap() == Some(Tier::Nvme));
    let bags_of = |first: i64| -> (Vec<i64>, Vec<i64>) {
        let idx: Vec<i64> = (0..32).map(|i| first + i * 13).collect();
        (idx, (0..=32).collect())
    };
    // Rows a fill the cache; rows b, whose read fails, take their slots.
    let (a, offsets) = bags_of(0);
    let (b, _) = bags_of(100);
    let mut out = vec![0f32; 32 * dim];
    t.gather(&Bags::new(&a, &offsets), &mut out).unwrap();
    assert_eq!(t.stats().cache_fills, 32);
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    let e = t.gather(&Bags::new(&b, &offsets), &mut out).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Io, "{e}");
    plan.clear();
    for idx in [&b, &a, &b] {
        let bags = Bags::new(idx, &offsets);
        t.gather(&bags, &mut out).unwrap();
        assert_eq!(
            out,
            naive(&w, dim, &bags),
            "every row as the table holds it"
        );
    }
}

/// An update of a cached row changes the cached copy only: the table's
/// buffer gets it when the row leaves the cache (written back by the call
/// that evicted it) or at `flush`, and reads see it at once.
#[test]
fn updates_of_cached_rows_reach_the_table_when_they_leave_the_cache_or_at_flush() {
    use crate::policy::PolicyKind;
    let (rows, dim) = (1024u64, 8usize);
    let (_rt, t, mut w) = row_cached(rows, dim, 16, PolicyKind::Lru);
    let in_buffer = |r: i64| -> Vec<f32> {
        let mut v = vec![0f32; dim];
        t.buffer()
            .read_as(r as u64 * dim as u64 * 4, &mut v)
            .unwrap();
        v
    };
    let hot: Vec<i64> = (0..16).map(|i| i * 61).collect();
    let offsets: Vec<i64> = (0..=16).collect();
    let mut out = vec![0f32; 16 * dim];
    t.gather_mapped(&Bags::new(&hot, &offsets), 1, &mut out)
        .unwrap();
    let grads: Vec<f32> = (0..16 * dim).map(|i| (i % 7) as f32 - 3.0).collect();
    t.sgd(&hot, &grads, 0.5).unwrap();
    for (k, &r) in hot.iter().enumerate() {
        for d in 0..dim {
            w[r as usize * dim + d] -= 0.5 * grads[k * dim + d];
        }
    }
    let row = |w: &[f32], r: i64| w[r as usize * dim..(r as usize + 1) * dim].to_vec();
    assert_ne!(in_buffer(hot[0]), row(&w, hot[0]), "held in the cache");
    let mut got = vec![0f32; 16 * dim];
    t.read_rows(&hot, &mut got).unwrap();
    assert_eq!(
        got,
        hot.iter().flat_map(|&r| row(&w, r)).collect::<Vec<_>>()
    );
    // Half of the hot rows leave the cache (LRU: the oldest first).
    let cold: Vec<i64> = (0..8).map(|i| 1 + i * 97).collect();
    let mut out8 = vec![0f32; 8 * dim];
    let bags = Bags::new(&cold, &offsets[..9]);
    t.gather_mapped(&bags, 2, &mut out8).unwrap();
    assert_eq!(out8, naive(&w, dim, &bags));
    for &r in &hot[..8] {
        assert_eq!(
            in_buffer(r),
            row(&w, r),
            "row {r} written back when evicted"
        );
    }
    assert_ne!(in_buffer(hot[15]), row(&w, hot[15]), "still cached");
    // The same through the buffer gather, then flush.
    let bags = Bags::new(&hot, &offsets);
    t.gather(&bags, &mut out).unwrap();
    assert_eq!(out, naive(&w, dim, &bags));
    t.flush().unwrap();
    for &r in &hot {
        assert_eq!(in_buffer(r), row(&w, r), "row {r} after flush");
    }
}

/// A write-back that fails fails the call and loses nothing: the rows
/// changed in the cache are read as changed, and reach the table once
/// the disk works again.
#[test]
fn a_failed_write_back_loses_no_update() {
    use crate::io::fault::Fault;
    use crate::io::IoOp;
    let dir = tempfile::tempdir().unwrap();
    let (_rt, plan, t, mut w) = faulty_cached(dir.path());
    let (rows, dim) = (512u64, 8usize);
    let a: Vec<i64> = (0..32).map(|i| i * 13).collect();
    let b: Vec<i64> = (0..32).map(|i| 5 + i * 13).collect();
    let offsets: Vec<i64> = (0..=32).collect();
    let mut out = vec![0f32; 32 * dim];
    t.gather(&Bags::new(&a, &offsets), &mut out).unwrap();
    let grads = vec![0.25f32; 32 * dim];
    t.sgd(&a, &grads, 1.0).unwrap();
    for &r in &a {
        w[r as usize * dim..(r as usize + 1) * dim]
            .iter_mut()
            .for_each(|x| *x -= 0.25);
    }
    // Rows b evict every row of a; writing them back fails.
    plan.inject(IoOp::Write, 0, Fault::Errno(libc::EIO));
    let e = t.gather(&Bags::new(&b, &offsets), &mut out).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Io, "{e}");
    let all: Vec<i64> = (0..rows as i64).collect();
    let mut got = vec![0f32; w.len()];
    t.read_rows(&all, &mut got).unwrap();
    assert_eq!(got, w, "the updates are read while they wait");
    plan.clear();
    for idx in [&b, &a] {
        let bags = Bags::new(idx, &offsets);
        t.gather(&bags, &mut out).unwrap();
        assert_eq!(out, naive(&w, dim, &bags));
    }
    t.flush().unwrap();
    let mut raw = vec![0f32; w.len()];
    t.buffer().read_as(0, &mut raw).unwrap();
    assert_eq!(raw, w, "every update reached the table");
}

/// Two threads updating different rows of one NVMe page: every update of
/// both stays (the page's read-modify-write of one never writes the
/// other's old row back), as do writes of rows racing the updates.
#[test]
fn updates_of_different_rows_of_one_page_from_two_threads_all_stay() {
    use crate::tier::NvmeConfig;
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(16 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 256 * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap();
    let options = TableOptions {
        placement: Placement::Prefer(Tier::Nvme),
        ..TableOptions::default()
    };
    let dim = 8usize;
    let t = EmbeddingTable::with_options(&rt, 512, dim, options).unwrap();
    t.write_rows(0, &vec![0f32; 512 * dim]).unwrap();
    assert_eq!(t.tier_of_row(0).unwrap(), Some(Tier::Nvme));
    let steps = 200;
    std::thread::scope(|s| {
        for r in [0i64, 1] {
            let t = &t;
            s.spawn(move || {
                for _ in 0..steps {
                    t.sgd(&[r], &[1.0; 8], 1.0).unwrap();
                }
            });
        }
        // Row 2, on the same page, written meanwhile.
        let t = &t;
        s.spawn(move || {
            for k in 0..steps {
                t.write_rows(2, &[k as f32; 8]).unwrap();
            }
        });
    });
    let mut got = vec![0f32; 3 * dim];
    t.read_rows(&[0, 1, 2], &mut got).unwrap();
    assert_eq!(got[..dim], [-(steps as f32); 8]);
    assert_eq!(got[dim..2 * dim], [-(steps as f32); 8]);
    assert_eq!(got[2 * dim..], [(steps - 1) as f32; 8]);
}
