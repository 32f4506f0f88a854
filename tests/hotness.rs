//! Hotness: the shared harvest test vectors (the same file the CUDA kernel
//! is checked against where a GPU is present), and counters bumped by the
//! runtime's accesses and by kernels reading through device maps.

use std::sync::atomic::AtomicU32;

use serde::Deserialize;
use strata::device::DeviceChoice;
use strata::hotness::{harvest, HarvestParams};
use strata::runtime::Access;
use strata::{Runtime, Tier};

#[derive(Deserialize)]
struct Vectors {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    decay: f32,
    k: usize,
    shift: u32,
    counts: Vec<u32>,
    scores: Vec<f32>,
    resident: Vec<bool>,
    expect_scores: Vec<f32>,
    expect_hot: Vec<(u64, f32)>,
    expect_cold: Vec<(u64, f32)>,
}

fn vectors() -> Vec<(HarvestParams, Case)> {
    // The source tree's copy; or, for a test binary carried to another
    // machine (benches/gpu-check.sh), the one under the working directory.
    let built = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/hotness.json");
    let text = std::fs::read_to_string(built)
        .or_else(|_| std::fs::read_to_string("tests/vectors/hotness.json"))
        .unwrap();
    let v: Vectors = serde_json::from_str(&text).unwrap();
    v.cases
        .into_iter()
        .map(|c| {
            (
                HarvestParams {
                    decay: c.decay,
                    k: c.k,
                    shift: c.shift,
                },
                c,
            )
        })
        .collect()
}

#[test]
fn the_reference_harvest_matches_the_shared_vectors() {
    for (params, case) in vectors() {
        let counts: Vec<AtomicU32> = case.counts.iter().map(|&c| AtomicU32::new(c)).collect();
        let mut scores = case.scores.clone();
        let h = harvest(&counts, &mut scores, &|p| case.resident[p], params).unwrap();
        assert_eq!(scores, case.expect_scores);
        assert_eq!(h.hot, case.expect_hot, "{params:?}");
        assert_eq!(h.cold, case.expect_cold, "{params:?}");
    }
}

#[test]
fn accesses_and_kernel_loads_make_pages_hot() {
    const PAGE: usize = 16 << 10;
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 2 * PAGE as u64)
        .host(16 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap();
    let b = rt.alloc(8 * PAGE as u64).unwrap();
    b.write(0, &vec![1; 8 * PAGE]).unwrap();
    // Pages 0 and 1 landed on the device; the rest in host memory.
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Device));
    let params = HarvestParams {
        decay: 0.5,
        k: 2,
        shift: 0,
    };
    b.harvest(params).unwrap(); // the writes, folded
    let mut out = vec![0; 100];
    for _ in 0..10 {
        b.read(5 * PAGE as u64, &mut out).unwrap();
    }
    let map = b.device_map().unwrap();
    {
        let launch = map.prepare(Access::ReadOnly).unwrap();
        for i in 0..20u64 {
            let _: u8 = launch.load(7 * PAGE as u64 + i);
        }
        let _: u8 = launch.load(0);
    }
    let h = b.harvest(params).unwrap();
    let hot: Vec<u64> = h.hot.iter().map(|x| x.0).collect();
    assert_eq!(hot, vec![7, 5], "{h:?}");
    // Device pages: page 1 was not touched since the first harvest.
    assert_eq!(h.cold[0].0, 1, "{h:?}");
}

#[test]
fn sampling_counts_a_fraction_and_off_counts_nothing() {
    const PAGE: usize = 4096;
    for (shift, lo, hi) in [(Some(3), 1000, 1500), (None, 0, 0)] {
        let rt = Runtime::builder()
            .page_size(PAGE)
            .host(4 * PAGE as u64)
            .sampling(shift)
            .build()
            .unwrap();
        let b = rt.alloc(PAGE as u64).unwrap();
        let mut out = [0u8; 8];
        for _ in 0..10_000 {
            b.read(0, &mut out).unwrap();
        }
        let n = b.device_map().unwrap().counts()[0];
        assert!((lo..=hi).contains(&n), "{shift:?}: {n}");
    }
    assert!(Runtime::builder().sampling(Some(17)).build().is_err());
}

/// The same vectors through `kernels/hotness.cu` on a GPU; skipped with a
/// printed reason where there is none, a failure with STRATA_REQUIRE_GPU=1.
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_harvest_matches_the_shared_vectors() {
    use strata::device::CudaBackend;
    use strata::lowlevel::cuda_hotness::CudaHotness;
    let backend = match CudaBackend::new(0, 1 << 30) {
        Ok(b) => b,
        Err(e) => {
            assert_eq!(e.kind(), strata::ErrorKind::NoDevice, "{e}");
            assert!(
                std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
                "STRATA_REQUIRE_GPU is set but no GPU opened: {e}"
            );
            eprintln!("skipping the cuda harvest: {e}");
            return;
        }
    };
    let h = CudaHotness::for_context(backend.context()).unwrap();
    let s = h.stream().clone();
    for (params, case) in vectors() {
        let mut counts = s.clone_htod(&case.counts).unwrap();
        let mut scores = s.clone_htod(&case.scores).unwrap();
        let resident: Vec<u8> = case.resident.iter().map(|&r| r as u8).collect();
        let resident = s.clone_htod(&resident).unwrap();
        let got = h
            .harvest(&mut counts, &mut scores, &resident, params)
            .unwrap();
        assert_eq!(s.clone_dtoh(&scores).unwrap(), case.expect_scores);
        assert!(s.clone_dtoh(&counts).unwrap().iter().all(|&c| c == 0));
        assert_eq!(got.hot, case.expect_hot, "{params:?}");
        assert_eq!(got.cold, case.expect_cold, "{params:?}");
    }
}

#[test]
fn the_access_stream_is_recorded_to_a_trace_file() {
    const PAGE: usize = 4096;
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(16 * PAGE as u64)
        .build()
        .unwrap();
    let a = rt.alloc(4 * PAGE as u64).unwrap();
    let b = rt.alloc(4 * PAGE as u64).unwrap();
    let path = dir.path().join("t.trace");
    let rec = rt.record_trace(&path, 0).unwrap();
    assert_eq!(
        rt.record_trace(&dir.path().join("u"), 0)
            .unwrap_err()
            .kind(),
        strata::ErrorKind::InvalidArgument,
        "one recording at a time"
    );
    a.write(PAGE as u64 - 1, &[1, 2]).unwrap(); // pages 0 and 1 of buffer 0
    b.read(3 * PAGE as u64, &mut [0; 8]).unwrap(); // page 3 of buffer 1
    assert_eq!(rec.finish().unwrap(), 3);
    a.read(0, &mut [0; 1]).unwrap(); // after the recording: not in it
    let text = std::fs::read_to_string(&path).unwrap();
    let ids: Vec<u64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ids, vec![0, 1, (1 << 32) | 3]);
    let e = rt
        .record_trace(std::path::Path::new("/nonexistent-dir/t"), 0)
        .unwrap_err();
    assert_eq!(e.kind(), strata::ErrorKind::NotFound, "{e}");
}

#[test]
fn a_readers_page_view_reads_what_was_written_and_touch_counts() {
    const PAGE: usize = 4096;
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(strata::device::DeviceChoice::Sim, PAGE as u64)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    // Two and a half pages: the last view ends with the buffer.
    let len = 2 * PAGE + PAGE / 2;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let b = rt.alloc(len as u64).unwrap();
    b.write(0, &data).unwrap();
    b.harvest(HarvestParams {
        decay: 1e-9,
        k: 0,
        shift: 0,
    })
    .unwrap();
    let map = b.device_map().unwrap();
    {
        let launch = map.prepare(Access::ReadOnly).unwrap();
        let mut r = launch.reader(1);
        for p in 0..3 {
            let (bytes, on_device) = r.page(p);
            assert_eq!(bytes, &data[p * PAGE..len.min((p + 1) * PAGE)], "page {p}");
            assert_eq!(on_device, b.tier_of(p).unwrap() == Some(Tier::Device));
        }
        for _ in 0..5 {
            r.touch(2);
        }
    }
    assert_eq!(map.counts(), vec![0, 0, 5]);
}

#[test]
#[should_panic(expected = "beyond the buffer")]
fn a_page_view_beyond_the_buffer_panics_like_an_index() {
    let rt = Runtime::builder()
        .page_size(4096)
        .host(1 << 16)
        .build()
        .unwrap();
    let b = rt.alloc(4096).unwrap();
    b.write(0, &[1; 4096]).unwrap();
    let map = b.device_map().unwrap();
    let launch = map.prepare(Access::ReadOnly).unwrap();
    let _ = launch.reader(0).page(1);
}

/// Harvest parameters out of range are refused and change nothing: a NaN
/// decay would leave every score NaN for good, a shift of 32 or more
/// overflows the counts' scale.
#[test]
fn harvest_refuses_parameters_out_of_range() {
    const PAGE: usize = 16 << 10;
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(16 * PAGE as u64)
        .build()
        .unwrap();
    let b = rt.alloc(4 * PAGE as u64).unwrap();
    b.write(0, &vec![1u8; 4 * PAGE]).unwrap();
    let ok = HarvestParams {
        decay: 0.5,
        k: 4,
        shift: 0,
    };
    for bad in [
        HarvestParams {
            decay: f32::NAN,
            ..ok
        },
        HarvestParams { decay: 0.0, ..ok },
        HarvestParams { decay: 1.5, ..ok },
        HarvestParams { shift: 32, ..ok },
        HarvestParams { shift: 64, ..ok },
    ] {
        let e = b.harvest(bad).unwrap_err();
        assert_eq!(e.kind(), strata::ErrorKind::InvalidArgument, "{bad:?}: {e}");
    }
    // The counts are still there for a good harvest.
    let h = b.harvest(ok).unwrap();
    assert!(!h.hot.is_empty(), "{h:?}");
}
