//! Streams and events: the order work runs in, and waits for it. What a
//! stream carries is in the files above this one: copies (`copy.rs`) and
//! kernel launches (`module.rs`).

use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::context::Context;
use super::errors::driver;
use crate::error::{Error, Result};

struct Inner {
    ctx: Context,
    raw: sys::CUstream,
}

// SAFETY: a driver stream handle, usable from any thread once its context
// is current there (every call binds it first).
unsafe impl Send for Inner {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.ctx.bind_quietly() {
            // SAFETY: the stream belongs to the context just made current;
            // destroyed once, after its work.
            unsafe {
                let _ = result::stream::synchronize(self.raw);
                let _ = result::stream::destroy(self.raw);
            }
        }
    }
}

/// A non-blocking stream (no implicit ordering with the legacy default
/// stream): work queued on it runs in order. Cloning gives another handle
/// to the same stream.
#[derive(Clone)]
pub struct Stream(Arc<Inner>);

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:p} on {:?})", self.0.raw, self.0.ctx)
    }
}

impl Context {
    /// A new stream of this context ([`Stream::new`]).
    pub fn stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// A new event of this context ([`Event::new`]).
    pub fn event(&self) -> Result<Event> {
        Event::new(self)
    }
}

impl Stream {
    /// A new stream of `ctx`.
    pub fn new(ctx: &Context) -> Result<Self> {
        ctx.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("cuStreamCreate", e))?;
        Ok(Self(Arc::new(Inner {
            ctx: ctx.clone(),
            raw,
        })))
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Context {
        &self.0.ctx
    }

    pub(super) fn raw(&self) -> sys::CUstream {
        self.0.raw
    }

    /// Waits until everything queued so far has run. Straight through the
    /// driver: it waits even where an earlier call recorded an error (see
    /// the [module docs](super)), and reports the first error of this
    /// stream's work.
    pub fn synchronize(&self) -> Result<()> {
        self.0.ctx.bind()?;
        // SAFETY: the stream belongs to the context just made current.
        unsafe { result::stream::synchronize(self.0.raw) }
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    /// [`synchronize`](Self::synchronize) for `Drop`s and for cleaning up
    /// after a failure, where the error has nowhere to go.
    pub fn synchronize_quietly(&self) {
        let _ = self.synchronize();
    }
}

/// A marker in a stream's work (timing disabled): waiting for it waits for
/// the work queued before it was recorded.
pub struct Event {
    ctx: Context,
    raw: sys::CUevent,
}

// SAFETY: a driver event handle, usable from any thread once its context
// is current there (every call binds it first).
unsafe impl Send for Event {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:p})", self.raw)
    }
}

impl Event {
    /// A new event of `ctx`, recorded nowhere yet (waiting for it returns
    /// at once).
    pub fn new(ctx: &Context) -> Result<Self> {
        ctx.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate", e))?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Marks the work queued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if !self.ctx.same(stream.context()) {
            return Err(Error::invalid(
                "the event belongs to another context than the stream",
            ));
        }
        self.ctx.bind()?;
        // SAFETY: event and stream belong to the context just made current.
        unsafe { result::event::record(self.raw, stream.raw()) }
            .map_err(|e| driver("cuEventRecord", e))
    }

    /// Waits until the work marked by the last [`record`](Self::record) has
    /// run.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event belongs to the context just made current.
        unsafe { result::event::synchronize(self.raw) }.map_err(|e| driver("cuEventSynchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind_quietly() {
            // SAFETY: created in this context, destroyed once.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}
