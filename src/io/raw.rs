//! What an engine implements (see [`crate::lowlevel`]): raw operations on
//! raw pointers, which [`IoQueue`](super::IoQueue) makes safe.

use std::fmt;
use std::fs::File;
use std::io;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::buf::BufPool;
use crate::error::Result;

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IoOp {
    /// Read from the file into the buffer.
    Read,
    /// Write the buffer to the file.
    Write,
}

/// An I/O engine: makes [`RawQueue`]s over a file.
pub trait IoEngine: Send + Sync {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;
    /// A raw queue of `depth` over `file`. Buffers of `pool`, if given, may
    /// be registered with the kernel (the queue keeps the pool alive).
    fn open_raw(
        &self,
        file: &Arc<File>,
        depth: usize,
        pool: Option<&Arc<BufPool>>,
    ) -> Result<Box<dyn RawQueue>>;
}

/// The engines strata has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// io_uring: batched submission, registered file.
    Uring,
    /// A thread pool calling `pread`/`pwrite`.
    Psync,
}

impl EngineKind {
    /// The name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Psync => "psync",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A single raw operation as an engine sees it.
#[derive(Debug, Clone, Copy)]
pub struct RawOp {
    /// Identifies the operation in its completion.
    pub id: u32,
    /// Read or write.
    pub op: IoOp,
    /// File offset.
    pub offset: u64,
    /// Start of the memory to transfer.
    pub ptr: *mut u8,
    /// Bytes to transfer.
    pub len: usize,
    /// For memory in a [`BufPool`] buffer: the pool's id and the buffer's
    /// index (an engine that registered that pool can use it).
    pub fixed: Option<(u64, u32)>,
}

// SAFETY: a RawOp is a description of memory whose owner (IoQueue) keeps it
// alive and untouched until the op completes; sending the description to an
// engine thread does not by itself access the memory.
unsafe impl Send for RawOp {}

/// What an engine implements: starts raw operations, reports completions.
///
/// # Safety
///
/// [`IoQueue`](super::IoQueue) frees or reuses an operation's memory as soon as `wait`
/// reports its id, so an implementation must report every pushed id exactly
/// once, only after its last access to the operation's memory, and must not
/// report ids it was not given.
pub unsafe trait RawQueue: Send {
    /// Starts (or queues for the next [`RawQueue::wait`]) one operation.
    /// The caller never has more than the queue's depth in flight.
    ///
    /// # Safety
    /// `op.ptr` must be valid for reads (writes, for `IoOp::Read`) of
    /// `op.len` bytes, and must not be accessed otherwise, until `op.id` is
    /// returned by `wait`.
    unsafe fn push(&mut self, op: RawOp);

    /// Submits what was pushed and waits until at least `min` operations
    /// have completed, appending `(id, bytes transferred or error)` to `out`.
    /// An `Err` means the wait itself failed; operations stay in flight.
    fn wait(&mut self, min: usize, out: &mut Vec<(u32, io::Result<usize>)>) -> io::Result<()>;

    /// Whether the engine registered the file and the buffer pool with the
    /// kernel (io_uring's fixed files and buffers); `(false, false)` for
    /// engines without such a thing.
    fn registered(&self) -> (bool, bool) {
        (false, false)
    }
}
