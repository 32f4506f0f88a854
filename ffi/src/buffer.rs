//! Buffers: alloc/free, read/write at any offset, evict, prefetch and the
//! tickets it returns.

use std::ffi::{c_int, c_void};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use strata::runtime::Placement;
use strata::Buffer;

use crate::cast::{self, SetOpt};
use crate::enums::{strata_tier, tier, tier_code};
use crate::objects::{
    self, strata_buffer, strata_runtime, strata_ticket, BufferObj, BUFFERS, TICKETS,
};
use crate::status::{boundary, Fail, R, STRATA_OK, STRATA_PENDING};

/// `offset..offset + len`, refusing a sum that overflows.
pub(crate) fn range(offset: u64, len: u64) -> R<Range<u64>> {
    let end = offset
        .checked_add(len)
        .ok_or_else(|| Fail::invalid(format!("offset {offset} + length {len} overflows")))?;
    Ok(offset..end)
}

/// Refuses a range beyond the buffer before the caller's pointer is turned
/// into a slice of that length (a length larger than the caller's memory
/// must not become a slice at all).
#[inline]
fn fits(b: &Buffer, offset: u64, len: usize) -> R<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= b.len() => Ok(()),
        _ => Err(Fail::invalid(format!(
            "range {offset}+{len} exceeds the buffer's {} bytes",
            b.len()
        ))),
    }
}

unsafe fn alloc(
    rt: *const strata_runtime,
    bytes: u64,
    placement: Placement,
    out: *mut *mut strata_buffer,
) -> R {
    // SAFETY: NULL or writable (the exported functions' contract).
    let out = unsafe { cast::out(out, "out") }?;
    let rt = objects::get(rt)?;
    let buffer = Arc::new(rt.rt.alloc_with(bytes, placement)?);
    let bits = rt.adopt(
        &BUFFERS,
        BufferObj {
            buffer,
            rt: rt.clone(),
        },
    )?;
    out.set(objects::ptr(bits));
    Ok(STRATA_OK)
}

/// Allocates `bytes` (rounded up to whole pages; 0 is refused) and stores
/// the buffer's handle in `*out`. Capacity for every page is reserved
/// across the tiers at once (`STRATA_ERR_OUT_OF_CAPACITY` when they cannot
/// hold it); pages take a slot in the fastest tier with room when first
/// written, and read as zeros before. Thread-safe; the buffer may be used
/// from any thread, and is freed by `strata_buffer_free` or with its
/// runtime.
///
/// # Safety
/// `out` is NULL or points to a writable `strata_buffer *`.
#[no_mangle]
pub unsafe extern "C" fn strata_alloc(
    rt: *const strata_runtime,
    bytes: u64,
    out: *mut *mut strata_buffer,
) -> c_int {
    // SAFETY: forwarded contract.
    boundary("strata_alloc", || unsafe {
        alloc(rt, bytes, Placement::Fastest, out)
    })
}

/// As `strata_alloc`, but pages go to `tier` while it has room (then to the
/// fastest tier with room). The tier must be configured.
///
/// # Safety
/// `out` is NULL or points to a writable `strata_buffer *`.
#[no_mangle]
pub unsafe extern "C" fn strata_alloc_in(
    rt: *const strata_runtime,
    bytes: u64,
    preferred: strata_tier,
    out: *mut *mut strata_buffer,
) -> c_int {
    boundary("strata_alloc_in", || {
        let placement = Placement::Prefer(tier(preferred)?);
        // SAFETY: forwarded contract.
        unsafe { alloc(rt, bytes, placement, out) }
    })
}

/// Frees a buffer: its handle is dead at once; its pages and reservation
/// are returned when the last pin, launch or DLPack tensor on it ends (at
/// once when there is none). A device map keeps nothing: its launches
/// after this fail with `STRATA_ERR_CLOSED`. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_buffer_free(buf: *mut strata_buffer) -> c_int {
    boundary("strata_buffer_free", || {
        // Pins and DLPack tensors made from it may keep the buffer itself
        // alive; its device maps' launches end with the handle all the same.
        if let Some(b) = objects::remove(buf)? {
            b.buffer.close_launches();
        }
        Ok(STRATA_OK)
    })
}

/// Stores the buffer's length in bytes (as allocated) in `*len`.
/// Thread-safe.
///
/// # Safety
/// `len` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_buffer_len(buf: *const strata_buffer, len: *mut u64) -> c_int {
    boundary("strata_buffer_len", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(len, "len") }?;
        out.set(objects::with(buf, |b| b.buffer.len())?);
        Ok(STRATA_OK)
    })
}

/// Stores the buffer's number of pages in `*pages`. Thread-safe.
///
/// # Safety
/// `pages` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_buffer_page_count(
    buf: *const strata_buffer,
    pages: *mut usize,
) -> c_int {
    boundary("strata_buffer_page_count", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(pages, "pages") }?;
        out.set(objects::with(buf, |b| b.buffer.page_count())?);
        Ok(STRATA_OK)
    })
}

/// Stores in `*tier_out` the tier page `page` lives in, or
/// `STRATA_TIER_NONE` if it was never written. The answer may be stale by
/// the time it returns (pages move in the background). Thread-safe.
///
/// # Safety
/// `tier_out` is NULL or points to a writable `strata_tier`.
#[no_mangle]
pub unsafe extern "C" fn strata_buffer_tier_of(
    buf: *const strata_buffer,
    page: usize,
    tier_out: *mut strata_tier,
) -> c_int {
    boundary("strata_buffer_tier_of", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(tier_out, "tier_out") }?;
        out.set(tier_code(objects::get(buf)?.buffer.tier_of(page)?));
        Ok(STRATA_OK)
    })
}

/// Reads `len` bytes at `offset` into `dst`, from whichever tiers hold them
/// (never-written pages read as zeros). `offset + len` must lie within the
/// buffer. Thread-safe: reads and writes of one buffer from many threads
/// are each atomic per page.
///
/// # Safety
/// When `len > 0`, `dst` is NULL or points to `len` writable bytes that no
/// other thread touches during the call.
#[no_mangle]
pub unsafe extern "C" fn strata_read(
    buf: *const strata_buffer,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    boundary("strata_read", || {
        let b = objects::get(buf)?;
        fits(&b.buffer, offset, len)?;
        // SAFETY: NULL or `len` writable bytes (this function's contract).
        let dst = unsafe { cast::bytes_mut(dst, len, "dst") }?;
        b.buffer.read(offset, dst)?;
        Ok(STRATA_OK)
    })
}

/// Writes `len` bytes from `src` at `offset`. A page written for the first
/// time takes a slot in the fastest tier with room (or the preferred one).
/// Pages mapped by a read-only launch refuse writes until it ends. If the
/// call fails, pages before the failing one are written, and the failing
/// page is as it was. Thread-safe.
///
/// # Safety
/// When `len > 0`, `src` is NULL or points to `len` readable bytes that no
/// other thread writes during the call.
#[no_mangle]
pub unsafe extern "C" fn strata_write(
    buf: *const strata_buffer,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> c_int {
    boundary("strata_write", || {
        let b = objects::get(buf)?;
        fits(&b.buffer, offset, len)?;
        // SAFETY: NULL or `len` readable bytes (this function's contract).
        let src = unsafe { cast::bytes(src, len, "src") }?;
        b.buffer.write(offset, src)?;
        Ok(STRATA_OK)
    })
}

/// Moves the written pages of `offset..offset + len` that live in tiers
/// faster than `tier` down to it (or, where it is full, to the next slower
/// tier with room) and returns when they have moved. Pinned pages stay.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn strata_evict(
    buf: *const strata_buffer,
    offset: u64,
    len: u64,
    tier_to: strata_tier,
) -> c_int {
    boundary("strata_evict", || {
        let to = tier(tier_to)?;
        objects::get(buf)?.buffer.evict(range(offset, len)?, to)?;
        Ok(STRATA_OK)
    })
}

/// Starts moving the written pages of `offset..offset + len` into `tier`
/// (up or down) in the background and stores a ticket for the request in
/// `*ticket`. Errors of the arguments are returned here, and then no ticket
/// is made and nothing moves: a bad handle, a NULL or misaligned `ticket`,
/// an unknown tier or one the runtime lacks, a range that overflows or
/// passes the buffer's end (`STRATA_ERR_INVALID_ARGUMENT`), and
/// `STRATA_ERR_CLOSED` when the runtime is destroyed meanwhile (then no
/// ticket is made, though moves may have started; they end with the
/// runtime). Every error
/// of the moves themselves (`STRATA_ERR_OUT_OF_CAPACITY`, `_IO`, …) comes
/// from `strata_ticket_wait`/`_poll`, however fast the move failed: this
/// call then still returns `STRATA_OK` and a ticket. Where `tier` is full,
/// its clean copies are dropped first, then its unpinned pages outside the
/// range (of any buffer) not referenced since the clock hand last passed
/// are demoted; what would need a page referenced since is declined: it
/// stays readable where it is, the request still succeeds, and
/// `strata_ticket_declined` counts it. When no page could make room at
/// all, the pages that fit move and the ticket's status is
/// `STRATA_ERR_OUT_OF_CAPACITY`. Pages that cannot move stay readable
/// where they are. The ticket must be freed with
/// `strata_ticket_free` (freeing it does not cancel the request).
/// Thread-safe.
///
/// # Safety
/// `ticket` is NULL or points to a writable `strata_ticket *`.
#[no_mangle]
pub unsafe extern "C" fn strata_prefetch(
    buf: *const strata_buffer,
    offset: u64,
    len: u64,
    tier_to: strata_tier,
    ticket: *mut *mut strata_ticket,
) -> c_int {
    boundary("strata_prefetch", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(ticket, "ticket") }?;
        let to = tier(tier_to)?;
        let b = objects::get(buf)?;
        let range = range(offset, len)?;
        // The argument errors `Buffer::prefetch` would put in its ticket,
        // found here so that they are returned at once; whatever error the
        // ticket then carries is the moves' own, and the caller gets it
        // from the ticket (however soon it finished).
        if range.end > b.buffer.len() {
            return Err(Fail::invalid(format!(
                "range {}..{} is outside the buffer's {} bytes",
                range.start,
                range.end,
                b.buffer.len()
            )));
        }
        if !b.rt.rt.tiers().contains(&to) {
            return Err(Fail::invalid(format!("the {to} tier is not configured")));
        }
        let t = b.buffer.prefetch(range, to);
        out.set(objects::ptr(b.rt.adopt(&TICKETS, t)?));
        Ok(STRATA_OK)
    })
}

fn settle(result: Option<strata::Result<()>>) -> R {
    match result {
        None => Ok(STRATA_PENDING),
        Some(r) => {
            r?;
            Ok(STRATA_OK)
        }
    }
}

/// Waits until the request is done: `STRATA_OK`, or the status of its first
/// error (with the message as the last error). The ticket stays valid:
/// waiting again returns the same result. Thread-safe: several threads may
/// wait on one ticket.
#[no_mangle]
pub extern "C" fn strata_ticket_wait(ticket: *const strata_ticket) -> c_int {
    boundary("strata_ticket_wait", || {
        let t = objects::get(ticket)?;
        (*t).clone().wait()?;
        Ok(STRATA_OK)
    })
}

/// `STRATA_PENDING` while the request runs, then as `strata_ticket_wait`.
/// Never blocks. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_ticket_poll(ticket: *const strata_ticket) -> c_int {
    boundary("strata_ticket_poll", || {
        settle(objects::get(ticket)?.poll())
    })
}

/// Waits at most `timeout_ns` nanoseconds: `STRATA_PENDING` if the request
/// is still running then, else as `strata_ticket_wait`. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_ticket_wait_timeout(
    ticket: *const strata_ticket,
    timeout_ns: u64,
) -> c_int {
    boundary("strata_ticket_wait_timeout", || {
        let t = objects::get(ticket)?;
        settle(t.wait_timeout(Duration::from_nanos(timeout_ns)))
    })
}

/// Pages of a prefetch declined so far, into `*pages`: the tier was full and
/// making room would have demoted pages referenced since the clock hand
/// last passed. They stay readable where they are, and the request still
/// succeeds (`strata_ticket_wait` returns `STRATA_OK`). 0 for any other
/// request. Thread-safe.
///
/// # Safety
/// `pages` is NULL (an error) or points to writable memory for a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_ticket_declined(
    ticket: *const strata_ticket,
    pages: *mut usize,
) -> c_int {
    boundary("strata_ticket_declined", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(pages, "pages") }?;
        out.set(objects::get(ticket)?.declined());
        Ok(STRATA_OK)
    })
}

/// Cancels the request of `ticket` (a `strata_prefetch` of `buf`'s runtime
/// above all): its batches still queued are dropped, their pages left
/// readable where they are; a batch already moving finishes, and
/// `strata_ticket_wait` then returns as soon as it has. Stores the pages
/// dropped in `*dropped` if not NULL (0 for a request already finished);
/// a misaligned `dropped` is refused before anything is cancelled. The
/// ticket must still be freed. Thread-safe.
///
/// # Safety
/// `dropped` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_ticket_cancel(
    buf: *const strata_buffer,
    ticket: *const strata_ticket,
    dropped: *mut usize,
) -> c_int {
    boundary("strata_ticket_cancel", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out_opt(dropped, "dropped") }?;
        let b = objects::get(buf)?;
        let t = objects::get(ticket)?;
        out.set(b.buffer.cancel(&t));
        Ok(STRATA_OK)
    })
}

/// Frees a ticket (the request goes on). NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_ticket_free(ticket: *mut strata_ticket) -> c_int {
    boundary("strata_ticket_free", || {
        drop(objects::remove(ticket)?);
        Ok(STRATA_OK)
    })
}
