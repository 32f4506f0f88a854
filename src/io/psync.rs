//! The psync engine: a pool of threads, each calling `pread`/`pwrite`.
//! Always available; chosen automatically where io_uring is not.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{self, Receiver, Sender};

use super::raw::{EngineKind, IoEngine, IoOp, RawOp, RawQueue};
use crate::error::{Error, Result};

/// Most threads one psync queue starts, whatever its depth.
pub const MAX_THREADS: usize = 64;

/// The psync engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct PsyncEngine;

impl IoEngine for PsyncEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Psync
    }

    fn open_raw(
        &self,
        file: &Arc<File>,
        depth: usize,
        _pool: Option<&Arc<super::buf::BufPool>>,
    ) -> Result<Box<dyn RawQueue>> {
        if depth == 1 {
            // One operation at a time gains nothing from a thread: run it
            // on the caller's thread at `wait`, saving two thread handoffs.
            return Ok(Box::new(InlineQueue {
                file: file.clone(),
                op: None,
            }));
        }
        let threads = depth.clamp(1, MAX_THREADS);
        let (submit_tx, submit_rx) = channel::bounded::<RawOp>(depth.max(1));
        let (done_tx, done_rx) = channel::unbounded();
        let workers = (0..threads)
            .map(|i| {
                let file = file.clone();
                let rx = submit_rx.clone();
                let tx = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("strata-psync-{i}"))
                    .spawn(move || worker(&file, rx, tx))
                    .map_err(|e| Error::io("starting a psync worker thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Box::new(PsyncQueue {
            submit: Some(submit_tx),
            done: done_rx,
            workers,
        }))
    }
}

/// One `pread`/`pwrite` of `op` on `file`.
fn perform(file: &File, op: &RawOp) -> io::Result<usize> {
    let fd = file.as_raw_fd();
    let offset = op.offset as libc::off_t;
    // SAFETY: the IoQueue that pushed `op` keeps `op.ptr` valid for
    // `op.len` bytes and untouched until this completion is delivered
    // (RawQueue::push's contract); `fd` is open because the caller holds
    // `file`.
    let n = unsafe {
        match op.op {
            IoOp::Read => libc::pread(fd, op.ptr.cast(), op.len, offset),
            IoOp::Write => libc::pwrite(fd, op.ptr.cast(), op.len, offset),
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn worker(file: &File, rx: Receiver<RawOp>, tx: Sender<(u32, io::Result<usize>)>) {
    for op in rx {
        if tx.send((op.id, perform(file, &op))).is_err() {
            return;
        }
    }
}

/// The depth-1 queue: the operation runs on the caller's thread.
struct InlineQueue {
    file: Arc<File>,
    op: Option<RawOp>,
}

// SAFETY: `wait` reports the single pushed op once, after `perform`
// returned (the system call's last access to its memory).
unsafe impl RawQueue for InlineQueue {
    unsafe fn push(&mut self, op: RawOp) {
        debug_assert!(self.op.is_none(), "depth 1");
        self.op = Some(op);
    }

    fn wait(&mut self, _min: usize, out: &mut Vec<(u32, io::Result<usize>)>) -> io::Result<()> {
        if let Some(op) = self.op.take() {
            out.push((op.id, perform(&self.file, &op)));
        }
        Ok(())
    }
}

struct PsyncQueue {
    submit: Option<Sender<RawOp>>,
    done: Receiver<(u32, io::Result<usize>)>,
    workers: Vec<JoinHandle<()>>,
}

// SAFETY: each op goes to exactly one worker, which sends its id once,
// after `pread`/`pwrite` returned; `wait` only reports what workers sent.
unsafe impl RawQueue for PsyncQueue {
    unsafe fn push(&mut self, op: RawOp) {
        // The channel's capacity is the queue depth, which the caller never
        // exceeds, so this does not block; the receivers live as long as the
        // workers, which live until `drop`.
        // If the workers are gone (they exit only when the channel closes,
        // or by panicking) the send fails, and so does the next `wait`, which
        // is how the loss is reported.
        if let Some(sender) = &self.submit {
            let _ = sender.send(op);
        }
    }

    fn wait(&mut self, min: usize, out: &mut Vec<(u32, io::Result<usize>)>) -> io::Result<()> {
        for _ in 0..min {
            match self.done.recv() {
                Ok(c) => out.push(c),
                Err(_) => return Err(io::Error::other("psync workers exited")),
            }
        }
        out.extend(self.done.try_iter());
        Ok(())
    }
}

impl Drop for PsyncQueue {
    fn drop(&mut self) {
        // Closing the submission channel ends each worker's loop.
        self.submit = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
