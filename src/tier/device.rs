//! The device tier's store: page-sized slots in one allocation of device
//! memory (a GPU's, or the simulated device's), reached through the
//! backend's copies. Slot tokens give each caller exclusive use of its
//! slot's bytes, which is what the backend's copy contract asks for.

use std::sync::Arc;

use super::slots::{Slot, SlotAllocator};
use super::store::{check_page_len, check_range, full_error, PageStore, Tier};
use crate::device::{BackendKind, DeviceBackend, DeviceMemory};
use crate::error::{Error, Result};
use crate::size::check_page_size;

/// Slots in device memory.
pub struct DeviceStore {
    backend: Arc<dyn DeviceBackend>,
    memory: Box<dyn DeviceMemory>,
    page_size: usize,
    slots: SlotAllocator,
}

impl std::fmt::Debug for DeviceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStore")
            .field("backend", &self.backend.kind())
            .field("page_size", &self.page_size)
            .field("capacity_pages", &self.slots.capacity())
            .finish()
    }
}

impl DeviceStore {
    /// `capacity` bytes (rounded down to whole pages) of `backend`'s memory.
    pub fn new(backend: Arc<dyn DeviceBackend>, capacity: u64, page_size: usize) -> Result<Self> {
        check_page_size(page_size)?;
        let capacity = capacity.min(backend.capacity());
        let pages = capacity / page_size as u64;
        if pages == 0 {
            return Err(Error::invalid(format!(
                "device capacity {capacity} holds no whole page of {page_size} bytes"
            )));
        }
        let pages = u32::try_from(pages).map_err(|_| {
            Error::invalid(format!("device capacity {capacity} has too many pages"))
        })?;
        let bytes = usize::try_from(pages as u64 * page_size as u64)
            .map_err(|_| Error::invalid("device capacity does not fit the address space"))?;
        let memory = backend.alloc(bytes)?;
        // Every copy below relies on this (DeviceMemory's safety contract).
        if memory.len() < bytes {
            return Err(Error::invalid(format!(
                "{} returned {} bytes for a {bytes}-byte allocation",
                backend.description(),
                memory.len()
            )));
        }
        Ok(Self {
            backend,
            memory,
            page_size,
            slots: SlotAllocator::new(pages),
        })
    }

    /// Backs the store's whole allocation with memory now (the simulated
    /// device's arena; a GPU's allocation already is).
    pub fn commit(&self) {
        self.memory.commit();
    }

    /// The backend (for reports: "simulated" or "cuda").
    pub fn backend(&self) -> BackendKind {
        self.backend.kind()
    }

    /// The backend itself (for allocations beside the slots: device maps).
    pub fn backend_handle(&self) -> &dyn DeviceBackend {
        &*self.backend
    }

    /// Host→device and device→host link traffic so far.
    pub fn link_stats(&self) -> (crate::link::LinkStats, crate::link::LinkStats) {
        self.backend.link_stats()
    }

    /// The device address of a slot's first byte (for device maps).
    pub fn device_address(&self, slot: &Slot) -> Result<u64> {
        self.slots.check(slot)?;
        Ok(self.memory.device_address(self.offset(slot)))
    }

    /// Where a read may land in `slot` directly — its page in the host
    /// memory behind the device's allocation, and the arena that keeps it
    /// mapped — on the simulated device; `None` on a GPU.
    pub(crate) fn direct_target(
        &self,
        slot: &Slot,
    ) -> Option<(std::ptr::NonNull<u8>, Arc<crate::sys::Arena>)> {
        let arena = self.memory.host_arena()?;
        self.slots.check(slot).ok()?;
        let offset = self.offset(slot);
        if offset + self.page_size > arena.len() {
            return None;
        }
        // SAFETY: `offset + page_size` lies within the arena (checked), which
        // is the allocation's host memory from its byte 0.
        Some((unsafe { arena.base().add(offset) }, arena))
    }

    /// Accounts a page read into a slot directly (`direct_target`) as
    /// crossing the host→device link.
    pub(crate) fn record_direct(&self, wall: std::time::Duration) {
        self.memory.record_h2d(self.page_size, wall);
    }

    /// Writes whole pages into slots with the copies queued together and
    /// waited for once (the link's latency paid once, not per page).
    pub fn write_many(&self, items: &mut [(&mut Slot, &[u8])]) -> Result<()> {
        let mut copies = Vec::with_capacity(items.len());
        for (slot, data) in items.iter() {
            check_page_len("source", data.len(), self.page_size)?;
            self.slots.check(slot)?;
            copies.push((self.offset(slot), *data));
        }
        // SAFETY: every slot is ours (checked), so each page lies inside the
        // allocation; each `&mut Slot` is the unique token for its bytes, so
        // the ranges are distinct and no one else uses them.
        unsafe { self.memory.copy_in_many(&copies) }
    }

    /// Reads whole pages out of slots, the copies queued together.
    pub fn read_many(&self, items: &mut [(&Slot, &mut [u8])]) -> Result<()> {
        let mut copies = Vec::with_capacity(items.len());
        for (slot, out) in items.iter_mut() {
            check_page_len("destination", out.len(), self.page_size)?;
            self.slots.check(slot)?;
            copies.push((self.offset(slot), &mut **out));
        }
        // SAFETY: as in `write_many`; writing a slot needs `&mut Slot`, which
        // cannot coexist with the `&Slot`s held here.
        unsafe { self.memory.copy_out_many(&mut copies) }
    }

    fn offset(&self, slot: &Slot) -> usize {
        slot.index() as usize * self.page_size
    }
}

impl PageStore for DeviceStore {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn address(&self, slot: &Slot) -> Option<u64> {
        self.device_address(slot).ok()
    }
    fn tier(&self) -> Tier {
        Tier::Device
    }
    /// The simulated device's memory is host memory: a caller's pointer
    /// into a pinned device page is strata's memory too.
    fn host_memory(&self) -> Option<std::ops::Range<u64>> {
        let arena = self.memory.host_arena()?;
        let base = arena.base().as_ptr() as u64;
        Some(base..base + arena.len() as u64)
    }
    fn page_size(&self) -> usize {
        self.page_size
    }
    fn capacity_pages(&self) -> u32 {
        self.slots.capacity()
    }
    fn used_pages(&self) -> u32 {
        self.slots.used()
    }
    fn alloc(&self) -> Result<Slot> {
        self.slots
            .alloc()
            .ok_or_else(|| full_error(Tier::Device, self.slots.capacity(), self.page_size))
    }
    fn free(&self, slot: Slot) -> Result<()> {
        self.slots.free(slot).map_err(|(e, _)| e)
    }
    fn write_page(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        check_page_len("source", data.len(), self.page_size)?;
        self.slots.check(slot)?;
        // SAFETY: the slot is ours (checked), so the page lies inside the
        // allocation; `&mut Slot` is the unique token for its bytes.
        unsafe { self.memory.copy_in(self.offset(slot), data) }
    }
    fn read_page(&self, slot: &Slot, out: &mut [u8]) -> Result<()> {
        check_page_len("destination", out.len(), self.page_size)?;
        self.slots.check(slot)?;
        // SAFETY: as above; writing the slot needs `&mut Slot`, which cannot
        // coexist with the caller's `&Slot`.
        unsafe { self.memory.copy_out(self.offset(slot), out) }
    }
    fn read_range(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(offset, out.len(), self.page_size)?;
        self.slots.check(slot)?;
        // SAFETY: as in `read_page`, for a sub-range of the slot.
        unsafe { self.memory.copy_out(self.offset(slot) + offset, out) }
    }
    fn write_range(&self, slot: &mut Slot, offset: usize, data: &[u8]) -> Result<()> {
        check_range(offset, data.len(), self.page_size)?;
        self.slots.check(slot)?;
        // SAFETY: as in `write_page`, for a sub-range of the slot.
        unsafe { self.memory.copy_in(self.offset(slot) + offset, data) }
    }
    fn emulated(&self) -> bool {
        self.backend.kind() == BackendKind::Sim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::{SimBackend, PCIE_GEN4_X16};
    use crate::error::ErrorKind;

    #[test]
    fn simulated_round_trip_is_accounted() {
        let backend: Arc<dyn DeviceBackend> =
            Arc::new(SimBackend::new(1 << 20, PCIE_GEN4_X16).unwrap());
        let s = DeviceStore::new(backend.clone(), 1 << 20, 65536).unwrap();
        assert_eq!(s.capacity_pages(), 16);
        assert!(s.emulated());
        let mut slots: Vec<Slot> = (0..16).map(|_| s.alloc().unwrap()).collect();
        assert_eq!(s.alloc().unwrap_err().kind(), ErrorKind::OutOfCapacity);
        for (i, slot) in slots.iter_mut().enumerate() {
            s.write_page(slot, &vec![i as u8; 65536]).unwrap();
        }
        let mut out = vec![0; 65536];
        for (i, slot) in slots.iter().enumerate() {
            s.read_page(slot, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == i as u8));
        }
        let (h2d, d2h) = backend.link_stats();
        assert_eq!((h2d.bytes, h2d.ops), (16 * 65536, 16));
        assert_eq!((d2h.bytes, d2h.ops), (16 * 65536, 16));
        // 64 KiB at 25 GB/s + 5 µs = 7.621 µs a page (whole nanoseconds).
        assert!(
            (h2d.modelled_seconds - 16.0 * 7.621e-6).abs() < 1e-9,
            "{h2d:?}"
        );
        let a0 = s.device_address(&slots[0]).unwrap();
        let a1 = s.device_address(&slots[1]).unwrap();
        assert_eq!(a0.abs_diff(a1) % 65536, 0);
        for slot in slots {
            s.free(slot).unwrap();
        }
    }

    #[test]
    fn capacity_is_capped_by_the_backend() {
        let backend: Arc<dyn DeviceBackend> =
            Arc::new(SimBackend::new(1 << 20, PCIE_GEN4_X16).unwrap());
        let s = DeviceStore::new(backend.clone(), 1 << 30, 65536).unwrap();
        assert_eq!(s.capacity_pages(), 16);
        assert!(DeviceStore::new(backend, 100, 4096).is_err());
    }
}
