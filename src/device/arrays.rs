//! Arrays in device memory that the runtime's kernels use: page-table
//! words ([`DeviceWords`]) and access counters ([`DeviceCounters`]).

use crate::error::{Error, Result};

use super::traits::{DeviceBackend, DeviceMemory};

/// `len` elements of `size` bytes of `backend`'s memory (at least one),
/// and its device address.
fn device_array(
    backend: &dyn DeviceBackend,
    len: usize,
    size: usize,
    what: &str,
) -> Result<(Box<dyn DeviceMemory>, u64)> {
    let bytes = len
        .checked_mul(size)
        .filter(|&b| b > 0)
        .ok_or_else(|| Error::invalid(format!("a device array of {len} {what}")))?;
    let memory = backend.alloc(bytes)?;
    if memory.len() < bytes {
        return Err(Error::invalid("device allocation shorter than asked"));
    }
    let address = memory.device_address(0);
    Ok((memory, address))
}

/// An array of 64-bit words in device memory that the host updates one
/// word at a time while kernels may read it (a device map on a GPU).
/// Host-side writes are serialized; kernels' reads are outside Rust's view.
pub struct DeviceWords {
    memory: parking_lot::Mutex<Box<dyn DeviceMemory>>,
    len: usize,
    address: u64,
}

impl std::fmt::Debug for DeviceWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceWords({} at {:#x})", self.len, self.address)
    }
}

impl DeviceWords {
    /// `len` words of `backend`'s memory.
    pub fn new(backend: &dyn DeviceBackend, len: usize) -> Result<Self> {
        let (memory, address) = device_array(backend, len, 8, "words")?;
        Ok(Self {
            memory: parking_lot::Mutex::new(memory),
            len,
            address,
        })
    }

    /// The device address of word 0.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Writes word `i`.
    pub fn set(&self, i: usize, value: u64) -> Result<()> {
        self.upload(i, &[value])
    }

    /// Writes `values` from word `at` on.
    pub fn upload(&self, at: usize, values: &[u64]) -> Result<()> {
        if at
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::invalid(format!(
                "words {at}+{} exceed the array's {}",
                values.len(),
                self.len
            )));
        }
        let memory = self.memory.lock();
        // SAFETY: the range is inside the allocation (checked above, and the
        // allocation is at least `len * 8` bytes); host-side writers are
        // serialized by the lock, and nothing on the host reads the range.
        unsafe { memory.copy_in(at * 8, bytemuck::cast_slice(values)) }
    }
}

/// A buffer's access counters in device memory (one u32 per page) for
/// CUDA kernels to bump (`strata_touch` / `strata_load` in
/// `include/strata_device.cuh`); the host drains them into the runtime's
/// counters when the buffer's launches end.
pub struct DeviceCounters {
    memory: parking_lot::Mutex<Box<dyn DeviceMemory>>,
    len: usize,
    address: u64,
}

impl std::fmt::Debug for DeviceCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceCounters({} at {:#x})", self.len, self.address)
    }
}

impl DeviceCounters {
    /// `len` counters of `backend`'s memory, zeroed.
    pub fn new(backend: &dyn DeviceBackend, len: usize) -> Result<Self> {
        let (memory, address) = device_array(backend, len, 4, "counters")?;
        let c = Self {
            memory: parking_lot::Mutex::new(memory),
            len,
            address,
        };
        c.zero()?;
        Ok(c)
    }

    /// The device address of counter 0.
    pub fn address(&self) -> u64 {
        self.address
    }

    fn zero(&self) -> Result<()> {
        Self::zero_locked(&**self.memory.lock(), self.len)
    }

    fn zero_locked(memory: &dyn DeviceMemory, len: usize) -> Result<()> {
        let zeros = vec![0u8; len * 4];
        // SAFETY: the range is the allocation's first `len * 4` bytes
        // (checked in `new`); host-side access is serialized by the lock
        // the caller holds.
        unsafe { memory.copy_in(0, &zeros) }
    }

    /// Reads the counts and sets them back to zero. Counts a kernel adds
    /// between the read and the reset are lost (call it when no kernel
    /// runs; they are access samples, never data). Two drains never both
    /// return the same counts: the read and the reset are one step under
    /// the lock.
    pub fn drain(&self) -> Result<Vec<u32>> {
        let mut counts = vec![0u32; self.len];
        let memory = self.memory.lock();
        // SAFETY: as in `zero_locked`; the destination is a host vector of
        // exactly `len * 4` bytes.
        unsafe { memory.copy_out(0, bytemuck::cast_slice_mut(&mut counts))? };
        if counts.iter().any(|&c| c != 0) {
            Self::zero_locked(&**memory, self.len)?;
        }
        Ok(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim;
    use crate::error::ErrorKind;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// The drain at the end of a buffer's last launch: counts come back once,
    /// the counters read zero afterwards (on the simulated device the
    /// counters' address is host memory, so a "kernel" bumps them directly).
    #[test]
    fn device_counters_start_at_zero_and_a_drain_resets_them() {
        let sim = sim::SimBackend::new(1 << 20, sim::PCIE_GEN4_X16).unwrap();
        let c = DeviceCounters::new(&sim, 5).unwrap();
        assert_eq!(c.drain().unwrap(), [0; 5]);
        let counters = c.address() as *const AtomicU32;
        for (page, n) in [(0usize, 3u32), (4, 1), (0, 2)] {
            // SAFETY: `page` < 5 counters, 4-byte aligned host memory that
            // lives as long as `c`; only atomics touch it meanwhile.
            unsafe { &*counters.add(page) }.fetch_add(n, Ordering::Relaxed);
        }
        assert_eq!(c.drain().unwrap(), [5, 0, 0, 0, 1]);
        assert_eq!(c.drain().unwrap(), [0; 5]);
        assert_eq!(
            DeviceCounters::new(&sim, 0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
