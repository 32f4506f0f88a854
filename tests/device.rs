//! The device tier: one test body on every backend present. The simulated
//! device always runs; CUDA runs where a GPU is (built with `--features
//! cuda`), is skipped with a printed reason elsewhere, and
//! `STRATA_REQUIRE_GPU=1` turns that skip into a failure.

mod common;

use std::sync::Arc;

use strata::device::{self, BackendKind, DeviceBackend, DeviceChoice};
use strata::tier::{DeviceStore, PageStore, Slot};
use strata::ErrorKind;

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
