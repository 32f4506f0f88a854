//! The device tier: one test body on every backend present. The simulated
//! device always runs; CUDA runs where a GPU is (built with `--features
//! cuda`), is skipped with a printed reason elsewhere, and
//! `STRATA_REQUIRE_GPU=1` turns that skip into a failure.

mod common;

use std::sync::Arc;

use strata::device::{self, BackendKind, DeviceBackend, DeviceChoice};
use strata::runtime::Placement;
use strata::tier::{DeviceStore, PageStore, Slot};
use strata::{ErrorKind, Tier};

use common::pattern;

fn backends() -> Vec<Arc<dyn DeviceBackend>> {
    let mut v = vec![device::open(DeviceChoice::Sim, 64 << 20).unwrap()];
    match device::open(DeviceChoice::Cuda, 256 << 20) {
        Ok(d) => v.push(d),
        Err(e) => {
            assert!(
                std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
                "STRATA_REQUIRE_GPU is set but no GPU backend opened: {e}"
            );
            eprintln!("skipping cuda: {e}");
        }
    }
    v
}

#[test]
fn device_store_round_trip_on_every_backend() {
    for backend in backends() {
        let kind = backend.kind();
        let page = 64 << 10;
        let s = DeviceStore::new(backend.clone(), 32 * page as u64, page).unwrap();
        assert_eq!(s.backend(), kind);
        let mut slots: Vec<Slot> = (0..32).map(|_| s.alloc().unwrap()).collect();
        assert_eq!(
            s.alloc().unwrap_err().kind(),
            ErrorKind::OutOfCapacity,
            "{kind}"
        );
        for (i, slot) in slots.iter_mut().enumerate() {
            s.write_page(slot, &pattern(i as u32, 1, page)).unwrap();
        }
        let mut out = vec![0; page];
        for (i, slot) in slots.iter().enumerate() {
            s.read_page(slot, &mut out).unwrap();
            assert_eq!(out, pattern(i as u32, 1, page), "{kind}: page {i}");
        }
        let (h2d, d2h) = backend.link_stats();
        assert!(
            h2d.bytes >= 32 * page as u64 && d2h.bytes >= 32 * page as u64,
            "{kind}"
        );
        if kind == BackendKind::Sim {
            assert!(
                h2d.modelled_seconds > 0.0,
                "the simulated link accounts modelled time"
            );
        } else {
            assert_eq!(
                h2d.modelled_seconds, 0.0,
                "a real link reports no modelled time"
            );
        }
        for slot in slots {
            s.free(slot).unwrap();
        }
    }
}

#[test]
fn the_simulated_budget_holds_across_allocations() {
    let sim = device::open(DeviceChoice::Sim, 1 << 20).unwrap();
    let a = sim.alloc(768 << 10).unwrap();
    assert_eq!(
        sim.alloc(512 << 10).unwrap_err().kind(),
        ErrorKind::OutOfCapacity
    );
    drop(a);
    assert!(sim.alloc(1 << 20).is_ok());
}

#[test]
fn auto_picks_cuda_only_where_a_gpu_is() {
    let auto = device::open(DeviceChoice::Auto, 64 << 20).unwrap();
    let cuda = device::open(DeviceChoice::Cuda, 64 << 20);
    match cuda {
        Ok(_) => assert_eq!(auto.kind(), BackendKind::Cuda),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::NoDevice, "{e}");
            assert_eq!(auto.kind(), BackendKind::Sim);
            assert_eq!(auto.kind().label(), "simulated");
        }
    }
    assert!("gpu".parse::<DeviceChoice>().is_err());
    assert_eq!("sim".parse::<DeviceChoice>().unwrap(), DeviceChoice::Sim);
}

/// strata's CUDA layer on its own (`strata::device::cuda`): copies, events,
/// pinned, mapped and managed memory, the per-context module cache and a
/// launch. Skipped with a printed reason without a GPU (or NVRTC, for the
/// kernel), a failure then with STRATA_REQUIRE_GPU=1.
#[cfg(feature = "cuda")]
mod cuda_layer {
    use strata::device::cuda::{
        nvrtc, Context, DeviceBuffer, LaunchConfig, ManagedBuffer, PinnedBuffer,
    };
    use strata::ErrorKind;

    fn context() -> Option<Context> {
        match Context::open(0) {
            Ok(ctx) => Some(ctx),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::NoDevice, "{e}");
                assert!(
                    std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
                    "STRATA_REQUIRE_GPU is set but no GPU opened: {e}"
                );
                eprintln!("skipping the cuda layer: {e}");
                None
            }
        }
    }

    fn data() -> Vec<u32> {
        (0..1000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect()
    }

    #[test]
    fn copies_round_trip_and_are_bounds_checked() {
        let Some(ctx) = context() else { return };
        let s = ctx.stream().unwrap();
        let data = data();
        let mut d = s.clone_htod(&data).unwrap();
        assert_eq!(s.clone_dtoh(&d).unwrap(), data);
        let mut head = [0u32; 3];
        s.memcpy_dtoh(&d, &mut head).unwrap();
        assert_eq!(head, data[..3]);
        s.memset_zeros(&mut d).unwrap();
        assert!(s.clone_dtoh(&d).unwrap().iter().all(|&x| x == 0));
        let too_long = vec![0u32; data.len() + 1];
        assert_eq!(
            s.memcpy_htod(&too_long, &mut d).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        // Several copies at offsets, waited for once.
        let dev = DeviceBuffer::<u32>::alloc(&ctx, 8).unwrap();
        // SAFETY: `dev` is this test's alone; the ranges do not overlap.
        unsafe { s.write_many(&dev, &[(0, &[1, 2][..]), (6, &[7, 8][..])]) }.unwrap();
        let (mut a, mut b) = ([0u32; 2], [0u32; 2]);
        // SAFETY: nothing writes `dev` meanwhile.
        unsafe { s.read_many(&dev, &mut [(0, &mut a[..]), (6, &mut b[..])]) }.unwrap();
        assert_eq!((a, b), ([1, 2], [7, 8]));
        // SAFETY: as above.
        let e = unsafe { s.write_many(&dev, &[(7, &[1, 2][..])]) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }

    #[test]
    fn pinned_copies_are_asynchronous_until_an_event() {
        let Some(ctx) = context() else { return };
        let s = ctx.stream().unwrap();
        let data = data();
        let mut up = PinnedBuffer::<u32>::new(&ctx, data.len()).unwrap();
        assert!(up.iter().all(|&x| x == 0), "pinned memory starts zeroed");
        up.copy_from_slice(&data);
        let mut down = PinnedBuffer::<u32>::new(&ctx, data.len()).unwrap();
        let dev = DeviceBuffer::<u32>::alloc(&ctx, data.len()).unwrap();
        let done = ctx.event().unwrap();
        // SAFETY: both pinned buffers and `dev` are untouched until the
        // event below has completed.
        unsafe {
            s.upload_async(&up, &dev, 0).unwrap();
            s.download_async(&dev, 0, &mut down).unwrap();
        }
        done.record(&s).unwrap();
        done.synchronize().unwrap();
        assert_eq!(&down[..], &data[..]);
    }

    #[test]
    fn a_module_loads_once_per_context_and_its_kernel_runs() {
        let Some(ctx) = context() else { return };
        if !nvrtc::available() {
            assert!(
                std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
                "STRATA_REQUIRE_GPU is set but libnvrtc cannot be loaded"
            );
            eprintln!("skipping the launch: libnvrtc cannot be loaded");
            return;
        }
        const ADD: &str = "extern \"C\" __global__ void add(unsigned *x, unsigned n, unsigned k) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) x[i] += k;
        }";
        let mut compiled = 0;
        let module = ctx
            .module("device-test add", || {
                compiled += 1;
                nvrtc::compile("add.cu", ADD)
            })
            .unwrap();
        let again = Context::open(0)
            .unwrap()
            .module("device-test add", || {
                compiled += 1;
                nvrtc::compile("add.cu", ADD)
            })
            .unwrap();
        assert_eq!(compiled, 1, "one context per GPU, one load per module");
        assert!(again.kernel("no_such_kernel").is_err());
        let add = module.kernel("add").unwrap();
        let s = ctx.stream().unwrap();
        let data = data();
        let n = data.len() as u32;
        let plus = 7u32;
        let mut x = s.clone_htod(&data).unwrap();
        let mut launch = s.launch(&add);
        launch.arg(&mut x).arg(&n).arg(&plus);
        // SAFETY: `add` takes (unsigned*, unsigned, unsigned); `x` holds `n`
        // elements and the kernel touches no element at or past `n`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
        let want: Vec<u32> = data.iter().map(|&v| v.wrapping_add(plus)).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), want);
        // The same kernel on mapped host memory (zero-copy), by address.
        let mapped = PinnedBuffer::mapped_from_slice(&ctx, &data).unwrap();
        let address = mapped.device_address().expect("mapped");
        let mut launch = s.launch(&add);
        launch.arg(&address).arg(&n).arg(&plus);
        // SAFETY: as above; the host leaves `mapped` alone until the stream
        // is synchronized.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
        s.synchronize().unwrap();
        assert_eq!(&mapped[..], &want[..]);
        // Unified Memory: filled from the host, prefetched back to it.
        let managed = ManagedBuffer::from_slice(&ctx, &data).unwrap();
        assert_eq!(managed.len(), data.len());
        s.prefetch_to_host(&managed).unwrap();
        s.synchronize().unwrap();
    }
}

/// Pages of the runtimes below.
const PAGE: usize = 4096;

/// A runtime of a 256-page simulated device over 512 pages of DRAM, no
/// background eviction.
fn sim_runtime() -> strata::Runtime {
    strata::Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 256 * PAGE as u64)
        .host(512 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap()
}

/// A prefetch over the device link goes in batches of 128 pages (one
/// transfer each, waited for once); a demand move (an eviction) in 32.
#[test]
fn prefetches_cross_the_device_link_in_large_batches() {
    let rt = sim_runtime();
    let b = rt
        .alloc_with(200 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let data: Vec<u8> = (0..200 * PAGE).map(|i| (i % 251) as u8).collect();
    b.write(0, &data).unwrap();
    let links = || rt.stats().device_links.unwrap();
    let (h2d, _) = links();
    b.prefetch(0..200 * PAGE as u64, Tier::Device)
        .wait()
        .unwrap();
    assert_eq!(b.residency().in_tier(Tier::Device), 200);
    let (h2d_after, d2h) = links();
    assert_eq!(h2d_after.ops - h2d.ops, 2, "200 pages: 128 + 72");
    assert_eq!(h2d_after.bytes - h2d.bytes, 200 * PAGE as u64);
    // Written on the device (their host copies dropped), then evicted:
    // a demand move, 32 pages a transfer.
    let data: Vec<u8> = data.iter().map(|x| x ^ 0x5a).collect();
    b.write(0, &data).unwrap();
    assert_eq!(b.residency().in_tier(Tier::Device), 200);
    b.evict(0..200 * PAGE as u64, Tier::Host).unwrap();
    let (_, d2h_after) = links();
    assert_eq!(d2h_after.ops - d2h.ops, 7, "200 pages: 6 × 32 + 8");
    assert_eq!(b.residency().in_tier(Tier::Host), 200);
    let mut back = vec![0; 200 * PAGE];
    b.read(0, &mut back).unwrap();
    assert!(back == data);
}

/// A large batch never asks for more move reservations than there are to
/// spare (each page of a move holds a second slot until it commits): with
/// most of the capacity promised to unwritten pages, a prefetch still
/// moves every page into a device with room.
#[test]
fn a_large_batch_fits_the_reservations_to_spare() {
    let rt = sim_runtime();
    // 700 of the 768 pages promised: 68 reservations to spare.
    let b = rt
        .alloc_with(700 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let data = vec![7u8; 128 * PAGE];
    b.write(0, &data).unwrap();
    b.prefetch(0..128 * PAGE as u64, Tier::Device)
        .wait()
        .unwrap();
    assert_eq!(b.residency().in_tier(Tier::Device), 128);
    let mut back = vec![0; 128 * PAGE];
    b.read(0, &mut back).unwrap();
    assert!(back == data);
}
