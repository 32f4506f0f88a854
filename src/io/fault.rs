//! A fault-injecting engine for tests: wraps a real engine and, on chosen
//! operations, returns short transfers, an errno (EIO, ENOSPC, …) or flips
//! a bit in the data. It sits under [`IoQueue`](crate::io::IoQueue), so the
//! shared retry and error mapping logic is what gets tested.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::Arc;

use parking_lot::Mutex;

use super::raw::{EngineKind, IoEngine, IoOp, RawOp, RawQueue};
use crate::error::Result;

/// One injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Transfer at most this many bytes (a multiple of 4096 for O_DIRECT);
    /// the queue must continue with the rest.
    Short(usize),
    /// Fail with this errno without touching the medium.
    Errno(i32),
    /// Flip one bit of the data: after a read lands in memory, or on its way
    /// to the medium for a write (the caller's buffer is restored after).
    FlipBit,
    /// Hold the operation this long before passing it on (a slow disk).
    Delay(std::time::Duration),
}

#[derive(Debug, Default)]
struct PlanState {
    /// (op, operations of that kind still to pass, fault).
    pending: Vec<(IoOp, u64, Fault)>,
    /// Fail every operation of a kind with an errno.
    always: HashMap<IoOp, i32>,
    /// Fail every wait with an errno, reaping nothing (a broken ring).
    waits: Option<i32>,
    injected: u64,
}

/// What to inject and when; shared between the test and the engine.
#[derive(Debug, Default)]
pub struct FaultPlan {
    state: Mutex<PlanState>,
}

impl FaultPlan {
    /// An empty plan.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Injects `fault` into the operation of kind `op` after `skip` more
    /// operations of that kind have been started (`skip = 0`: the next).
    /// The continuation of a short transfer and the retry of an `EINTR`
    /// count as operations.
    pub fn inject(&self, op: IoOp, skip: u64, fault: Fault) {
        self.state.lock().pending.push((op, skip, fault));
    }

    /// Fails every later operation of kind `op` with `errno` (a dead disk).
    pub fn fail_all(&self, op: IoOp, errno: i32) {
        self.state.lock().always.insert(op, errno);
    }

    /// Fails every later wait for completions with `errno`, reaping
    /// nothing: operations already started never come back (an engine
    /// that broke with requests in flight).
    pub fn fail_waits(&self, errno: i32) {
        self.state.lock().waits = Some(errno);
    }

    /// Removes every fault.
    pub fn clear(&self) {
        let mut s = self.state.lock();
        s.pending.clear();
        s.always.clear();
        s.waits = None;
    }

    /// How many faults have fired.
    pub fn injected(&self) -> u64 {
        self.state.lock().injected
    }

    fn next(&self, op: IoOp) -> Option<Fault> {
        let mut s = self.state.lock();
        if let Some(&errno) = s.always.get(&op) {
            s.injected += 1;
            return Some(Fault::Errno(errno));
        }
        // The first due entry fires; every other entry for this kind of
        // operation counts one operation passing.
        let fired = s.pending.iter().position(|e| e.0 == op && e.1 == 0);
        for (i, entry) in s.pending.iter_mut().enumerate() {
            if entry.0 == op && Some(i) != fired && entry.1 > 0 {
                entry.1 -= 1;
            }
        }
        let i = fired?;
        let (_, _, fault) = s.pending.remove(i);
        s.injected += 1;
        Some(fault)
    }
}

/// An engine that injects the faults of a [`FaultPlan`] into another engine.
pub struct FaultEngine {
    inner: Arc<dyn IoEngine>,
    plan: Arc<FaultPlan>,
}

impl FaultEngine {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn IoEngine>, plan: Arc<FaultPlan>) -> Self {
        Self { inner, plan }
    }
}

impl IoEngine for FaultEngine {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn open_raw(
        &self,
        file: &Arc<File>,
        depth: usize,
        pool: Option<&Arc<super::buf::BufPool>>,
    ) -> Result<Box<dyn RawQueue>> {
        Ok(Box::new(FaultQueue {
            inner: self.inner.open_raw(file, depth, pool)?,
            plan: self.plan.clone(),
            failed: Vec::new(),
            flips: HashMap::new(),
        }))
    }
}

struct FaultQueue {
    inner: Box<dyn RawQueue>,
    plan: Arc<FaultPlan>,
    failed: Vec<(u32, io::Result<usize>)>,
    /// Ops whose data gets (Read) or got (Write) a bit flipped: id → op.
    flips: HashMap<u32, RawOp>,
}

fn flip(op: &RawOp) {
    // SAFETY: `op` describes memory the IoQueue keeps valid until this op's
    // completion has been returned from `wait`; we touch it only before
    // handing a write to the inner engine or after the inner engine has
    // completed the op, when no one else accesses it.
    unsafe { *op.ptr.add(op.len / 2) ^= 0x10 };
}

// SAFETY: an op failed here is reported once (from `failed`) and never
// reaches the inner queue; every other op is forwarded and reported when the
// inner queue (itself a RawQueue) reports it. `flip` touches memory only
// before forwarding or after the inner report.
unsafe impl RawQueue for FaultQueue {
    unsafe fn push(&mut self, mut op: RawOp) {
        match self.plan.next(op.op) {
            Some(Fault::Errno(errno)) => {
                self.failed
                    .push((op.id, Err(io::Error::from_raw_os_error(errno))));
                return;
            }
            Some(Fault::Short(max)) if max < op.len => op.len = max,
            Some(Fault::Short(_)) => {}
            Some(Fault::Delay(d)) => std::thread::sleep(d),
            Some(Fault::FlipBit) => {
                if op.op == IoOp::Write {
                    flip(&op);
                }
                self.flips.insert(op.id, op);
            }
            None => {}
        }
        // SAFETY: forwarded under the same contract (a shortened op covers a
        // prefix of the same memory).
        unsafe { self.inner.push(op) }
    }

    fn wait(&mut self, min: usize, out: &mut Vec<(u32, io::Result<usize>)>) -> io::Result<()> {
        let broken = {
            let mut s = self.plan.state.lock();
            s.injected += u64::from(s.waits.is_some());
            s.waits
        };
        if let Some(errno) = broken {
            return Err(io::Error::from_raw_os_error(errno));
        }
        let before = out.len();
        out.append(&mut self.failed);
        let got = out.len() - before;
        let res = self.inner.wait(min.saturating_sub(got), out);
        for (id, _) in &out[before..] {
            if let Some(op) = self.flips.remove(id) {
                // Reads: corrupt what arrived. Writes: restore the caller's
                // buffer (the medium keeps the flipped bit).
                flip(&op);
            }
        }
        res
    }

    fn registered(&self) -> (bool, bool) {
        self.inner.registered()
    }
}
