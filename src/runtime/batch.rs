//! The one batch interface of the copy paths: [`move_batched`] locks a
//! batch's pages (ascending, the only order in which more than one page
//! lock is ever held), keeps those that may move, and hands each kind of
//! move to its copy path:
//!
//! | kind | path | how |
//! |------|------|-----|
//! | memory↔memory | `copy_memory.rs` | page by page under the lock, one copy |
//! | host↔device | `copy_device.rs` | one batched transfer over the link |
//! | memory↔NVMe | `copy_nvme.rs` | the batch's I/O in flight on one session |
//!
//! Every path ends in `Table::commit`. A page demoted into the tier that
//! holds its clean copy takes neither: it goes back to the copy here,
//! under its lock, with no I/O (`Table::demote_to_clean`).
#![forbid(unsafe_code)]

use super::table::{lost, Entry, Locked, Lost, Table};
use super::{copy_device, copy_memory, copy_nvme};
use crate::error::{Error, Result};
use crate::tier::Tier;

/// A kind of move, with its copy path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Memory,
    HostDevice,
    Nvme,
}

impl Kind {
    fn of(src: Tier, dst: Tier) -> Self {
        match (src, dst) {
            (Tier::Nvme, _) | (_, Tier::Nvme) => Kind::Nvme,
            (Tier::Host, Tier::Device) | (Tier::Device, Tier::Host) => Kind::HostDevice,
            _ => Kind::Memory,
        }
    }

    /// Moves locked `pages` (all of this kind) into `dst`.
    fn run(self, table: &Table, pages: Locked<'_>, dst: Tier, full: &mut Vec<usize>) -> Result<()> {
        match self {
            Kind::Memory => copy_memory::move_pages(table, pages, dst, full),
            Kind::HostDevice => copy_device::move_pages(table, pages, dst, full),
            Kind::Nvme => {
                // One session's queue at a time.
                let mut pages = pages;
                let mut first_err = None;
                while !pages.is_empty() {
                    let rest = pages.split_off(pages.len().min(table.batch()));
                    let moved = if dst == Tier::Nvme {
                        copy_nvme::write_out(table, pages, full)
                    } else {
                        copy_nvme::read_in(table, pages, dst, full)
                    };
                    if let Err(e) = moved {
                        first_err.get_or_insert(e);
                    }
                    pages = rest;
                }
                first_err.map_or(Ok(()), Err)
            }
        }
    }
}

/// Moves the pages of `pages` whose tier satisfies `wanted` into `dst`,
/// `chunk` at a time (their NVMe I/O, if any, `table.batch()` at a time:
/// one session's queue). Returns the pages that found `dst` full; any other
/// failure is returned as an error after the batch (its pages stay where
/// they were).
pub(crate) fn move_batched(
    table: &Table,
    pages: &[usize],
    dst: Tier,
    wanted: &dyn Fn(Tier) -> bool,
    chunk: usize,
) -> Result<Vec<usize>> {
    let mut full = Vec::new();
    let mut first_err = None;
    let mut rest = pages;
    while !rest.is_empty() {
        // Each page of a move holds a second slot until it commits: a
        // chunk larger than the reservations to spare would send its
        // surplus to `full` with the tier not full. (Never below a batch
        // of `table.batch()`: what every chunk was before some grew.)
        let spare = table.rt.acct.spare_for_moves();
        let n = (chunk.min(spare.max(table.batch() as u64) as usize))
            .max(1)
            .min(rest.len());
        let (now, later) = rest.split_at(n);
        if let Err(e) = move_chunk(table, now, dst, wanted, &mut full) {
            first_err.get_or_insert(e);
        }
        rest = later;
    }
    first_err.map_or(Ok(full), Err)
}

fn move_chunk(
    table: &Table,
    chunk: &[usize],
    dst: Tier,
    wanted: &dyn Fn(Tier) -> bool,
    full: &mut Vec<usize>,
) -> Result<()> {
    if table.rt.store(dst).is_none() {
        return Err(Error::invalid(format!("the {dst} tier is not configured")));
    }
    let mut sorted = chunk.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    // Ascending page order, so two batches cannot deadlock.
    let mut locked: Locked<'_> = Vec::with_capacity(sorted.len());
    let mut first_err = None;
    for &p in &sorted {
        let mut entry = table.pages[p].lock();
        if matches!(entry.loc, Lost) {
            first_err.get_or_insert(lost(p));
        }
        let movable = entry.pins == 0
            && entry
                .tier()
                .is_some_and(|t| t != dst && wanted(t) && table.may_move(t, dst));
        if movable && !table.demote_to_clean(p, &mut entry, dst) {
            locked.push((p, entry));
        }
    }
    let res = run_by_kind(table, locked, dst, full);
    match (first_err, res) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(()),
    }
}

/// Runs each kind's pages through its path (a batch is almost always of
/// one kind: the engine groups pages by the tier they are in).
fn run_by_kind(table: &Table, locked: Locked<'_>, dst: Tier, full: &mut Vec<usize>) -> Result<()> {
    let kind = |e: &Entry| Kind::of(e.tier().expect("movable pages are resident"), dst);
    let Some(first) = locked.first().map(|(_, e)| kind(e)) else {
        return Ok(());
    };
    if locked.iter().all(|(_, e)| kind(e) == first) {
        return first.run(table, locked, dst, full);
    }
    let mut groups: [Locked<'_>; 3] = Default::default();
    for (p, e) in locked {
        let k = kind(&e);
        groups[k as usize].push((p, e));
    }
    let mut first_err = None;
    for (k, pages) in [Kind::Memory, Kind::HostDevice, Kind::Nvme]
        .into_iter()
        .zip(groups)
    {
        if pages.is_empty() {
            continue;
        }
        if let Err(e) = k.run(table, pages, dst, full) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}
