//! The host-DRAM store: an mmap arena carved into page-aligned slots.

use std::any::Any;
use std::ptr::NonNull;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::slots::{Slot, SlotAllocator};
use super::store::{check_page_len, check_range, full_error, PageStore, Tier};
use crate::error::{Error, Result};
use crate::size::check_page_size;
use crate::sys::Arena;

/// How to build a [`HostStore`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostConfig {
    /// Capacity in bytes; rounded down to whole pages, must hold at least one.
    pub capacity: u64,
    /// Slot size: a power of two, 4 KiB … 2 MiB.
    pub page_size: usize,
    /// Ask for transparent huge pages where the kernel allows them.
    pub huge_pages: bool,
    /// Bind the arena to this NUMA node (`mbind`).
    pub numa_node: Option<u32>,
}

impl HostConfig {
    /// A config of `capacity` bytes in pages of `page_size`, with huge pages
    /// and no NUMA binding.
    pub fn new(capacity: u64, page_size: usize) -> Self {
        Self {
            capacity,
            page_size,
            huge_pages: true,
            numa_node: None,
        }
    }
}

/// Registers an arena with someone who needs to know about it — the CUDA
/// driver (`cuMemHostRegister`) for zero-copy access and asynchronous copies.
/// The returned guard unregisters on drop; the store drops it before it
/// unmaps the arena.
pub trait ArenaRegistrar {
    /// Registers `len` bytes at `base`.
    fn register(&self, base: NonNull<u8>, len: usize) -> Result<Box<dyn Any + Send + Sync>>;
}

/// Page-sized slots in an anonymous DRAM arena.
///
/// Slot bytes are reached through [`HostStore::bytes`] (`&Slot`) and
/// [`HostStore::bytes_mut`] (`&mut Slot`): slot tokens are unique, so the
/// borrow checker rules out data races on a slot.
pub struct HostStore {
    tier: Tier,
    page_size: usize,
    slots: SlotAllocator,
    // Declared before `arena`: registrations are released before the unmap.
    registrations: Mutex<Vec<Box<dyn Any + Send + Sync>>>,
    /// Where a device sees the arena once registered with it (cuda).
    device_base: std::sync::OnceLock<u64>,
    /// Shared with reads in flight into its slots (see
    /// `NvmeSession::submit_read_into`), which keep it mapped.
    arena: std::sync::Arc<Arena>,
}

impl std::fmt::Debug for HostStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStore")
            .field("tier", &self.tier)
            .field("page_size", &self.page_size)
            .field("capacity_pages", &self.slots.capacity())
            .field("used_pages", &self.slots.used())
            .field("huge_pages", &self.arena.huge_pages())
            .field("numa_node", &self.arena.numa_node())
            .finish()
    }
}

impl HostStore {
    /// Creates a host store. Errors name the bad parameter.
    pub fn new(config: &HostConfig) -> Result<Self> {
        Self::with_tier(config, Tier::Host)
    }

    pub(crate) fn with_tier(config: &HostConfig, tier: Tier) -> Result<Self> {
        check_page_size(config.page_size)?;
        let pages = config.capacity / config.page_size as u64;
        if pages == 0 {
            return Err(Error::invalid(format!(
                "{tier} capacity {} holds no whole page of {} bytes",
                config.capacity, config.page_size
            )));
        }
        let pages = u32::try_from(pages).map_err(|_| {
            Error::invalid(format!(
                "{tier} capacity {} has too many pages",
                config.capacity
            ))
        })?;
        let bytes = usize::try_from(pages as u64 * config.page_size as u64)
            .map_err(|_| Error::invalid("capacity does not fit the address space"))?;
        let arena = Arena::new(bytes, config.huge_pages, config.numa_node)
            .map_err(|e| e.context(format!("creating the {tier} arena")))?;
        Ok(Self {
            tier,
            page_size: config.page_size,
            slots: SlotAllocator::new(pages),
            registrations: Mutex::new(Vec::new()),
            device_base: std::sync::OnceLock::new(),
            arena: std::sync::Arc::new(arena),
        })
    }

    /// The bytes of a slot.
    pub fn bytes<'a>(&'a self, slot: &'a Slot) -> Result<&'a [u8]> {
        let ptr = self.slot_ptr(slot)?;
        // SAFETY: `slot_ptr` checked the slot is ours, so `ptr..ptr+page_size`
        // lies inside the arena. Rust code gets `&mut [u8]` to these bytes
        // only through `&mut Slot` (exclusive by the borrow checker, and the
        // caller holds `&Slot`) or through a mutable view of a pinned page,
        // which holds `&mut Buffer`, so nothing reads that buffer's pages
        // through the runtime while it lives; writes through a pin's raw
        // address are the holder's to order (see `runtime/view.rs`).
        Ok(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.page_size) })
    }

    /// The bytes of a slot, writable.
    pub fn bytes_mut<'a>(&'a self, slot: &'a mut Slot) -> Result<&'a mut [u8]> {
        let ptr = self.slot_ptr(slot)?;
        // SAFETY: as in `bytes`; `&mut Slot` is the runtime's unique token
        // for these bytes, and no slice lent out of them lives meanwhile: a
        // borrowed view or a read-only launch (whose kernels may hold
        // `&[u8]`) refuses writes through the runtime, and a mutable view
        // holds `&mut Buffer`.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), self.page_size) })
    }

    /// Checks that `slot` is one of this store's.
    pub(crate) fn check(&self, slot: &Slot) -> Result<()> {
        self.slots.check(slot)
    }

    /// The address of a slot's first byte. Stays valid while the store lives;
    /// dereferencing it is up to the caller (C ABI, device copies).
    pub fn slot_ptr(&self, slot: &Slot) -> Result<NonNull<u8>> {
        self.slots.check(slot)?;
        let offset = slot.index() as usize * self.page_size;
        // SAFETY: index < capacity, so offset + page_size <= arena length.
        Ok(unsafe { self.arena.base().add(offset) })
    }

    /// Copies one page between two slots of host-memory stores.
    pub fn copy_page(&self, src: &Slot, dst_store: &HostStore, dst: &mut Slot) -> Result<()> {
        check_page_len("destination", dst_store.page_size, self.page_size)?;
        dst_store.bytes_mut(dst)?.copy_from_slice(self.bytes(src)?);
        Ok(())
    }

    /// Registers the whole arena (see [`ArenaRegistrar`]); the guard is kept
    /// until the store drops.
    pub fn register(&self, registrar: &dyn ArenaRegistrar) -> Result<()> {
        let guard = registrar.register(self.arena.base(), self.arena.len())?;
        self.registrations.lock().push(guard);
        Ok(())
    }

    /// Registers the arena with a device backend for zero-copy kernel
    /// access and asynchronous copies (a no-op on the simulated device).
    pub fn register_with_device(&self, backend: &dyn crate::device::DeviceBackend) -> Result<()> {
        if self.device_base.get().is_some() {
            return Ok(());
        }
        // SAFETY: the arena stays mapped while the store lives, and the
        // registration is kept in `registrations`, which drops before the
        // arena unmaps.
        let registration = unsafe { backend.register_host(self.arena.base(), self.arena.len()) }
            .map_err(|e| e.context(format!("registering the {} arena", self.tier)))?;
        if let Some(r) = registration {
            self.registrations.lock().push(r.guard);
            let _ = self.device_base.set(r.device_base);
        }
        Ok(())
    }

    /// The address through which a kernel reaches a slot: the device
    /// mapping of the registered arena, or the host address where the arena
    /// is not registered (the simulated device reads host memory directly).
    pub fn kernel_address(&self, slot: &Slot) -> Result<u64> {
        let host = self.slot_ptr(slot)?.as_ptr() as u64;
        Ok(match self.device_base.get() {
            Some(base) => base + (host - self.arena.base().as_ptr() as u64),
            None => host,
        })
    }

    /// The arena, to keep it mapped while I/O lands in it.
    pub(crate) fn arena_handle(&self) -> std::sync::Arc<Arena> {
        self.arena.clone()
    }

    /// Start and length of the arena.
    pub fn arena_range(&self) -> (NonNull<u8>, usize) {
        (self.arena.base(), self.arena.len())
    }

    /// Whether the arena was advised to use transparent huge pages and the
    /// kernel accepted (whether huge pages then back it is the kernel's
    /// choice, page by page).
    pub fn huge_pages(&self) -> bool {
        self.arena.huge_pages()
    }

    /// The NUMA node the arena is bound to.
    pub fn numa_node(&self) -> Option<u32> {
        self.arena.numa_node()
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.slots.capacity() as u64 * self.page_size as u64
    }
}

impl PageStore for HostStore {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn host_memory(&self) -> Option<std::ops::Range<u64>> {
        let base = self.arena.base().as_ptr() as u64;
        Some(base..base + self.arena.len() as u64)
    }
    fn address(&self, slot: &Slot) -> Option<u64> {
        self.slot_ptr(slot).ok().map(|p| p.as_ptr() as u64)
    }
    fn kernel_address(&self, slot: &Slot) -> u64 {
        HostStore::kernel_address(self, slot).unwrap_or(0)
    }
    fn tier(&self) -> Tier {
        self.tier
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
            .ok_or_else(|| full_error(self.tier, self.slots.capacity(), self.page_size))
    }
    fn free(&self, slot: Slot) -> Result<()> {
        self.slots.free(slot).map_err(|(e, _slot)| e)
    }
    fn write_page(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        check_page_len("source", data.len(), self.page_size)?;
        self.bytes_mut(slot)?.copy_from_slice(data);
        Ok(())
    }
    fn read_page(&self, slot: &Slot, out: &mut [u8]) -> Result<()> {
        check_page_len("destination", out.len(), self.page_size)?;
        out.copy_from_slice(self.bytes(slot)?);
        Ok(())
    }
    fn with_page(&self, slot: &Slot, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        f(self.bytes(slot)?)
    }
    fn read_range(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(offset, out.len(), self.page_size)?;
        out.copy_from_slice(&self.bytes(slot)?[offset..offset + out.len()]);
        Ok(())
    }
    fn write_range(&self, slot: &mut Slot, offset: usize, data: &[u8]) -> Result<()> {
        check_range(offset, data.len(), self.page_size)?;
        self.bytes_mut(slot)?[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn round_trip_and_capacity() {
        let s = HostStore::new(&HostConfig::new(4 * 65536, 65536)).unwrap();
        let mut slots: Vec<Slot> = (0..4).map(|_| s.alloc().unwrap()).collect();
        assert_eq!(s.alloc().unwrap_err().kind(), ErrorKind::OutOfCapacity);
        for (i, slot) in slots.iter_mut().enumerate() {
            s.write_page(slot, &vec![i as u8 + 1; 65536]).unwrap();
        }
        let mut out = vec![0; 65536];
        for (i, slot) in slots.iter().enumerate() {
            s.read_page(slot, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == i as u8 + 1));
            assert_eq!(s.slot_ptr(slot).unwrap().as_ptr() as usize % 65536, 0);
        }
        for slot in slots {
            s.free(slot).unwrap();
        }
        assert_eq!(s.used_pages(), 0);
    }

    #[test]
    fn bad_configs() {
        let e = HostStore::new(&HostConfig::new(0, 4096)).unwrap_err();
        assert!(e.message().contains("holds no whole page"), "{e}");
        let e = HostStore::new(&HostConfig::new(1 << 20, 12288)).unwrap_err();
        assert!(e.message().contains("power of two"), "{e}");
        let s = HostStore::new(&HostConfig::new(1 << 20, 4096)).unwrap();
        let mut slot = s.alloc().unwrap();
        assert!(s.write_page(&mut slot, &[0; 100]).is_err());
        s.free(slot).unwrap();
    }

    struct Counting(Arc<AtomicUsize>);
    struct Guard(Arc<AtomicUsize>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    impl ArenaRegistrar for Counting {
        fn register(&self, base: NonNull<u8>, len: usize) -> Result<Box<dyn Any + Send + Sync>> {
            assert_eq!(base.as_ptr() as usize % 4096, 0);
            assert!(len > 0);
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(Guard(self.0.clone())))
        }
    }

    #[test]
    fn registration_released_on_drop() {
        let live = Arc::new(AtomicUsize::new(0));
        let s = HostStore::new(&HostConfig::new(1 << 20, 4096)).unwrap();
        s.register(&Counting(live.clone())).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 1);
        drop(s);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}
