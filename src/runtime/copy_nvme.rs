//! The memory↔NVMe copy path: a batch's reads or writes are in flight on
//! one NVMe session together.
//!
//! - Into memory ([`read_in`]): each page's NVMe slot travels with its read
//!   under the page's lock (the page reads as lost meanwhile) and comes
//!   back in the completion; each page commits as its read completes, while
//!   the others are still in flight. Reads into host DRAM, and into the
//!   simulated device's memory (host memory too), land in the page's new
//!   slot directly; into a GPU's, through a bounce buffer and a copy.
//! - Out to NVMe ([`write_out`]): each page is copied out under its lock,
//!   the locks are released for the writes, and a page commits only if no
//!   one changed it meanwhile (a racing write wins; the move is abandoned).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::table::{Begun, Entry, Locked, Reserved, Resident, Table};
use crate::error::{Error, ErrorKind, Result};
use crate::tier::nvme::{lent_host_slot, NvmeCompletion, NvmeSession};
use crate::tier::{DeviceStore, HostStore, NvmeStore, PageStore, Slot, Tier};

/// Where a read may land directly: the page's new slot in host memory.
#[derive(Clone, Copy)]
enum Direct<'a> {
    Host(&'a HostStore),
    /// The simulated device, whose memory is host memory.
    Device(&'a DeviceStore),
}

impl Direct<'_> {
    /// The direct target for reads into `dst`, if any.
    fn of(table: &Table, dst: Tier) -> Option<Direct<'_>> {
        match dst {
            Tier::Host => Some(Direct::Host(table.rt.tiers.host())),
            Tier::Device => table
                .rt
                .tiers
                .device()
                .filter(|d| d.emulated())
                .map(Direct::Device),
            _ => None,
        }
    }

    fn alloc(self) -> Result<Slot> {
        match self {
            Direct::Host(h) => h.alloc(),
            Direct::Device(d) => d.alloc(),
        }
    }

    fn tier(self) -> Tier {
        match self {
            Direct::Host(_) => Tier::Host,
            Direct::Device(_) => Tier::Device,
        }
    }

    fn submit(
        self,
        session: &mut NvmeSession<'_>,
        slot: Slot,
        fresh: Slot,
        tag: u64,
    ) -> std::result::Result<(), (Error, Slot, Slot)> {
        match self {
            Direct::Host(h) => session.submit_read_into(slot, h, fresh, tag),
            Direct::Device(d) => session.submit_read_into_device(slot, d, fresh, tag),
        }
    }
}

/// What a batch did, for its accounting.
#[derive(Default)]
struct Outcome {
    /// The source tier of each page committed.
    committed: Vec<Tier>,
    /// Pages whose copy failed.
    failed: u64,
    first_err: Option<Error>,
}

impl Outcome {
    fn error(&mut self, e: Error) {
        self.first_err.get_or_insert(e);
    }
}

/// Moves locked NVMe pages into the memory tier `dst`; pages that find it
/// full go to `full`. Nothing returns early once a page's slot is out for
/// a read: it is put back, even when the engine never returns the read.
pub(crate) fn read_in(
    table: &Table,
    mut pages: Locked<'_>,
    dst: Tier,
    full: &mut Vec<usize>,
) -> Result<()> {
    if pages.is_empty() {
        return Ok(());
    }
    let nvme = table.rt.tiers.nvme().expect("pages on NVMe have a store");
    // Reads into host memory land in the page's new slot directly.
    let direct = Direct::of(table, dst);
    let started = Instant::now();
    let mut reserved = table.reserve(&mut pages, full);
    let mut out = Outcome::default();
    match nvme.session() {
        Err(e) => {
            // No read started: every page stays on NVMe, its move failed
            // (as `write_out` counts them).
            out.failed += pages.len() as u64;
            out.error(e);
        }
        Ok(mut session) => {
            let begun = submit_reads(table, &mut session, &mut pages, direct, full, &mut out);
            reap_reads(table, &mut session, &mut pages, &begun, dst, full, &mut out);
            // Reads the engine never gave back: each page goes back to its
            // NVMe slot, whose bytes a read does not change; the move fails.
            let never_reaped = session.in_flight() as u64;
            if never_reaped > 0 {
                let back = session.abandon();
                // Only reads are in flight here: every one comes back.
                table.rt.note_lost_pages(never_reaped - back.len() as u64);
                for (tag, slot) in back {
                    let i = tag as usize;
                    let (_, entry) = &mut pages[i];
                    entry.put_back(begun[i].expect("every read was begun"), slot);
                    out.failed += 1;
                }
                if direct.is_some() {
                    // Their new slots went with the requests (the engine
                    // may still write them): leaked, they keep their
                    // reservations, so promised pages still find room.
                    reserved.pages -= never_reaped;
                }
            }
        }
    }
    table.account(&out.committed, dst, started, out.failed);
    drop(reserved);
    out.first_err.map_or(Ok(()), Err)
}

/// Submits the read of every page (its slot taken out of the entry);
/// returns, per page, the page as it was when its slot was taken.
fn submit_reads(
    table: &Table,
    session: &mut NvmeSession<'_>,
    pages: &mut Locked<'_>,
    direct: Option<Direct<'_>>,
    full: &mut Vec<usize>,
    out: &mut Outcome,
) -> Vec<Option<Begun>> {
    let nvme = table.rt.tiers.nvme().expect("pages on NVMe have a store");
    let mut begun: Vec<Option<Begun>> = vec![None; pages.len()];
    for (i, (p, entry)) in pages.iter_mut().enumerate() {
        if let Some(to) = direct {
            // Into host memory: straight into the page's new slot.
            let fresh = match to.alloc() {
                Ok(f) => f,
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                    full.push(*p);
                    continue;
                }
                Err(e) => {
                    out.failed += 1;
                    out.error(e);
                    continue;
                }
            };
            let (b, slot) = entry.take_for_read().expect("checked resident");
            begun[i] = Some(b);
            if let Err((e, slot, fresh)) = to.submit(session, slot, fresh, i as u64) {
                entry.put_back(b, slot);
                table.free(to.tier(), fresh);
                out.failed += 1;
                out.error(e);
            }
            continue;
        }
        // The slot travels with its read and comes back in the completion;
        // the page lock keeps everyone else out.
        let buf = match nvme.buffer() {
            Ok(b) => b,
            Err(e) => {
                out.failed += 1;
                out.error(e);
                continue;
            }
        };
        let (b, slot) = entry.take_for_read().expect("checked resident");
        begun[i] = Some(b);
        if let Err(r) = session.submit_read(slot, buf, i as u64) {
            entry.put_back(b, r.slot);
            out.failed += 1;
            out.error(r.error);
        }
    }
    begun
}

/// Installs each page as its read completes. Every slot in a read must come
/// back to its page: after an engine error, keeps reaping (a few times)
/// what is in flight; reads never reaped keep their pages lost.
fn reap_reads(
    table: &Table,
    session: &mut NvmeSession<'_>,
    pages: &mut Locked<'_>,
    begun: &[Option<Begun>],
    dst: Tier,
    full: &mut Vec<usize>,
    out: &mut Outcome,
) {
    let mut done = Vec::new();
    let mut engine_errors = 0;
    while session.in_flight() > 0 && engine_errors < 4 {
        let reaped = session.reap(1, &mut done);
        for c in done.drain(..) {
            let i = c.tag as usize;
            let (p, entry) = &mut pages[i];
            let b = begun[i].expect("every read was begun");
            match complete_read(table, *p, entry, b, dst, c) {
                Ok(()) => out.committed.push(Tier::Nvme),
                Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
                Err(e) => {
                    out.failed += 1;
                    out.error(e);
                }
            }
        }
        if let Err(e) = reaped {
            engine_errors += 1;
            out.error(e);
        }
    }
}

/// A completed read of page `p`: its NVMe slot goes back into the entry,
/// and the page commits in `dst` if the read succeeded.
fn complete_read(
    table: &Table,
    p: usize,
    entry: &mut Entry,
    begun: Begun,
    dst: Tier,
    c: NvmeCompletion,
) -> Result<()> {
    entry.put_back(begun, c.slot);
    if !c.buf.is_lent() {
        c.result?;
        return install(table, p, entry, begun, dst, &c.buf);
    }
    // Read straight into its new slot (a lent buffer comes only from a
    // direct read into `dst`).
    let fresh = lent_host_slot(c.buf).expect("a lent buffer carries its slot");
    match c.result {
        Ok(()) => {
            if let Some(Direct::Device(d)) = Direct::of(table, dst) {
                // Crossed the simulated link with no copy: its modelled
                // time is accounted; the wall time is the NVMe read's.
                d.record_direct(Duration::ZERO);
            }
            // From NVMe: freed, never retired.
            table.commit_locked(p, entry, begun, dst, fresh);
            Ok(())
        }
        Err(e) => {
            table.free(dst, fresh);
            Err(e)
        }
    }
}

/// Writes a page just read from NVMe into a fresh slot of `dst` and commits
/// it there (the page's lock is held by the caller).
fn install(
    table: &Table,
    p: usize,
    entry: &mut Entry,
    begun: Begun,
    dst: Tier,
    bytes: &[u8],
) -> Result<()> {
    let to = table.store(dst);
    let mut slot = to.alloc()?;
    if let Err(e) = to.write_new(&mut slot, bytes) {
        table.free(dst, slot);
        return Err(e);
    }
    // From NVMe: freed, never retired.
    table.commit_locked(p, entry, begun, dst, slot);
    Ok(())
}

/// Moves locked memory-tier pages to NVMe; pages that find it full go to
/// `full`.
pub(crate) fn write_out(table: &Table, mut pages: Locked<'_>, full: &mut Vec<usize>) -> Result<()> {
    if pages.is_empty() {
        return Ok(());
    }
    let nvme = table
        .rt
        .tiers
        .nvme()
        .expect("the destination tier is configured");
    let started = Instant::now();
    let mut reserved = table.reserve(&mut pages, full);
    let mut out = Outcome::default();
    let mut session = match nvme.session() {
        Ok(s) => s,
        Err(e) => {
            table.account(&[], Tier::Nvme, started, pages.len() as u64);
            return Err(e);
        }
    };
    // 1. Each page copied out under its lock and its write submitted at
    // once; the locks go when all are submitted, before the writes end.
    let meta = submit_writes(table, nvme, &mut session, &pages, full, &mut out);
    drop(pages);
    // 2. The writes complete with no page lock held.
    let written = reap_writes(table, &mut session, &meta, &mut reserved, &mut out);
    drop(session);
    // 3. Commit, in ascending order, what no one touched meanwhile.
    commit_writes(table, written, &mut reserved, &mut out);
    table.account(&out.committed, Tier::Nvme, started, out.failed);
    drop(reserved);
    out.first_err.map_or(Ok(()), Err)
}

/// Copies each page out and submits its write to a fresh NVMe slot;
/// returns each write's page and the page as it was copied (indexed by the
/// write's tag).
fn submit_writes(
    table: &Table,
    nvme: &NvmeStore,
    session: &mut NvmeSession<'_>,
    pages: &Locked<'_>,
    full: &mut Vec<usize>,
    out: &mut Outcome,
) -> Vec<(usize, Begun)> {
    let mut meta: Vec<(usize, Begun)> = Vec::with_capacity(pages.len());
    for (p, entry) in pages.iter() {
        let Resident { tier, slot } = &entry.loc else {
            unreachable!("checked resident")
        };
        let fresh = match nvme.alloc() {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::OutOfCapacity => {
                full.push(*p);
                continue;
            }
            Err(e) => {
                out.failed += 1;
                out.error(e);
                continue;
            }
        };
        let copied = nvme.buffer().and_then(|mut buf| {
            table
                .store(*tier)
                .with_page(slot, &mut |b| {
                    buf.copy_from_slice(b);
                    Ok(())
                })
                .map(|()| buf)
        });
        let buf = match copied {
            Ok(buf) => buf,
            Err(e) => {
                table.free(Tier::Nvme, fresh);
                out.failed += 1;
                out.error(e);
                continue;
            }
        };
        let tag = meta.len() as u64;
        meta.push((
            *p,
            Begun {
                src: *tier,
                version: entry.version,
            },
        ));
        if let Err(r) = session.submit_write(fresh, buf, tag) {
            table.free(Tier::Nvme, r.slot);
            out.failed += 1;
            out.error(r.error);
        }
    }
    meta
}

/// Reaps every write: the pages written, with their fresh slots.
fn reap_writes(
    table: &Table,
    session: &mut NvmeSession<'_>,
    meta: &[(usize, Begun)],
    reserved: &mut Reserved<'_>,
    out: &mut Outcome,
) -> Vec<(usize, Begun, Slot)> {
    let mut written = Vec::with_capacity(meta.len());
    let mut done = Vec::new();
    let reaped = session.reap(session.in_flight(), &mut done);
    for c in done {
        let (p, begun) = meta[c.tag as usize];
        match c.result {
            Ok(()) => written.push((p, begun, c.slot)),
            Err(e) => {
                table.free(Tier::Nvme, c.slot);
                out.failed += 1;
                out.error(e);
            }
        }
    }
    if let Err(e) = reaped {
        // Writes still in flight: their fresh slots stay allocated (leaked)
        // and keep their reservations, so promised pages still find room;
        // the pages keep their old copies: their moves failed.
        reserved.pages -= session.in_flight() as u64;
        out.failed += session.in_flight() as u64;
        out.error(e);
    }
    written
}

/// Commits each written page that no one changed since its copy; the
/// others' fresh slots go back (the move is abandoned).
fn commit_writes(
    table: &Table,
    mut written: Vec<(usize, Begun, Slot)>,
    reserved: &mut Reserved<'_>,
    out: &mut Outcome,
) {
    written.sort_unstable_by_key(|w| w.0);
    for (p, begun, slot) in written {
        // Never wait long for a page lock while holding reservations: a
        // first write holding it may be waiting for a slot to free up.
        let Some(mut entry) = table.pages[p].try_lock_for(Duration::from_millis(2)) else {
            table.free(Tier::Nvme, slot);
            table.note_abandoned();
            continue;
        };
        // A launch that began since the copy keeps the page where it is.
        let committed = if table.may_move(begun.src, Tier::Nvme) {
            table.commit(p, &mut entry, begun, Tier::Nvme, slot)
        } else {
            Err(slot)
        };
        match committed {
            Ok(retired) => {
                if retired {
                    reserved.pages -= 1;
                }
                out.committed.push(begun.src);
            }
            Err(slot) => {
                table.free(Tier::Nvme, slot);
                table.note_abandoned();
            }
        }
    }
}
