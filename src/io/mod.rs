//! I/O engines under the NVMe tier.
//!
//! Two layers, so that the logic every engine needs is written once:
//! - [`RawQueue`]: what an engine implements — start single `pread`/`pwrite`
//!   style operations on raw pointers and report how many bytes each moved.
//!   `io_uring` ([`UringEngine`]) and a thread pool of `pread`/`pwrite` ([`PsyncEngine`]).
//!   It and the [`IoEngine`] trait that makes raw queues are in `raw.rs`,
//!   below the engines' files; the buffers in `buf.rs`.
//! - [`IoQueue`]: the safe queue callers use. It takes owned
//!   [`AlignedBuf`]s and hands them back with the result (what makes
//!   io_uring sound: the kernel may write into a buffer until its completion
//!   is reaped), continues short transfers, retries `EINTR`/`EAGAIN`, and
//!   turns errno values into typed errors.
//!
//! A queue belongs to one thread at a time (one ring per worker).

pub(crate) mod buf;
pub mod fault;
pub(crate) mod psync;
pub(crate) mod raw;
pub(crate) mod uring;

use std::fmt;
use std::fs::File;
use std::io;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

pub use buf::{AlignedBuf, IO_ALIGN};
pub use psync::PsyncEngine;
pub use uring::UringEngine;

pub use raw::{EngineKind, IoEngine, IoOp};
pub(crate) use raw::{RawOp, RawQueue};

pub(crate) use buf::BufPool;

/// One operation handed to an [`IoQueue`].
#[derive(Debug)]
pub struct IoRequest {
    /// Read or write.
    pub op: IoOp,
    /// Byte offset in the file (a multiple of [`IO_ALIGN`] for O_DIRECT).
    pub offset: u64,
    /// The buffer; its whole length is transferred.
    pub buf: AlignedBuf,
    /// The caller's tag, returned with the completion.
    pub tag: u64,
}

/// A finished operation: the buffer comes back whatever happened.
#[derive(Debug)]
pub struct IoCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Read or write.
    pub op: IoOp,
    /// The request's offset.
    pub offset: u64,
    /// The request's buffer (filled, for a successful read).
    pub buf: AlignedBuf,
    /// `Ok` once every byte was transferred.
    pub result: Result<()>,
}

/// Which engine to use: a specific one, or `auto` (io_uring where it works).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    /// io_uring where it works, else psync.
    #[default]
    Auto,
    /// io_uring, or an error where it is unavailable.
    Uring,
    /// The psync thread pool.
    Psync,
}

impl FromStr for EngineChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(Self::Uring),
            "psync" => Ok(Self::Psync),
            _ => Err(Error::invalid(format!(
                "unknown io engine {s:?} (use auto, uring or psync)"
            ))),
        }
    }
}

/// The engine for `choice`.
pub fn engine(choice: EngineChoice) -> Result<Arc<dyn IoEngine>> {
    match choice {
        EngineChoice::Psync => Ok(Arc::new(psync::PsyncEngine)),
        EngineChoice::Uring => {
            uring::probe()?;
            Ok(Arc::new(uring::UringEngine::default()))
        }
        EngineChoice::Auto => match uring::probe() {
            Ok(()) => Ok(Arc::new(uring::UringEngine::default())),
            Err(_) => Ok(Arc::new(psync::PsyncEngine)),
        },
    }
}

/// How often `EINTR`/`EAGAIN` or a zero-byte write is retried before the
/// operation fails.
const MAX_RETRIES: u32 = 64;

struct InFlight {
    req: IoRequest,
    done: usize,
    retries: u32,
}

/// The safe queue over a [`RawQueue`]: owned buffers in, owned buffers out.
pub struct IoQueue {
    raw: Box<dyn RawQueue>,
    slots: Vec<Option<InFlight>>,
    free_ids: Vec<u32>,
    in_flight: usize,
    depth: usize,
    kind: EngineKind,
    raw_done: Vec<(u32, io::Result<usize>)>,
}

impl fmt::Debug for IoQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoQueue")
            .field("engine", &self.kind)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl IoQueue {
    /// Waits for every operation in flight, dropping their completions:
    /// true once none is left. If waiting fails, their buffers are leaked
    /// (the kernel may still write them) and false says so: the places
    /// those operations write may still change, and must not be reused.
    /// A queue that failed to settle is left empty and should be dropped.
    pub fn settle(&mut self) -> bool {
        let mut done = Vec::new();
        while self.in_flight > 0 {
            done.clear();
            if self.raw.wait(self.in_flight, &mut done).is_err() {
                let slots = std::mem::take(&mut self.slots);
                std::mem::forget(slots);
                self.in_flight = 0;
                // No ids: a push onto this queue is handed back, never
                // started into slots that are gone.
                self.free_ids.clear();
                return false;
            }
            for (id, _) in done.drain(..) {
                if self.slots[id as usize].take().is_some() {
                    self.in_flight -= 1;
                    self.free_ids.push(id);
                }
            }
        }
        true
    }

    /// A queue of `depth` (1 ..= 4096) over `file` on `engine`; buffers of
    /// `pool` get the engine's fast path where it has one.
    pub fn new(
        engine: &dyn IoEngine,
        file: &Arc<File>,
        depth: usize,
        pool: Option<&Arc<BufPool>>,
    ) -> Result<Self> {
        if !(1..=4096).contains(&depth) {
            return Err(Error::invalid(format!(
                "queue depth {depth} is outside 1..=4096"
            )));
        }
        Ok(Self {
            raw: engine.open_raw(file, depth, pool)?,
            slots: (0..depth).map(|_| None).collect(),
            free_ids: (0..depth as u32).rev().collect(),
            in_flight: 0,
            depth,
            kind: engine.kind(),
            raw_done: Vec::with_capacity(depth),
        })
    }

    /// The engine behind this queue.
    pub fn engine(&self) -> EngineKind {
        self.kind
    }

    /// Maximum operations in flight.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Operations in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether the engine registered (the file, the buffer pool) with the
    /// kernel.
    pub fn registered(&self) -> (bool, bool) {
        self.raw.registered()
    }

    /// Starts a request; hands it back unchanged when the queue is full.
    /// The operation is submitted to the kernel at the next [`IoQueue::reap`]
    /// (so pushes batch).
    pub fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest> {
        let Some(id) = self.free_ids.pop() else {
            return Err(req);
        };
        self.slots[id as usize] = Some(InFlight {
            req,
            done: 0,
            retries: 0,
        });
        self.in_flight += 1;
        self.start(id);
        Ok(())
    }

    fn start(&mut self, id: u32) {
        let f = self.slots[id as usize]
            .as_mut()
            .expect("started op is in flight");
        let len = f.req.buf.len() - f.done;
        // SAFETY: `done < len` for an op being (re)started, so the pointer
        // stays inside the buffer.
        let ptr = unsafe { f.req.buf.as_mut_ptr().add(f.done) };
        let op = RawOp {
            id,
            op: f.req.op,
            offset: f.req.offset + f.done as u64,
            ptr,
            len,
            fixed: f.req.buf.registered_index(),
        };
        // SAFETY: the buffer is owned by `self.slots[id]` and is neither
        // accessed nor dropped until `id` comes back from `wait`: completions
        // are the only place a slot is emptied, and `Drop` drains the raw
        // queue before the slots are freed.
        unsafe { self.raw.push(op) };
    }

    /// Submits pushed requests and waits until at least `min` requests (at
    /// most those in flight) have finished, appending them to `out`.
    /// Per-request failures are in each completion's `result`; an `Err`
    /// here means the engine itself failed.
    pub fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<()> {
        let target = out.len() + min.min(self.in_flight);
        loop {
            let want = target.saturating_sub(out.len());
            let mut raw_done = std::mem::take(&mut self.raw_done);
            let waited = self.raw.wait(want, &mut raw_done);
            for (id, res) in raw_done.drain(..) {
                self.complete(id, res, out);
            }
            self.raw_done = raw_done;
            waited.map_err(|e| Error::io(format!("{} engine wait", self.kind), e))?;
            if out.len() >= target {
                return Ok(());
            }
        }
    }

    fn complete(&mut self, id: u32, res: io::Result<usize>, out: &mut Vec<IoCompletion>) {
        let f = self.slots[id as usize]
            .as_mut()
            .expect("completion of an op in flight");
        let (op, total, offset) = (f.req.op, f.req.buf.len(), f.req.offset);
        let what = || {
            let verb = match op {
                IoOp::Read => "read",
                IoOp::Write => "write",
            };
            format!("{verb} of {total} bytes at offset {offset}")
        };
        let outcome: Option<Result<()>> = match res {
            Ok(n) if n > 0 => {
                f.done += n;
                (f.done >= total).then_some(Ok(()))
            }
            Ok(_) if op == IoOp::Read => Some(Err(Error::new(
                ErrorKind::Io,
                format!("{}: end of file after {} bytes", what(), f.done),
            ))),
            Ok(_) => {
                f.retries += 1;
                (f.retries > MAX_RETRIES).then(|| {
                    Err(Error::new(
                        ErrorKind::Io,
                        format!("{}: the device keeps accepting no bytes", what()),
                    ))
                })
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) => {
                f.retries += 1;
                (f.retries > MAX_RETRIES).then(|| Err(Error::io(what(), e)))
            }
            Err(e) => Some(Err(Error::io(what(), e))),
        };
        match outcome {
            None => self.start(id),
            Some(result) => {
                let f = self.slots[id as usize].take().expect("op in flight");
                self.free_ids.push(id);
                self.in_flight -= 1;
                out.push(IoCompletion {
                    tag: f.req.tag,
                    op,
                    offset,
                    buf: f.req.buf,
                    result,
                });
            }
        }
    }

    /// Runs one request to completion on an idle queue (push + reap).
    /// An `Err` means the engine itself failed or the queue was busy; the
    /// request then stays with the queue, which should be dropped.
    pub fn run(&mut self, req: IoRequest) -> Result<IoCompletion> {
        if self.in_flight != 0 {
            return Err(Error::invalid("IoQueue::run needs an idle queue"));
        }
        let tag = req.tag;
        self.push(req)
            .map_err(|_| Error::invalid("i/o queue has depth 0"))?;
        let mut out = Vec::with_capacity(1);
        self.reap(1, &mut out)?;
        let pos = out
            .iter()
            .position(|c| c.tag == tag)
            .expect("the only op in flight completed");
        Ok(out.swap_remove(pos))
    }
}
impl Drop for IoQueue {
    fn drop(&mut self) {
        // Buffers may still be in the kernel's hands: wait for every op
        // before the slots (and their buffers) are freed. If waiting itself
        // fails, leak the buffers rather than free memory the kernel may
        // still write.
        self.settle();
    }
}
