//! What a tier is: its name ([`Tier`]) and what every store of one offers
//! ([`PageStore`]), with the argument checks the stores share. The stores'
//! files build on this one and `slots.rs`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::slots::Slot;
use crate::error::{Error, Result};

/// A memory tier, ordered fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// GPU memory (HBM).
    Device = 0,
    /// Host DRAM.
    Host = 1,
    /// CXL-attached memory.
    Cxl = 2,
    /// NVMe storage.
    Nvme = 3,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Cxl, Tier::Nvme];

    /// The lowercase name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Cxl => "cxl",
            Tier::Nvme => "nvme",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown tier {s:?} (use device, host, cxl or nvme)"
                ))
            })
    }
}

/// What every store offers: page-sized slots that hold bytes.
///
/// `read_page`/`write_page` copy a whole page; stores also have faster
/// media-specific paths (direct slices for memory, owned-buffer batches for
/// NVMe).
pub trait PageStore: Send + Sync {
    /// Which tier this store serves.
    fn tier(&self) -> Tier;
    /// The addresses of the host memory its slots live in, where the CPU
    /// reaches them in place (host and CXL arenas, a simulated device's
    /// allocation); `None` otherwise.
    fn host_memory(&self) -> Option<std::ops::Range<u64>> {
        None
    }
    /// Bytes per slot.
    fn page_size(&self) -> usize;
    /// Total slots.
    fn capacity_pages(&self) -> u32;
    /// Slots in use.
    fn used_pages(&self) -> u32;
    /// Takes a free slot; `OutOfCapacity` when the store is full.
    fn alloc(&self) -> Result<Slot>;
    /// Returns a slot to the store. A slot of another store is an error.
    fn free(&self, slot: Slot) -> Result<()>;
    /// Writes a whole page (`data.len() == page_size`) in place. On NVMe a
    /// failed in-place write leaves the slot unreadable (an error, never
    /// stale data); `NvmeStore::replace` writes to a fresh slot first and
    /// keeps the previous copy until the new one is durable.
    fn write_page(&self, slot: &mut Slot, data: &[u8]) -> Result<()>;
    /// Writes a whole page into a slot that holds no data yet (fresh from
    /// `alloc`). There is no previous copy to keep, so NVMe writes it in
    /// place instead of copy-then-commit; other stores as `write_page`.
    fn write_new(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        self.write_page(slot, data)
    }
    /// Reads a whole page (`out.len() == page_size`).
    fn read_page(&self, slot: &Slot, out: &mut [u8]) -> Result<()>;
    /// Calls `f` with the page's bytes. The default reads the page into a
    /// temporary buffer; memory tiers hand out the slot's own bytes, so a
    /// move out of them is a single copy.
    fn with_page(&self, slot: &Slot, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let mut page = vec![0; self.page_size()];
        self.read_page(slot, &mut page)?;
        f(&page)
    }
    /// Reads `out.len()` bytes at `offset` within a page. The default reads
    /// the whole page; memory tiers copy just the range.
    fn read_range(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(offset, out.len(), self.page_size())?;
        let mut page = vec![0; self.page_size()];
        self.read_page(slot, &mut page)?;
        out.copy_from_slice(&page[offset..offset + out.len()]);
        Ok(())
    }
    /// Writes `data` at `offset` within a page. The default reads the page,
    /// patches it and writes it whole (on NVMe: copy-then-commit); memory
    /// tiers write just the range, in place.
    fn write_range(&self, slot: &mut Slot, offset: usize, data: &[u8]) -> Result<()> {
        check_range(offset, data.len(), self.page_size())?;
        let mut page = vec![0; self.page_size()];
        self.read_page(slot, &mut page)?;
        page[offset..offset + data.len()].copy_from_slice(data);
        self.write_page(slot, &page)
    }
    /// Whether the tier is emulated (reports must say so).
    fn emulated(&self) -> bool {
        false
    }
    /// A stable address of the slot's first byte for code outside the
    /// runtime (kernels, C callers): a device address on the device tier, a
    /// host virtual address on memory tiers; `None` where the medium is not
    /// addressable (NVMe). It stays valid while the slot is allocated.
    fn address(&self, _slot: &Slot) -> Option<u64> {
        None
    }
    /// The address through which a kernel reaches the slot (device maps):
    /// device memory's own address, or the device mapping of a registered
    /// host arena; on the simulated device the same as [`address`](Self::address).
    /// 0 where the medium is not addressable (NVMe).
    fn kernel_address(&self, slot: &Slot) -> u64 {
        self.address(slot).unwrap_or(0)
    }
    /// The store as `Any`, to reach store-specific features.
    fn as_any(&self) -> &dyn std::any::Any;
}

pub(crate) fn check_page_len(what: &str, len: usize, page_size: usize) -> Result<()> {
    if len == page_size {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{what} buffer is {len} bytes; a page is {page_size}"
        )))
    }
}

pub(crate) fn check_range(offset: usize, len: usize, page_size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= page_size => Ok(()),
        _ => Err(Error::invalid(format!(
            "range {offset}+{len} exceeds a page of {page_size} bytes"
        ))),
    }
}

pub(crate) fn full_error(tier: Tier, capacity: u32, page_size: usize) -> Error {
    Error::new(
        crate::error::ErrorKind::OutOfCapacity,
        format!(
            "{tier} tier is full: all {capacity} pages of {} in use",
            crate::size::format_size(page_size as u64)
        ),
    )
}
