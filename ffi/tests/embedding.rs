//! The embedding table through the C ABI matches the Rust table bit for
//! bit on tiny tiers (pages on the device, in host memory and on NVMe),
//! and refuses bad input with a status before it reads or writes.

mod common;

use std::ptr::{null, null_mut};

use common::*;
use strata::offload::embedding::{Bags, EmbeddingTable, Pooling};
use strata_ffi::*;

const ROWS: u64 = 3000;
const DIM: usize = 16; // 64 B rows: 1024 a page of 64 KiB, 3 pages

fn weights() -> Vec<f32> {
    (0..ROWS as usize * DIM)
        .map(|i| ((i as f32) * 0.013).sin())
        .collect()
}

fn create(rt: *const strata_runtime) -> *mut strata_embedding {
    let mut e = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_embedding_create(rt, ROWS, DIM, 4, &mut e) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    e
}

fn bags<'a>(idx: &'a [i64], off: &'a [i64], w: Option<&'a [f32]>, pooling: i32) -> strata_bags {
    strata_bags {
        indices: idx.as_ptr(),
        num_indices: idx.len(),
        offsets: off.as_ptr(),
        num_offsets: off.len(),
        weights: w.map_or(null(), |w| w.as_ptr()),
        pooling,
        padding_idx: -1,
    }
}

fn forward(e: *const strata_embedding, b: &strata_bags, out: &mut [f32]) -> i32 {
    // SAFETY: `b`'s arrays live for the call, `out` is writable.
    unsafe { strata_embedding_forward(e, b, out.as_mut_ptr(), out.len(), null_mut()) }
}

#[test]
fn calls_match_the_rust_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    // One page a tier: the table's three pages spread over all three.
    let rt = create_rt(&path);
    let rust_rt = strata::Runtime::builder()
        .page_size(PAGE as usize)
        .host(4 * PAGE)
        .build()
        .unwrap();
    let e = create(rt);
    let reference = EmbeddingTable::new(&rust_rt, ROWS, DIM).unwrap();
    let w = weights();
    // SAFETY: readable floats.
    let s = unsafe { strata_embedding_write_rows(e, 0, w.as_ptr(), w.len()) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    reference.write_rows(0, &w).unwrap();
    // The three pages were written at once, each taking the fastest tier
    // with room: one in each tier.
    let tier_of = |r: i64| {
        let mut t = -2;
        // SAFETY: a writable tier.
        let s = unsafe { strata_embedding_tier_of_row(e, r, &mut t) };
        assert_eq!(s, STRATA_OK);
        t
    };
    let placed: Vec<strata_tier> = [0, 1024, 2048].into_iter().map(tier_of).collect();
    let mut tiers = placed.clone();
    tiers.sort_unstable();
    assert_eq!(
        tiers,
        [STRATA_TIER_DEVICE, STRATA_TIER_HOST, STRATA_TIER_NVME]
    );
    let idx: Vec<i64> = (0..400).map(|i| (i * 577 % ROWS) as i64).collect();
    let off = [0i64, 0, 100, 250, 399, 400];
    let psw: Vec<f32> = (0..400).map(|i| i as f32 / 400.0).collect();
    let mut state = vec![0f32; ROWS as usize];
    let mut ref_state = state.clone();
    for (weights, pooling) in [
        (None, STRATA_POOLING_SUM),
        (Some(&psw[..]), STRATA_POOLING_SUM),
        (None, STRATA_POOLING_MEAN),
    ] {
        let b = bags(&idx, &off, weights, pooling);
        let mut out = vec![f32::NAN; 5 * DIM];
        let mut st = strata_embedding_stats::default();
        // SAFETY: as in `forward`, and a writable stats struct.
        let s = unsafe { strata_embedding_forward(e, &b, out.as_mut_ptr(), out.len(), &mut st) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        assert_eq!(st.lookups, 400);
        // Only the rows of the page the writes put on the device hit.
        assert_eq!(
            st.fast_hits,
            idx.iter()
                .filter(|&&r| placed[r as usize / 1024] == STRATA_TIER_DEVICE)
                .count() as u64
        );
        let mut rb = Bags::new(&idx, &off).pooling(if pooling == STRATA_POOLING_MEAN {
            Pooling::Mean
        } else {
            Pooling::Sum
        });
        if let Some(w) = weights {
            rb = rb.weights(w);
        }
        let mut want = vec![0f32; 5 * DIM];
        reference.gather(&rb, &mut want).unwrap();
        assert_eq!(out, want);
        // A step of each optimizer on the distinct rows of the batch.
        let mut rows = idx.clone();
        rows.sort_unstable();
        rows.dedup();
        let g: Vec<f32> = (0..rows.len() * DIM)
            .map(|i| (i as f32 * 0.7).cos())
            .collect();
        // SAFETY: readable rows and gradients, writable state.
        let s =
            unsafe { strata_embedding_sgd(e, rows.as_ptr(), rows.len(), g.as_ptr(), g.len(), 0.1) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        reference.sgd(&rows, &g, 0.1).unwrap();
        // SAFETY: as above.
        let s = unsafe {
            strata_embedding_rowwise_adagrad(
                e,
                rows.as_ptr(),
                rows.len(),
                g.as_ptr(),
                g.len(),
                state.as_mut_ptr(),
                state.len(),
                0.05,
                1e-8,
            )
        };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        reference
            .rowwise_adagrad(&rows, &g, &mut ref_state, 0.05, 1e-8)
            .unwrap();
    }
    assert_eq!(state, ref_state);
    // The state given as the gradients' memory: refused, nothing changed.
    let mut g = vec![0.5f32; ROWS as usize];
    // SAFETY: readable rows; `g` writable for its length (given twice).
    let s = unsafe {
        strata_embedding_rowwise_adagrad(
            e,
            [0i64].as_ptr(),
            1,
            g.as_ptr(),
            DIM,
            g.as_mut_ptr(),
            ROWS as usize,
            0.05,
            1e-8,
        )
    };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "share memory");
    assert!(g.iter().all(|&x| x == 0.5));
    let all: Vec<i64> = (0..ROWS as i64).collect();
    let (mut got, mut want) = (vec![0f32; w.len()], vec![0f32; w.len()]);
    // SAFETY: readable indices, writable floats.
    let s = unsafe {
        strata_embedding_read_rows(e, all.as_ptr(), all.len(), got.as_mut_ptr(), got.len())
    };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    reference.read_rows(&all, &mut want).unwrap();
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_ne!(got, w, "the steps changed rows");
    let mut st = strata_embedding_stats::default();
    // SAFETY: a writable stats struct.
    assert_eq!(unsafe { strata_embedding_get_stats(e, &mut st) }, STRATA_OK);
    assert_eq!(st.lookups, 1200, "read_rows is not counted");
    assert_eq!(strata_embedding_reset_stats(e), STRATA_OK);
    // SAFETY: as above.
    assert_eq!(unsafe { strata_embedding_get_stats(e, &mut st) }, STRATA_OK);
    assert_eq!(st.lookups, 0);
    let (mut rows, mut dim) = (0u64, 0usize);
    // SAFETY: writable out-parameters.
    let s = unsafe { strata_embedding_shape(e, &mut rows, &mut dim) };
    assert_eq!(s, STRATA_OK);
    assert_eq!((rows, dim), (ROWS, DIM));
    // The table keeps its runtime alive past strata_runtime_destroy.
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    let mut out = vec![0f32; 5 * DIM];
    assert_eq!(forward(e, &bags(&idx, &off, None, 0), &mut out), STRATA_OK);
    assert_eq!(strata_embedding_free(e), STRATA_OK);
    fails(
        strata_embedding_free(e),
        STRATA_ERR_INVALID_HANDLE,
        "embedding table",
    );
    assert_eq!(strata_embedding_free(null_mut()), STRATA_OK);
}

/// A runtime with one page of device, host and NVMe each.
fn create_rt(path: &std::ffi::CString) -> *mut strata_runtime {
    let mut c = config(1, 1, 8, path);
    c.background_eviction = 0;
    common::create(&c)
}

#[test]
fn bad_input_gets_a_status_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let rt = create_rt(&path);
    let mut e = null_mut();
    // SAFETY: the out-pointers are NULL or writable.
    unsafe {
        fails(
            strata_embedding_create(rt, ROWS, DIM, 4, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "out",
        );
        fails(
            strata_embedding_create(null(), ROWS, DIM, 4, &mut e),
            STRATA_ERR_NULL_POINTER,
            "runtime",
        );
        fails(
            strata_embedding_create(rt, 0, DIM, 4, &mut e),
            STRATA_ERR_INVALID_ARGUMENT,
            "at least one row",
        );
        fails(
            strata_embedding_create(rt, ROWS, DIM, 0, &mut e),
            STRATA_ERR_INVALID_ARGUMENT,
            "threads 0",
        );
        fails(
            strata_embedding_create_in(rt, ROWS, DIM, 9, 4, &mut e),
            STRATA_ERR_INVALID_ARGUMENT,
            "tier",
        );
        fails(
            strata_embedding_create(rt, u64::MAX / 8, DIM, 4, &mut e),
            STRATA_ERR_INVALID_ARGUMENT,
            "overflow",
        );
    }
    assert!(e.is_null(), "no handle on failure");
    let e = create(rt);
    let w = weights();
    // SAFETY: readable floats.
    let s = unsafe { strata_embedding_write_rows(e, 0, w.as_ptr(), w.len()) };
    assert_eq!(s, STRATA_OK);
    let idx = [1i64, 2, 3];
    let off = [0i64, 3];
    let mut out = vec![7f32; DIM];
    // Out-of-range ids, bad offsets, a bad pooling, a short output.
    for (i, o, p, says) in [
        (
            &[1i64, ROWS as i64][..],
            &[0i64, 2][..],
            0,
            "index 3000 is out of range",
        ),
        (&[1, -1][..], &[0, 2][..], 0, "index -1 is out of range"),
        (&idx[..], &[1, 3][..], 0, "offsets must start at 0"),
        (&idx[..], &[0, 2, 1, 3][..], 0, "non-decreasing"),
        (
            &idx[..],
            &[0, 2][..],
            0,
            "last offset 2 is not the number of indices 3",
        ),
        (&idx[..], &[][..], 0, "offsets must start at 0"),
        (&idx[..], &off[..], 7, "unknown pooling 7"),
        (&idx[..], &[0, 1, 3][..], 0, "out holds 16 values, not 32"),
    ] {
        fails(
            forward(e, &bags(i, o, None, p), &mut out),
            STRATA_ERR_INVALID_ARGUMENT,
            says,
        );
        assert!(out.iter().all(|&x| x == 7.0), "{says}: out untouched");
    }
    // NULL pointers with a length, and NULL required arguments.
    let mut b = bags(&idx, &off, None, 0);
    b.indices = null();
    fails(
        forward(e, &b, &mut out),
        STRATA_ERR_NULL_POINTER,
        "bags->indices",
    );
    let mut b = bags(&idx, &off, None, 0);
    b.offsets = null();
    fails(
        forward(e, &b, &mut out),
        STRATA_ERR_NULL_POINTER,
        "bags->offsets",
    );
    // SAFETY: the NULL arguments are refused before use.
    unsafe {
        fails(
            strata_embedding_forward(e, null(), out.as_mut_ptr(), out.len(), null_mut()),
            STRATA_ERR_NULL_POINTER,
            "bags",
        );
        let b = bags(&idx, &off, None, 0);
        fails(
            strata_embedding_forward(e, &b, null_mut(), DIM, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "out",
        );
        fails(
            strata_embedding_forward(null(), &b, out.as_mut_ptr(), out.len(), null_mut()),
            STRATA_ERR_NULL_POINTER,
            "embedding table handle",
        );
        // A misaligned output and a misaligned stats struct.
        let raw = out.as_mut_ptr().cast::<u8>().add(1).cast::<f32>();
        fails(
            strata_embedding_forward(e, &b, raw, DIM - 1, null_mut()),
            STRATA_ERR_INVALID_ARGUMENT,
            "aligned",
        );
        let mut st = [0u64; 3];
        let bad = st
            .as_mut_ptr()
            .cast::<u8>()
            .add(4)
            .cast::<strata_embedding_stats>();
        fails(
            strata_embedding_forward(e, &b, out.as_mut_ptr(), out.len(), bad),
            STRATA_ERR_INVALID_ARGUMENT,
            "misaligned",
        );
        assert!(out.iter().all(|&x| x == 7.0));
        // A handle of another type.
        let buf = alloc(rt, 4096);
        fails(
            strata_embedding_forward(buf.cast(), &b, out.as_mut_ptr(), out.len(), null_mut()),
            STRATA_ERR_INVALID_HANDLE,
            "embedding table",
        );
        assert_eq!(strata_buffer_free(buf), STRATA_OK);
        // Updates: out-of-range, repeated rows, short gradients, bad lr,
        // a short state.
        let g = [1f32; 2 * DIM];
        fails(
            strata_embedding_sgd(e, [5i64, ROWS as i64].as_ptr(), 2, g.as_ptr(), g.len(), 0.1),
            STRATA_ERR_INVALID_ARGUMENT,
            "out of range",
        );
        fails(
            strata_embedding_sgd(e, [5i64, 5].as_ptr(), 2, g.as_ptr(), g.len(), 0.1),
            STRATA_ERR_INVALID_ARGUMENT,
            "rows repeat",
        );
        fails(
            strata_embedding_sgd(e, [5i64, 6].as_ptr(), 2, g.as_ptr(), DIM, 0.1),
            STRATA_ERR_INVALID_ARGUMENT,
            "grads holds 16 values, not 32",
        );
        fails(
            strata_embedding_sgd(e, [5i64].as_ptr(), 1, g.as_ptr(), DIM, f32::INFINITY),
            STRATA_ERR_INVALID_ARGUMENT,
            "finite",
        );
        fails(
            strata_embedding_sgd(e, null(), 1, g.as_ptr(), DIM, 0.1),
            STRATA_ERR_NULL_POINTER,
            "rows",
        );
        let mut state = vec![0f32; 10];
        fails(
            strata_embedding_rowwise_adagrad(
                e,
                [5i64].as_ptr(),
                1,
                g.as_ptr(),
                DIM,
                state.as_mut_ptr(),
                state.len(),
                0.1,
                1e-8,
            ),
            STRATA_ERR_INVALID_ARGUMENT,
            "state holds 10 values",
        );
        assert!(state.iter().all(|&s| s == 0.0));
        fails(
            strata_embedding_write_rows(e, ROWS as i64 - 1, g.as_ptr(), g.len()),
            STRATA_ERR_INVALID_ARGUMENT,
            "rows 2999..3001 are out of range",
        );
        fails(
            strata_embedding_write_rows(e, 0, g.as_ptr(), DIM + 1),
            STRATA_ERR_INVALID_ARGUMENT,
            "whole number of rows",
        );
        let mut t = 0;
        fails(
            strata_embedding_tier_of_row(e, -3, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "index -3",
        );
        fails(
            strata_embedding_tier_of_row(e, 0, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "tier",
        );
        let mut got = vec![0f32; DIM];
        fails(
            strata_embedding_read_rows(e, [1i64, 2].as_ptr(), 2, got.as_mut_ptr(), got.len()),
            STRATA_ERR_INVALID_ARGUMENT,
            "out holds 16 values, not 32",
        );
        fails(
            strata_embedding_get_stats(e, null_mut()),
            STRATA_ERR_NULL_POINTER,
            "stats",
        );
    }
    // Nothing was read (no lookup counted) or written.
    let mut st = strata_embedding_stats::default();
    // SAFETY: a writable stats struct.
    assert_eq!(unsafe { strata_embedding_get_stats(e, &mut st) }, STRATA_OK);
    assert_eq!(st.lookups, 0);
    let all: Vec<i64> = (0..ROWS as i64).collect();
    let mut got = vec![0f32; w.len()];
    // SAFETY: readable indices, writable floats.
    let s = unsafe {
        strata_embedding_read_rows(e, all.as_ptr(), all.len(), got.as_mut_ptr(), got.len())
    };
    assert_eq!(s, STRATA_OK);
    assert_eq!(got, w);
    assert_eq!(strata_embedding_free(e), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// A table with a row cache through the C ABI pools what the Rust table
/// with the same cache pools, bit for bit, counts the same hits and
/// fills, keeps the cached copies current through an update, and refuses
/// a bad cache with a status.
#[test]
fn a_row_cached_table_matches_the_rust_one() {
    use strata::device::DeviceChoice;
    use strata::offload::embedding::{RowCacheOptions, TableOptions};
    use strata::policy::PolicyKind;
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let mut c = config(2, 4, 8, &path);
    c.background_eviction = 0;
    let rt = common::create(&c);
    let create = |cache_rows: usize, policy: i32, e: &mut *mut strata_embedding| {
        // SAFETY: a writable out-pointer.
        unsafe {
            strata_embedding_create_cached(
                rt,
                ROWS,
                DIM,
                STRATA_TIER_HOST,
                4,
                cache_rows,
                policy,
                e,
            )
        }
    };
    let mut e = null_mut();
    let s = create(500, STRATA_POLICY_LRU, &mut e);
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let rust_rt = strata::Runtime::builder()
        .page_size(PAGE as usize)
        .device(DeviceChoice::Sim, 2 * PAGE)
        .host(4 * PAGE)
        .background_eviction(false)
        .build()
        .unwrap();
    let options = TableOptions {
        placement: strata::Placement::Prefer(strata::tier::Tier::Host),
        threads: 4,
        row_cache: Some(RowCacheOptions {
            rows: 500,
            policy: PolicyKind::Lru,
        }),
    };
    let reference = EmbeddingTable::with_options(&rust_rt, ROWS, DIM, options).unwrap();
    let w = weights();
    // SAFETY: readable floats.
    let s = unsafe { strata_embedding_write_rows(e, 0, w.as_ptr(), w.len()) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    reference.write_rows(0, &w).unwrap();
    // Skewed lookups: 40 hot rows spread over the table, and a tail.
    let idx: Vec<i64> = (0..2000u64)
        .map(|i| {
            let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20;
            (if h % 4 != 0 { h % 40 * 71 } else { h % ROWS }) as i64
        })
        .collect();
    let off: Vec<i64> = (0..=100).map(|b| b * 20).collect();
    let check = |round: &str| {
        let b = bags(&idx, &off, None, 0);
        let mut got = vec![0f32; 100 * DIM];
        let mut st = strata_embedding_stats::default();
        // SAFETY: `b`'s arrays live for the call; writable out and stats.
        let s = unsafe { strata_embedding_forward(e, &b, got.as_mut_ptr(), got.len(), &mut st) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        let mut want = vec![0f32; 100 * DIM];
        let l = reference.gather(&Bags::new(&idx, &off), &mut want).unwrap();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{round}: pooled as the Rust table"
        );
        assert_eq!(
            (st.lookups, st.cache_hits, st.cache_fills),
            (l.lookups, l.cache_hits, l.cache_fills),
            "{round}"
        );
        st
    };
    let first = check("cold");
    assert!(
        first.cache_fills > 0 && first.cache_hits > 1000,
        "{first:?}"
    );
    let warm = check("warm");
    assert!(warm.cache_hits > first.cache_hits, "{warm:?}");
    // An update of cached rows reaches their copies.
    let rows = [0i64, 71, 142, 2999];
    let grads: Vec<f32> = (0..rows.len() * DIM).map(|i| i as f32 * 0.5).collect();
    // SAFETY: readable rows and gradients.
    let s = unsafe {
        strata_embedding_sgd(
            e,
            rows.as_ptr(),
            rows.len(),
            grads.as_ptr(),
            grads.len(),
            0.25,
        )
    };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    reference.sgd(&rows, &grads, 0.25).unwrap();
    check("after sgd");
    assert_eq!(strata_embedding_free(e), STRATA_OK);
    // Refusals, each with a status and no handle.
    let mut e = null_mut();
    for (cache_rows, policy, want, says) in [
        (
            0,
            STRATA_POLICY_LRU,
            STRATA_ERR_INVALID_ARGUMENT,
            "row cache holds",
        ),
        (500, 99, STRATA_ERR_INVALID_ARGUMENT, "policy"),
        (
            500,
            STRATA_POLICY_BELADY,
            STRATA_ERR_INVALID_ARGUMENT,
            "belady",
        ),
        (
            500,
            STRATA_POLICY_LOOKAHEAD,
            STRATA_ERR_INVALID_ARGUMENT,
            "lookahead",
        ),
        (1 << 20, STRATA_POLICY_LRU, STRATA_ERR_OUT_OF_CAPACITY, ""),
    ] {
        fails(create(cache_rows, policy, &mut e), want, says);
        assert!(e.is_null(), "no handle on failure");
    }
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}
