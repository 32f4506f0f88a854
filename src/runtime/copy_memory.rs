//! The memory↔memory copy path: a page moves between two memory tiers (any
//! pair but host↔device, which `copy_device.rs` batches) with one copy
//! under its lock, straight from the source's bytes where it has them, and
//! commits at once.
#![forbid(unsafe_code)]

use std::time::Instant;

use super::table::{Entry, Locked, Table};
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

/// Moves locked pages into `dst` one by one; pages that find `dst` full go
/// to `full`. The first other failure is returned (its page stays where
/// it was).
pub(crate) fn move_pages(
    table: &Table,
    mut pages: Locked<'_>,
    dst: Tier,
    full: &mut Vec<usize>,
) -> Result<()> {
    let mut first_err = None;
    for (p, entry) in pages.iter_mut() {
        match move_page(table, *p, entry, dst) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::OutOfCapacity => full.push(*p),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Moves the page under `entry` into `dst` (copy, then commit), the lock
/// held throughout. `Ok(false)` when there was nothing to move.
fn move_page(table: &Table, p: usize, entry: &mut Entry, dst: Tier) -> Result<bool> {
    // A pinned page is left alone by the callers; the check is theirs.
    let Some(begun) = entry.begin_move(dst, |src| table.may_move(src, dst)) else {
        return Ok(false);
    };
    let src = begun.src;
    let slot = entry.slot().expect("begun moves are resident");
    let from = table.store(src);
    let to = table
        .rt
        .store(dst)
        .ok_or_else(|| Error::invalid(format!("the {dst} tier is not configured")))?;
    let started = Instant::now();
    // The page holds two slots until the move commits: account the second
    // against the runtime's capacity.
    table.rt.reserve_move()?;
    let moved = to.alloc().and_then(|mut fresh| {
        // One copy, straight from the source's bytes where it has them.
        match from.with_page(slot, &mut |bytes| to.write_new(&mut fresh, bytes)) {
            Ok(()) => Ok(fresh),
            Err(e) => {
                table.free(dst, fresh);
                Err(e)
            }
        }
    });
    match moved {
        Ok(fresh) => {
            // The lock was held throughout: the commit cannot be refused.
            let retired = table.commit_locked(p, entry, begun, dst, fresh);
            if !retired {
                table.rt.release_moves(1);
            }
            table.account(&[src], dst, started, 0);
            Ok(true)
        }
        Err(e) => {
            table.rt.release_moves(1);
            // A full destination is a refusal, not a failed move (as in the
            // batched paths).
            table.note_failed(&e);
            Err(e.context(format!("moving page {p} from {src} to {dst}")))
        }
    }
}
