//! The CXL store: a [`HostStore`] on a CPU-less NUMA node (how Linux shows a
//! CXL memory expander), or — where the machine has none and the
//! configuration asks for one — an emulated CXL tier: DRAM behind a
//! bandwidth cap and an added latency per transfer. An emulated tier says
//! so everywhere it is reported.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::host::{HostConfig, HostStore};
use super::slots::Slot;
use super::store::{check_page_len, check_range, PageStore, Tier};
use crate::error::{Error, ErrorKind, Result};
pub use crate::link::{LinkModel, Throttle};
use crate::sys::Topology;

/// Where the CXL tier's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CxlMode {
    /// A CPU-less NUMA node if the machine has one, else no CXL tier.
    #[default]
    Auto,
    /// Always emulate, even where real CXL memory exists.
    Emulated,
    /// No CXL tier.
    Off,
}

/// Where a CXL tier's memory comes from on this machine:
/// [`CxlMode::backing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CxlBacking {
    /// Real CXL memory: a CPU-less NUMA node (how Linux shows a CXL
    /// expander), with its memory size.
    Node {
        /// The NUMA node.
        id: u32,
        /// Its memory.
        memory_bytes: u64,
    },
    /// DRAM behind a bandwidth cap and added latency.
    Emulated,
    /// No CXL tier.
    Absent,
}

impl CxlMode {
    /// What this mode means on a machine of `topology` — the one place
    /// `auto` is resolved: the first of the memory-only NUMA nodes slower
    /// than DRAM ([`Topology::slow_memory_nodes`]: a node the kernel's
    /// memory tiers rank slower first), else no tier.
    pub fn backing(self, topology: &Topology) -> CxlBacking {
        match self {
            CxlMode::Off => CxlBacking::Absent,
            CxlMode::Emulated => CxlBacking::Emulated,
            CxlMode::Auto => match topology.slow_memory_nodes().first() {
                Some(n) => CxlBacking::Node {
                    id: n.id,
                    memory_bytes: n.memory_bytes,
                },
                None => CxlBacking::Absent,
            },
        }
    }

    /// Real CXL memory where the machine has some, else emulated (what the
    /// optimizer's CXL tier and the copy benchmark use).
    pub fn real_or_emulated(topology: &Topology) -> CxlMode {
        match CxlMode::Auto.backing(topology) {
            CxlBacking::Node { .. } => CxlMode::Auto,
            _ => CxlMode::Emulated,
        }
    }
}

/// Added latency of a CXL expander over local DRAM: published measurements
/// of CXL 1.1/2.0 Type-3 expanders put it at roughly +100 ns (Sun et al.,
/// "Demystifying CXL Memory", MICRO 2023; Li et al., "Pond", ASPLOS 2023).
pub const CXL_DEFAULT_LATENCY_NS: u64 = 100;

/// Fraction of local DRAM bandwidth an emulated CXL tier gets by default
/// (the same measurements: about half).
pub const CXL_DEFAULT_BANDWIDTH_FRACTION: f64 = 0.5;

/// How to build a [`CxlStore`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CxlConfig {
    /// Where the memory comes from.
    pub mode: CxlMode,
    /// Capacity in bytes (for a real node: at most the node's memory).
    pub capacity: u64,
    /// Slot size.
    pub page_size: usize,
    /// Emulation: bandwidth cap in bytes/s; `None` means half of this
    /// machine's measured memcpy bandwidth.
    pub bandwidth: Option<f64>,
    /// Emulation: added latency per transfer in nanoseconds.
    pub latency_ns: u64,
}

impl CxlConfig {
    /// A config with default emulation parameters.
    pub fn new(mode: CxlMode, capacity: u64, page_size: usize) -> Self {
        Self {
            mode,
            capacity,
            page_size,
            bandwidth: None,
            latency_ns: CXL_DEFAULT_LATENCY_NS,
        }
    }
}

/// This machine's single-thread memcpy bandwidth in bytes/s, measured once
/// (64 MiB copied a few times) and cached.
pub fn local_memcpy_bandwidth() -> f64 {
    static BW: OnceLock<f64> = OnceLock::new();
    *BW.get_or_init(|| {
        let len = 64 << 20;
        let src = vec![1u8; len];
        let mut dst = vec![0u8; len];
        dst.copy_from_slice(&src);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        len as f64 / best.max(1e-9)
    })
}

/// The CXL tier.
#[derive(Debug)]
pub struct CxlStore {
    host: HostStore,
    throttle: Option<Throttle>,
}

impl CxlConfig {
    /// Checks that this machine can provide the tier: a mode that finds no
    /// memory (`off`, or `auto` with no CPU-less node) provides none, and
    /// real CXL memory must hold the capacity (what `strata info` reports
    /// and [`CxlStore::new`] refuses).
    pub fn check(&self, topology: &Topology) -> Result<()> {
        match self.mode.backing(topology) {
            CxlBacking::Absent => Err(absent(self.mode)),
            CxlBacking::Node { id, memory_bytes } if self.capacity > memory_bytes => {
                Err(Error::invalid(format!(
                    "cxl capacity {} exceeds NUMA node {id}'s {}",
                    crate::size::format_size(self.capacity),
                    crate::size::format_size(memory_bytes)
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Why a mode whose backing is [`CxlBacking::Absent`] gives no tier.
fn absent(mode: CxlMode) -> Error {
    if mode == CxlMode::Off {
        Error::invalid("the CXL tier is configured off")
    } else {
        Error::new(
            ErrorKind::Unsupported,
            "no CPU-less NUMA node (CXL memory) on this machine; set cxl mode to \"emulated\" to emulate one",
        )
    }
}

impl CxlStore {
    /// Builds the tier: on the first CPU-less NUMA node for
    /// [`CxlMode::Auto`] (an error naming the absence if there is none), or
    /// emulated for [`CxlMode::Emulated`].
    pub fn new(config: &CxlConfig, topology: &Topology) -> Result<Self> {
        let host_config = |numa_node| HostConfig {
            capacity: config.capacity,
            page_size: config.page_size,
            huge_pages: true,
            numa_node,
        };
        match config.mode.backing(topology) {
            CxlBacking::Absent => Err(absent(config.mode)),
            CxlBacking::Node { id, .. } => {
                config.check(topology)?;
                Ok(Self {
                    host: HostStore::with_tier(&host_config(Some(id)), Tier::Cxl)?,
                    throttle: None,
                })
            }
            CxlBacking::Emulated => {
                let bandwidth = config
                    .bandwidth
                    .unwrap_or_else(|| local_memcpy_bandwidth() * CXL_DEFAULT_BANDWIDTH_FRACTION);
                let model = LinkModel {
                    bandwidth,
                    latency_ns: config.latency_ns,
                };
                let throttle = Throttle::new(model).map_err(|e| e.context("emulated cxl"))?;
                Ok(Self {
                    host: HostStore::with_tier(&host_config(None), Tier::Cxl)?,
                    throttle: Some(throttle),
                })
            }
        }
    }

    /// The link model of an emulated tier (`None` for real CXL memory).
    pub fn emulation(&self) -> Option<LinkModel> {
        self.throttle.as_ref().map(Throttle::model)
    }

    /// Modelled link time of an emulated tier so far.
    pub fn modelled(&self) -> Option<Duration> {
        self.throttle.as_ref().map(Throttle::modelled)
    }

    /// The NUMA node of a real CXL tier.
    pub fn numa_node(&self) -> Option<u32> {
        self.host.numa_node()
    }

    /// The underlying arena, for zero-copy access and registration. Direct
    /// access bypasses the emulated link's pacing.
    pub fn as_host(&self) -> &HostStore {
        &self.host
    }

    /// Runs `f`, a transfer of `bytes`, at the emulated link's pace. Callers
    /// check their arguments first: a call refused after the pacing would
    /// have waited for, and counted in the modelled time, bytes that never
    /// moved.
    fn paced<T>(&self, bytes: usize, f: impl FnOnce() -> T) -> T {
        match &self.throttle {
            Some(t) => t.transfer(bytes, f),
            None => f(),
        }
    }

    /// Copies a page from a host slot into a CXL slot (demotion).
    pub fn copy_from_host(&self, src_store: &HostStore, src: &Slot, dst: &mut Slot) -> Result<()> {
        let bytes = self.host.page_size();
        check_page_len("source", src_store.page_size(), bytes)?;
        src_store.check(src)?;
        self.host.check(dst)?;
        self.paced(bytes, || src_store.copy_page(src, &self.host, dst))
    }

    /// Copies a page from a CXL slot into a host slot (promotion).
    pub fn copy_to_host(&self, src: &Slot, dst_store: &HostStore, dst: &mut Slot) -> Result<()> {
        let bytes = self.host.page_size();
        check_page_len("destination", dst_store.page_size(), bytes)?;
        self.host.check(src)?;
        dst_store.check(dst)?;
        self.paced(bytes, || self.host.copy_page(src, dst_store, dst))
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.host.capacity_bytes()
    }
}

impl PageStore for CxlStore {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn address(&self, slot: &Slot) -> Option<u64> {
        self.host.slot_ptr(slot).ok().map(|p| p.as_ptr() as u64)
    }
    fn host_memory(&self) -> Option<std::ops::Range<u64>> {
        self.host.host_memory()
    }
    fn kernel_address(&self, slot: &Slot) -> u64 {
        self.host.kernel_address(slot).unwrap_or(0)
    }
    fn tier(&self) -> Tier {
        Tier::Cxl
    }
    fn page_size(&self) -> usize {
        self.host.page_size()
    }
    fn capacity_pages(&self) -> u32 {
        self.host.capacity_pages()
    }
    fn used_pages(&self) -> u32 {
        self.host.used_pages()
    }
    fn alloc(&self) -> Result<Slot> {
        self.host.alloc()
    }
    fn free(&self, slot: Slot) -> Result<()> {
        self.host.free(slot)
    }
    fn write_page(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        check_page_len("source", data.len(), self.host.page_size())?;
        self.host.check(slot)?;
        self.paced(data.len(), || self.host.write_page(slot, data))
    }
    fn read_page(&self, slot: &Slot, out: &mut [u8]) -> Result<()> {
        check_page_len("destination", out.len(), self.host.page_size())?;
        self.host.check(slot)?;
        let bytes = out.len();
        self.paced(bytes, || self.host.read_page(slot, out))
    }
    fn with_page(&self, slot: &Slot, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        self.host.check(slot)?;
        // The copy `f` makes out of CXL memory is the transfer to pace.
        let bytes = self.host.page_size();
        self.paced(bytes, || self.host.with_page(slot, f))
    }
    fn read_range(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(offset, out.len(), self.host.page_size())?;
        self.host.check(slot)?;
        let bytes = out.len();
        self.paced(bytes, || self.host.read_range(slot, offset, out))
    }
    fn write_range(&self, slot: &mut Slot, offset: usize, data: &[u8]) -> Result<()> {
        check_range(offset, data.len(), self.host.page_size())?;
        self.host.check(slot)?;
        self.paced(data.len(), || self.host.write_range(slot, offset, data))
    }
    fn emulated(&self) -> bool {
        self.throttle.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_without_cpu_less_node_names_the_problem() {
        let topo = Topology::default();
        let e = CxlStore::new(&CxlConfig::new(CxlMode::Auto, 1 << 20, 4096), &topo).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.message().contains("CPU-less"), "{e}");
    }

    #[test]
    fn emulated_round_trip_is_paced() {
        let mut cfg = CxlConfig::new(CxlMode::Emulated, 16 * 65536, 65536);
        cfg.bandwidth = Some(1e9); // 64 KiB takes 65.5 µs at 1 GB/s
        cfg.latency_ns = 1000;
        let s = CxlStore::new(&cfg, &Topology::default()).unwrap();
        assert!(s.emulated());
        let mut slot = s.alloc().unwrap();
        let data: Vec<u8> = (0..65536).map(|i| (i % 251) as u8).collect();
        let t = Instant::now();
        for _ in 0..8 {
            s.write_page(&mut slot, &data).unwrap();
        }
        // 8 × (65 536 ns of bandwidth share + 1 000 ns latency).
        assert_eq!(s.modelled(), Some(Duration::from_nanos(8 * 66_536)));
        // And the pacing really happened: a lower bound only, which no
        // machine load can break (the throttle spins until the model allows).
        assert!(t.elapsed() >= Duration::from_nanos(8 * 65_536));
        let mut out = vec![0; 65536];
        s.read_page(&slot, &mut out).unwrap();
        assert_eq!(out, data);
        s.free(slot).unwrap();
    }

    #[test]
    fn refused_transfers_are_neither_paced_nor_counted() {
        let mut cfg = CxlConfig::new(CxlMode::Emulated, 16 * 4096, 4096);
        cfg.bandwidth = Some(1e9);
        cfg.latency_ns = 1000;
        let s = CxlStore::new(&cfg, &Topology::default()).unwrap();
        let other = CxlStore::new(&cfg, &Topology::default()).unwrap();
        let host = HostStore::new(&HostConfig::new(1 << 20, 8192)).unwrap();
        let mut slot = s.alloc().unwrap();
        let foreign = other.alloc().unwrap();
        let mut host_slot = host.alloc().unwrap();
        // A source or destination of the wrong length, a range past the
        // page, a slot of another store, stores of different page sizes:
        // each is refused before a byte moves.
        let mut big = vec![0; 64 << 20];
        assert!(s.write_page(&mut slot, &big).is_err());
        assert!(s.read_page(&slot, &mut big).is_err());
        assert!(s.read_range(&slot, 4000, &mut [0; 200]).is_err());
        assert!(s.write_range(&mut slot, 4096, &[1]).is_err());
        assert!(s.read_page(&foreign, &mut [0; 4096]).is_err());
        assert!(s.with_page(&foreign, &mut |_| Ok(())).is_err());
        assert!(s.copy_to_host(&slot, &host, &mut host_slot).is_err());
        assert!(s.copy_from_host(&host, &host_slot, &mut slot).is_err());
        // (Counted, 128 MiB at 1 GB/s: the calls spun for 134 ms too.)
        assert_eq!(s.modelled(), Some(Duration::ZERO));
        // A transfer that happens is still paced and counted.
        s.write_page(&mut slot, &[7; 4096]).unwrap();
        assert_eq!(s.modelled(), Some(Duration::from_nanos(4096 + 1000)));
        s.free(slot).unwrap();
        other.free(foreign).unwrap();
        host.free(host_slot).unwrap();
    }

    #[test]
    fn bad_bandwidth_rejected() {
        let mut cfg = CxlConfig::new(CxlMode::Emulated, 1 << 20, 4096);
        cfg.bandwidth = Some(0.0);
        assert!(CxlStore::new(&cfg, &Topology::default()).is_err());
        cfg.bandwidth = Some(1e9);
        cfg.latency_ns = u64::MAX;
        assert!(CxlStore::new(&cfg, &Topology::default()).is_err());
    }
}
