//! Write/read round trips on random pages, one body run against every store
//! and engine.

mod common;

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use strata::io::AlignedBuf;
use strata::sys::Topology;
use strata::tier::{
    CxlConfig, CxlMode, CxlStore, HostConfig, HostStore, NvmeConfig, NvmeStore, PageStore, Slot,
};
use strata::ErrorKind;

use common::{engines, pattern};

/// Fills the store, rewrites random pages over several rounds, and checks
/// every page against what was last written to it.
fn random_round_trip(store: &dyn PageStore, seed: u64) {
    let page = store.page_size();
    let n = store.capacity_pages();
    let mut slots: Vec<Slot> = (0..n).map(|_| store.alloc().unwrap()).collect();
    assert_eq!(store.alloc().unwrap_err().kind(), ErrorKind::OutOfCapacity);
    let mut written = vec![0u32; n as usize];
    for (i, s) in slots.iter_mut().enumerate() {
        store.write_page(s, &pattern(i as u32, 0, page)).unwrap();
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut out = vec![0u8; page];
    for round in 1..200u32 {
        let i = rng.random_range(0..n) as usize;
        if rng.random_bool(0.5) {
            store
                .write_page(&mut slots[i], &pattern(i as u32, round, page))
                .unwrap();
            written[i] = round;
        } else {
            store.read_page(&slots[i], &mut out).unwrap();
            assert_eq!(
                out,
                pattern(i as u32, written[i], page),
                "page {i} (seed {seed})"
            );
        }
    }
    for (i, s) in slots.iter().enumerate() {
        store.read_page(s, &mut out).unwrap();
        assert_eq!(
            out,
            pattern(i as u32, written[i], page),
            "page {i} (seed {seed})"
        );
    }
    for s in slots {
        store.free(s).unwrap();
    }
    assert_eq!(store.used_pages(), 0);
}

#[test]
fn host_store_round_trip() {
    for page in [4096, 65536, 2 << 20] {
        let s = HostStore::new(&HostConfig::new(16 * page as u64, page)).unwrap();
        random_round_trip(&s, page as u64);
    }
}

#[test]
fn emulated_cxl_store_round_trip() {
    let mut cfg = CxlConfig::new(CxlMode::Emulated, 32 * 16384, 16384);
    cfg.bandwidth = Some(10e9);
    let s = CxlStore::new(&cfg, &Topology::default()).unwrap();
    assert!(s.emulated());
    random_round_trip(&s, 3);
}

#[test]
fn nvme_store_round_trip_on_every_engine() {
    for (name, engine) in engines() {
        for page in [4096, 65536] {
            let dir = tempfile::tempdir().unwrap();
            let s = NvmeStore::with_engine(
                &NvmeConfig::new(dir.path(), 24 * page as u64, page),
                engine.clone(),
            )
            .unwrap();
            assert_eq!(s.engine().name(), name);
            random_round_trip(&s, page as u64 + 7);
            let st = s.stats();
            assert!(st.reads > 0 && st.writes > 0 && st.errors == 0, "{st:?}");
        }
    }
}

/// The batched session API at full depth, from several threads at once:
/// every page read back verifies against what its thread wrote.
#[test]
fn nvme_sessions_from_many_threads() {
    for (_, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            NvmeStore::with_engine(&NvmeConfig::new(dir.path(), 256 * 4096, 4096), engine).unwrap(),
        );
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut session = store.session_with_depth(8).unwrap();
                    let slots: Vec<Slot> = (0..32).map(|_| store.alloc().unwrap()).collect();
                    let mut done = Vec::new();
                    // Write all 32 pages, at most 8 in flight.
                    let mut pending: Vec<(usize, Slot)> = slots.into_iter().enumerate().collect();
                    let mut back: Vec<Option<Slot>> = (0..32).map(|_| None).collect();
                    while !pending.is_empty() || session.in_flight() > 0 {
                        while session.in_flight() < session.depth() {
                            let Some((i, slot)) = pending.pop() else {
                                break;
                            };
                            let mut buf = AlignedBuf::new(4096).unwrap();
                            buf.copy_from_slice(&pattern(t * 100 + i as u32, 0, 4096));
                            session.submit_write(slot, buf, i as u64).unwrap();
                        }
                        session.reap(1, &mut done).unwrap();
                        for c in done.drain(..) {
                            c.result.unwrap();
                            back[c.tag as usize] = Some(c.slot);
                        }
                    }
                    // Read them back the same way.
                    let mut pending: Vec<(usize, Slot)> =
                        back.into_iter().map(Option::unwrap).enumerate().collect();
                    let mut freed = 0;
                    while !pending.is_empty() || session.in_flight() > 0 {
                        while session.in_flight() < session.depth() {
                            let Some((i, slot)) = pending.pop() else {
                                break;
                            };
                            session
                                .submit_read(slot, AlignedBuf::new(4096).unwrap(), i as u64)
                                .unwrap();
                        }
                        session.reap(1, &mut done).unwrap();
                        for c in done.drain(..) {
                            c.result.unwrap();
                            assert_eq!(&c.buf[..], &pattern(t * 100 + c.tag as u32, 0, 4096)[..]);
                            store.free(c.slot).unwrap();
                            freed += 1;
                        }
                    }
                    assert_eq!(freed, 32);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(store.used_pages(), 0);
    }
}

/// io_uring sessions register the file and the store's buffer pool (what
/// lets reads and writes of pool buffers take the READ_FIXED/WRITE_FIXED
/// path; the round-trip tests above check the data that path moves).
#[test]
fn uring_sessions_register_the_file_and_the_buffer_pool() {
    let Ok(engine) = strata::io::engine(strata::io::EngineChoice::Uring) else {
        assert!(
            std::env::var_os("STRATA_REQUIRE_URING").is_none(),
            "io_uring required"
        );
        eprintln!("skipping: io_uring unavailable");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = std::sync::Arc::new(tempfile::tempfile_in(dir.path()).unwrap());
    let pool = strata::lowlevel::BufPool::new(4096, 4).unwrap();
    let q = strata::io::IoQueue::new(&*engine, &file, 4, Some(&pool)).unwrap();
    let (files, buffers) = q.registered();
    assert!(files, "registered file");
    if !buffers {
        // Registration pins memory against RLIMIT_MEMLOCK; without root a
        // low limit refuses it and the engine falls back (and says so here).
        assert!(
            std::env::var_os("STRATA_REQUIRE_URING").is_none(),
            "buffer registration refused"
        );
        eprintln!("skipping: buffer registration refused (memlock limit)");
    }
}

#[test]
fn session_refuses_what_it_cannot_take_and_hands_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let a = NvmeStore::new(&NvmeConfig::new(dir.path(), 4 * 4096, 4096)).unwrap();
    let b = NvmeStore::new(&NvmeConfig::new(dir.path(), 4 * 4096, 4096)).unwrap();
    let foreign = b.alloc().unwrap();
    let mut s = a.session_with_depth(1).unwrap();
    let r = s
        .submit_read(foreign, AlignedBuf::new(4096).unwrap(), 0)
        .unwrap_err();
    assert_eq!(r.error.kind(), ErrorKind::InvalidArgument);
    b.free(r.slot).unwrap();
    let slot = a.alloc().unwrap();
    let r = s
        .submit_write(slot, AlignedBuf::new(8192).unwrap(), 0)
        .unwrap_err();
    assert!(r.error.message().contains("a page is 4096"), "{}", r.error);
    a.free(r.slot).unwrap();
}
