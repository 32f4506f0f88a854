//! Fault injection under the NVMe store: short transfers, EINTR, EIO,
//! ENOSPC and flipped bits each give their typed error (or are absorbed),
//! and nothing acknowledged is lost.

mod common;

use std::sync::Arc;

use strata::io::fault::{Fault, FaultEngine, FaultPlan};
use strata::io::{AlignedBuf, IoEngine, IoOp};
use strata::tier::{NvmeConfig, NvmeStore, PageStore};
use strata::ErrorKind;

use common::{engines, pattern};

const PAGE: usize = 16384;

fn faulty(engine: &Arc<dyn IoEngine>, dir: &std::path::Path) -> (NvmeStore, Arc<FaultPlan>) {
    let plan = FaultPlan::new();
    let engine: Arc<dyn IoEngine> = Arc::new(FaultEngine::new(engine.clone(), plan.clone()));
    let store =
        NvmeStore::with_engine(&NvmeConfig::new(dir, 16 * PAGE as u64, PAGE), engine).unwrap();
    (store, plan)
}

#[test]
fn short_transfers_and_eintr_are_completed_transparently() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slot = s.alloc().unwrap();
        plan.inject(IoOp::Write, 0, Fault::Short(4096));
        plan.inject(IoOp::Write, 0, Fault::Errno(libc::EINTR));
        s.write_page(&mut slot, &pattern(1, 1, PAGE)).unwrap();
        plan.inject(IoOp::Read, 0, Fault::Short(8192));
        plan.inject(IoOp::Read, 1, Fault::Errno(libc::EAGAIN));
        let mut out = vec![0; PAGE];
        s.read_page(&slot, &mut out).unwrap();
        assert_eq!(out, pattern(1, 1, PAGE), "{name}");
        assert_eq!(plan.injected(), 4, "{name}: every fault fired");
        s.free(slot).unwrap();
    }
}

#[test]
fn read_errors_are_typed_and_the_page_survives() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slot = s.alloc().unwrap();
        s.write_page(&mut slot, &pattern(2, 0, PAGE)).unwrap();
        let mut out = vec![0; PAGE];

        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let e = s.read_page(&slot, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert_eq!(e.raw_os_error(), Some(libc::EIO));

        plan.inject(IoOp::Read, 0, Fault::FlipBit);
        let e = s.read_page(&slot, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");

        // The fault was in transit: the acknowledged page is still intact.
        s.read_page(&slot, &mut out).unwrap();
        assert_eq!(out, pattern(2, 0, PAGE), "{name}");
        assert_eq!(s.stats().corrupted, 1);
        s.free(slot).unwrap();
    }
}

#[test]
fn failed_replacement_keeps_the_previous_copy() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slot = s.alloc().unwrap();
        s.write_page(&mut slot, &pattern(3, 0, PAGE)).unwrap();
        let before = slot.index();
        let mut out = vec![0; PAGE];

        for (errno, kind) in [
            (libc::ENOSPC, ErrorKind::NoSpace),
            (libc::EIO, ErrorKind::Io),
        ] {
            plan.inject(IoOp::Write, 0, Fault::Errno(errno));
            let e = s.replace(&mut slot, &pattern(3, 1, PAGE)).unwrap_err();
            assert_eq!(e.kind(), kind, "{name}: {e}");
            assert_eq!(
                slot.index(),
                before,
                "{name}: the slot still names the old copy"
            );
            s.read_page(&slot, &mut out).unwrap();
            assert_eq!(out, pattern(3, 0, PAGE), "{name}: acknowledged data lost");
            assert_eq!(s.used_pages(), 1, "{name}: the fresh slot was returned");
        }

        // A write whose bits flip on the way to the medium is caught on read,
        // never returned as data.
        plan.inject(IoOp::Write, 0, Fault::FlipBit);
        s.replace(&mut slot, &pattern(3, 2, PAGE)).unwrap();
        assert_eq!(
            s.read_page(&slot, &mut out).unwrap_err().kind(),
            ErrorKind::Corrupted
        );

        // And a clean replacement works.
        s.replace(&mut slot, &pattern(3, 3, PAGE)).unwrap();
        s.read_page(&slot, &mut out).unwrap();
        assert_eq!(out, pattern(3, 3, PAGE));
        s.free(slot).unwrap();
    }
}

#[test]
fn a_dead_disk_fails_every_operation_and_returns_no_data() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slots: Vec<_> = (0..4).map(|_| s.alloc().unwrap()).collect();
        for (i, slot) in slots.iter_mut().enumerate() {
            s.write_page(slot, &pattern(i as u32, 0, PAGE)).unwrap();
        }
        plan.fail_all(IoOp::Read, libc::EIO);
        plan.fail_all(IoOp::Write, libc::EIO);
        // Batched: every completion carries its own error.
        let mut session = s.session_with_depth(4).unwrap();
        for (i, slot) in slots.drain(..).enumerate() {
            session
                .submit_read(slot, AlignedBuf::new(PAGE).unwrap(), i as u64)
                .unwrap();
        }
        let mut done = Vec::new();
        session.reap(4, &mut done).unwrap();
        assert_eq!(done.len(), 4);
        for c in &done {
            assert_eq!(
                c.result.as_ref().unwrap_err().kind(),
                ErrorKind::Io,
                "{name}"
            );
        }
        // Writes fail too, batched — and copy-then-commit writes keep the
        // acknowledged copies untouched.
        let mut fresh: Vec<_> = (0..2).map(|_| s.alloc().unwrap()).collect();
        for (i, slot) in fresh.drain(..).enumerate() {
            session
                .submit_write(slot, s.buffer().unwrap(), 100 + i as u64)
                .unwrap();
        }
        let mut wrote = Vec::new();
        session.reap(2, &mut wrote).unwrap();
        assert_eq!(wrote.len(), 2, "{name}");
        for c in wrote {
            assert_eq!(
                c.result.as_ref().unwrap_err().kind(),
                ErrorKind::Io,
                "{name}"
            );
            s.free(c.slot).unwrap();
        }
        for c in done.iter_mut() {
            let e = s.write_page(&mut c.slot, &pattern(9, 9, PAGE)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{name}");
        }
        drop(session);
        // The disk comes back: everything acknowledged is still there.
        plan.clear();
        let mut out = vec![0; PAGE];
        for c in done {
            s.read_page(&c.slot, &mut out).unwrap();
            assert_eq!(out, pattern(c.tag as u32, 0, PAGE), "{name}");
            s.free(c.slot).unwrap();
        }
    }
}

/// The batched session path, on the threaded psync pool and on io_uring with
/// registered buffers: short transfers are completed, a flipped bit is
/// caught, and the other requests of the batch are unaffected.
#[test]
fn session_batches_absorb_short_transfers_and_catch_flipped_bits() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut session = s.session_with_depth(4).unwrap();
        let slots: Vec<_> = (0..4).map(|_| s.alloc().unwrap()).collect();
        plan.inject(IoOp::Write, 1, Fault::Short(4096));
        for (i, slot) in slots.into_iter().enumerate() {
            let mut buf = s.buffer().unwrap();
            buf.copy_from_slice(&pattern(i as u32, 5, PAGE));
            session.submit_write(slot, buf, i as u64).unwrap();
        }
        let mut done = Vec::new();
        session.reap(4, &mut done).unwrap();
        assert!(done.iter().all(|c| c.result.is_ok()), "{name}");
        plan.inject(IoOp::Read, 2, Fault::FlipBit);
        plan.inject(IoOp::Read, 0, Fault::Short(8192));
        for c in done.drain(..) {
            session
                .submit_read(c.slot, s.buffer().unwrap(), c.tag)
                .unwrap();
        }
        let mut read = Vec::new();
        session.reap(4, &mut read).unwrap();
        assert_eq!(read.len(), 4, "{name}");
        let corrupted = read
            .iter()
            .filter(|c| matches!(&c.result, Err(e) if e.kind() == ErrorKind::Corrupted))
            .count();
        assert_eq!(corrupted, 1, "{name}: exactly the flipped read is caught");
        for c in read.iter().filter(|c| c.result.is_ok()) {
            assert_eq!(&c.buf[..], &pattern(c.tag as u32, 5, PAGE)[..], "{name}");
        }
        assert_eq!(plan.injected(), 3, "{name}");
        drop(session);
        for c in read {
            s.free(c.slot).unwrap();
        }
    }
}

/// Dropping a session with requests in flight waits for them (the kernel
/// may still be writing into their buffers) and leaves the store usable.
#[test]
fn dropping_a_busy_session_drains_it() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _plan) = faulty(&engine, dir.path());
        let mut keep = s.alloc().unwrap();
        s.write_page(&mut keep, &pattern(7, 7, PAGE)).unwrap();
        let mut session = s.session_with_depth(8).unwrap();
        for i in 0..8 {
            let slot = s.alloc().unwrap();
            session.submit_write(slot, s.buffer().unwrap(), i).unwrap();
        }
        assert_eq!(session.in_flight(), 8);
        drop(session);
        let mut out = vec![0; PAGE];
        s.read_page(&keep, &mut out).unwrap();
        assert_eq!(out, pattern(7, 7, PAGE), "{name}");
    }
}

#[test]
fn end_of_file_is_an_error_not_a_hang() {
    // A read past the end of the laid-out file returns 0 bytes: the queue
    // must report it rather than retry forever.
    let dir = tempfile::tempdir().unwrap();
    let f = std::sync::Arc::new(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("small"))
            .unwrap(),
    );
    for (name, engine) in engines() {
        let mut q = strata::io::IoQueue::new(&*engine, &f, 2, None).unwrap();
        let c = q
            .run(strata::io::IoRequest {
                op: IoOp::Read,
                offset: 1 << 20,
                buf: AlignedBuf::new(4096).unwrap(),
                tag: 9,
            })
            .unwrap();
        let e = c.result.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}");
        assert!(e.message().contains("end of file"), "{name}: {e}");
    }
}

/// A small read of a large page reads only the sectors it covers, each
/// verified by its own checksum: a flipped bit in transit is `Corrupted`,
/// never returned; a never-written or torn slot is refused as a whole-page
/// read would be; and the bytes match a whole-page read.
#[test]
fn range_reads_read_and_verify_only_their_sectors() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slot = s.alloc().unwrap();
        let data = pattern(4, 4, PAGE);
        s.write_page(&mut slot, &data).unwrap();
        let before = s.stats().bytes_read;
        // 100 bytes across the boundary of sectors 1 and 2: two sectors read.
        let mut out = vec![0; 100];
        s.read_range(&slot, 2 * 4096 - 50, &mut out).unwrap();
        assert_eq!(out, data[2 * 4096 - 50..2 * 4096 + 50], "{name}");
        assert_eq!(
            s.stats().bytes_read - before,
            8192,
            "{name}: two sectors, not the page"
        );
        let mut small = vec![0; 4096];
        s.read_range(&slot, 3 * 4096, &mut small).unwrap();
        assert_eq!(small, data[3 * 4096..], "{name}");

        plan.inject(IoOp::Read, 0, Fault::FlipBit);
        let e = s.read_range(&slot, 4096, &mut small).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        s.read_range(&slot, 4096, &mut small).unwrap();
        assert_eq!(small, data[4096..2 * 4096], "{name}");

        // A failed rewrite leaves the old copy readable by range too.
        plan.inject(IoOp::Write, 0, Fault::Errno(libc::EIO));
        assert!(s.write_page(&mut slot, &pattern(5, 5, PAGE)).is_err());
        s.read_range(&slot, 0, &mut small).unwrap();
        assert_eq!(small, data[..4096], "{name}");
        // A page rewritten: its new sectors' checksums hold.
        let new = pattern(6, 6, PAGE);
        s.write_page(&mut slot, &new).unwrap();
        s.read_range(&slot, 4096 + 8, &mut out).unwrap();
        assert_eq!(out, new[4096 + 8..4096 + 108], "{name}");
        let fresh = s.alloc().unwrap();
        assert!(
            s.read_range(&fresh, 0, &mut out).is_err(),
            "{name}: never written"
        );
        s.free(slot).unwrap();
        s.free(fresh).unwrap();
    }
}

/// A write the engine broke under (it could wait neither for the write
/// nor, afterwards, for the queue) may still land: its slot is never
/// handed out again, so no later page is overwritten by it. The page a
/// failed copy-then-commit write was replacing keeps its copy.
#[test]
fn a_slot_under_a_write_the_engine_lost_is_never_reused() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let old = pattern(1, 1, PAGE);
        let mut kept = s.alloc().unwrap();
        s.write_new(&mut kept, &old).unwrap();
        let mut lost = s.alloc().unwrap();
        plan.fail_waits(libc::EIO);
        let e = s.write_new(&mut lost, &pattern(2, 2, PAGE)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        // So is a copy-then-commit write: the page keeps its old copy.
        let e = s.write_page(&mut kept, &pattern(3, 3, PAGE)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        plan.clear();
        // The caller frees the slot of its failed write, as the runtime does.
        let index = lost.index();
        s.free(lost).unwrap();
        let mut out = vec![0; PAGE];
        s.read_page(&kept, &mut out).unwrap();
        assert_eq!(out, old, "{name}");
        // The reserve slot the lost copy-then-commit write took is kept out
        // of use too, as an ordinary slot: the reserve is whole again, and
        // the page can be rewritten at once.
        s.write_page(&mut kept, &pattern(4, 4, PAGE)).unwrap();
        s.read_page(&kept, &mut out).unwrap();
        assert_eq!(out, pattern(4, 4, PAGE), "{name}");
        // 16 pages, one in reserve: 15 ordinary, one holds `kept`, and the
        // two abandoned ones never come back.
        let mut more = Vec::new();
        while let Ok(slot) = s.alloc() {
            assert_ne!(slot.index(), index, "{name}: the abandoned slot came back");
            more.push(slot);
        }
        assert_eq!(more.len(), 12, "{name}");
    }
}

/// A caller that keeps the slot of a write the engine lost and writes the
/// page again: in place is refused (the lost write may still land on it),
/// copy-then-commit writes a fresh slot and keeps the abandoned one out of
/// use for good.
#[test]
fn a_rewrite_of_a_slot_under_a_lost_write_moves_the_page() {
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty(&engine, dir.path());
        let mut slot = s.alloc().unwrap();
        let abandoned = slot.index();
        plan.fail_waits(libc::EIO);
        s.write_new(&mut slot, &pattern(1, 1, PAGE)).unwrap_err();
        plan.clear();
        let e = s.write_new(&mut slot, &pattern(1, 2, PAGE)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name}: {e}");
        s.write_page(&mut slot, &pattern(1, 3, PAGE)).unwrap();
        assert_ne!(slot.index(), abandoned, "{name}");
        let mut out = vec![0; PAGE];
        s.read_page(&slot, &mut out).unwrap();
        assert_eq!(out, pattern(1, 3, PAGE), "{name}");
        let mut more = Vec::new();
        while let Ok(x) = s.alloc() {
            assert_ne!(x.index(), abandoned, "{name}: the abandoned slot came back");
            more.push(x);
        }
        // 15 ordinary: the page's slot and the abandoned one are taken.
        assert_eq!(more.len(), 13, "{name}");
    }
}

/// A settled queue takes new requests; one that failed to settle hands
/// them back instead of starting them.
#[test]
fn a_settled_queue_runs_again_and_a_failed_one_refuses() {
    use strata::io::{IoQueue, IoRequest};
    let read = |tag| IoRequest {
        op: IoOp::Read,
        offset: 0,
        buf: AlignedBuf::new(4096).unwrap(),
        tag,
    };
    for (name, engine) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        file.set_len(1 << 20).unwrap();
        let file = Arc::new(file);
        let plan = FaultPlan::new();
        let faulty = FaultEngine::new(engine.clone(), plan.clone());
        let mut q = IoQueue::new(&faulty, &file, 1, None).unwrap();
        q.push(read(1)).unwrap();
        assert!(q.settle(), "{name}");
        q.run(read(2)).unwrap();
        q.push(read(3)).unwrap();
        plan.fail_waits(libc::EIO);
        assert!(!q.settle(), "{name}");
        plan.clear();
        assert!(q.push(read(4)).is_err(), "{name}");
    }
}

#[test]
fn an_nvme_tier_of_one_page_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let e = NvmeStore::new(&NvmeConfig::new(dir.path(), PAGE as u64, PAGE)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    NvmeStore::new(&NvmeConfig::new(dir.path(), 2 * PAGE as u64, PAGE)).unwrap();
}
