//! A CSR graph in tiered buffers, read by the kernels through device maps
//! on the simulated device, with the accounting that turns a run into
//! modelled GPU time.
//!
//! Four configurations, same kernels, same graph:
//!
//! | config | where the arrays are | what an access costs |
//! |---|---|---|
//! | `strata` | device up to the budget, the rest in host memory; between kernel launches (BFS levels, PageRank iterations) the balancer promotes and demotes pages by the default policy | a device page: HBM; a host page: a zero-copy PCIe read |
//! | `uvm-lru` | host memory, with a model of Unified Memory on top: a fault-driven LRU of 2 MiB groups holding the budget | a resident group: HBM; a fault: fault latency plus the group's 2 MiB migration (and the evicted group's migration back) |
//! | `zero-copy` | host memory, read in place (EMOGI) | PCIe |
//! | `all-device` | device memory (the whole graph) | HBM |
//!
//! Reads are counted in 128-byte transactions per array (consecutive loads
//! in one line are one transaction, as a warp's coalesced loads are), and
//! modelled time is transactions × 128 B over the bandwidth of where they
//! went, plus migrations. Modelled parameters: [`GpuModel`].
//!
//! On a GPU ([`TieredGraph::build_on`] with `DeviceChoice::Cuda`) the same
//! layout serves the CUDA kernels of `cuda.rs`, which read it through the
//! maps' device copies and measure time instead of modelling it.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use super::algo::{Mem, Read};
use super::Csr;
use strata::device::DeviceChoice;
use strata::error::{Error, Result};
use strata::policy::{lru::Lru, Outcome, Policy};
use strata::runtime::{Access, Buffer, DeviceMap, Launch, Placement, Reader, Runtime};
use strata::tier::Tier;

/// The configurations compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Config {
    /// Tiered by strata's default policy.
    #[serde(rename = "strata")]
    Strata,
    /// Unified-Memory-like fault-driven LRU at 2 MiB.
    #[serde(rename = "uvm-lru")]
    UvmLru,
    /// Everything in host memory, read in place.
    #[serde(rename = "zero-copy")]
    ZeroCopy,
    /// Everything in device memory.
    #[serde(rename = "all-device")]
    AllDevice,
    /// On a GPU: the arrays in CUDA Unified Memory (`cuMemAllocManaged`),
    /// with device memory beyond the budget held back.
    #[serde(rename = "uvm")]
    Uvm,
}

impl Config {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Config::Strata => "strata",
            Config::UvmLru => "uvm-lru",
            Config::ZeroCopy => "zero-copy",
            Config::AllDevice => "all-device",
            Config::Uvm => "uvm",
        }
    }
}

/// The modelled GPU (simulated device): figures of a PCIe Gen4 H100-class
/// part. Stated, not measured; every report says "modelled".
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GpuModel {
    /// Device memory bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// Host↔device link bandwidth for zero-copy reads and migrations,
    /// bytes/s (the simulated link model's).
    pub pcie_bandwidth: f64,
    /// Bytes per memory transaction.
    pub line: u64,
    /// Unified Memory: cost of servicing one fault, beyond the transfer.
    pub fault_seconds: f64,
    /// Unified Memory migration granularity.
    pub uvm_group: u64,
    /// Launching a kernel and waiting for it (one per BFS level, SSSP
    /// bucket round, PageRank iteration, CC round), in every configuration.
    pub launch_seconds: f64,
}

impl Default for GpuModel {
    fn default() -> Self {
        Self {
            hbm_bandwidth: 2.0e12,
            pcie_bandwidth: strata::lowlevel::PCIE_GEN4_X16.bandwidth,
            line: 128,
            fault_seconds: 25e-6,
            uvm_group: 2 << 20,
            launch_seconds: 5e-6,
        }
    }
}

/// Arrays, in the order they are allocated (and placed).
const OFFSETS: usize = 0;
const NEIGHBORS: usize = 1;
const WEIGHTS: usize = 2;
const IN_OFFSETS: usize = 3;
const IN_NEIGHBORS: usize = 4;

/// A graph in tiered buffers for one configuration.
pub struct TieredGraph {
    /// The runtime holding it.
    pub rt: Runtime,
    config: Config,
    bufs: Vec<Option<Buffer>>,
    vertices: usize,
    directed: bool,
    page_size: usize,
}

fn write_array<T: bytemuck::Pod>(rt: &Runtime, data: &[T], placement: Placement) -> Result<Buffer> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let b = rt.alloc_with(bytes.len().max(1) as u64, placement)?;
    // In 8 MiB pieces: the whole array need not be copied at once.
    for (i, piece) in bytes.chunks(8 << 20).enumerate() {
        b.write((i * (8 << 20)) as u64, piece)?;
    }
    Ok(b)
}

impl TieredGraph {
    /// Bytes of the arrays a kernel reads (weights only for SSSP).
    pub fn footprint(g: &Csr, weights: bool) -> u64 {
        let mut b = g.offsets.len() as u64 * 8 + g.neighbors.len() as u64 * 4;
        if weights {
            b += g.weights.len() as u64 * 4;
        }
        if let Some((o, n)) = &g.incoming {
            b += o.len() as u64 * 8 + n.len() as u64 * 4;
        }
        b
    }

    /// Lays `g` out for `config` with `budget` bytes of simulated device
    /// memory.
    pub fn build(
        g: &Csr,
        config: Config,
        budget: u64,
        page_size: usize,
        weights: bool,
    ) -> Result<Self> {
        Self::build_on(g, config, budget, page_size, weights, DeviceChoice::Sim)
    }

    /// [`build`](Self::build) on the device `device` (a GPU's device tier
    /// is then `budget` bytes of its memory).
    pub fn build_on(
        g: &Csr,
        config: Config,
        budget: u64,
        page_size: usize,
        weights: bool,
        device: DeviceChoice,
    ) -> Result<Self> {
        let total = Self::footprint(g, weights);
        // Every array rounds up to whole pages.
        let pages_bytes = total + 6 * page_size as u64;
        let device_bytes = match config {
            Config::Strata => budget,
            Config::AllDevice => pages_bytes,
            Config::UvmLru | Config::ZeroCopy | Config::Uvm => 0,
        };
        if config == Config::Strata && device_bytes < page_size as u64 {
            return Err(Error::invalid(format!(
                "a device budget of {budget} bytes holds no {page_size}-byte page"
            )));
        }
        let rt = Runtime::builder()
            .page_size(page_size)
            .device(device, device_bytes)
            .host(pages_bytes)
            .background_eviction(false)
            // Sampled counters feed the balancer; the baselines count nothing.
            .sampling((config == Config::Strata).then_some(4))
            .build()?;
        // strata's device starts empty, as Unified Memory's does: what it
        // holds it promotes (and pays for) during the kernels.
        let place = match config {
            Config::AllDevice => Placement::Fastest,
            _ => Placement::Prefer(Tier::Host),
        };
        let mut bufs: Vec<Option<Buffer>> = (0..5).map(|_| None).collect();
        bufs[OFFSETS] = Some(write_array(&rt, &g.offsets, place)?);
        bufs[NEIGHBORS] = Some(write_array(&rt, &g.neighbors, place)?);
        if weights {
            bufs[WEIGHTS] = Some(write_array(&rt, &g.weights, place)?);
        }
        if let Some((o, n)) = &g.incoming {
            bufs[IN_OFFSETS] = Some(write_array(&rt, o, place)?);
            bufs[IN_NEIGHBORS] = Some(write_array(&rt, n, place)?);
        }
        Ok(Self {
            rt,
            config,
            bufs,
            vertices: g.vertices(),
            directed: g.directed(),
            page_size,
        })
    }

    /// The buffers' device maps (for one kernel run).
    pub fn maps(&self) -> Result<Vec<Option<DeviceMap>>> {
        self.bufs
            .iter()
            .map(|b| b.as_ref().map(Buffer::device_map).transpose())
            .collect()
    }

    /// Starts a trial cold: for strata, the device emptied (uncharged: it
    /// is the state before any trial), the access counts of the writes and
    /// of earlier trials folded away, and the balancer's policy fresh.
    pub fn reset(&self, balancer: strata::runtime::BalancerConfig) -> Result<()> {
        if self.config != Config::Strata {
            return Ok(());
        }
        for b in self.bufs.iter().flatten() {
            b.evict(0..b.len(), Tier::Host)?;
            // Decay 1e-9 leaves no trace of the counts in the scores.
            let _ = b.harvest(strata::hotness::HarvestParams {
                decay: 1e-9,
                k: 0,
                shift: 0,
            });
        }
        self.rt.configure_balancer(balancer)
    }

    /// The arrays' buffers: offsets, neighbours, weights, incoming offsets,
    /// incoming neighbours (`None` where the graph has none).
    pub fn buffers(&self) -> &[Option<Buffer>] {
        &self.bufs
    }

    /// Whether the graph is directed (then it carries its transpose).
    pub fn directed(&self) -> bool {
        self.directed
    }

    /// Vertex count.
    pub fn vertices(&self) -> usize {
        self.vertices
    }

    /// Bytes of each array (0 where the graph has none), for capping
    /// Unified Memory transfers at the array's end.
    fn array_bytes(&self) -> [u64; 5] {
        std::array::from_fn(|a| self.bufs[a].as_ref().map_or(0, Buffer::len))
    }

    /// Whether every page of every array is in device memory.
    pub fn all_on_device(&self) -> bool {
        self.bufs
            .iter()
            .flatten()
            .all(|b| (0..b.page_count()).all(|p| b.tier_of(p).ok().flatten() == Some(Tier::Device)))
    }
}

/// What a run read and moved.
#[derive(Debug, Default)]
pub struct Accounting {
    /// 128-byte transactions served from device memory.
    pub device_tx: AtomicU64,
    /// Transactions served from host memory over PCIe (zero-copy).
    pub host_tx: AtomicU64,
    /// Unified Memory model: group accesses, faults, evictions.
    pub uvm_accesses: AtomicU64,
    /// See `uvm_accesses`.
    pub uvm_faults: AtomicU64,
    /// See `uvm_accesses`.
    pub uvm_evictions: AtomicU64,
    /// Bytes the faults migrated (2 MiB groups, capped at the array's end).
    pub uvm_fault_bytes: AtomicU64,
    /// Kernel launches (steps between which the balancer may run).
    pub launches: AtomicU64,
}

/// The kernels' view of a [`TieredGraph`] during one run.
pub struct TieredMem<'m> {
    graph: &'m TieredGraph,
    maps: &'m [Option<DeviceMap>],
    launches: Vec<Option<Launch<'m>>>,
    acct: &'m Accounting,
    uvm: Option<Mutex<Lru>>,
    group_shift: u32,
    group_bytes: u64,
    array_bytes: [u64; 5],
    /// Balancer rounds' errors, if any (the run goes on; reported after).
    pub errors: Vec<Error>,
    /// A relaunch failed: reads return zeros until the run ends, and the
    /// run reports the error in `errors` instead of a result.
    broken: bool,
}

impl<'m> TieredMem<'m> {
    /// Starts a run: launches over every map.
    pub fn new(
        graph: &'m TieredGraph,
        maps: &'m [Option<DeviceMap>],
        acct: &'m Accounting,
        model: &GpuModel,
        budget: u64,
    ) -> Result<Self> {
        let group_pages = (model.uvm_group / graph.page_size as u64).max(1);
        let uvm = (graph.config == Config::UvmLru).then(|| {
            // The same byte budget as strata's device tier.
            let groups = (budget / model.uvm_group).max(1) as usize;
            Mutex::new(Lru::new(groups))
        });
        let mut m = Self {
            graph,
            maps,
            launches: Vec::new(),
            acct,
            uvm,
            group_shift: group_pages.trailing_zeros(),
            group_bytes: group_pages * graph.page_size as u64,
            array_bytes: graph.array_bytes(),
            errors: Vec::new(),
            broken: false,
        };
        m.launch()?;
        Ok(m)
    }

    fn launch(&mut self) -> Result<()> {
        self.launches = self
            .maps
            .iter()
            .map(|m| m.as_ref().map(|m| m.prepare(Access::ReadOnly)).transpose())
            .collect::<Result<_>>()?;
        Ok(())
    }
}

impl Mem for TieredMem<'_> {
    type Reader<'a>
        = TieredRead<'a>
    where
        Self: 'a;

    fn reader(&self, task: u64) -> TieredRead<'_> {
        let seed = task.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xC0FFEE;
        TieredRead {
            readers: std::array::from_fn(|a| {
                self.launches
                    .get(a)
                    .and_then(Option::as_ref)
                    .map(|l| l.reader(seed.wrapping_add(a as u64)))
            }),
            last_line: [u64::MAX; 5],
            last_group: [u64::MAX; 5],
            device_tx: 0,
            host_tx: 0,
            uvm_accesses: 0,
            uvm_faults: 0,
            uvm_evictions: 0,
            uvm_fault_bytes: 0,
            mem: self,
        }
    }

    fn vertices(&self) -> usize {
        self.graph.vertices
    }

    fn directed(&self) -> bool {
        self.graph.directed
    }

    fn between_steps(&mut self) {
        self.acct.launches.fetch_add(1, Ordering::Relaxed);
        if self.graph.config != Config::Strata {
            return;
        }
        // A kernel launch ends; the balancer moves pages; the next begins.
        self.launches.clear();
        if let Err(e) = self.graph.rt.balance_once() {
            self.errors.push(e);
        }
        if let Err(e) = self.launch() {
            self.broken = true;
            self.errors.push(e);
        }
    }
}

/// One task's reads; adds its counts to the run's [`Accounting`] on drop.
pub struct TieredRead<'a> {
    readers: [Option<Reader<'a, 'a>>; 5],
    last_line: [u64; 5],
    last_group: [u64; 5],
    device_tx: u64,
    host_tx: u64,
    uvm_accesses: u64,
    uvm_faults: u64,
    uvm_evictions: u64,
    uvm_fault_bytes: u64,
    mem: &'a TieredMem<'a>,
}

impl TieredRead<'_> {
    #[inline]
    fn load<T: bytemuck::Pod>(&mut self, array: usize, index: u64) -> T {
        let Some(r) = self.readers[array].as_mut() else {
            // Only after a failed relaunch, which the run reports.
            assert!(
                self.mem.broken,
                "the kernel reads only arrays the graph has"
            );
            return T::zeroed();
        };
        let (value, page, on_device) = r.load_at::<T>(index);
        let line = (index * std::mem::size_of::<T>() as u64) >> 7;
        if line != self.last_line[array] {
            self.last_line[array] = line;
            match &self.mem.uvm {
                Some(uvm) => {
                    let group = (page as u64) >> self.mem.group_shift;
                    if group != self.last_group[array] {
                        self.last_group[array] = group;
                        self.uvm_accesses += 1;
                        let id = (array as u64) << 40 | group;
                        if let Outcome::Miss { evicted } = uvm.lock().access(id) {
                            self.uvm_faults += 1;
                            let m = self.mem;
                            let start = group * m.group_bytes;
                            self.uvm_fault_bytes += m
                                .group_bytes
                                .min(m.array_bytes[array].saturating_sub(start));
                            self.uvm_evictions += evicted.is_some() as u64;
                        }
                    }
                    self.device_tx += 1;
                }
                None if on_device => self.device_tx += 1,
                None => self.host_tx += 1,
            }
        }
        value
    }
}

impl Drop for TieredRead<'_> {
    fn drop(&mut self) {
        let a = self.mem.acct;
        a.device_tx.fetch_add(self.device_tx, Ordering::Relaxed);
        a.host_tx.fetch_add(self.host_tx, Ordering::Relaxed);
        a.uvm_accesses
            .fetch_add(self.uvm_accesses, Ordering::Relaxed);
        a.uvm_faults.fetch_add(self.uvm_faults, Ordering::Relaxed);
        a.uvm_evictions
            .fetch_add(self.uvm_evictions, Ordering::Relaxed);
        a.uvm_fault_bytes
            .fetch_add(self.uvm_fault_bytes, Ordering::Relaxed);
    }
}

impl Read for TieredRead<'_> {
    #[inline]
    fn offset(&mut self, v: usize) -> u64 {
        self.load(OFFSETS, v as u64)
    }
    #[inline]
    fn neighbor(&mut self, i: u64) -> u32 {
        self.load(NEIGHBORS, i)
    }
    #[inline]
    fn weight(&mut self, i: u64) -> u32 {
        self.load(WEIGHTS, i)
    }
    #[inline]
    fn in_offset(&mut self, v: usize) -> u64 {
        if self.mem.graph.directed {
            self.load(IN_OFFSETS, v as u64)
        } else {
            self.load(OFFSETS, v as u64)
        }
    }
    #[inline]
    fn in_neighbor(&mut self, i: u64) -> u32 {
        if self.mem.graph.directed {
            self.load(IN_NEIGHBORS, i)
        } else {
            self.load(NEIGHBORS, i)
        }
    }
}
