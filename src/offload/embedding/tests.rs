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
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
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
    let e: crate::Error = EmbeddingError::RepeatedRow { row: 3 }.into();
    assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
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
    assert_eq!(e.kind(), crate::ErrorKind::OutOfCapacity);
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

#[test]
fn mapped_gather_equals_the_buffer_gather_and_counts_device_hits() {
    let (rows, dim) = (2048u64, 16usize); // 64 B rows: 64 a page, 32 pages
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 8 * PAGE as u64)
        .host(64 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap();
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
