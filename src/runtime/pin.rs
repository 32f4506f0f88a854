//! Pins: pages held resident in one tier, their addresses lent out
//! ([`Buffer::pin`], [`Pin`], [`OwnedPin`]).
#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::accounting::Counters;
use super::buffer::Buffer;
use super::request::{Priority, Request, Source};
use super::table::{lost, Lost, PageGuard, Resident, Zero};
use crate::error::{Error, ErrorKind, Result};
use crate::tier::Tier;

impl Buffer {
    /// Makes the pages of `range` resident in `tier` (moving or
    /// materializing them) and keeps them there until the returned guard
    /// drops. The guard gives each page's address: a device address on the
    /// device tier, a host address on the host and CXL tiers (NVMe pages are
    /// not addressable and cannot be pinned). A pin larger than the tier, or
    /// one that cannot be satisfied, is an error and pins nothing.
    ///
    /// Writes through the runtime still reach pinned pages, in place, while
    /// whoever holds the addresses (a kernel, a C caller) may be using them:
    /// ordering the two is the caller's job, as for any shared buffer.
    ///
    /// Whoever holds the addresses may write through them, so the pages'
    /// clean copies in slower tiers are dropped (see [`pin_read`](Self::pin_read)).
    pub fn pin(&self, range: Range<u64>, tier: Tier) -> Result<Pin<'_>> {
        self.pin_with(range, tier, true)
    }

    /// [`pin`](Self::pin) for a holder that only reads through the
    /// addresses (weights a kernel reads, an expert's matrices): the pages'
    /// clean copies in slower tiers stay valid, so demoting them later
    /// needs no copy. Writing through these addresses is a contract
    /// violation the runtime cannot see: a later demotion would bring back
    /// the bytes as they were before the write.
    pub fn pin_read(&self, range: Range<u64>, tier: Tier) -> Result<Pin<'_>> {
        self.pin_with(range, tier, false)
    }

    fn pin_with(&self, range: Range<u64>, tier: Tier, writable: bool) -> Result<Pin<'_>> {
        let pages = self.table.page_range(&range)?;
        let store = self
            .rt()
            .store(tier)
            .ok_or_else(|| Error::invalid(format!("the {tier} tier is not configured")))?;
        if tier == Tier::Nvme {
            return Err(Error::invalid(
                "nvme pages are not addressable and cannot be pinned",
            ));
        }
        if pages.len() as u64 > store.capacity_pages() as u64 {
            return Err(Error::new(
                ErrorKind::OutOfCapacity,
                format!(
                    "a pin of {} pages exceeds the {tier} tier's {} pages",
                    pages.len(),
                    store.capacity_pages()
                ),
            ));
        }
        let mut pin = Pin {
            buffer: self,
            pages: pages.start..pages.start,
            tier,
            addresses: Vec::with_capacity(pages.len()),
        };
        // The whole range first, in batches, through the engine at demand
        // priority (room made in `tier` as a prefetch makes it); then page
        // by page under each page's lock, moving again what raced away.
        self.move_for_pin(&pages, tier)?;
        // A page never written is made resident from zeros, allocated
        // only if the range has one.
        let zeros = std::cell::OnceCell::new();
        for p in pages.clone() {
            let mut entry = self.resident_for_pin(p, tier, &pages, &zeros)?;
            let Resident { slot, .. } = &entry.loc else {
                unreachable!("made resident above")
            };
            pin.addresses
                .push(store.address(slot).expect("memory tiers are addressable"));
            // Whoever holds a writable pin's address may write through it:
            // a move that copied the page before it does not commit, and
            // the clean copy goes.
            if self.table.pin_entry(&mut entry, writable) {
                self.rt().acct.pinned[tier as usize].fetch_add(1, Ordering::Relaxed);
            }
            // The guard now covers this page (and unpins it on drop, also
            // if a later page fails).
            pin.pages.end = p + 1;
        }
        Ok(pin)
    }

    /// Moves the pages of `pages` not in `tier` there in batches (what does
    /// not fit is tried again page by page); counts the faults.
    fn move_for_pin(&self, pages: &Range<usize>, tier: Tier) -> Result<()> {
        let elsewhere: Vec<usize> = pages
            .clone()
            .filter(|&p| {
                let e = self.table.pages[p].lock();
                e.pins == 0 && e.tier().is_some_and(|t| t != tier)
            })
            .collect();
        if elsewhere.is_empty() {
            return Ok(());
        }
        match self.demand_move(elsewhere.clone(), tier, pages) {
            // What did not fit is tried again page by page.
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::OutOfCapacity => {}
            Err(e) => return Err(e),
        }
        let moved = elsewhere
            .iter()
            .filter(|&&p| self.table.pages[p].lock().tier() == Some(tier))
            .count();
        Counters::add(&self.rt().counters().faults, moved as u64);
        Ok(())
    }

    /// Page `p` of a pin of `pages` made resident in `tier`, its lock held.
    /// A full tier gets room made in it (a victim demoted, never a page of
    /// `pages`), with the page unlocked meanwhile: a few tries, then the
    /// error stands.
    fn resident_for_pin(
        &self,
        p: usize,
        tier: Tier,
        pages: &Range<usize>,
        zeros: &std::cell::OnceCell<Vec<u8>>,
    ) -> Result<PageGuard<'_>> {
        let mut tries = 0;
        loop {
            let mut entry = self.table.pages[p].lock();
            let src = match &entry.loc {
                Resident { tier: t, .. } if *t == tier => return Ok(entry),
                Resident { .. } if entry.pins > 0 => {
                    return Err(Error::invalid(format!(
                        "page {p} is pinned in another tier"
                    )));
                }
                Resident { tier: t, .. } => *t,
                Lost => return Err(lost(p)),
                Zero => match self.engine().first_write(
                    &self.table,
                    zeros.get_or_init(|| vec![0; self.rt().page_size()]),
                    Some(&[tier]),
                ) {
                    Ok(loc) => {
                        entry.loc = loc;
                        return Ok(entry);
                    }
                    Err(e) if e.kind() == ErrorKind::OutOfCapacity && tries < 3 => {
                        drop(entry);
                        tries += 1;
                        let (_, failed) = self.engine().make_room_for(
                            &self.table,
                            tier,
                            1,
                            pages,
                            Priority::Demand,
                        );
                        if let Some(e) = failed {
                            self.rt().note_background("making room for a pin", e);
                        }
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            drop(entry);
            if !self.table.may_move(src, tier) {
                return Err(Error::invalid(format!(
                    "page {p} cannot move to the {tier} tier while a kernel launch maps it"
                )));
            }
            if tries == 3 {
                return Err(Error::new(
                    ErrorKind::OutOfCapacity,
                    format!(
                        "page {p} cannot move to the {tier} tier: it is full ({})",
                        self.rt().capacity_report()
                    ),
                ));
            }
            tries += 1;
            let full = self.demand_move(vec![p], tier, pages)?;
            if full.is_empty() && self.table.pages[p].lock().tier() == Some(tier) {
                Counters::add(&self.rt().counters().faults, 1);
            }
        }
    }

    /// Moves `pages` into `tier` through the engine at demand priority,
    /// making room there (never by demoting a page of `protect`); waits.
    /// The pages that still found `tier` full.
    fn demand_move(
        &self,
        pages: Vec<usize>,
        tier: Tier,
        protect: &Range<usize>,
    ) -> Result<Vec<usize>> {
        self.engine().run(
            &self.table,
            Request {
                pages,
                dst: tier,
                from: Source::Any,
                priority: Priority::Demand,
                room: Some(protect.clone()),
            },
        )
    }

    /// [`pin`](Self::pin) for holders that cannot keep a borrow of the
    /// buffer alive (the C ABI's handle tables): the guard holds a
    /// reference to the buffer, which therefore lives until the guard drops.
    pub fn pin_owned(self: &Arc<Self>, range: Range<u64>, tier: Tier) -> Result<OwnedPin> {
        self.own(self.pin(range, tier)?)
    }

    /// [`pin_read`](Self::pin_read) with an owned guard, as
    /// [`pin_owned`](Self::pin_owned).
    pub fn pin_read_owned(self: &Arc<Self>, range: Range<u64>, tier: Tier) -> Result<OwnedPin> {
        self.own(self.pin_read(range, tier)?)
    }

    fn own(self: &Arc<Self>, mut pin: Pin<'_>) -> Result<OwnedPin> {
        // The owned guard takes the pinned pages over; the borrowed one is
        // left covering none, so its drop unpins nothing.
        let pages = std::mem::replace(&mut pin.pages, 0..0);
        let addresses = std::mem::take(&mut pin.addresses);
        Ok(OwnedPin {
            buffer: self.clone(),
            pages,
            tier: pin.tier,
            addresses,
        })
    }
}

/// Pages held resident in one tier; see [`Buffer::pin`].
#[derive(Debug)]
#[must_use = "the pages are unpinned when the guard drops"]
pub struct Pin<'a> {
    buffer: &'a Buffer,
    pages: Range<usize>,
    tier: Tier,
    addresses: Vec<u64>,
}

impl Pin<'_> {
    /// The tier the pages are pinned in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The pinned pages (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pages.clone()
    }

    /// Each pinned page's address (device or host), in page order. The
    /// addresses stay valid until the guard drops; what is done through
    /// them is outside Rust's checks (kernels, C callers).
    pub fn addresses(&self) -> &[u64] {
        &self.addresses
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        for p in self.pages.clone() {
            let mut entry = self.buffer.table.pages[p].lock();
            if entry.unpin() {
                self.buffer.rt().acct.pinned[self.tier as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A [`Pin`] that owns a reference to its buffer; see [`Buffer::pin_owned`].
#[derive(Debug)]
#[must_use = "the pages are unpinned when the guard drops"]
pub struct OwnedPin {
    buffer: Arc<Buffer>,
    pages: Range<usize>,
    tier: Tier,
    addresses: Vec<u64>,
}

impl OwnedPin {
    /// The tier the pages are pinned in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The pinned pages (indices into the buffer).
    pub fn pages(&self) -> Range<usize> {
        self.pages.clone()
    }

    /// Each pinned page's address, as [`Pin::addresses`].
    pub fn addresses(&self) -> &[u64] {
        &self.addresses
    }
}

impl Drop for OwnedPin {
    fn drop(&mut self) {
        // Unpins exactly as the borrowed guard does.
        drop(Pin {
            buffer: &self.buffer,
            pages: std::mem::replace(&mut self.pages, 0..0),
            tier: self.tier,
            addresses: Vec::new(),
        });
    }
}
