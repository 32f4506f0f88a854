//! `strata.Buffer` and `strata.Ticket`.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use strata::Tier;

use crate::convert::{byte_range, offset};
use crate::dlpack::{self, Pin};
use crate::errors::{invalid, raise};
use crate::pybuf::Contiguous;

/// An allocation whose pages may live in any tier; freed when the last
/// reference to it (its own, or a Pin's, or an exported tensor's) goes.
///
/// Ranges are `(start, stop)` tuples of byte offsets, half-open like a
/// slice (`(0, 4096)` is the first 4 KiB), or None for the whole buffer.
/// Tiers are named "device", "host", "cxl" or "nvme"; an unknown name, or
/// a tier the runtime lacks, raises InvalidArgumentError (a ValueError).
/// Every call that can wait releases the GIL.
#[pyclass(module = "strata", frozen)]
pub(crate) struct Buffer {
    pub(crate) rt: strata::Runtime,
    pub(crate) buf: Arc<strata::Buffer>,
}

impl Buffer {
    pub(crate) fn new(rt: strata::Runtime, buf: strata::Buffer) -> Self {
        Self {
            rt,
            buf: Arc::new(buf),
        }
    }
}

#[pymethods]
impl Buffer {
    /// The length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.buf.len()
    }

    fn __len__(&self) -> usize {
        // A buffer lives in this address space's tiers: its length fits.
        usize::try_from(self.buf.len()).unwrap_or(usize::MAX)
    }

    /// The number of pages.
    #[getter]
    fn page_count(&self) -> usize {
        self.buf.page_count()
    }

    /// The page size in bytes.
    #[getter]
    fn page_size(&self) -> usize {
        self.rt.page_size()
    }

    /// Reads n bytes at offset (n=None: to the end) into a new bytes
    /// object, from whichever tiers hold them (pages never written read as
    /// zeros).
    #[pyo3(signature = (offset = 0, n = None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: i64,
        n: Option<i64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let at = crate::convert::offset(offset, "offset")?;
        let len = self.buf.len();
        let n = match n {
            Some(n) => crate::convert::offset(n, "n")?,
            None => len.saturating_sub(at),
        };
        // Refused before allocating n bytes.
        if at.checked_add(n).is_none_or(|end| end > len) {
            return Err(invalid(format!(
                "range {at}+{n} exceeds the buffer's {len} bytes"
            )));
        }
        let n = usize::try_from(n).map_err(|_| invalid("n is too large"))?;
        PyBytes::new_with(py, n, |out| {
            py.detach(|| self.buf.read(at, out)).map_err(raise)
        })
    }

    /// Reads len(out) bytes at offset straight into out, any writable
    /// C-contiguous buffer-protocol object (bytearray, memoryview, a NumPy
    /// array ...), without an intermediate copy. Returns the bytes read.
    fn readinto(&self, py: Python<'_>, offset: i64, out: &Bound<'_, PyAny>) -> PyResult<usize> {
        let at = crate::convert::offset(offset, "offset")?;
        let mut view = Contiguous::writable(out)?;
        let dst = view.as_mut_slice();
        let n = dst.len();
        // Memory strata lent out (a DLPack view of a pin) as dst: the read
        // goes through a copy (Buffer::read).
        py.detach(|| self.buf.read(at, dst)).map_err(raise)?;
        Ok(n)
    }

    /// Writes the bytes of data at offset: any C-contiguous buffer-protocol
    /// object (bytes, bytearray, memoryview, a NumPy array ...), read in
    /// place. A page written for the first time takes a slot in the
    /// fastest tier with room (or the preferred one).
    fn write(&self, py: Python<'_>, offset: i64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let at = crate::convert::offset(offset, "offset")?;
        let view = Contiguous::readable(data)?;
        let src = view.as_slice();
        // As in readinto: strata's own memory as the source goes through a
        // copy (Buffer::write).
        py.detach(|| self.buf.write(at, src)).map_err(raise)
    }

    /// Moves the pages of range into tier in the background; the call
    /// returns once the moves are queued (with the GIL released: it can
    /// wait while the engine's queues are full), and the Ticket's wait()
    /// raises the first error. A range outside the buffer is refused here.
    /// Where tier is full, its clean copies are dropped first, then its
    /// unpinned pages outside range not referenced since the clock hand
    /// last passed are demoted; what would need a page referenced since is
    /// declined (Ticket.declined counts it; wait() still succeeds).
    /// OutOfCapacityError when no page could make room at all (what fits
    /// moves). Pinned pages stay where they are pinned, pages never written
    /// stay unmaterialized.
    fn prefetch(&self, py: Python<'_>, range: Option<(i64, i64)>, tier: &str) -> PyResult<Ticket> {
        // A range past the end is refused here, not at the ticket's wait.
        let r = byte_range(range, self.buf.len(), "buffer")?;
        let t = crate::convert::tier(tier)?;
        let ticket = py.detach(|| self.buf.prefetch(r, t));
        Ok(Ticket { ticket })
    }

    /// Cancels the request of ticket (one of this runtime's, a prefetch
    /// above all): its batches still queued are dropped, their pages left
    /// where they are; a batch already moving finishes. Returns the pages
    /// dropped (0 for a request already finished).
    fn cancel(&self, py: Python<'_>, ticket: &Ticket) -> usize {
        py.detach(|| self.buf.cancel(&ticket.ticket))
    }

    /// Moves the pages of range that live in tiers faster than tier down to
    /// it (or, where it is full, to the next slower tier with room) and
    /// returns when they are there. OutOfCapacityError when none has room.
    fn evict(&self, py: Python<'_>, range: Option<(i64, i64)>, tier: &str) -> PyResult<()> {
        let r = byte_range(range, self.buf.len(), "buffer")?;
        let t = crate::convert::tier(tier)?;
        py.detach(|| self.buf.evict(r, t)).map_err(raise)
    }

    /// The tier page (an index, not a byte offset) lives in; None while it
    /// has never been written.
    fn tier_of(&self, page: i64) -> PyResult<Option<&'static str>> {
        let p = usize::try_from(offset(page, "page")?).map_err(|_| invalid("page is too large"))?;
        Ok(self.buf.tier_of(p).map_err(raise)?.map(Tier::name))
    }

    /// How many pages live in each tier now: {"device": n, "host": n,
    /// "cxl": n, "nvme": n, "unwritten": n, "lost": n}.
    fn residency<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.buf.residency();
        let d = PyDict::new(py);
        for t in Tier::ALL {
            d.set_item(t.name(), r.in_tier(t))?;
        }
        d.set_item("unwritten", r.unwritten)?;
        d.set_item("lost", r.lost)?;
        Ok(d)
    }

    /// Makes the pages of range resident in tier ("device", "host" or
    /// "cxl"; NVMe pages have no address) and keeps them there until the
    /// Pin is released (unpin(), the end of a with block, or its
    /// collection). The Pin exports the range through DLPack
    /// (numpy.from_dlpack(pin), torch.from_dlpack(pin)) as a 1-D tensor of
    /// dtype ("uint8", "int8", "int16", "int32", "int64", "uint16",
    /// "uint32", "uint64", "float16", "bfloat16", "float32", "float64",
    /// "bool"): the range must hold whole elements and start aligned to
    /// one. A page pinned in another tier (by another Pin, or by a tensor
    /// exported from one, which keeps its pages pinned after the Pin is
    /// released) is refused with InvalidArgumentError.
    #[pyo3(signature = (range, tier, *, dtype = "uint8"))]
    fn pin(
        &self,
        py: Python<'_>,
        range: Option<(i64, i64)>,
        tier: &str,
        dtype: &str,
    ) -> PyResult<Pin> {
        let r = byte_range(range, self.buf.len(), "buffer")?;
        let t = crate::convert::tier(tier)?;
        let dt = dlpack::dtype(dtype)?;
        strata_ffi::dlpack_elements(r.start, r.end - r.start, dt).map_err(raise)?;
        let pin = py
            .detach(|| self.buf.pin_owned(r.clone(), t))
            .map_err(raise)?;
        Ok(Pin::new(&self.rt, &self.buf, pin, r, dtype, dt, true))
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.Buffer(nbytes={}, pages={})",
            self.buf.len(),
            self.buf.page_count()
        )
    }
}

/// The handle of a background request (Buffer.prefetch). Dropping it does
/// not cancel the request; Buffer.cancel does.
#[pyclass(module = "strata", frozen)]
pub(crate) struct Ticket {
    ticket: strata::Ticket,
}

#[pymethods]
impl Ticket {
    /// Waits for the request (at most timeout seconds if given, with the
    /// GIL released) and raises its first error. Returns True when it has
    /// finished, False when the timeout passed first. Ctrl-C (any signal
    /// handler that raises) interrupts the wait; the request goes on.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout {
            None => Duration::MAX,
            Some(s) if s.is_finite() && s >= 0.0 => {
                Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
            }
            Some(s) => return Err(invalid(format!("timeout {s} is not a number of seconds"))),
        };
        // In slices, so that Python's signal handlers run between them.
        const SLICE: Duration = Duration::from_millis(100);
        let deadline = std::time::Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(std::time::Instant::now())
            });
            if let Some(result) = py.detach(|| self.ticket.wait_timeout(left.min(SLICE))) {
                return result.map(|()| true).map_err(raise);
            }
            if left <= SLICE {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }

    /// Whether the request has finished (wait() then returns at once, or
    /// raises its error).
    fn done(&self) -> bool {
        self.ticket.poll().is_some()
    }

    /// Pages of a prefetch declined so far: the tier was full and making
    /// room would have demoted pages referenced since the clock hand last
    /// passed. They stay readable where they are; wait() still succeeds.
    #[getter]
    fn declined(&self) -> usize {
        self.ticket.declined()
    }

    fn __repr__(&self) -> String {
        let state = if self.done() { "done" } else { "running" };
        format!("strata.Ticket({state})")
    }
}
