//! The host↔device copy path: locked pages moving one way between host
//! DRAM and the device tier go over the link in one batched transfer (the
//! copies queued together and waited for once), then each commits.
#![forbid(unsafe_code)]

use std::time::Instant;

use super::table::{Locked, Resident, Table};
use crate::error::{ErrorKind, Result};
use crate::tier::{DeviceStore, HostStore, Slot, Tier};

/// Moves locked pages between host and device (all one way, into `dst`);
/// pages that find `dst` full go to `full`.
pub(crate) fn move_pages(
    table: &Table,
    mut pages: Locked<'_>,
    dst: Tier,
    full: &mut Vec<usize>,
) -> Result<()> {
    if pages.is_empty() {
        return Ok(());
    }
    let tiers = &table.rt.tiers;
    let device = tiers.device().expect("pages in the device tier have one");
    let host = tiers.host();
    let started = Instant::now();
    let mut reserved = table.reserve(&mut pages, full);
    let to = table.store(dst);
    // Fresh slots, each with the index of its page in `pages`.
    let mut fresh: Vec<(usize, Slot)> = Vec::with_capacity(pages.len());
    let mut first_err = None;
    // Failed moves: pages whose slot or copy failed (not those that found
    // `dst` full: a refusal, not a failure).
    let mut failed = 0u64;
    for (i, (p, _)) in pages.iter().enumerate() {
        match to.alloc() {
            Ok(s) => fresh.push((i, s)),
            Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
            Err(e) => {
                failed += 1;
                first_err.get_or_insert(e);
            }
        }
    }
    let copied = if dst == Tier::Device {
        to_device(device, host, &pages, &mut fresh)
    } else {
        to_host(device, host, &pages, &mut fresh)
    };
    if let Err(e) = copied {
        failed += fresh.len() as u64;
        for (_, s) in fresh.drain(..) {
            table.free(dst, s);
        }
        first_err.get_or_insert(e);
    }
    let mut committed = Vec::with_capacity(fresh.len());
    for (i, slot) in fresh {
        let (p, entry) = &mut pages[i];
        let begun = entry
            .begin_move(dst, |_| true)
            .expect("checked movable under the lock held since");
        if table.commit_locked(*p, entry, begun, dst, slot) {
            reserved.pages -= 1;
        }
        committed.push(begun.src);
    }
    table.account(&committed, dst, started, failed);
    drop(reserved);
    first_err.map_or(Ok(()), Err)
}

/// The page's slot in its (source) tier.
fn source<'a>(pages: &'a Locked<'_>, i: usize) -> &'a Slot {
    let Resident { slot, .. } = &pages[i].1.loc else {
        unreachable!("checked resident")
    };
    slot
}

/// Host pages into their fresh device slots, in one transfer.
fn to_device(
    device: &DeviceStore,
    host: &HostStore,
    pages: &Locked<'_>,
    fresh: &mut [(usize, Slot)],
) -> Result<()> {
    let sources: Vec<&[u8]> = fresh
        .iter()
        .map(|(i, _)| host.bytes(source(pages, *i)))
        .collect::<Result<_>>()?;
    let mut items: Vec<(&mut Slot, &[u8])> = fresh
        .iter_mut()
        .zip(sources)
        .map(|((_, s), b)| (s, b))
        .collect();
    device.write_many(&mut items)
}

/// Device pages into their fresh host slots, in one transfer.
fn to_host(
    device: &DeviceStore,
    host: &HostStore,
    pages: &Locked<'_>,
    fresh: &mut [(usize, Slot)],
) -> Result<()> {
    let mut items: Vec<(&Slot, &mut [u8])> = Vec::with_capacity(fresh.len());
    for (i, s) in fresh.iter_mut() {
        items.push((source(pages, *i), host.bytes_mut(s)?));
    }
    device.read_many(&mut items)
}
