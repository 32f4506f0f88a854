//! Benchmarks behind `strata bench`: each measures strata beside the limit
//! or a peer in the same run and reports both.

pub mod copy;
pub mod graph;
pub mod io;
pub mod migrate;
pub mod moe;
pub mod optim;
pub mod pages;
pub mod priority;
pub mod recsys;

use strata::error::Result;
use strata::io::{AlignedBuf, IoOp};
use strata::lowlevel::NvmeSession;
use strata::tier::Slot;

/// The middle of `v` once sorted (of an even count, the upper of the two
/// middle values); `v` is sorted in place. `v` must not be empty.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One pass over every slot, in order, through `session` at its full
/// depth: each slot is written (after `prepare` fills its buffer) or read
/// once. Slots and buffers are returned to `slots` and `bufs` as their
/// operations complete; `progress` is told how many have.
pub(crate) fn sequential_pass(
    session: &mut NvmeSession<'_>,
    slots: &mut [Option<Slot>],
    bufs: &mut Vec<AlignedBuf>,
    op: IoOp,
    prepare: &mut dyn FnMut(&mut AlignedBuf),
    progress: &mut dyn FnMut(usize),
) -> Result<()> {
    let pages = slots.len();
    let mut done = Vec::with_capacity(session.depth());
    let mut next = 0usize;
    let mut finished = 0usize;
    while finished < pages {
        while next < pages && session.in_flight() < session.depth() {
            let slot = slots[next].take().expect("slot present");
            let mut buf = bufs.pop().expect("a buffer per queue slot");
            let r = match op {
                IoOp::Write => {
                    prepare(&mut buf);
                    session.submit_write(slot, buf, next as u64)
                }
                IoOp::Read => session.submit_read(slot, buf, next as u64),
            };
            r.map_err(|r| r.error)?;
            next += 1;
        }
        session.reap(1, &mut done)?;
        for c in done.drain(..) {
            c.result?;
            slots[c.tag as usize] = Some(c.slot);
            bufs.push(c.buf);
            finished += 1;
        }
        progress(finished);
    }
    Ok(())
}
