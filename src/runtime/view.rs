//! Borrowed views: a range of a buffer pinned in host memory (the host or
//! CXL tier, or the simulated device's, which is host memory behind a link
//! model) and lent to Rust code as `&[u8]` or `&mut [u8]`, one slice per
//! page (a page's slot is contiguous; neighbouring pages' slots need not
//! be). On the simulated device a device view is what a kernel reads and
//! writes in device memory: no copy crosses the modelled link.
//!
//! What makes the slices sound is what the runtime refuses while a view
//! lives, checked under the buffer's launch lock:
//! - its pages are pinned: they do not move and their slots are not freed;
//! - a shared view ([`Buffer::view`]) refuses writes through the runtime
//!   (as a read-only kernel launch does) and read-write launches;
//! - a mutable view ([`Buffer::view_mut`]) borrows the buffer mutably, so
//!   no other safe access to it exists, and refuses every launch.
//!
//! Raw addresses handed out earlier (another [`Pin`](super::Pin)'s, a C
//! caller's) are outside Rust's checks, as they always are: whoever writes
//! through them orders that with the views.
// The slices are made from the pinned slots' addresses: the one unsafe
// operation of this module, justified at each use.
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;

use super::buffer::Buffer;
use super::page::one_more;
use super::pin::{OwnedPin, Pin};
use crate::error::{Error, Result};
use crate::tier::Tier;

/// A shared view of pinned pages; see [`Buffer::view`].
#[derive(Debug)]
#[must_use = "the pages are unpinned, and writes allowed again, when the view drops"]
pub struct View<'a> {
    pin: Option<Pin<'a>>,
    buffer: &'a Buffer,
    page_size: usize,
}

/// A mutable view of pinned pages; see [`Buffer::view_mut`].
#[derive(Debug)]
#[must_use = "the pages are unpinned, and launches allowed again, when the view drops"]
pub struct ViewMut<'a> {
    pin: Option<Pin<'a>>,
    buffer: &'a Buffer,
    page_size: usize,
}

fn check_tier(buffer: &Buffer, tier: Tier) -> Result<()> {
    match tier {
        Tier::Host | Tier::Cxl => Ok(()),
        Tier::Device if buffer.device_in_host_memory() => Ok(()),
        _ => Err(Error::invalid(format!(
            "a view lends host memory: pin in the host or cxl tier (or the simulated device's), not {tier}"
        ))),
    }
}

/// Where page `p` of a pinned range starts and how many of its bytes lie
/// within the buffer (its last page may be short); `None` for a page the
/// pin does not hold.
fn locate(
    pin: Option<&Pin<'_>>,
    buffer: &Buffer,
    page_size: usize,
    p: usize,
) -> Option<(u64, usize)> {
    let pin = pin?;
    locate_in(pin.addresses(), pin.pages(), buffer, page_size, p)
}

/// As [`locate`], from a pin's addresses and pages.
fn locate_in(
    addresses: &[u64],
    pages: Range<usize>,
    buffer: &Buffer,
    page_size: usize,
    p: usize,
) -> Option<(u64, usize)> {
    let address = *addresses.get(p.checked_sub(pages.start)?)?;
    let start = p as u64 * page_size as u64;
    Some((
        address,
        (buffer.len() - start).min(page_size as u64) as usize,
    ))
}

impl Buffer {
    /// Pins the pages of `range` in `tier` (host or CXL, or the device
    /// when it is the simulated one) and lends them as slices
    /// ([`View::page`], [`View::pages`]). While the view lives,
    /// writes to the buffer through the runtime fail with
    /// `InvalidArgument` and read-write kernel launches are refused (reads
    /// and read-only launches go on); the pin's own errors are
    /// [`pin`](Self::pin)'s. Refused while a read-write launch is live.
    pub fn view(&self, range: Range<u64>, tier: Tier) -> Result<View<'_>> {
        check_tier(self, tier)?;
        {
            let mut l = self.table().launches.lock();
            if l.read_write > 0 {
                return Err(Error::invalid(
                    "a read-write kernel launch of this buffer is live: views wait until it ends",
                ));
            }
            one_more(&mut l.views);
        }
        let mut view = View {
            pin: None,
            buffer: self,
            page_size: self.table().rt.page_size(),
        };
        // On an error the view drops here and gives its hold back.
        view.pin = Some(self.pin(range, tier)?);
        Ok(view)
    }

    /// As [`view`](Self::view), lending the pages writable
    /// ([`ViewMut::page_mut`]). The buffer is borrowed mutably, so nothing
    /// else reads or writes it through this handle meanwhile, and kernel
    /// launches of it are refused. Refused while a launch is live.
    pub fn view_mut(&mut self, range: Range<u64>, tier: Tier) -> Result<ViewMut<'_>> {
        self.hold_exclusive(tier)?;
        let page_size = self.table().rt.page_size();
        let this: &Buffer = self;
        let mut view = ViewMut {
            pin: None,
            buffer: this,
            page_size,
        };
        view.pin = Some(this.pin(range, tier)?);
        Ok(view)
    }
}

impl View<'_> {
    /// The pages lent (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pin.as_ref().map_or(0..0, Pin::pages)
    }

    /// The bytes of page `p` (one of [`pages`](Self::pages); the buffer's
    /// last page may be shorter than a page), or `None` for another page.
    pub fn page(&self, p: usize) -> Option<&[u8]> {
        let (address, len) = locate(self.pin.as_ref(), self.buffer, self.page_size, p)?;
        // SAFETY: `address` is the start of page `p`'s slot in host memory
        // (`check_tier`: a host-memory tier, or the simulated device's
        // arena, whose pinned addresses are host addresses), `page_size`
        // bytes long and at least `len`;
        // the pin keeps the page in that slot and the slot allocated for as
        // long as `self` lives, which bounds the returned borrow; no safe
        // code writes those bytes meanwhile: runtime writes are refused
        // while `views > 0` and read-write launches cannot start.
        Some(unsafe { std::slice::from_raw_parts(address as *const u8, len) })
    }

    /// Every lent page with its index, in order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[u8])> {
        self.pages().filter_map(|p| Some((p, self.page(p)?)))
    }
}

impl ViewMut<'_> {
    /// The pages lent (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pin.as_ref().map_or(0..0, Pin::pages)
    }

    /// The bytes of page `p`, writable (as [`View::page`]).
    pub fn page_mut(&mut self, p: usize) -> Option<&mut [u8]> {
        let (address, len) = locate(self.pin.as_ref(), self.buffer, self.page_size, p)?;
        // SAFETY: as in `View::page`, and exclusive: the buffer is borrowed
        // mutably by this view (no other safe access to it exists), no
        // launch can start while `exclusive` is set, and the returned
        // borrow holds `&mut self`, so no two slices of this view alias.
        Some(unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) })
    }

    /// Every page lent, each writable at once (a page not in host memory
    /// is left out), in page order: for work spread over threads.
    pub fn pages_mut(&mut self) -> Vec<(usize, &mut [u8])> {
        let mut out = Vec::with_capacity(self.pages().len());
        for p in self.pages() {
            if let Some((address, len)) = locate(self.pin.as_ref(), self.buffer, self.page_size, p)
            {
                // SAFETY: as in `page_mut`; and the slices do not alias one
                // another: each page of the buffer holds its own slot, so
                // distinct pages are distinct ranges of host memory.
                out.push((p, unsafe {
                    std::slice::from_raw_parts_mut(address as *mut u8, len)
                }));
            }
        }
        out
    }
}

impl Buffer {
    /// A mutable view's hold: refused where `tier` cannot be lent or a
    /// launch is live; then launches are refused until
    /// [`release`](release) gives it back.
    fn hold_exclusive(&self, tier: Tier) -> Result<()> {
        check_tier(self, tier)?;
        let mut l = self.table().launches.lock();
        if l.read_only + l.read_write > 0 {
            return Err(Error::invalid(
                "a kernel launch of this buffer is live: a mutable view waits until it ends",
            ));
        }
        one_more(&mut l.views);
        l.exclusive = true;
        Ok(())
    }

    /// Whether the device tier's memory is host memory (the simulated
    /// device), so that its pinned pages can be lent as slices.
    fn device_in_host_memory(&self) -> bool {
        self.table()
            .rt
            .tiers
            .device()
            .is_some_and(|d| d.backend() == crate::device::BackendKind::Sim)
    }
}

/// Every page of a buffer pinned in one tier and lent writable for as long
/// as the guard lives; see [`Buffer::into_view_mut`].
#[derive(Debug)]
#[must_use = "the pages are unpinned, and the buffer freed, when the view drops"]
pub struct OwnedViewMut {
    pin: Option<OwnedPin>,
    buffer: Arc<Buffer>,
    page_size: usize,
}

impl Buffer {
    /// As [`view_mut`](Self::view_mut) of the whole buffer, for as long as
    /// the returned guard lives, which owns the buffer: memory a component
    /// keeps to itself (a row cache's slots), its pages held in `tier`
    /// and nothing else able to read, write, launch over or move them.
    /// Dropping the guard frees the buffer.
    pub fn into_view_mut(self, tier: Tier) -> Result<OwnedViewMut> {
        self.hold_exclusive(tier)?;
        let page_size = self.table().rt.page_size();
        let mut view = OwnedViewMut {
            pin: None,
            buffer: Arc::new(self),
            page_size,
        };
        // On an error the view drops here and gives its hold back.
        let len = view.buffer.len();
        view.pin = Some(view.buffer.pin_owned(0..len, tier)?);
        Ok(view)
    }
}

impl OwnedViewMut {
    /// The pages lent (every page of the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pin.as_ref().map_or(0..0, OwnedPin::pages)
    }

    /// Every page, each writable at once, in page order (as
    /// [`ViewMut::pages_mut`]).
    pub fn pages_mut(&mut self) -> Vec<(usize, &mut [u8])> {
        let Some(pin) = self.pin.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(pin.pages().len());
        for p in pin.pages() {
            if let Some((address, len)) = locate_in(
                pin.addresses(),
                pin.pages(),
                &self.buffer,
                self.page_size,
                p,
            ) {
                // SAFETY: `address` is the start of page `p`'s slot in host
                // memory (`check_tier`), at least `len` bytes; the pin keeps
                // the page in that slot while `self` lives, which bounds
                // the returned borrows (they hold `&mut self`). Nothing else
                // reads or writes those bytes: the buffer was moved into
                // this guard (no other handle to it exists, and `Buffer` is
                // not `Clone`), launches of it are refused while
                // `exclusive` is set, and distinct pages are distinct slots,
                // so the slices do not alias one another.
                out.push((p, unsafe {
                    std::slice::from_raw_parts_mut(address as *mut u8, len)
                }));
            }
        }
        out
    }
}

impl Drop for OwnedViewMut {
    fn drop(&mut self) {
        drop(self.pin.take());
        release(&self.buffer, true);
    }
}

/// Gives the hold back once the pin has dropped.
fn release(buffer: &Buffer, exclusive: bool) {
    let mut l = buffer.table().launches.lock();
    l.views -= 1;
    if exclusive {
        l.exclusive = false;
    }
}

impl Drop for View<'_> {
    fn drop(&mut self) {
        drop(self.pin.take());
        release(self.buffer, false);
    }
}

impl Drop for ViewMut<'_> {
    fn drop(&mut self) {
        drop(self.pin.take());
        release(self.buffer, true);
    }
}
