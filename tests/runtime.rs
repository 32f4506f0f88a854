//! The runtime over all tiers: oversubscription, moves, errors, faults, and
//! a model-based test from several threads against an oracle.

mod common;

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use strata::device::DeviceChoice;
use strata::io::fault::{Fault, FaultEngine, FaultPlan};
use strata::io::{IoEngine, IoOp};
use strata::runtime::{Access, Placement};
use strata::tier::{CxlConfig, CxlMode, NvmeConfig};
use strata::{ErrorKind, Runtime, Tier};

use common::{engines, pattern};

const PAGE: usize = 16 << 10;

/// A runtime of `device` pages of simulated device and `host` of host
/// memory, no background eviction.
fn sim_and_host(device: u64, host: u64) -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, device * PAGE as u64)
        .host(host * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap()
}

/// device 4 pages (simulated), host 4, emulated CXL 4, NVMe `nvme_pages`;
/// no background eviction, so pages stay where the test puts them.
fn tiny(dir: &std::path::Path, engine: Arc<dyn IoEngine>, nvme_pages: u64) -> Runtime {
    tiny_with(dir, engine, nvme_pages, false)
}

fn tiny_with(
    dir: &std::path::Path,
    engine: Arc<dyn IoEngine>,
    nvme_pages: u64,
    background_eviction: bool,
) -> Runtime {
    let mut cxl = CxlConfig::new(CxlMode::Emulated, 4 * PAGE as u64, PAGE);
    cxl.bandwidth = Some(20e9);
    Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 4 * PAGE as u64)
        .host(4 * PAGE as u64)
        .cxl(cxl)
        .nvme(NvmeConfig::new(dir, nvme_pages * PAGE as u64, PAGE))
        .nvme_engine(engine)
        .background_eviction(background_eviction)
        .build()
        .unwrap()
}

#[test]
fn reads_and_writes_cross_page_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 64);
    let b = rt.alloc(3 * PAGE as u64 + 100).unwrap();
    assert_eq!(b.page_count(), 4);
    let mut out = vec![1u8; 5000];
    b.read(PAGE as u64 - 100, &mut out).unwrap();
    assert!(
        out.iter().all(|&x| x == 0),
        "never-written pages read as zeros"
    );
    let data = pattern(1, 1, 2 * PAGE + 300);
    b.write(PAGE as u64 / 2, &data).unwrap();
    let mut back = vec![0; data.len()];
    b.read(PAGE as u64 / 2, &mut back).unwrap();
    assert_eq!(back, data);
    let mut head = vec![9; PAGE / 2];
    b.read(0, &mut head).unwrap();
    assert!(
        head.iter().all(|&x| x == 0),
        "bytes before the write stay zero"
    );
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Device));
    assert_eq!(b.tier_of(3).unwrap(), None);
    // Bad ranges.
    let len = b.len();
    assert_eq!(
        b.read(len - 10, &mut [0; 11]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        b.write(u64::MAX, &[1]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        b.evict(0..len + 1, Tier::Host).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert!(b.tier_of(4).is_err());
}

#[test]
fn builds_from_the_config_file_form() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "page_size = \"16k\"\ndevice = \"sim\"\ndevice_capacity = \"64k\"\nwatermark_low = 1.0\nwatermark_high = 1.0\n[host]\ncapacity = \"64k\"\n[nvme]\npath = {:?}\ncapacity = \"1M\"\n",
        dir.path()
    );
    let config =
        strata::config::Config::resolve(Some(&toml), &|_| None, &strata::sys::Topology::default())
            .unwrap();
    let rt = config.builder().build().unwrap();
    assert_eq!(rt.tiers(), vec![Tier::Device, Tier::Host, Tier::Nvme]);
    assert_eq!(rt.device_backend().unwrap().label(), "simulated");
    let b = rt.alloc(20 * PAGE as u64).unwrap();
    b.write(0, &pattern(1, 2, 20 * PAGE)).unwrap();
    let used: Vec<u32> = rt.stats().tiers.iter().map(|t| t.used_pages).collect();
    assert_eq!(used, vec![4, 4, 12]);
}

#[test]
fn allocation_errors() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 16);
    assert_eq!(rt.alloc(0).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let total: u64 = rt.stats().tiers.iter().map(|t| t.free_pages as u64).sum();
    let all = rt.alloc(total * PAGE as u64).unwrap();
    let e = rt.alloc(1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfCapacity);
    for tier in ["device", "host", "cxl", "nvme"] {
        assert!(e.message().contains(tier), "{e}");
    }
    drop(all);
    let again = rt.alloc(total * PAGE as u64).unwrap();
    drop(again);
    assert_eq!(rt.stats().reserved_pages, 0);
    let no_cxl = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    assert_eq!(
        no_cxl
            .alloc_with(10, Placement::Prefer(Tier::Cxl))
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    assert!(no_cxl.alloc_typed::<u64>(u64::MAX).is_err());
}

#[test]
fn oversubscribes_the_device_eightfold_and_reads_everything_back() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tiny(dir.path(), engine, 32);
        assert_eq!(rt.device_backend().map(|b| b.label()), Some("simulated"));
        // 8 × the 4-page device over three buffers.
        let bufs: Vec<_> = [10u64, 12, 10]
            .iter()
            .map(|&p| rt.alloc(p * PAGE as u64).unwrap())
            .collect();
        for (i, b) in bufs.iter().enumerate() {
            b.write(0, &pattern(i as u32, 0, b.len() as usize)).unwrap();
        }
        let stats = rt.stats();
        let used: Vec<u32> = stats.tiers.iter().map(|t| t.used_pages).collect();
        assert_eq!(used, vec![4, 4, 4, 20], "{name}: fastest tiers fill first");
        for (i, b) in bufs.iter().enumerate() {
            let mut out = vec![0; b.len() as usize];
            b.read(0, &mut out).unwrap();
            assert_eq!(out, pattern(i as u32, 0, out.len()), "{name}: buffer {i}");
        }
        // Through pins: each page brought into the device and read there.
        for (i, b) in bufs.iter().enumerate() {
            let want = pattern(i as u32, 0, b.len() as usize);
            for p in 0..b.page_count() {
                let range = (p * PAGE) as u64..((p + 1) * PAGE) as u64;
                let pin = b.pin(range.clone(), Tier::Device).unwrap();
                assert_eq!(b.tier_of(p).unwrap(), Some(Tier::Device));
                assert_ne!(pin.addresses()[0], 0);
                let mut out = vec![0; PAGE];
                b.read(range.start, &mut out).unwrap();
                assert_eq!(
                    out,
                    want[p * PAGE..(p + 1) * PAGE],
                    "{name}: buffer {i} page {p}"
                );
            }
        }
        // Through device maps: a launch per buffer stages its pages into
        // memory (moving other buffers' pages to NVMe) and a simulated
        // kernel reads every byte through the map.
        for (i, b) in bufs.iter().enumerate() {
            let want = pattern(i as u32, 0, b.len() as usize);
            let map = b.device_map().unwrap();
            let counted: u64 = map.counts().iter().map(|&c| c as u64).sum();
            let launch = map.prepare(Access::ReadOnly).unwrap();
            for p in 0..b.page_count() {
                assert_ne!(b.tier_of(p).unwrap(), Some(Tier::Nvme));
            }
            let words = b.len() / 8;
            for w in 0..words {
                let v: u64 = launch.load(w);
                let at = w as usize * 8;
                assert_eq!(
                    v.to_ne_bytes(),
                    want[at..at + 8],
                    "{name}: buffer {i} word {w}"
                );
            }
            drop(launch);
            // Every load counted (sampling is off: every access counts).
            let now: u64 = map.counts().iter().map(|&c| c as u64).sum();
            assert_eq!(now - counted, words);
        }
        drop(bufs);
        assert!(
            rt.stats().tiers.iter().all(|t| t.used_pages == 0),
            "{name}: every slot returned"
        );
    }
}

#[test]
fn evict_cascades_down_and_prefetch_brings_pages_up() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt.alloc(4 * PAGE as u64).unwrap();
    let data = pattern(5, 5, 4 * PAGE);
    b.write(0, &data).unwrap();
    assert_eq!(b.tier_of(3).unwrap(), Some(Tier::Device));
    // Fill host and CXL with another buffer so the eviction must cascade.
    let filler = rt
        .alloc_with(8 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    filler.write(0, &pattern(6, 6, 8 * PAGE)).unwrap();
    b.evict(0..b.len(), Tier::Host).unwrap();
    for p in 0..4 {
        assert_eq!(
            b.tier_of(p).unwrap(),
            Some(Tier::Nvme),
            "host and cxl are full"
        );
    }
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data);
    b.prefetch(0..2 * PAGE as u64, Tier::Device).wait().unwrap();
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Device));
    assert_eq!(b.tier_of(2).unwrap(), Some(Tier::Nvme));
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data);
    let s = rt.stats();
    assert_eq!(s.moves, 6);
    let (h2d, d2h) = s.device_links.unwrap();
    assert!(h2d.bytes > 0 && d2h.bytes > 0);
    // 4 pages device→nvme (cascading past full host and cxl), 2 back up.
    let link = |from, to| {
        s.links
            .iter()
            .find(|l| l.from == from && l.to == to)
            .map(|l| l.stats.ops)
    };
    assert_eq!(link(Tier::Device, Tier::Nvme), Some(4));
    assert_eq!(link(Tier::Nvme, Tier::Device), Some(2));
    assert_eq!(s.links.iter().map(|l| l.stats.ops).sum::<u64>(), s.moves);
    assert!(b.prefetch(0..1, Tier::Device).poll().unwrap().is_ok());
}

#[test]
fn a_failed_move_leaves_the_page_readable_where_it_was() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let plan = FaultPlan::new();
        let rt = tiny(
            dir.path(),
            Arc::new(FaultEngine::new(engine, plan.clone())),
            32,
        );
        let b = rt
            .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Nvme))
            .unwrap();
        let data = pattern(8, 8, 2 * PAGE);
        b.write(0, &data).unwrap();
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
        // A read error on the way up, then a write error on the way down.
        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let e = b.prefetch(0..b.len(), Tier::Device).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
        let mut back = vec![0u8; 2 * PAGE];
        b.read(0, &mut back).unwrap();
        assert_eq!(
            back, data,
            "{name}: readable where it was after the failed read"
        );
        b.prefetch(0..b.len(), Tier::Host).wait().unwrap();
        // Written in host, the pages' NVMe copies are gone: going down
        // needs a write.
        b.write(0, &data).unwrap();
        plan.inject(IoOp::Write, 0, Fault::Errno(libc::ENOSPC));
        let e = b.evict(0..b.len(), Tier::Nvme).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace, "{name}: {e}");
        assert_eq!(
            b.tier_of(0).unwrap(),
            Some(Tier::Host),
            "{name}: stayed where it was"
        );
        let mut out = vec![0; data.len()];
        b.read(0, &mut out).unwrap();
        assert_eq!(out, data, "{name}");
        assert!(rt.stats().failed_moves >= 2);
    }
}

#[test]
fn pinned_pages_stay_put_and_report_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt.alloc(6 * PAGE as u64).unwrap();
    let data = pattern(3, 3, 6 * PAGE);
    b.write(0, &data).unwrap();
    {
        let pin = b.pin(PAGE as u64..3 * PAGE as u64, Tier::Host).unwrap();
        assert_eq!(pin.pages(), 1..3);
        assert_eq!(pin.addresses().len(), 2);
        // The address is the page's memory: read it as a C caller would.
        // SAFETY: a host pin's address stays valid for a page while the
        // guard lives, and no one writes the page during this read.
        let seen = unsafe { std::slice::from_raw_parts(pin.addresses()[1] as *const u8, PAGE) };
        assert_eq!(seen, &data[2 * PAGE..3 * PAGE]);
        assert!(pin.addresses().iter().all(|a| a % PAGE as u64 == 0));
        assert_ne!(pin.addresses()[0], pin.addresses()[1]);
        assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Host));
        // Pinned pages never move; the others do.
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Host));
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
        let host = rt
            .stats()
            .tiers
            .into_iter()
            .find(|t| t.tier == Tier::Host)
            .unwrap();
        assert_eq!(host.pinned_pages, 2);
        // Writes still work on pinned pages, in place.
        b.write(PAGE as u64, &[7; 10]).unwrap();
        let again = b.pin(PAGE as u64..2 * PAGE as u64, Tier::Host).unwrap();
        assert_eq!(again.addresses()[0], pin.addresses()[0]);
        // Pinned elsewhere: cannot be pinned on the device too.
        assert!(b.pin(PAGE as u64..2 * PAGE as u64, Tier::Device).is_err());
    }
    let host = rt
        .stats()
        .tiers
        .into_iter()
        .find(|t| t.tier == Tier::Host)
        .unwrap();
    assert_eq!(host.pinned_pages, 0);
    b.evict(0..b.len(), Tier::Nvme).unwrap();
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Nvme));
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    let mut expect = data.clone();
    expect[PAGE..PAGE + 10].fill(7);
    assert_eq!(out, expect);
    // Errors: larger than the tier, NVMe, unwritten pages are materialized.
    let e = b.pin(0..b.len(), Tier::Device).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
    assert_eq!(
        b.pin(0..1, Tier::Nvme).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let fresh = rt.alloc(PAGE as u64).unwrap();
    let pin = fresh.pin(0..1, Tier::Device).unwrap();
    assert_eq!(fresh.tier_of(0).unwrap(), Some(Tier::Device));
    drop(pin);
    let mut z = vec![1; PAGE];
    fresh.read(0, &mut z).unwrap();
    assert!(z.iter().all(|&x| x == 0));
}

/// Moves hold a second slot until they commit; they must not take the
/// slot a reserved, never-written page is owed.
#[test]
fn moves_never_starve_a_reserved_first_write() {
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(2 * PAGE as u64)
        .cxl({
            let mut c = CxlConfig::new(CxlMode::Emulated, 2 * PAGE as u64, PAGE);
            c.bandwidth = Some(50e9);
            c.latency_ns = 0;
            c
        })
        .build()
        .unwrap();
    for _ in 0..50 {
        let x = Arc::new(rt.alloc(3 * PAGE as u64).unwrap());
        x.write(0, &pattern(1, 1, 3 * PAGE)).unwrap();
        let y = rt.alloc(PAGE as u64).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mover = {
            let (x, stop) = (x.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Refusals are fine; they must be refusals.
                    for r in [
                        x.evict(0..PAGE as u64, Tier::Cxl),
                        x.prefetch(0..PAGE as u64, Tier::Host).wait(),
                    ] {
                        if let Err(e) = r {
                            assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
                        }
                    }
                }
            })
        };
        y.write(0, &[7; 100]).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        mover.join().unwrap();
        let mut out = vec![0; 3 * PAGE];
        x.read(0, &mut out).unwrap();
        assert_eq!(out, pattern(1, 1, 3 * PAGE));
    }
}

/// Read-only and read-write launches of one buffer exclude each other: a
/// read-only launch's kernels read the bytes as unchanging (on the
/// simulated device as `&[u8]`, `Reader::page`), which a read-write
/// launch's kernels would write under them. Launches of one mode overlap.
#[test]
fn read_only_and_read_write_launches_of_a_buffer_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt.alloc(2 * PAGE as u64).unwrap();
    b.write(0, &[1; 2 * PAGE]).unwrap();
    let map = b.device_map().unwrap();
    let (ro, ro2) = (
        map.prepare(Access::ReadOnly).unwrap(),
        map.prepare(Access::ReadOnly).unwrap(),
    );
    let e = map.prepare(Access::ReadWrite).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(
        e.message()
            .contains("read-only launch of the buffer is live"),
        "{e}"
    );
    assert_eq!(ro.load::<u8>(0), 1);
    drop((ro, ro2));
    let (rw, rw2) = (
        map.prepare(Access::ReadWrite).unwrap(),
        map.prepare(Access::ReadWrite).unwrap(),
    );
    let e = map.prepare(Access::ReadOnly).unwrap_err();
    assert!(
        e.message()
            .contains("read-write launch of the buffer is live"),
        "{e}"
    );
    drop((rw, rw2));
    drop(map.prepare(Access::ReadOnly).unwrap());
}

/// Device maps: `prepare` stages NVMe pages into memory and counts the
/// faults; under a read-only launch writes are refused, demotions wait and a
/// promotion swaps the map entry while the old copy stays valid until the
/// launch ends; under a read-write launch nothing in memory moves.
#[test]
fn device_maps_stage_pages_and_swap_entries_under_a_launch() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt.alloc(6 * PAGE as u64).unwrap();
    let data = pattern(8, 8, 6 * PAGE);
    b.write(0, &data).unwrap();
    b.evict(0..b.len(), Tier::Nvme).unwrap();
    let faults = rt.stats().faults;
    let map = b.device_map().unwrap();
    assert_eq!(map.pages(), 6);
    let launch = map.prepare(Access::ReadOnly).unwrap();
    assert_eq!(rt.stats().faults - faults, 6, "every page was staged");
    for p in 0..6 {
        assert!(matches!(
            b.tier_of(p).unwrap(),
            Some(Tier::Host | Tier::Cxl | Tier::Device)
        ));
        assert_ne!(launch.entry(p), 0);
    }
    assert_ne!(launch.map_address(), 0);
    let check = |launch: &strata::runtime::Launch<'_>| {
        for (i, &byte) in data.iter().enumerate().step_by(97) {
            assert_eq!(launch.load::<u8>(i as u64), byte, "byte {i}");
        }
    };
    check(&launch);
    assert_eq!(
        b.write(0, &[1]).unwrap_err().kind(),
        ErrorKind::InvalidArgument,
        "a read-only launch refuses writes"
    );
    b.evict(0..b.len(), Tier::Nvme).unwrap();
    assert!(
        (0..6).all(|p| b.tier_of(p).unwrap() != Some(Tier::Nvme)),
        "no demotion"
    );
    let p = (0..6)
        .find(|&p| b.tier_of(p).unwrap() == Some(Tier::Host))
        .unwrap();
    let before = launch.entry(p);
    let host_used = |rt: &Runtime| rt.stats().tiers[1].used_pages;
    let used = host_used(&rt);
    b.prefetch((p * PAGE) as u64..(p * PAGE + 1) as u64, Tier::Device)
        .wait()
        .unwrap();
    assert_eq!(b.tier_of(p).unwrap(), Some(Tier::Device));
    assert_ne!(launch.entry(p), before, "the entry was swapped");
    assert_eq!(host_used(&rt), used, "the old copy is kept for the launch");
    check(&launch);
    drop(launch);
    assert_eq!(host_used(&rt), used - 1, "and freed when it ends");

    let rw = map.prepare(Access::ReadWrite).unwrap();
    let q = (0..6)
        .find(|&p| b.tier_of(p).unwrap() == Some(Tier::Host))
        .unwrap();
    b.prefetch(0..b.len(), Tier::Device).wait().unwrap();
    assert_eq!(b.tier_of(q).unwrap(), Some(Tier::Host), "nothing moves");
    b.write(0, &[9]).unwrap();
    drop(rw);
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out[0], 9);
    assert_eq!(out[1..], data[1..]);
}

/// The reclaimer brings tiers above their high watermark down to the low
/// one, cascading, without losing a byte.
#[test]
fn background_eviction_keeps_tiers_between_watermarks() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 20 * PAGE as u64)
        .host(20 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 64 * PAGE as u64, PAGE))
        .watermarks(strata::runtime::Watermarks::new(0.5, 0.75))
        .build()
        .unwrap();
    let b = rt.alloc(36 * PAGE as u64).unwrap();
    let data = pattern(4, 4, 36 * PAGE);
    b.write(0, &data).unwrap();
    let used = |t: usize| rt.stats().tiers[t].used_pages;
    // The reclaimer works in the background: wait for it (bounded).
    for _ in 0..500 {
        if used(0) <= 15 && used(1) <= 15 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(used(0) <= 15 && used(1) <= 15, "{:?}", rt.stats().tiers);
    assert!(rt.stats().reclaimed_pages >= 6);
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data);
    assert_eq!(
        Runtime::builder()
            .watermarks(strata::runtime::Watermarks::new(0.9, 0.5))
            .build()
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
}

/// `stats()` while a full NVMe tier is rewritten (its reserve slot in use).
#[test]
fn stats_during_writes_to_a_full_nvme_tier() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 4 * PAGE as u64, PAGE))
        .build()
        .unwrap();
    let b = Arc::new(rt.alloc(4 * PAGE as u64).unwrap());
    b.write(0, &pattern(2, 2, 4 * PAGE)).unwrap();
    let writer = {
        let b = b.clone();
        std::thread::spawn(move || {
            for i in 0..200 {
                b.write(PAGE as u64, &pattern(3, i, PAGE)).unwrap();
            }
        })
    };
    for _ in 0..2000 {
        for t in rt.stats().tiers {
            assert!(t.used_pages + t.free_pages <= 4, "{t:?}");
        }
    }
    writer.join().unwrap();
}

/// Four threads, each writing and reading its own buffer against its own
/// oracle, while all of them move pages of every buffer between tiers at
/// random; every tier holds 4 pages, so pages move all the time.
#[test]
fn model_based_random_operations_from_four_threads() {
    let seed: u64 = std::env::var("STRATA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("model-based test seed: {seed} (rerun with STRATA_SEED={seed})");
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        // Background eviction on: the reclaimer moves pages too.
        let rt = tiny_with(dir.path(), engine, 24, true);
        let launches = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let bufs: Arc<Vec<_>> = Arc::new(
            (0..4)
                .map(|_| rt.alloc(5 * PAGE as u64 + 777).unwrap())
                .collect(),
        );
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let bufs = bufs.clone();
                let rt = rt.clone();
                let launches = launches.clone();
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ t as u64);
                    let mine = &bufs[t];
                    let len = mine.len() as usize;
                    let mut oracle = vec![0u8; len];
                    let tiers = [Tier::Device, Tier::Host, Tier::Cxl, Tier::Nvme];
                    for step in 0..1000 {
                        let off = rng.random_range(0..len);
                        let n = rng.random_range(1..=(len - off).min(3 * PAGE));
                        match rng.random_range(0..14) {
                            0..=3 => {
                                let data = pattern(t as u32 * 1000 + step, off as u32, n);
                                mine.write(off as u64, &data).unwrap();
                                oracle[off..off + n].copy_from_slice(&data);
                            }
                            4..=6 => {
                                let mut out = vec![0; n];
                                mine.read(off as u64, &mut out).unwrap();
                                assert_eq!(
                                    out,
                                    oracle[off..off + n],
                                    "thread {t} step {step} (seed {seed})"
                                );
                            }
                            12 | 13 => {
                                // A kernel launch over our own buffer reads
                                // it through the device map while others
                                // move its pages.
                                let map = mine.device_map().unwrap();
                                match map.prepare(Access::ReadOnly) {
                                    Ok(launch) => {
                                        launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        for (i, &want) in
                                            oracle.iter().enumerate().skip(off).take(n.min(512))
                                        {
                                            assert_eq!(
                                                launch.load::<u8>(i as u64),
                                                want,
                                                "thread {t} step {step} byte {i} (seed {seed})"
                                            );
                                        }
                                    }
                                    Err(e) => assert_eq!(
                                        e.kind(),
                                        ErrorKind::OutOfCapacity,
                                        "{e} (seed {seed})"
                                    ),
                                };
                            }
                            11 => {
                                // A short-lived buffer of our own: written,
                                // read back, freed (or refused when every
                                // page is promised).
                                match rt.alloc((n as u64).max(1)) {
                                    Ok(tmp) => {
                                        let data = pattern(t as u32, step, n);
                                        tmp.write(0, &data).unwrap();
                                        let mut out = vec![0; n];
                                        tmp.read(0, &mut out).unwrap();
                                        assert_eq!(
                                            out, data,
                                            "thread {t} step {step} (seed {seed})"
                                        );
                                    }
                                    Err(e) => assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}"),
                                }
                            }
                            10 => {
                                // Pin a few of someone's pages for a moment;
                                // a full tier or a page pinned elsewhere is
                                // a refusal, not a failure.
                                let other = &bufs[rng.random_range(0..4)];
                                let start = rng.random_range(0..other.len());
                                let tier =
                                    [Tier::Device, Tier::Host, Tier::Cxl][rng.random_range(0..3)];
                                match other
                                    .pin(start..(start + 2 * PAGE as u64).min(other.len()), tier)
                                {
                                    Ok(pin) => {
                                        assert_eq!(pin.tier(), tier);
                                        let mut out = vec![0; n];
                                        mine.read(off as u64, &mut out).unwrap();
                                        assert_eq!(
                                            out,
                                            oracle[off..off + n],
                                            "thread {t} step {step} (seed {seed})"
                                        );
                                    }
                                    Err(e) => assert!(
                                        matches!(
                                            e.kind(),
                                            ErrorKind::OutOfCapacity | ErrorKind::InvalidArgument
                                        ),
                                        "{e} (seed {seed})"
                                    ),
                                }
                            }
                            _ => {
                                // Move someone's pages; running out of room
                                // in a tier is fine, losing data is not.
                                let other = &bufs[rng.random_range(0..4)];
                                let tier = tiers[rng.random_range(0..4)];
                                let end = rng.random_range(1..=other.len());
                                let r = if rng.random_bool(0.3) {
                                    other.prefetch(0..end, tier).wait()
                                } else if rng.random_bool(0.5) {
                                    // Not waited for: the moves race the
                                    // writes that follow.
                                    let _ = other.prefetch(0..end, tier);
                                    Ok(())
                                } else {
                                    other.evict(0..end, tier)
                                };
                                if let Err(e) = r {
                                    assert_eq!(
                                        e.kind(),
                                        ErrorKind::OutOfCapacity,
                                        "{e} (seed {seed})"
                                    );
                                }
                            }
                        }
                    }
                    let mut all = vec![0; len];
                    mine.read(0, &mut all).unwrap();
                    assert_eq!(all, oracle, "thread {t} final (seed {seed})");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let stats = rt.stats();
        eprintln!(
            "{name}: {} moves, {} abandoned, {} background evictions, {} faults, {} launches",
            stats.moves,
            stats.abandoned_moves,
            stats.reclaimed_pages,
            stats.faults,
            launches.load(std::sync::atomic::Ordering::Relaxed)
        );
        assert!(stats.moves > 0, "{name}: pages moved");
        assert!(stats.reclaimed_pages > 0, "{name}: the reclaimer ran");
        assert!(
            launches.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{name}: kernels read through device maps"
        );
    }
}

/// More pages than one batch, to and from NVMe, with the data checked and
/// every move counted on its link.
#[test]
fn batched_moves_to_and_from_nvme_keep_every_byte() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let rt = Runtime::builder()
            .page_size(PAGE)
            .host(80 * PAGE as u64)
            .nvme(NvmeConfig::new(dir.path(), 96 * PAGE as u64, PAGE))
            .nvme_engine(engine)
            .build()
            .unwrap();
        let b = rt.alloc(70 * PAGE as u64).unwrap();
        let data = pattern(4, 4, 70 * PAGE);
        b.write(0, &data).unwrap();
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        assert!(
            (0..70).all(|p| b.tier_of(p).unwrap() == Some(Tier::Nvme)),
            "{name}"
        );
        let mut out = vec![0; data.len()];
        b.read(0, &mut out).unwrap();
        assert_eq!(out, data, "{name}");
        b.prefetch(0..b.len(), Tier::Host).wait().unwrap();
        assert!(
            (0..70).all(|p| b.tier_of(p).unwrap() == Some(Tier::Host)),
            "{name}"
        );
        b.read(0, &mut out).unwrap();
        assert_eq!(out, data, "{name}");
        let s = rt.stats();
        let ops = |from, to| {
            s.links
                .iter()
                .find(|l| l.from == from && l.to == to)
                .map(|l| l.stats.ops)
        };
        assert_eq!(ops(Tier::Host, Tier::Nvme), Some(70), "{name}");
        assert_eq!(ops(Tier::Nvme, Tier::Host), Some(70), "{name}");
        assert_eq!(s.failed_moves, 0, "{name}");
    }
}

#[test]
fn batches_respect_a_shallow_queue_and_a_full_slowest_tier_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut nvme = NvmeConfig::new(dir.path(), 10 * PAGE as u64, PAGE);
    nvme.queue_depth = 4;
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(16 * PAGE as u64)
        .nvme(nvme)
        .build()
        .unwrap();
    let b = rt.alloc(12 * PAGE as u64).unwrap();
    let data = pattern(6, 1, 12 * PAGE);
    b.write(0, &data).unwrap();
    // 8 pages through a queue of 4.
    b.evict(0..8 * PAGE as u64, Tier::Nvme).unwrap();
    assert!((0..8).all(|p| b.tier_of(p).unwrap() == Some(Tier::Nvme)));
    b.prefetch(0..8 * PAGE as u64, Tier::Host).wait().unwrap();
    assert!((0..8).all(|p| b.tier_of(p).unwrap() == Some(Tier::Host)));
    // NVMe holds 9 usable pages (one is its reserve): the 10th and later
    // cannot go, and evict says so.
    let e = b.evict(0..b.len(), Tier::Nvme).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
    let on_nvme = (0..12)
        .filter(|&p| b.tier_of(p).unwrap() == Some(Tier::Nvme))
        .count();
    assert_eq!(on_nvme, 9);
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data);
    assert_eq!(
        rt.stats().failed_moves,
        0,
        "a full tier is a refusal, not a failure"
    );
}

#[test]
fn typed_views_and_residency_report_what_users_see() {
    let rt = sim_and_host(2, 16);
    let b = rt
        .alloc_with(8 * PAGE as u64, Placement::Prefer(Tier::Device))
        .unwrap();
    let r = b.residency();
    assert_eq!((r.unwritten, r.lost, r.pages), (8, 0, [0; 4]));
    // An unaligned offset, spanning a page boundary.
    let values: Vec<u64> = (0..1000).map(|i| i * 0x0101_0101).collect();
    let at = PAGE as u64 - 13;
    b.write_as(at, &values).unwrap();
    let mut back = vec![0u64; 1000];
    b.read_as(at, &mut back).unwrap();
    assert_eq!(back, values);
    let r = b.residency();
    // 8000 bytes from PAGE - 13 touch pages 0 and 1 (and 2 when pages are
    // small); the device holds two, the rest went to the host.
    let touched = (at + 8000).div_ceil(PAGE as u64);
    assert_eq!(r.in_tier(Tier::Device) + r.in_tier(Tier::Host), touched);
    assert_eq!(r.unwritten, 8 - touched);
    b.evict(0..b.len(), Tier::Host).unwrap();
    assert_eq!(b.residency().in_tier(Tier::Device), 0);
    assert_eq!(b.residency().in_tier(Tier::Host), touched);
    assert!(b.write_as(8 * PAGE as u64 - 4, &[1u64]).is_err());
    assert_eq!(rt.stats().lost_pages, 0);
}

#[test]
fn the_host_config_reaches_the_arena() {
    let Some(node) = strata::sys::Topology::detect()
        .numa_nodes
        .first()
        .map(|n| n.id)
    else {
        eprintln!("skipping: sysfs shows no NUMA node here");
        return;
    };
    let mut host = strata::HostConfig::new(16 * PAGE as u64, PAGE);
    host.numa_node = Some(node);
    host.huge_pages = false;
    let rt = match Runtime::builder()
        .page_size(PAGE)
        .host_config(host.clone())
        .build()
    {
        Ok(rt) => rt,
        // mbind needs CAP_SYS_NICE under some container profiles.
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            eprintln!("skipping: mbind refused here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let b = rt.alloc(4 * PAGE as u64).unwrap();
    b.write(0, &[7; 100]).unwrap();
    // A node that does not exist is refused by the arena (its node range
    // check, before mbind): the binding is not dropped on the way.
    host.numa_node = Some(4000);
    let e = Runtime::builder()
        .page_size(PAGE)
        .host_config(host)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("4000"), "{e}");
}

#[test]
fn a_config_without_nvme_builds_a_runtime_without_it() {
    let c = strata::Config::resolve(
        Some("page_size = \"16k\"\n[nvme]\ncapacity = 0\n"),
        &|_| None,
        &strata::sys::Topology::detect(),
    );
    let c = match c {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert!(c.nvme.is_none());
    let rt = c.builder().device(DeviceChoice::Sim, 0).build().unwrap();
    assert!(!rt.tiers().contains(&Tier::Nvme));
}

/// A move whose reads the I/O engine never returns fails, and its pages
/// stay on NVMe, intact: a read does not change the slot it reads, so each
/// page goes back to its slot. Nothing is lost; once the engine works again
/// the pages read as written and move.
#[test]
fn pages_whose_reads_the_engine_lost_stay_where_they_were() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let plan = FaultPlan::new();
        let rt = tiny(
            dir.path(),
            Arc::new(FaultEngine::new(engine, plan.clone())),
            32,
        );
        let b = rt
            .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Nvme))
            .unwrap();
        let data = pattern(3, 3, 4 * PAGE);
        b.write(0, &data).unwrap();
        assert_eq!(b.residency().in_tier(Tier::Nvme), 4, "{name}");
        // The engine breaks with the reads of pages 0 and 1 in flight.
        plan.fail_waits(libc::EIO);
        let e = b
            .prefetch(0..2 * PAGE as u64, Tier::Host)
            .wait()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        plan.clear();
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
        let r = b.residency();
        assert_eq!((r.lost, r.in_tier(Tier::Nvme)), (0, 4), "{name}");
        let mut out = vec![0; 4 * PAGE];
        b.read(0, &mut out).unwrap();
        assert_eq!(out, data, "{name}");
        b.prefetch(0..2 * PAGE as u64, Tier::Host).wait().unwrap();
        assert_eq!(b.residency().in_tier(Tier::Host), 2, "{name}");
        b.read(0, &mut out).unwrap();
        assert_eq!(out, data, "{name}");
    }
}

/// A range of no bytes names no page, wherever it starts: evicting,
/// prefetching or pinning it moves and pins nothing.
#[test]
fn an_empty_range_inside_a_page_acts_on_no_page() {
    let rt = sim_and_host(4, 16);
    let b = rt
        .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Device))
        .unwrap();
    b.write(0, &pattern(1, 1, 2 * PAGE)).unwrap();
    let mid = PAGE as u64 + 100;
    b.evict(mid..mid, Tier::Host).unwrap();
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Device));
    b.evict(0..2 * PAGE as u64, Tier::Host).unwrap();
    b.prefetch(mid..mid, Tier::Device).wait().unwrap();
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Host));
    let pin = b.pin(mid..mid, Tier::Device).unwrap();
    assert!(pin.pages().is_empty() && pin.addresses().is_empty());
    drop(pin);
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Host));
}

#[test]
fn the_simulated_devices_memory_is_lent_as_slices_without_crossing_the_link() {
    let rt = sim_and_host(4, 16);
    let len = 2 * PAGE as u64;
    let mut b = rt.alloc_with(len, Placement::Prefer(Tier::Device)).unwrap();
    let data = pattern(7, 3, len as usize);
    b.write(0, &data).unwrap();
    assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Device));
    let links = || rt.stats().device_links.unwrap();
    let before = links();
    {
        let v = b.view(0..len, Tier::Device).unwrap();
        assert_eq!(v.page(1).unwrap(), &data[PAGE..]);
        assert!(b.write(0, b"x").is_err(), "writes wait for the view");
    }
    {
        let mut v = b.view_mut(0..len, Tier::Device).unwrap();
        v.page_mut(1).unwrap()[..4].copy_from_slice(b"kern");
    }
    let after = links();
    assert_eq!(
        (after.0.bytes, after.1.bytes),
        (before.0.bytes, before.1.bytes),
        "device memory read and written in place, as a kernel does"
    );
    let mut out = [0u8; 4];
    b.read(PAGE as u64, &mut out).unwrap();
    assert_eq!(&out, b"kern");
}

#[test]
fn an_owned_view_holds_its_buffer_in_its_tier_until_it_drops() {
    let rt = sim_and_host(4, 16);
    let b = rt
        .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let mut v = b.into_view_mut(Tier::Device).unwrap();
    assert_eq!(v.pages(), 0..2);
    for (p, bytes) in v.pages_mut() {
        assert_eq!(bytes.len(), PAGE);
        bytes[..2].copy_from_slice(&[b'v', p as u8]);
    }
    // Its two pages stay in device memory: another buffer gets the rest,
    // and evicting the device cannot take them.
    let other = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Device))
        .unwrap();
    other.write(0, &vec![1u8; 4 * PAGE]).unwrap();
    assert_eq!(other.residency().pages[Tier::Device as usize], 2);
    let t = other.prefetch(0..4 * PAGE as u64, Tier::Device);
    let _ = t.wait();
    assert_eq!(other.residency().pages[Tier::Device as usize], 2);
    assert_eq!(v.pages_mut()[1].1[..2], [b'v', 1]);
    // Dropped, the buffer is freed and its device pages with it.
    drop(v);
    other
        .prefetch(0..4 * PAGE as u64, Tier::Device)
        .wait()
        .unwrap();
    assert_eq!(other.residency().pages[Tier::Device as usize], 4);
    // A host-only tier list refuses a device view.
    let host_only = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    let b = host_only.alloc(PAGE as u64).unwrap();
    assert!(b.into_view_mut(Tier::Device).is_err());
}

#[test]
fn views_lend_pinned_host_pages_as_slices() {
    let rt = sim_and_host(4, 16);
    // Three and a half pages, first written onto the device.
    let len = 3 * PAGE as u64 + 100;
    let mut b = rt.alloc_with(len, Placement::Prefer(Tier::Device)).unwrap();
    let data = pattern(5, 5, len as usize);
    b.write(0, &data).unwrap();
    {
        let v = b.view(PAGE as u64..len, Tier::Host).unwrap();
        assert_eq!(v.pages(), 1..4);
        assert_eq!(v.page(1).unwrap(), &data[PAGE..2 * PAGE]);
        assert_eq!(
            v.page(3).unwrap(),
            &data[3 * PAGE..],
            "the last page is short"
        );
        assert!(v.page(0).is_none() && v.page(4).is_none());
        assert_eq!(
            b.tier_of(2).unwrap(),
            Some(Tier::Host),
            "pinned in host memory"
        );
        // Reads go on; writes and read-write launches wait for the view.
        let mut out = vec![0; 8];
        b.read(0, &mut out).unwrap();
        let e = b.write(0, b"x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains("borrowed view"), "{e}");
        let map = b.device_map().unwrap();
        assert!(map.prepare(Access::ReadWrite).is_err());
        drop(map.prepare(Access::ReadOnly).unwrap());
        // Two shared views at once are fine.
        let w = b.view(0..PAGE as u64, Tier::Host).unwrap();
        assert_eq!(w.iter().count(), 1);
        assert!(
            b.view(0..1, Tier::Device).is_err(),
            "page 0 is pinned in host memory by the views above"
        );
        assert!(b.view(0..1, Tier::Nvme).is_err());
    }
    b.write(0, b"after").unwrap();
    {
        let mut v = b.view_mut(0..2 * PAGE as u64, Tier::Host).unwrap();
        v.page_mut(1).unwrap()[..4].copy_from_slice(b"mut!");
        assert!(v.page_mut(2).is_none());
    }
    let mut out = [0u8; 4];
    b.read(PAGE as u64, &mut out).unwrap();
    assert_eq!(&out, b"mut!");
    // Every page at once, for work spread over threads: each its own bytes.
    {
        let mut v = b.view_mut(PAGE as u64..len, Tier::Host).unwrap();
        let pages = v.pages_mut();
        assert_eq!(pages.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3]);
        for (p, bytes) in pages {
            assert_eq!(bytes.len(), if p == 3 { 100 } else { PAGE }, "page {p}");
            bytes[..2].copy_from_slice(&[b'p', b'0' + p as u8]);
        }
    }
    for p in 1..4u8 {
        let mut out = [0u8; 2];
        b.read(p as u64 * PAGE as u64, &mut out).unwrap();
        assert_eq!(out, [b'p', b'0' + p], "page {p}");
    }
    // A launch in progress refuses a mutable view, and the reverse.
    let map = b.device_map().unwrap();
    let launch = map.prepare(Access::ReadOnly).unwrap();
    drop(launch);
    drop(map);
    let v = b.view_mut(0..1, Tier::Host).unwrap();
    drop(v);
    let map = b.device_map().unwrap();
    let launch = map.prepare(Access::ReadWrite).unwrap();
    assert!(b.view(0..1, Tier::Host).is_err());
    drop(launch);
    assert!(b.view(0..1, Tier::Host).is_ok());
}

/// A prefetch into a full tier makes room as a pin does, but only among
/// pages not referenced since the clock hand last passed: with nothing
/// colder it is declined (its ticket says how many pages; nothing is
/// demoted), and once the hand has passed it demotes the coldest pages
/// outside its range (never a pinned one). Every page stays readable.
#[test]
fn prefetch_into_a_full_tier_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 64);
    // The device's 4 pages hold a, one of them pinned.
    let a = rt.alloc(4 * PAGE as u64).unwrap();
    let a_data = pattern(1, 2, 4 * PAGE);
    a.write(0, &a_data).unwrap();
    assert!((0..4).all(|p| a.tier_of(p).unwrap() == Some(Tier::Device)));
    let pin = a.pin(0..PAGE as u64, Tier::Device).unwrap();
    let b = rt
        .alloc_with(3 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let b_data = pattern(3, 4, 3 * PAGE);
    b.write(0, &b_data).unwrap();
    assert!((0..3).all(|p| b.tier_of(p).unwrap() == Some(Tier::Host)));
    // a was just written: every victim is referenced, so the prefetch is
    // declined and nothing moves.
    let t = b.prefetch(0..b.len(), Tier::Device);
    t.wait_timeout(std::time::Duration::MAX).unwrap().unwrap();
    assert_eq!(t.declined(), 3);
    assert_eq!(rt.stats().prefetches_declined, 3);
    assert!((0..3).all(|p| b.tier_of(p).unwrap() == Some(Tier::Host)));
    assert!((0..4).all(|p| a.tier_of(p).unwrap() == Some(Tier::Device)));
    // The hand has passed a's pages since: now they are the coldest.
    let t = b.prefetch(0..b.len(), Tier::Device);
    t.wait_timeout(std::time::Duration::MAX).unwrap().unwrap();
    assert_eq!(t.declined(), 0);
    assert!((0..3).all(|p| b.tier_of(p).unwrap() == Some(Tier::Device)));
    assert_eq!(a.tier_of(0).unwrap(), Some(Tier::Device), "pinned: stays");
    assert!((1..4).all(|p| a.tier_of(p).unwrap() > Some(Tier::Device)));
    assert!(rt.stats().reclaimed_pages >= 3);
    drop(pin);
    // Larger than the tier: at most the tier moves, the ticket declines the
    // rest.
    let c = rt
        .alloc_with(6 * PAGE as u64, Placement::Prefer(Tier::Cxl))
        .unwrap();
    let c_data = pattern(5, 6, 6 * PAGE);
    c.write(0, &c_data).unwrap();
    let t = c.prefetch(0..c.len(), Tier::Device);
    t.wait_timeout(std::time::Duration::MAX).unwrap().unwrap();
    let on_device = (0..6)
        .filter(|&p| c.tier_of(p).unwrap() == Some(Tier::Device))
        .count();
    // What did not move was declined (each batch of the request gets one
    // turn of the clock hand), at least the two the tier cannot hold.
    assert_eq!(on_device + t.declined(), 6, "{on_device} {}", t.declined());
    assert!(t.declined() >= 2);
    for (buf, data) in [(&a, &a_data), (&b, &b_data), (&c, &c_data)] {
        let mut out = vec![0; data.len()];
        buf.read(0, &mut out).unwrap();
        assert_eq!(&out, data);
    }
    assert_eq!(rt.stats().failed_moves, 0);
}

/// Background eviction that fails (every NVMe write refused) loses
/// nothing and is not silent: the failure is counted and returned by
/// `Runtime::check`, which then clears it; `shutdown` of a healthy runtime
/// waits for its moves and returns Ok.
#[test]
fn background_failures_are_recorded_and_returned() {
    use strata::io::IoOp;
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::new();
    let engine = Arc::new(FaultEngine::new(engines()[0].1.clone(), plan.clone()));
    plan.fail_all(IoOp::Write, libc::EIO);
    let rt = tiny_with(dir.path(), engine, 32, true);
    rt.check().unwrap();
    // CXL full (above its high watermark): the reclaimer demotes to NVMe,
    // whose writes fail. The buffer's own writes fit in CXL.
    let b = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Cxl))
        .unwrap();
    let data = pattern(9, 9, 4 * PAGE);
    b.write(0, &data).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while rt.stats().background_errors == 0 {
        assert!(std::time::Instant::now() < deadline, "no failure recorded");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let e = rt.check().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(e.message().contains("demoting"), "{e}");
    plan.clear();
    let mut out = vec![0; data.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data, "a failed demotion lost nothing");
    assert_eq!(rt.stats().lost_pages, 0);
    drop(b);
    drop(rt);

    let rt = tiny_with(dir.path(), engines()[0].1.clone(), 32, true);
    let b = rt.alloc(4 * PAGE as u64).unwrap();
    b.write(0, &data).unwrap();
    let moving = b.prefetch(0..2 * PAGE as u64, Tier::Nvme);
    rt.clone().shutdown().unwrap();
    assert_eq!(rt.stats().in_flight_moves, 0);
    assert!(
        moving.poll().is_some(),
        "shutdown returned before the move's ticket was told how it ended"
    );
    b.read(0, &mut out).unwrap();
    assert_eq!(out, data);
}

/// A prefetch whose room-making fails (the demotions' writes to NVMe are
/// refused) says so on its own ticket, not as a background failure, and
/// every page stays readable.
#[test]
fn a_prefetch_reports_its_room_making_failures() {
    use strata::io::IoOp;
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::new();
    let engine = Arc::new(FaultEngine::new(engines()[0].1.clone(), plan.clone()));
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 32 * PAGE as u64, PAGE))
        .nvme_engine(engine)
        .background_eviction(false)
        .build()
        .unwrap();
    let a = rt.alloc(4 * PAGE as u64).unwrap();
    let b = rt
        .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    let (da, db) = (pattern(1, 1, 4 * PAGE), pattern(2, 2, 2 * PAGE));
    a.write(0, &da).unwrap();
    b.write(0, &db).unwrap();
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
    // a was just written: the first prefetch is declined; the clock hand
    // has passed a's pages since, so the second must demote them.
    let t = b.prefetch(0..b.len(), Tier::Host);
    t.wait_timeout(std::time::Duration::MAX).unwrap().unwrap();
    assert_eq!(t.declined(), 2);
    plan.fail_all(IoOp::Write, libc::EIO);
    let e = b.prefetch(0..b.len(), Tier::Host).wait().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(e.message().contains("making room"), "{e}");
    plan.clear();
    rt.check().unwrap();
    for (buf, data) in [(&a, &da), (&b, &db)] {
        let mut out = vec![0; data.len()];
        buf.read(0, &mut out).unwrap();
        assert_eq!(&out, data);
    }
}

/// The page moves per link, from `rt.stats()`.
fn link_ops(rt: &Runtime, from: Tier, to: Tier) -> u64 {
    rt.stats()
        .links
        .iter()
        .find(|l| l.from == from && l.to == to)
        .map_or(0, |l| l.stats.ops)
}

#[test]
fn a_promoted_page_keeps_its_clean_copy_and_goes_back_to_it_without_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    let data = pattern(9, 9, 4 * PAGE);
    b.write(0, &data).unwrap();
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
    b.prefetch(0..b.len(), Tier::Host).wait().unwrap();
    let s = rt.stats();
    assert_eq!(s.clean_kept, 4);
    let nvme = s.tiers.iter().find(|t| t.tier == Tier::Nvme).unwrap();
    assert_eq!((nvme.used_pages, nvme.clean_copies), (4, 4));
    // Page 1 is written while in host: its NVMe copy is dropped at once.
    let fresh = pattern(10, 10, 100);
    b.write(PAGE as u64 + 5, &fresh).unwrap();
    let mut expect = data.clone();
    expect[PAGE + 5..PAGE + 105].copy_from_slice(&fresh);
    assert_eq!(rt.stats().clean_invalidated, 1);
    // Back to NVMe: three pages go back to their copies with no write, the
    // written one is written.
    b.evict(0..b.len(), Tier::Nvme).unwrap();
    let s = rt.stats();
    assert_eq!(s.clean_demotions, 3);
    assert_eq!(link_ops(&rt, Tier::Host, Tier::Nvme), 1);
    for p in 0..4 {
        assert_eq!(b.tier_of(p).unwrap(), Some(Tier::Nvme));
    }
    let mut out = vec![0; expect.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, expect, "no stale copy was served");
    // A writable pin drops the copy too (its holder may write); a
    // read-only one keeps it.
    let pin = b.pin_read(0..PAGE as u64, Tier::Host).unwrap();
    drop(pin);
    let pin = b.pin(PAGE as u64..2 * PAGE as u64, Tier::Host).unwrap();
    drop(pin);
    b.evict(0..2 * PAGE as u64, Tier::Nvme).unwrap();
    assert_eq!(rt.stats().clean_demotions, 4, "the read-only pin kept it");
    assert_eq!(
        link_ops(&rt, Tier::Host, Tier::Nvme),
        2,
        "the writable one did not"
    );
    b.read(0, &mut out).unwrap();
    assert_eq!(out, expect);
    let s = rt.stats();
    assert_eq!(s.tiers.iter().map(|t| t.clean_copies).sum::<u64>(), 0);
}

#[test]
fn clean_copies_give_their_room_to_the_tier_that_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 8);
    let nvme = |rt: &Runtime| {
        let s = rt.stats();
        let t = s
            .tiers
            .iter()
            .find(|t| t.tier == Tier::Nvme)
            .unwrap()
            .clone();
        (t.used_pages, t.clean_copies, t.used_pages + t.free_pages)
    };
    // As many pages as NVMe holds, written there and promoted into device
    // and host memory (8 slots): every NVMe slot is a clean copy.
    let cap = nvme(&rt).2 as usize;
    assert!((5..=8).contains(&cap), "{cap}");
    let a = rt
        .alloc_with((cap * PAGE) as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    let data = pattern(3, 3, cap * PAGE);
    a.write(0, &data).unwrap();
    a.prefetch(0..4 * PAGE as u64, Tier::Device).wait().unwrap();
    a.prefetch(4 * PAGE as u64..a.len(), Tier::Host)
        .wait()
        .unwrap();
    assert_eq!(nvme(&rt), (cap as u32, cap as u64, cap as u32));
    // A second buffer's first writes: what device, host and CXL have left
    // takes some, NVMe's clean copies give their slots for the rest, one
    // each.
    let free_elsewhere = 12 - cap;
    let b = rt.alloc(8 * PAGE as u64).unwrap();
    let more = pattern(4, 4, 8 * PAGE);
    b.write(0, &more).unwrap();
    let dropped = 8 - free_elsewhere;
    assert_eq!(rt.stats().clean_dropped, dropped as u64);
    assert_eq!(nvme(&rt), (cap as u32, (cap - dropped) as u64, cap as u32));
    let mut out = vec![0; data.len()];
    a.read(0, &mut out).unwrap();
    assert_eq!(out, data, "a dropped copy loses nothing");
    let mut out = vec![0; more.len()];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, more);
}

#[test]
fn promotions_count_as_paid_when_their_page_is_read_before_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), engines()[0].1.clone(), 32);
    let b = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let data = pattern(5, 1, 4 * PAGE);
    b.write(0, &data).unwrap();
    b.prefetch(0..b.len(), Tier::Device).wait().unwrap();
    // Two of the four are read in device memory, then all leave.
    let mut out = vec![0; 10];
    b.read(3, &mut out).unwrap();
    b.read(2 * PAGE as u64, &mut out).unwrap();
    let s = rt.stats();
    assert_eq!(
        (s.promotions_paid, s.promotions_unpaid),
        (0, 0),
        "none left yet"
    );
    b.evict(0..b.len(), Tier::Host).unwrap();
    let s = rt.stats();
    assert_eq!((s.promotions_paid, s.promotions_unpaid), (2, 2));
    // Back up and out again unread: two more that did not pay.
    b.prefetch(0..2 * PAGE as u64, Tier::Device).wait().unwrap();
    b.evict(0..b.len(), Tier::Host).unwrap();
    let s = rt.stats();
    assert_eq!((s.promotions_paid, s.promotions_unpaid), (2, 4));
}

/// A caller may hand strata its own memory back — a pinned page's address
/// as `read`'s destination or `write`'s source, what a DLPack view of a pin
/// is — in host memory and in the simulated device's: the bytes go through
/// a copy, and every byte reads back as written.
#[test]
fn reads_and_writes_through_memory_the_runtime_lent_out() {
    let rt = sim_and_host(4, 4);
    let b = rt.alloc(2 * PAGE as u64).unwrap();
    let data = pattern(5, 5, 2 * PAGE);
    for tier in [Tier::Device, Tier::Host] {
        b.write(0, &data).unwrap();
        let pin = b.pin(0..PAGE as u64, tier).unwrap();
        let addr = pin.addresses()[0];
        assert!(
            b.overlaps_runtime_memory(addr as *const u8, PAGE),
            "{tier:?}"
        );
        // SAFETY: the pin keeps page 0 where it is while the guard lives;
        // this test is the only user of the page's memory meanwhile.
        let page = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, PAGE) };
        // Page 0 read into its own memory, and written from it.
        b.read(0, page).unwrap();
        assert_eq!(page, &data[..PAGE], "{tier:?}");
        b.write(0, page).unwrap();
        // Page 1 read into page 0's memory: page 0 now holds its bytes.
        b.read(PAGE as u64, page).unwrap();
        drop(pin);
        let mut back = vec![0u8; 2 * PAGE];
        b.read(0, &mut back).unwrap();
        assert_eq!(&back[..PAGE], &data[PAGE..], "{tier:?}");
        assert_eq!(&back[PAGE..], &data[PAGE..], "{tier:?}");
    }
}

/// A device map may outlive its buffer: a launch running when the buffer
/// is dropped keeps the pages until it ends, then they are freed (the
/// capacity back for other buffers), and the map starts no more launches.
#[test]
fn a_device_map_outliving_its_buffer_frees_the_pages_when_its_launch_ends() {
    let rt = sim_and_host(4, 4);
    let used = |rt: &Runtime| rt.stats().tiers.iter().map(|t| t.used_pages).sum::<u32>();
    let b = rt.alloc(3 * PAGE as u64).unwrap();
    b.write(0, &pattern(6, 6, 3 * PAGE)).unwrap();
    let map = b.device_map().unwrap();
    let launch = map.prepare(Access::ReadOnly).unwrap();
    drop(b);
    assert_eq!(used(&rt), 3, "the running launch keeps its pages");
    assert_eq!(
        map.prepare(Access::ReadOnly).unwrap_err().kind(),
        ErrorKind::Closed,
        "no launch starts once the buffer is gone"
    );
    drop(launch);
    assert_eq!(used(&rt), 0, "freed when the launch ends");
    assert_eq!(
        map.prepare(Access::ReadOnly).unwrap_err().kind(),
        ErrorKind::Closed
    );
    // The whole capacity is back for another buffer.
    let c = rt.alloc(8 * PAGE as u64).unwrap();
    c.write(0, &vec![7u8; 8 * PAGE]).unwrap();
    drop(map);
}

/// A binding's handle to a buffer may end while pins made from it keep the
/// buffer alive: `close_launches` ends its device maps' launches then,
/// while the pins, reads and writes go on and the pages stay.
#[test]
fn launches_closed_leave_pins_reads_and_pages_as_they_were() {
    let rt = sim_and_host(4, 4);
    let b = Arc::new(rt.alloc(2 * PAGE as u64).unwrap());
    let data = pattern(2, 7, 2 * PAGE);
    b.write(0, &data).unwrap();
    let pin = b.pin_owned(0..PAGE as u64, Tier::Host).unwrap();
    let map = b.device_map().unwrap();
    let running = map.prepare(Access::ReadOnly).unwrap();
    b.close_launches();
    assert_eq!(
        map.prepare(Access::ReadOnly).unwrap_err().kind(),
        ErrorKind::Closed
    );
    drop(running);
    let mut back = vec![0u8; 2 * PAGE];
    b.read(0, &mut back).unwrap();
    assert_eq!(back, data, "the last launch's end freed nothing");
    // SAFETY: the pin keeps its page's host memory in place.
    let pinned = unsafe { std::slice::from_raw_parts(pin.addresses()[0] as *const u8, PAGE) };
    assert_eq!(pinned, &data[..PAGE]);
    drop(pin);
    b.write(0, &[9u8; 4]).unwrap();
}

/// A prefetch that finds no room because the tiers below are full is short
/// of capacity (its ticket's error), not declined: declining is for
/// victims valued more than the prefetch, and here none could go anywhere.
#[test]
fn a_prefetch_with_the_tiers_below_full_is_out_of_capacity_not_declined() {
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 4 * PAGE as u64)
        .host(2 * PAGE as u64)
        .cxl(CxlConfig::new(CxlMode::Emulated, 2 * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap();
    let a = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let a_data = pattern(5, 6, 4 * PAGE);
    a.write(0, &a_data).unwrap();
    let c = rt
        .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Cxl))
        .unwrap();
    c.write(0, &vec![9u8; 2 * PAGE]).unwrap();
    assert_eq!(a.tier_of(0).unwrap(), Some(Tier::Host));
    assert_eq!(a.tier_of(2).unwrap(), Some(Tier::Device));
    // Twice: the second after the clock hand has passed a's DRAM pages.
    for _ in 0..2 {
        let t = a.prefetch(2 * PAGE as u64..3 * PAGE as u64, Tier::Host);
        let e = t
            .wait_timeout(std::time::Duration::from_secs(60))
            .expect("the prefetch ends")
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfCapacity, "{e}");
        assert_eq!(t.declined(), 0);
    }
    assert_eq!(rt.stats().prefetches_declined, 0);
    let mut back = vec![0u8; 4 * PAGE];
    a.read(0, &mut back).unwrap();
    assert_eq!(back, a_data);
}

/// A launch over pages on NVMe when memory is full and NVMe's every slot
/// is taken, some by clean copies of the pages in memory: demoting those
/// pages onto their copies makes the room, with no I/O and no free slot.
#[test]
fn a_launch_makes_room_over_clean_copies_when_nvme_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(2 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 4 * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap();
    let a = rt.alloc(2 * PAGE as u64).unwrap();
    a.write(0, &[1; 2 * PAGE]).unwrap();
    a.evict(0..a.len(), Tier::Nvme).unwrap();
    // Back in host memory, each keeping its NVMe copy.
    a.prefetch(0..a.len(), Tier::Host).wait().unwrap();
    assert_eq!(rt.stats().tiers.last().unwrap().clean_copies, 2);
    let b = rt.alloc(2 * PAGE as u64).unwrap();
    b.write(0, &[2; 2 * PAGE]).unwrap();
    assert_eq!(
        (0..2).map(|p| b.tier_of(p).unwrap()).collect::<Vec<_>>(),
        [Some(Tier::Nvme); 2]
    );
    let map = b.device_map().unwrap();
    let launch = map.prepare(Access::ReadOnly).unwrap();
    assert_eq!(launch.load::<u8>(PAGE as u64), 2);
    drop(launch);
    let mut out = vec![0; 2 * PAGE];
    a.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 1));
}
