//! I/O failures of the NVMe tier seen end to end, through `Runtime` and
//! `Buffer`: a failing or corrupted read, a failing write and a failing
//! background move each give their typed error, the caller never gets wrong
//! bytes, and every byte acknowledged before the failure reads back once
//! the fault is gone. tests/faults.rs checks the same at the store level.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use strata::io::fault::{Fault, FaultEngine, FaultPlan};
use strata::io::{IoEngine, IoOp};
use strata::runtime::{Buffer, Placement, Residency};
use strata::tier::NvmeConfig;
use strata::{ErrorKind, Runtime, Tier};

use common::{engines, pattern};

/// Four 4 KiB sectors a page, so that small reads are served from single
/// sectors (each with its own checksum) and whole reads from the page's.
const PAGE: usize = 16 << 10;

/// A directory on a filesystem with O_DIRECT (tmpfs has none).
fn nvme_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("strata-io-failures")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// A host tier of `host_pages` and a 32-page NVMe tier in `dir` over
/// `engine`; no device tier and no background eviction, so pages stay
/// where the test puts them.
fn runtime(dir: &Path, engine: Arc<dyn IoEngine>, host_pages: u64) -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .host(host_pages * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 32 * PAGE as u64, PAGE))
        .nvme_engine(engine)
        .background_eviction(false)
        .build()
        .unwrap()
}

/// [`runtime`] over a fault-injecting wrapper of `engine`.
fn faulty(dir: &Path, engine: &Arc<dyn IoEngine>, host_pages: u64) -> (Runtime, Arc<FaultPlan>) {
    let plan = FaultPlan::new();
    let engine: Arc<dyn IoEngine> = Arc::new(FaultEngine::new(engine.clone(), plan.clone()));
    (runtime(dir, engine, host_pages), plan)
}

/// A buffer holding `data`, written straight to NVMe.
fn on_nvme(rt: &Runtime, data: &[u8]) -> Buffer {
    let b = rt
        .alloc_with(data.len() as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    b.write(0, data).unwrap();
    assert_eq!(
        b.residency().in_tier(Tier::Nvme),
        b.page_count() as u64,
        "setup: every page on NVMe"
    );
    b
}

/// What a user can observe of a buffer without reading it, and of the
/// runtime's NVMe tier.
#[derive(Debug, PartialEq)]
struct Observed {
    residency: Residency,
    tiers: Vec<Option<Tier>>,
    nvme_used: u32,
    pinned: u64,
    lost_pages: u64,
}

fn observe(rt: &Runtime, b: &Buffer) -> Observed {
    let s = rt.stats();
    let nvme = s.tiers.iter().find(|t| t.tier == Tier::Nvme).unwrap();
    Observed {
        residency: b.residency(),
        tiers: (0..b.page_count()).map(|p| b.tier_of(p).unwrap()).collect(),
        nvme_used: nvme.used_pages,
        pinned: s.tiers.iter().map(|t| t.pinned_pages).sum(),
        lost_pages: s.lost_pages,
    }
}

/// The whole buffer, read back.
fn contents(b: &Buffer) -> Vec<u8> {
    let mut out = vec![0; b.len() as usize];
    b.read(0, &mut out).unwrap();
    out
}

/// The private swap file of the NVMe tier made in `dir`, reopened through
/// this process's descriptor of it (it has no name: O_TMPFILE, or created
/// and unlinked at once). Opened without O_DIRECT; the kernel keeps its
/// page cache coherent with the runtime's direct I/O.
fn swap_file(dir: &Path) -> File {
    let mut found = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if target.starts_with(dir) {
            found.push(fd.path());
        }
    }
    assert_eq!(found.len(), 1, "one swap file open in {}", dir.display());
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&found[0])
        .unwrap()
}

/// Flips one bit of byte `at` of the page of the swap file that holds
/// exactly `page` (found by its content: the slot a page takes is the
/// runtime's business).
fn corrupt_on_disk(dir: &Path, page: &[u8], at: usize) {
    let file = swap_file(dir);
    let len = file.metadata().unwrap().len() as usize;
    let mut data = vec![0; len];
    file.read_exact_at(&mut data, 0).unwrap();
    let slots: Vec<usize> = (0..len / PAGE)
        .filter(|&s| &data[s * PAGE..(s + 1) * PAGE] == page)
        .collect();
    assert_eq!(slots.len(), 1, "the page is in exactly one slot on disk");
    let offset = (slots[0] * PAGE + at) as u64;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x04;
    file.write_all_at(&byte, offset).unwrap();
    file.sync_all().unwrap();
}

/// (a) A demand read of an NVMe page whose read fails with EIO returns an
/// `Io` error carrying the errno, changes nothing, and once the fault is
/// gone the page reads as written. Neither a whole-page read nor a small
/// one (served from sectors) fills the caller's buffer with anything but
/// the page's bytes; a foreground error is the caller's, not a background
/// failure for `Runtime::check`.
#[test]
fn a_failed_demand_read_is_an_io_error_and_changes_nothing() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(1, 1, 4 * PAGE);
        let b = on_nvme(&rt, &data);
        let before = observe(&rt, &b);

        // The whole buffer, the second page's read fails.
        plan.inject(IoOp::Read, 1, Fault::Errno(libc::EIO));
        let mut out = vec![0; data.len()];
        let e = b.read(0, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}");
        assert_eq!(plan.injected(), 1, "{name}: the fault fired");
        assert_ne!(
            out[PAGE..2 * PAGE],
            data[PAGE..2 * PAGE],
            "{name}: no data came from a failed read"
        );

        // A small read inside one sector of a page.
        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let mut small = [0u8; 100];
        let e = b.read(2 * PAGE as u64 + 5000, &mut small).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert_eq!(small, [0u8; 100], "{name}: no data came from a failed read");

        assert_eq!(
            observe(&rt, &b),
            before,
            "{name}: a failed read moved nothing"
        );
        rt.check()
            .unwrap_or_else(|e| panic!("{name}: a foreground error is no background failure: {e}"));
        assert_eq!(contents(&b), data, "{name}: acknowledged data intact");
        b.read(2 * PAGE as u64 + 5000, &mut small).unwrap();
        assert_eq!(small[..], data[2 * PAGE + 5000..2 * PAGE + 5100], "{name}");
        // A short transfer is no failure: the rest is read.
        plan.inject(IoOp::Read, 0, Fault::Short(4096));
        let mut page = vec![0; PAGE];
        b.read(3 * PAGE as u64, &mut page).unwrap();
        assert_eq!(page, data[3 * PAGE..], "{name}: after a short read");
        assert_eq!(plan.injected(), 3, "{name}: every fault fired");
        assert_eq!(observe(&rt, &b), before, "{name}");
    }
}

/// (a) The reads a move starts fail the same way: a pin into the host tier
/// whose NVMe read fails pins nothing and leaves the pages on NVMe; a
/// dead disk (every read refused) fails every NVMe read and no host read.
#[test]
fn failed_reads_under_a_pin_or_a_dead_disk_leave_every_page_where_it_was() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(2, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        let host_data = pattern(2, 2, PAGE);
        let h = rt
            .alloc_with(PAGE as u64, Placement::Prefer(Tier::Host))
            .unwrap();
        h.write(0, &host_data).unwrap();
        let before = observe(&rt, &b);

        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let e = b.pin(0..b.len(), Tier::Host).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        // The page whose read succeeded may have moved; nothing is pinned,
        // and the page whose read failed is still on NVMe.
        let after = observe(&rt, &b);
        assert_eq!((after.pinned, after.lost_pages), (0, 0), "{name}");
        assert!(
            after.residency.in_tier(Tier::Nvme) >= 1,
            "{name}: {after:?}"
        );
        assert_eq!(contents(&b), data, "{name}");
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        assert_eq!(observe(&rt, &b), before, "{name}");

        plan.fail_all(IoOp::Read, libc::EIO);
        for p in 0..2 {
            let mut out = vec![0; PAGE];
            let e = b.read((p * PAGE) as u64, &mut out).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{name}: page {p}: {e}");
        }
        assert_eq!(contents(&h), host_data, "{name}: host pages need no disk");
        plan.clear();

        assert_eq!(observe(&rt, &b), before, "{name}");
        assert_eq!(contents(&b), data, "{name}: acknowledged data intact");
        let pin = b.pin(0..b.len(), Tier::Host).unwrap();
        drop(pin);
        assert_eq!(contents(&b), data, "{name}");
    }
}

/// (b) A page whose bytes changed on the medium (one bit flipped in the
/// swap file behind the runtime's back) reads as `Corrupted`, never as the
/// flipped bytes: whole, through a small read of the damaged sector, and
/// through a prefetch. Its intact sectors and the other pages still read;
/// a partial write cannot merge into it and is refused; a whole-page write
/// replaces it.
#[test]
fn a_page_corrupted_on_disk_is_never_returned_as_data() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let rt = runtime(dir.path(), engine, 4);
        let data = pattern(3, 1, 3 * PAGE);
        let b = on_nvme(&rt, &data);
        let before = observe(&rt, &b);
        // Byte 5000 of page 1: in its second sector.
        corrupt_on_disk(dir.path(), &data[PAGE..2 * PAGE], 5000);
        let mut bad = data[PAGE..2 * PAGE].to_vec();
        bad[5000] ^= 0x04;

        let mut out = vec![0; data.len()];
        let e = b.read(0, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert!(e.message().contains("checksum"), "{name}: {e}");
        assert_ne!(
            out[PAGE..2 * PAGE],
            bad[..],
            "{name}: the flipped bytes came out"
        );
        let mut page = vec![0; PAGE];
        let e = b.read(PAGE as u64, &mut page).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert_ne!(page, bad, "{name}: the flipped bytes came out");
        let mut small = [0u8; 64];
        let e = b.read(PAGE as u64 + 4990, &mut small).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");

        // The page's first sector is intact: a read of it alone is served.
        b.read(PAGE as u64 + 100, &mut small).unwrap();
        assert_eq!(small[..], data[PAGE + 100..PAGE + 164], "{name}");
        for p in [0, 2] {
            b.read((p * PAGE) as u64, &mut page).unwrap();
            assert_eq!(page, data[p * PAGE..(p + 1) * PAGE], "{name}: page {p}");
        }

        let e = b.prefetch(0..b.len(), Tier::Host).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert_eq!(b.tier_of(1).unwrap(), Some(Tier::Nvme), "{name}");

        let e = b.write(PAGE as u64 + 10, b"merge").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        let e = b.read(PAGE as u64, &mut page).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: still refused: {e}");
        assert!(rt.nvme_stats().unwrap().corrupted >= 4, "{name}");
        rt.check().unwrap();

        let fresh = pattern(3, 2, PAGE);
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        b.write(PAGE as u64, &fresh).unwrap();
        b.read(PAGE as u64, &mut page).unwrap();
        assert_eq!(page, fresh, "{name}: a whole-page write replaces it");
        b.read(0, &mut out).unwrap();
        assert_eq!(out[..PAGE], data[..PAGE], "{name}");
        assert_eq!(out[2 * PAGE..], data[2 * PAGE..], "{name}");
        assert_eq!(b.tier_of(1).unwrap(), before.tiers[1], "{name}");
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
    }
}

/// (b) A bit flipped on the way to the medium (the write itself reported
/// success) is caught by the next read: `Corrupted`, not the flipped bytes.
#[test]
fn a_write_corrupted_in_transit_reads_as_corrupted() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(4, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        let next = pattern(4, 2, PAGE);
        plan.inject(IoOp::Write, 0, Fault::FlipBit);
        b.write(0, &next).unwrap();
        assert_eq!(plan.injected(), 1, "{name}: the fault fired");
        let mut page = vec![0; PAGE];
        let e = b.read(0, &mut page).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert_ne!(page, next, "{name}");
        // Bytes 0..64 are in the first sector; the flip hit the third.
        let mut small = [0u8; 64];
        b.read(0, &mut small).unwrap();
        assert_eq!(small[..], next[..64], "{name}");
        b.read(PAGE as u64, &mut page).unwrap();
        assert_eq!(page, data[PAGE..], "{name}: the other page is untouched");
    }
}

/// (c) A write to an NVMe page whose disk write fails returns the error
/// (EIO: `Io`, ENOSPC: `NoSpace`), whether it covers the page or part of
/// it, and the page reads back its previous content, in the same tier,
/// taking no more NVMe room. A write over two pages whose second page
/// fails has written the first and left the second as it was (the
/// documented contract of `Buffer::write`).
#[test]
fn a_failed_write_to_an_nvme_page_keeps_its_old_content() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(5, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        let before = observe(&rt, &b);
        let next = pattern(5, 2, 2 * PAGE);

        for (errno, kind) in [
            (libc::EIO, ErrorKind::Io),
            (libc::ENOSPC, ErrorKind::NoSpace),
        ] {
            plan.inject(IoOp::Write, 0, Fault::Errno(errno));
            let e = b.write(0, &next[..PAGE]).unwrap_err();
            assert_eq!(e.kind(), kind, "{name}: whole page: {e}");
            assert_eq!(e.raw_os_error(), Some(errno), "{name}: {e}");
            assert_eq!(contents(&b), data, "{name}: whole page, errno {errno}");

            plan.inject(IoOp::Write, 0, Fault::Errno(errno));
            let e = b.write(PAGE as u64 + 300, &next[..100]).unwrap_err();
            assert_eq!(e.kind(), kind, "{name}: part of a page: {e}");
            assert_eq!(contents(&b), data, "{name}: part of a page, errno {errno}");
            assert_eq!(observe(&rt, &b), before, "{name}: errno {errno}");
        }
        // A partial write reads the page to merge into it: that read fails.
        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let e = b.write(PAGE as u64 + 300, &next[..100]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: merging read: {e}");
        assert_eq!(contents(&b), data, "{name}: merging read");
        assert_eq!(plan.injected(), 5, "{name}: every fault fired");

        plan.inject(IoOp::Write, 1, Fault::Errno(libc::EIO));
        let e = b.write(0, &next).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        let got = contents(&b);
        assert_eq!(
            got[..PAGE],
            next[..PAGE],
            "{name}: the first page was written"
        );
        assert_eq!(
            got[PAGE..],
            data[PAGE..],
            "{name}: the second page as it was"
        );
        assert_eq!(observe(&rt, &b), before, "{name}");

        b.write(0, &next).unwrap();
        assert_eq!(contents(&b), next, "{name}: writes work again");
        rt.check().unwrap();
    }
}

/// (c) An engine that breaks with a page's write in flight (its
/// completion never comes back) fails the write, and the page keeps its
/// previous copy: the write went to a fresh slot, never over the page.
#[test]
fn a_write_the_engine_lost_keeps_the_old_content() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(6, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        plan.fail_waits(libc::EIO);
        let e = b.write(0, &pattern(6, 2, PAGE)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        plan.clear();
        assert_eq!(contents(&b), data, "{name}: the old copy is intact");
        assert_eq!(b.residency().in_tier(Tier::Nvme), 2, "{name}");
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
        let next = pattern(6, 3, 2 * PAGE);
        b.write(0, &next).unwrap();
        assert_eq!(contents(&b), next, "{name}: writes work again");
    }
}

/// (d) A failure of work done off the caller's request — the demotions
/// that make room for a pin, refused by the disk — is returned by
/// `Runtime::check` once (then cleared), loses no page, and the runtime
/// goes on working when the disk does.
#[test]
fn check_returns_a_room_making_failure_once() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        // The host tier full of a's pages; b on NVMe.
        let a = rt
            .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Host))
            .unwrap();
        let da = pattern(7, 1, 4 * PAGE);
        a.write(0, &da).unwrap();
        assert_eq!(a.residency().in_tier(Tier::Host), 4, "{name}: setup");
        let db = pattern(7, 2, PAGE);
        let b = on_nvme(&rt, &db);
        rt.check().unwrap();
        let errors = rt.stats().background_errors;

        // Pinning b in the host tier must demote a page of a: its write fails.
        plan.fail_all(IoOp::Write, libc::EIO);
        let pinned = b.pin(0..b.len(), Tier::Host).map(|_| ());
        plan.clear();
        assert!(
            pinned.is_err(),
            "{name}: no room was made, yet b was pinned"
        );
        assert!(
            rt.stats().background_errors > errors,
            "{name}: the failure was counted"
        );
        let e = rt.check().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert!(e.message().contains("making room"), "{name}: {e}");
        rt.check()
            .unwrap_or_else(|e| panic!("{name}: returned twice: {e}"));

        assert_eq!(contents(&a), da, "{name}: the page that failed to move");
        assert_eq!(contents(&b), db, "{name}");
        assert_eq!(a.residency().in_tier(Tier::Host), 4, "{name}");
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
        let pin = b.pin(0..b.len(), Tier::Host).unwrap();
        drop(pin);
        assert_eq!(contents(&b), db, "{name}");
        assert_eq!(contents(&a), da, "{name}");
        rt.check().unwrap();
    }
}

/// (c) The first write of a page placed on NVMe fails (EIO, ENOSPC): the
/// error comes back, the page stays unwritten (it reads as zeros, as
/// before) and keeps no NVMe slot; written again, it holds the new bytes.
#[test]
fn a_failed_first_write_leaves_the_page_unwritten_and_takes_no_slot() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let b = rt
            .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Nvme))
            .unwrap();
        let before = observe(&rt, &b);
        let data = pattern(8, 1, 2 * PAGE);
        for (errno, kind) in [
            (libc::EIO, ErrorKind::Io),
            (libc::ENOSPC, ErrorKind::NoSpace),
        ] {
            plan.inject(IoOp::Write, 0, Fault::Errno(errno));
            let e = b.write(PAGE as u64, &data[PAGE..]).unwrap_err();
            assert_eq!(e.kind(), kind, "{name}: {e}");
            plan.inject(IoOp::Write, 0, Fault::Errno(errno));
            let e = b.write(10, &data[..100]).unwrap_err();
            assert_eq!(e.kind(), kind, "{name}: part of a page: {e}");
            assert_eq!(observe(&rt, &b), before, "{name}: errno {errno}");
            assert_eq!(contents(&b), vec![0; 2 * PAGE], "{name}: errno {errno}");
        }
        b.write(0, &data).unwrap();
        assert_eq!(contents(&b), data, "{name}");
        assert_eq!(b.residency().in_tier(Tier::Nvme), 2, "{name}");
    }
}

/// Faults the I/O queue absorbs (short transfers, EINTR) change nothing a
/// user sees, on a move's batched reads and writes; a bit flipped in
/// transit on a move's read fails the move with `Corrupted` and leaves the
/// page on NVMe, intact.
#[test]
fn moves_through_absorbed_and_transient_faults_keep_every_byte() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(9, 1, 4 * PAGE);
        let b = on_nvme(&rt, &data);

        plan.inject(IoOp::Read, 0, Fault::Short(4096));
        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EINTR));
        b.prefetch(0..b.len(), Tier::Host).wait().unwrap();
        assert_eq!(b.residency().in_tier(Tier::Host), 4, "{name}");
        assert_eq!(contents(&b), data, "{name}: up through short reads");
        // Written in host, the pages need writes to go back down.
        let next = pattern(9, 2, 4 * PAGE);
        b.write(0, &next).unwrap();
        plan.inject(IoOp::Write, 0, Fault::Short(8192));
        plan.inject(IoOp::Write, 1, Fault::Errno(libc::EINTR));
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        assert_eq!(b.residency().in_tier(Tier::Nvme), 4, "{name}");
        assert_eq!(contents(&b), next, "{name}: down through short writes");
        assert_eq!(plan.injected(), 4, "{name}: every fault fired");

        plan.inject(IoOp::Read, 0, Fault::FlipBit);
        let e = b.prefetch(0..PAGE as u64, Tier::Host).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme), "{name}");
        plan.inject(IoOp::Read, 0, Fault::FlipBit);
        let mut page = vec![0; PAGE];
        let e = b.read(0, &mut page).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupted, "{name}: {e}");
        assert_eq!(contents(&b), next, "{name}: the flips were in transit");
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
        rt.check().unwrap();
    }
}

/// (d) A page the balancer marked for promotion moves when a whole-page
/// read reaches it. When that move's disk read fails, the caller's read
/// still gets the page's bytes (from NVMe, where it stayed) and the
/// failed promotion is returned by `Runtime::check`, once.
#[test]
fn check_returns_a_failed_promotion_on_read_once() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 4);
        let data = pattern(10, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        let mut small = [0u8; 64];
        for _ in 0..100 {
            b.read(10, &mut small).unwrap();
        }
        let report = rt.balance_once().unwrap();
        assert!(
            report.marked >= 1,
            "{name}: setup: no page marked: {report:?}"
        );
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme), "{name}: setup");

        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        let mut page = vec![0; PAGE];
        b.read(0, &mut page).unwrap();
        assert_eq!(page, data[..PAGE], "{name}: the read is served");
        assert_eq!(plan.injected(), 1, "{name}: the promotion's read failed");
        assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme), "{name}");
        let e = rt.check().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        assert!(e.message().contains("promotion"), "{name}: {e}");
        rt.check()
            .unwrap_or_else(|e| panic!("{name}: returned twice: {e}"));
        assert_eq!(contents(&b), data, "{name}");
        assert_eq!(rt.stats().lost_pages, 0, "{name}");
    }
}

/// An engine that opens queues until told to refuse (a device that went
/// away): a move that cannot open its queue does not start.
struct Refusing {
    inner: Arc<dyn IoEngine>,
    refuse: AtomicBool,
}

impl IoEngine for Refusing {
    fn kind(&self) -> strata::io::EngineKind {
        self.inner.kind()
    }
    fn open_raw(
        &self,
        file: &Arc<File>,
        depth: usize,
        pool: Option<&Arc<strata::lowlevel::BufPool>>,
    ) -> strata::Result<Box<dyn strata::lowlevel::RawQueue>> {
        if self.refuse.load(Ordering::SeqCst) {
            return Err(strata::Error::new(ErrorKind::Io, "the disk went away"));
        }
        self.inner.open_raw(file, depth, pool)
    }
}

/// (e) Moves the disk failed under count in `Stats::failed_moves` whichever
/// way they went: up when their queue could not be opened, down when the
/// engine lost their writes. Their pages stay where they were.
#[test]
fn moves_the_disk_failed_count_as_failed_both_ways() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let refusing = Arc::new(Refusing {
            inner: engine.clone(),
            refuse: Default::default(),
        });
        let rt = runtime(dir.path(), refusing.clone(), 8);
        let data = pattern(11, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        refusing.refuse.store(true, Ordering::SeqCst);
        let e = b.prefetch(0..b.len(), Tier::Host).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        refusing.refuse.store(false, Ordering::SeqCst);
        assert_eq!(b.residency().in_tier(Tier::Nvme), 2, "{name}");
        let s = rt.stats();
        assert_eq!((s.moves, s.failed_moves), (0, 2), "{name}: up");

        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 8);
        let b = rt.alloc(2 * PAGE as u64).unwrap();
        b.write(0, &data).unwrap();
        plan.fail_waits(libc::EIO);
        let e = b.evict(0..b.len(), Tier::Nvme).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{name}: {e}");
        plan.clear();
        assert_eq!(b.residency().in_tier(Tier::Host), 2, "{name}");
        assert_eq!(contents(&b), data, "{name}");
        let s = rt.stats();
        assert_eq!((s.moves, s.failed_moves), (0, 2), "{name}: down");
    }
}

/// A slow disk holds up the pages being read and no one else: while one
/// page's read from NVMe takes seconds (its lock held throughout), a
/// buffer's residency and a harvest of its counters answer at once, with
/// the page where it was before the move, and the move then lands.
#[test]
fn asking_where_pages_are_does_not_wait_for_a_slow_read() {
    for (name, engine) in engines() {
        let dir = nvme_dir();
        let (rt, plan) = faulty(dir.path(), &engine, 8);
        let data = pattern(12, 1, 2 * PAGE);
        let b = on_nvme(&rt, &data);
        plan.inject(
            IoOp::Read,
            0,
            Fault::Delay(std::time::Duration::from_secs(3)),
        );
        let ticket = b.prefetch(0..PAGE as u64, Tier::Host);
        for _ in 0..2000 {
            if plan.injected() > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(plan.injected(), 1, "{name}: the slow read never started");
        let r = b.residency();
        b.harvest(strata::hotness::HarvestParams::default())
            .unwrap();
        assert!(
            ticket.poll().is_none(),
            "{name}: residency or harvest waited for the slow read"
        );
        assert_eq!(r.in_tier(Tier::Nvme), 2, "{name}: where the pages were");
        ticket.wait().unwrap();
        assert_eq!(
            b.residency().in_tier(Tier::Host),
            1,
            "{name}: the move landed"
        );
        assert_eq!(contents(&b), data, "{name}");
    }
}
