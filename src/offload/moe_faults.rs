//! The expert cache when a background read fails: a failed prefetch or
//! read-ahead is nobody's error but a later fetch's of that same expert
//! (which moves it again), never the error of a call that only needed its
//! room. On a private runtime, through a fault-injecting NVMe engine.

use std::sync::Arc;

use super::*;
use crate::io::fault::{Fault, FaultEngine, FaultPlan};
use crate::io::{EngineChoice, IoEngine, IoOp};

const P: usize = 64 << 10;

/// A cache of `slots` device slots on a runtime whose NVMe reads go
/// through `plan`: four experts of layer 0, expert e all bytes e + 1;
/// host memory holds one of them, the rest are on NVMe.
fn faulty(slots: usize, dir: &std::path::Path) -> (ExpertCache, Arc<FaultPlan>) {
    let plan = FaultPlan::new();
    let inner = crate::io::engine(EngineChoice::Psync).unwrap();
    let engine: Arc<dyn IoEngine> = Arc::new(FaultEngine::new(inner, plan.clone()));
    let rt = Runtime::builder()
        .page_size(P)
        .device(DeviceChoice::Sim, (slots * P) as u64)
        .host(P as u64)
        .nvme(NvmeConfig::new(dir, 32 * P as u64, P))
        .nvme_engine(engine)
        .background_eviction(false)
        .sampling(None)
        .build()
        .unwrap();
    let mut c =
        ExpertCache::with_runtime(rt, MoeConfig::new(slots, P as u64, P as u64), false).unwrap();
    for e in 0..4u32 {
        c.register(0, e, &vec![e as u8 + 1; P]).unwrap();
    }
    (c, plan)
}

/// Waits until the move started for expert `e` (a prefetch) has finished,
/// failed or not (on the simulated device it stays in flight on the
/// modelled clock).
fn settle(c: &ExpertCache, e: u32) {
    let i = c.lookup(0, e).unwrap();
    for _ in 0..2000 {
        if c.state.lock().meta[i]
            .ticket
            .as_ref()
            .is_none_or(|t| t.poll().is_some())
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("the move of expert {e} never finished");
}

/// Expert `e`'s bytes as its fetch sees them.
fn fetched(c: &ExpertCache, e: u32) -> Vec<u8> {
    let pin = c.fetch(0, e).unwrap();
    let mut out = vec![0; P];
    pin.buffer().read(0, &mut out).unwrap();
    out
}

#[test]
fn a_failed_prefetch_is_no_error_of_the_fetch_that_evicts_it() {
    let dir = tempfile::tempdir().unwrap();
    let (c, plan) = faulty(1, dir.path());
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    assert_eq!(c.prefetch(0, &[1]).unwrap(), 1);
    settle(&c, 1);
    assert_eq!(plan.injected(), 1);
    // The one slot is the failed prefetch's: expert 2's fetch takes it.
    assert_eq!(fetched(&c, 2), vec![3; P]);
    assert_eq!(fetched(&c, 1), vec![2; P]);
}

#[test]
fn a_fetch_whose_prefetch_failed_moves_the_expert_again() {
    let dir = tempfile::tempdir().unwrap();
    let (c, plan) = faulty(2, dir.path());
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    assert_eq!(c.prefetch(0, &[1]).unwrap(), 1);
    settle(&c, 1);
    assert_eq!(plan.injected(), 1);
    assert_eq!(fetched(&c, 1), vec![2; P]);
    let s = c.stats();
    // A miss, not a hit on the prefetch.
    assert_eq!((s.fetches, s.hits, s.prefetches_used), (1, 0, 0));
    // A read error that persists is the fetch's.
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    assert_eq!(c.prefetch(0, &[2]).unwrap(), 1);
    settle(&c, 2);
    assert!(c.fetch(0, 2).is_err());
}

#[test]
fn cancelling_a_layers_prefetches_cancels_a_failed_one_and_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (c, plan) = faulty(3, dir.path());
    plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
    assert_eq!(c.prefetch(0, &[1, 2]).unwrap(), 2);
    settle(&c, 1);
    settle(&c, 2);
    assert_eq!(plan.injected(), 1);
    // On the simulated device both are in flight until the clock moves.
    assert_eq!(c.cancel_prefetches(0).unwrap(), 2);
    let s = c.stats();
    assert_eq!((s.prefetches_cancelled, s.evictions), (2, 0));
    assert!(!c.is_resident(0, 1).unwrap() && !c.is_resident(0, 2).unwrap());
    assert_eq!(fetched(&c, 2), vec![3; P]);
}

#[test]
fn choosing_a_victim_does_not_wait_for_another_experts_read() {
    let dir = tempfile::tempdir().unwrap();
    let (c, plan) = faulty(2, dir.path());
    // Experts 1 and 2 in the two slots, unpinned; expert 0 in host memory.
    assert_eq!(fetched(&c, 1), vec![2; P]);
    assert_eq!(fetched(&c, 2), vec![3; P]);
    // Expert 3's prefetch evicts one of them; its read is slow, and its
    // pages are locked while it runs.
    plan.inject(
        IoOp::Read,
        0,
        Fault::Delay(std::time::Duration::from_secs(3)),
    );
    assert_eq!(c.prefetch(0, &[3]).unwrap(), 1);
    let i3 = c.lookup(0, 3).unwrap();
    for _ in 0..2000 {
        if plan.injected() > 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(plan.injected(), 1, "expert 3's read never started");
    // Expert 0's prefetch needs the other slot: its victim is the
    // unprotected expert, chosen without waiting on expert 3's pages.
    assert_eq!(c.prefetch(0, &[0]).unwrap(), 1);
    let read_done = c.state.lock().meta[i3]
        .ticket
        .as_ref()
        .is_none_or(|t| t.poll().is_some());
    assert!(
        !read_done,
        "the victim was chosen only after expert 3's read"
    );
    settle(&c, 3);
    assert_eq!(fetched(&c, 3), vec![4; P]);
    assert_eq!(fetched(&c, 0), vec![1; P]);
}
