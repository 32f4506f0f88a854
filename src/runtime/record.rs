//! Recording the runtime's page-access stream to a trace file (text, one
//! decimal page id per access per line, `#` comments: the format of
//! [`crate::trace`]), for
//! `strata trace replay`. A page's id is its buffer's number × 2^32 plus its
//! index in the buffer, so every page of the runtime has its own id.
//!
//! Recording costs one relaxed atomic load per access while off. While on,
//! each recorded access (one in 2^k when sampled, as the counters sample) takes a lock and formats a line into a buffered file.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Where recorded accesses go.
#[derive(Default)]
pub(crate) struct TraceSink {
    /// Fast check on the access path.
    pub(crate) on: AtomicBool,
    state: Mutex<Option<Recording>>,
}

struct Recording {
    out: BufWriter<File>,
    shift: u32,
    sampler: crate::hotness::Sampler,
    accesses: u64,
    error: Option<std::io::Error>,
}

impl TraceSink {
    /// Records an access to page `page` of buffer `buffer`.
    #[inline]
    pub(crate) fn record(&self, buffer: u32, page: usize) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut state = self.state.lock();
        let Some(r) = state.as_mut() else { return };
        let id = (buffer as u64) << 32 | page as u64;
        if r.error.is_some() || !r.sampler.hit(r.shift) {
            return;
        }
        match writeln!(r.out, "{id}") {
            Ok(()) => r.accesses += 1,
            Err(e) => r.error = Some(e),
        }
    }
}

/// What holds the runtime's [`TraceSink`]: a recorder keeps it alive.
pub(crate) trait TraceHost: Send + Sync {
    fn sink(&self) -> &TraceSink;
}

/// A recording in progress; [`finish`](Self::finish) ends it (dropping it
/// ends it too, ignoring errors).
#[must_use = "the recording ends when the guard drops"]
pub struct TraceRecorder {
    rt: Arc<dyn TraceHost>,
    done: bool,
}

impl std::fmt::Debug for TraceRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceRecorder")
    }
}

impl TraceRecorder {
    pub(crate) fn start(rt: Arc<dyn TraceHost>, path: &Path, shift: u32) -> Result<Self> {
        if shift > 16 {
            return Err(Error::invalid(format!(
                "sampling 1 in 2^{shift} accesses: at most 2^16"
            )));
        }
        let mut state = rt.sink().state.lock();
        if state.is_some() {
            return Err(Error::invalid("a trace is already being recorded"));
        }
        let file = File::create(path)
            .map_err(|e| Error::io(format!("creating trace {}", path.display()), e))?;
        let mut out = BufWriter::new(file);
        writeln!(
            out,
            "# strata page-access trace: one page id (buffer << 32 | page) per access; sampled 1 in {}",
            1u64 << shift
        )
        .map_err(|e| Error::io(format!("writing trace {}", path.display()), e))?;
        *state = Some(Recording {
            out,
            shift,
            sampler: crate::hotness::Sampler::new(0x5EED),
            accesses: 0,
            error: None,
        });
        rt.sink().on.store(true, Ordering::Release);
        drop(state);
        Ok(Self { rt, done: false })
    }

    /// Ends the recording: flushes the file and returns how many accesses
    /// it holds, or the first write error.
    pub fn finish(mut self) -> Result<u64> {
        self.done = true;
        self.stop()
    }

    fn stop(&self) -> Result<u64> {
        self.rt.sink().on.store(false, Ordering::Release);
        let Some(mut r) = self.rt.sink().state.lock().take() else {
            return Ok(0);
        };
        if let Some(e) = r.error.take() {
            return Err(Error::io("writing the trace", e));
        }
        r.out
            .flush()
            .map_err(|e| Error::io("flushing the trace", e))?;
        Ok(r.accesses)
    }
}

impl Drop for TraceRecorder {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stop();
        }
    }
}
