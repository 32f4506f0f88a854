//! A CSR graph in tiered buffers, read by the kernels through device maps
//! on the simulated device, with the accounting that turns a run into
//! modelled GPU time ([`super::model`]).
//!
//! The configurations, same kernels, same graph, same device budget:
//!
//! | config | where the arrays are | what moving the data in costs |
//! |---|---|---|
//! | `strata` | allocated device-first as far as the budget holds, the rest in host memory; between kernel launches (BFS levels, SSSP bucket rounds, PageRank iterations, CC rounds) the balancer promotes and demotes pages by the default policy | the initial upload, every migration, the balancer's CPU time, translation loads and counter atomics |
//! | `uvm` | Unified Memory as the driver does it ([`super::model::Uvm`]) | faults in batches, migrations, evictions |
//! | `uvm-advised` | as `uvm`, with `cudaMemAdviseSetReadMostly` and `cudaMemPrefetchAsync` of what fits (EMOGI's "optimized UVM") | the prefetch, then as `uvm` |
//! | `zero-copy` | host memory, read in place (EMOGI's merged, aligned accesses) | nothing: every L2 miss crosses the link |
//! | `all-device` | device memory (the whole graph) | the upload |
//! | `static-optimum` | the budget filled with the pages that sent the most bytes over the link in a profiling run of the same trial (hindsight), preloaded, no migration | nothing (a bound, not a system) |
//!
//! Vertex state is in device memory in every configuration and charged as
//! such. `resident` runs the kernels over the tiered buffers with every
//! page in the fastest tier and no accounting: the simulation's own speed,
//! for comparison with CPU graph frameworks (wall time only).
//!
//! On a GPU ([`TieredGraph::build_on`] with `DeviceChoice::Cuda`) the same
//! layout serves the CUDA kernels of `cuda.rs`, which read it through the
//! maps' device copies and measure time instead of modelling it.
#![forbid(unsafe_code)]

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

use super::algo::{Mem, Read, State, WARP};
use super::model::{self, Platform, SharedTraffic, Traffic, Uvm, L2};
use super::Csr;
use strata::device::DeviceChoice;
use strata::error::{Error, Result};
use strata::runtime::{Access, Buffer, DeviceMap, Launch, Placement, Reader, Runtime};
use strata::tier::Tier;

/// The configurations compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Config {
    /// Tiered by strata's default policy.
    #[serde(rename = "strata")]
    Strata,
    /// Unified Memory: the driver's model on the simulated device; on a GPU,
    /// `cuMemAllocManaged` with device memory beyond the budget held back.
    #[serde(rename = "uvm")]
    Uvm,
    /// Unified Memory with read-mostly advice and a prefetch of what fits.
    #[serde(rename = "uvm-advised")]
    UvmAdvised,
    /// Everything in host memory, read in place.
    #[serde(rename = "zero-copy")]
    ZeroCopy,
    /// Everything in device memory.
    #[serde(rename = "all-device")]
    AllDevice,
    /// The best fixed placement in hindsight (a bound).
    #[serde(rename = "static-optimum")]
    StaticOptimum,
    /// Every page in the fastest tier, no model: wall time only.
    #[serde(rename = "resident")]
    Resident,
}

impl Config {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Config::Strata => "strata",
            Config::Uvm => "uvm",
            Config::UvmAdvised => "uvm-advised",
            Config::ZeroCopy => "zero-copy",
            Config::AllDevice => "all-device",
            Config::StaticOptimum => "static-optimum",
            Config::Resident => "resident",
        }
    }
}

impl std::str::FromStr for Config {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        [
            Config::Strata,
            Config::Uvm,
            Config::UvmAdvised,
            Config::ZeroCopy,
            Config::AllDevice,
            Config::StaticOptimum,
            Config::Resident,
        ]
        .into_iter()
        .find(|c| c.name() == s)
        .ok_or_else(|| {
            Error::invalid(format!(
                "unknown configuration {s:?} (use strata, uvm, uvm-advised, zero-copy, \
                 all-device, static-optimum or resident)"
            ))
        })
    }
}

/// The recommender benchmark's modelled GPU: bandwidths of a platform
/// preset ([`Platform`]), charged per 128-byte line.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GpuModel {
    /// The preset.
    pub platform: &'static str,
    /// Device memory bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// Host↔device link bandwidth for zero-copy reads and migrations,
    /// bytes/s.
    pub pcie_bandwidth: f64,
    /// Bytes per memory transaction.
    pub line: u64,
    /// Launching a kernel and waiting for it.
    pub launch_seconds: f64,
}

impl From<&Platform> for GpuModel {
    fn from(p: &Platform) -> Self {
        Self {
            platform: p.name,
            hbm_bandwidth: p.hbm_bandwidth,
            pcie_bandwidth: p.link_raw * model::LINE as f64 / (model::LINE as f64 + p.tlp_overhead),
            line: model::LINE,
            launch_seconds: p.launch_seconds,
        }
    }
}

impl Default for GpuModel {
    fn default() -> Self {
        Self::from(&Platform::default())
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

    /// [`footprint`](Self::footprint) with every array rounded up to
    /// whole pages: what "100% of the graph" means for a device budget.
    pub fn paged_footprint(g: &Csr, weights: bool, page_size: usize) -> u64 {
        let p = page_size as u64;
        let r = |b: u64| b.next_multiple_of(p);
        let mut b = r(g.offsets.len() as u64 * 8) + r(g.neighbors.len() as u64 * 4);
        if weights {
            b += r(g.weights.len() as u64 * 4);
        }
        if let Some((o, n)) = &g.incoming {
            b += r(o.len() as u64 * 8) + r(n.len() as u64 * 4);
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
            Config::Strata | Config::StaticOptimum => budget,
            Config::AllDevice | Config::Resident => pages_bytes,
            Config::ZeroCopy | Config::Uvm | Config::UvmAdvised => 0,
        };
        if matches!(config, Config::Strata | Config::StaticOptimum)
            && device_bytes < page_size as u64
        {
            return Err(Error::invalid(format!(
                "a device budget of {budget} bytes holds no {page_size}-byte page"
            )));
        }
        let rt = Runtime::builder()
            .page_size(page_size)
            .device(device, device_bytes)
            .host(pages_bytes)
            .background_eviction(false)
            // The whole budget is the device tier's to fill, as it is
            // Unified Memory's: no headroom kept below a high watermark.
            .watermarks(strata::runtime::Watermarks::new(1.0, 1.0))
            // Sampled counters feed the balancer; the baselines count nothing.
            .sampling((config == Config::Strata).then_some(4))
            .build()?;
        // Every array is written to host memory first; each configuration
        // then moves in what it moves, and pays for it (strata's initial
        // placement: `place_initial`).
        let place = match config {
            Config::AllDevice | Config::Resident => Placement::Fastest,
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

    /// Starts a trial cold: for strata and the static optimum, the device
    /// emptied (uncharged: it is the state before any trial), the access
    /// counts of the writes and of earlier trials folded away, and the
    /// balancer's policy fresh.
    pub fn reset(&self, balancer: strata::runtime::BalancerConfig) -> Result<()> {
        if !matches!(self.config, Config::Strata | Config::StaticOptimum) {
            return Ok(());
        }
        for b in self.bufs.iter().flatten() {
            b.evict(0..b.len(), Tier::Host)?;
            // Decay 1e-9 leaves no trace of the counts in the scores.
            b.harvest(strata::hotness::HarvestParams {
                decay: 1e-9,
                k: 0,
                shift: 0,
            })?;
        }
        self.rt.configure_balancer(balancer)
    }

    /// strata's initial placement, as an allocation with the default
    /// placement makes it: the arrays in order, device memory first, as far
    /// as `budget` holds them (the copies go over the link and are
    /// charged with the run's migrations).
    pub fn place_initial(&self, budget: u64) -> Result<()> {
        let mut left = budget / self.page_size as u64 * self.page_size as u64;
        for b in self.bufs.iter().flatten() {
            let take = b.len().next_multiple_of(self.page_size as u64).min(left);
            if take == 0 {
                break;
            }
            b.prefetch(0..take.min(b.len()), Tier::Device).wait()?;
            left -= take;
        }
        Ok(())
    }

    /// Places the pages `pages` ((array, page) pairs) in device memory,
    /// for the static optimum.
    pub fn place_pages(&self, pages: &[(usize, usize)]) -> Result<()> {
        let ps = self.page_size as u64;
        for &(a, p) in pages {
            let b = self.bufs[a]
                .as_ref()
                .expect("weights exist for arrays the graph has");
            let start = p as u64 * ps;
            b.prefetch(start..(start + ps).min(b.len()), Tier::Device)
                .wait()?;
        }
        Ok(())
    }

    /// Page size of the buffers.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The configuration.
    pub fn config(&self) -> Config {
        self.config
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

    /// Bytes of each array (0 where the graph has none).
    pub fn array_bytes(&self) -> [u64; 5] {
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

/// Where a configuration's graph pages are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Where the page is (strata, the static optimum).
    ByPage,
    /// Device memory (all-device; Unified Memory once resident).
    Device,
    /// Host memory over the link (zero-copy).
    Host,
}

/// Arrays the accounting tracks: the five CSR arrays, then the state.
const ARRAYS: usize = 5 + State::ALL.len();

/// What a run cost, by mechanism.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct RunCost {
    /// Kernel launches.
    pub launches: u64,
    /// Modelled seconds of the kernels (launch overhead included).
    pub kernel_seconds: f64,
    /// Everything the kernels read, by where it was served.
    pub traffic: Traffic,
    /// Unified Memory's driver, where it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uvm: Option<model::UvmStats>,
    /// Modelled seconds of the driver's fault service, evictions and
    /// prefetches.
    pub uvm_seconds: f64,
    /// Measured CPU seconds of strata's balancer rounds.
    pub balancer_seconds: f64,
    /// Modelled seconds of strata's device maps' upkeep. On a GPU each
    /// launch over a buffer uploads its device map (8 bytes a page) and,
    /// when it ends, reads back the kernels' access counters (4 bytes a
    /// page): one copy each way per buffer at the link's DMA rate. The
    /// simulated device keeps its maps and counters in host memory, so the
    /// model charges what the CUDA backend does.
    pub maps_seconds: f64,
    /// Launches over the buffers' device maps (strata's; each charged in
    /// `maps_seconds`).
    pub map_launches: u64,
    /// Balancer rounds run.
    pub rounds: u64,
}

/// The share of the kernels' modelled time the balancer's rounds may take:
/// a round runs between launches once the kernels since the last one took
/// at least that round's cost (CPU time and its copies) over this share.
pub const BALANCER_SHARE: f64 = 0.1;

/// The kernels' view of a [`TieredGraph`] during one run.
pub struct TieredMem<'m> {
    graph: &'m TieredGraph,
    maps: &'m [Option<DeviceMap>],
    launches: Vec<Option<Launch<'m>>>,
    platform: Platform,
    l2: L2,
    uvm: Option<Uvm>,
    shared: SharedTraffic,
    place: Place,
    /// Whether the model runs (not for `resident`).
    account: bool,
    /// Whether reads count into the runtime's counters (strata).
    counting: bool,
    page_shift: u32,
    /// Bytes each page sent over the link (the static optimum's profile).
    weights: Option<Vec<Vec<AtomicU64>>>,
    cost: RunCost,
    /// Modelled kernel seconds since the last balancer round, and that
    /// round's cost (CPU and copies).
    since_round: f64,
    last_round: f64,
    /// Balancer rounds' errors, if any (the run goes on; reported after).
    pub errors: Vec<Error>,
    /// A relaunch failed: reads return zeros until the run ends, and the
    /// run reports the error in `errors` instead of a result.
    broken: bool,
}

impl<'m> TieredMem<'m> {
    /// Starts a run: launches over every map. `budget` is Unified
    /// Memory's device memory; `profile` records what each page sent over
    /// the link (for [`weights`](Self::weights)).
    pub fn new(
        graph: &'m TieredGraph,
        maps: &'m [Option<DeviceMap>],
        platform: &Platform,
        budget: u64,
        profile: bool,
    ) -> Result<Self> {
        Self::resuming(graph, maps, platform, budget, profile, None)
    }

    /// [`new`](Self::new), Unified Memory starting from `uvm` (what an
    /// earlier run left resident, from [`take_uvm`](Self::take_uvm))
    /// instead of empty.
    pub fn resuming(
        graph: &'m TieredGraph,
        maps: &'m [Option<DeviceMap>],
        platform: &Platform,
        budget: u64,
        profile: bool,
        uvm: Option<Uvm>,
    ) -> Result<Self> {
        let config = graph.config;
        let carried = uvm.filter(|_| matches!(config, Config::Uvm | Config::UvmAdvised));
        let uvm = carried.or_else(|| {
            matches!(config, Config::Uvm | Config::UvmAdvised).then(|| {
                let advised = config == Config::UvmAdvised;
                let u = Uvm::new(
                    &graph.array_bytes(),
                    budget,
                    platform.uvm_batch_faults,
                    advised,
                );
                if advised {
                    u.prefetch_if_fits(platform);
                }
                u
            })
        });
        let place = match config {
            Config::Strata | Config::StaticOptimum => Place::ByPage,
            Config::ZeroCopy => Place::Host,
            Config::Uvm | Config::UvmAdvised | Config::AllDevice | Config::Resident => {
                Place::Device
            }
        };
        let weights = profile.then(|| {
            graph
                .bufs
                .iter()
                .map(|b| {
                    let pages = b.as_ref().map_or(0, Buffer::page_count);
                    (0..pages).map(|_| AtomicU64::new(0)).collect()
                })
                .collect()
        });
        let mut m = Self {
            graph,
            maps,
            launches: Vec::new(),
            platform: *platform,
            l2: L2::new(if config == Config::Resident {
                0
            } else {
                platform.l2_bytes
            }),
            uvm,
            shared: SharedTraffic::default(),
            place,
            account: config != Config::Resident,
            counting: config == Config::Strata,
            page_shift: graph.page_size.trailing_zeros(),
            weights,
            cost: RunCost::default(),
            since_round: 0.0,
            last_round: 0.0,
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
        if self.counting {
            // The maps up now, the counters back when these launches end
            // (see `RunCost::maps_seconds`).
            let p = &self.platform;
            for m in self.maps.iter().flatten() {
                let pages = m.pages() as u64;
                self.cost.maps_seconds += p.h2d(8 * pages, 1) + p.d2h(4 * pages, 1);
                self.cost.map_launches += 1;
            }
        }
        Ok(())
    }

    /// A launch ends: what it read becomes modelled time.
    fn end_launch(&mut self) {
        let t = self.shared.take();
        self.cost.launches += 1;
        if self.account {
            let s = t.seconds(&self.platform) + self.platform.launch_seconds;
            self.cost.kernel_seconds += s;
            self.since_round += s;
        }
        self.cost.traffic.add(&t);
        if let Some(u) = &self.uvm {
            u.end_launch(&self.platform);
        }
    }

    /// Ends the run: the last launch, if it read anything, and the cost.
    pub fn finish(&mut self) -> RunCost {
        let pending = self.shared.take();
        if pending != Traffic::default() {
            self.shared.add(&pending);
            self.end_launch();
        }
        if let Some(u) = &self.uvm {
            u.end_launch(&self.platform);
            let (stats, seconds) = u.take_stats();
            self.cost.uvm = Some(stats);
            self.cost.uvm_seconds = seconds;
        }
        self.cost
    }

    /// Unified Memory's state after [`finish`](Self::finish), for a later
    /// run to resume ([`resuming`](Self::resuming)).
    pub fn take_uvm(&mut self) -> Option<Uvm> {
        self.uvm.take()
    }

    /// The profile: per array, bytes each page sent over the link.
    pub fn weights(&self) -> Option<Vec<Vec<u64>>> {
        self.weights.as_ref().map(|w| {
            w.iter()
                .map(|a| a.iter().map(|x| x.load(Ordering::Relaxed)).collect())
                .collect()
        })
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
            cur: [Cursor::default(); ARRAYS],
            traffic: Traffic::default(),
            accesses: 0,
            offsets: 0,
            random: seed,
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
        self.end_launch();
        if self.graph.config != Config::Strata {
            return;
        }
        // A round only once the kernels ran long enough that its CPU time
        // stays a small share of theirs (as the background balancer's
        // interval does): rounds cost the more pages the buffers have.
        if self.since_round * BALANCER_SHARE < self.last_round {
            return;
        }
        self.since_round = 0.0;
        self.cost.rounds += 1;
        // A kernel launch ends; the balancer moves pages; the next begins.
        self.launches.clear();
        // The round's CPU time: of this thread (not the time it waits for
        // a core the kernel's idle workers hold: the policy, the harvest,
        // submitting), plus the migration engine's lanes running its moves,
        // less the copies they made: those are DMA on a GPU, charged as
        // migrations at the link's rate.
        let links = || self.graph.rt.stats().device_links.unwrap_or_default();
        let copying = || {
            let (h2d, d2h) = links();
            h2d.wall_seconds + d2h.wall_seconds
        };
        // The balance lanes' (CPU, wall) seconds.
        let lanes = || {
            self.graph
                .rt
                .stats()
                .engine
                .iter()
                .find(|p| p.priority == "balance")
                .map_or((0.0, 0.0), |p| (p.cpu_seconds, p.busy_seconds))
        };
        let (copied, laned) = (copying(), lanes());
        let (h2d0, d2h0) = links();
        let t = crate::sys::thread_cpu_seconds();
        let rep = self.graph.rt.balance_once();
        let own = crate::sys::thread_cpu_seconds() - t;
        if let Err(e) = rep {
            self.errors.push(e);
        }
        let (lane_cpu, lane_wall) = (lanes().0 - laned.0, lanes().1 - laned.1);
        // The copies ran on the lanes: their wall time, scaled by the share
        // of the lanes' wall time that was CPU (a lane waiting for a core
        // inflates both alike), is what they took of the lanes' CPU.
        let copies = if lane_wall > 0.0 {
            (copying() - copied) * (lane_cpu / lane_wall).min(1.0)
        } else {
            0.0
        };
        let cpu = own + (lane_cpu - copies).max(0.0);
        self.cost.balancer_seconds += cpu;
        // The next round waits for kernels worth ten times this one: its
        // CPU time and its copies' modelled DMA time.
        let (h2d, d2h) = links();
        let p = &self.platform;
        self.last_round = cpu
            + p.h2d(h2d.bytes - h2d0.bytes, h2d.ops - h2d0.ops)
            + p.d2h(d2h.bytes - d2h0.bytes, d2h.ops - d2h0.ops);
        if let Err(e) = self.launch() {
            self.broken = true;
            self.errors.push(e);
        }
    }
}

/// One array's position in a task's reads: the page being read and the
/// line being gathered into one request.
#[derive(Clone, Copy)]
struct Cursor<'a> {
    page: usize,
    bytes: &'a [u8],
    on_device: bool,
    line: u64,
    mask: u8,
    line_device: bool,
    line_page: usize,
}

impl Default for Cursor<'_> {
    fn default() -> Self {
        Self {
            page: usize::MAX,
            bytes: &[],
            on_device: false,
            line: u64::MAX,
            mask: 0,
            line_device: false,
            line_page: 0,
        }
    }
}

/// One task's reads; adds its traffic to the launch's on drop.
pub struct TieredRead<'a> {
    readers: [Option<Reader<'a, 'a>>; 5],
    cur: [Cursor<'a>; ARRAYS],
    traffic: Traffic,
    accesses: u64,
    offsets: u64,
    random: u64,
    mem: &'a TieredMem<'a>,
}

impl<'a> TieredRead<'a> {
    #[inline(always)]
    fn load<T: bytemuck::Pod>(&mut self, array: usize, index: u64) -> T {
        let size = std::mem::size_of::<T>();
        let off = index * size as u64;
        let shift = self.mem.page_shift;
        let page = (off >> shift) as usize;
        if page != self.cur[array].page && !self.switch_page(array, page) {
            return T::zeroed();
        }
        let within = (off & ((1u64 << shift) - 1)) as usize;
        let value = bytemuck::pod_read_unaligned(&self.cur[array].bytes[within..within + size]);
        if self.mem.counting {
            if let Some(r) = self.readers[array].as_mut() {
                r.touch(page);
            }
            self.accesses += 1;
        }
        if self.mem.account {
            self.note(array, off, page);
        }
        value
    }

    /// Looks page `page` of `array` up; false only after a failed
    /// relaunch (reads then return zeros; the run reports the error).
    #[cold]
    #[inline(never)]
    fn switch_page(&mut self, array: usize, page: usize) -> bool {
        let Some(r) = self.readers[array].as_ref() else {
            assert!(
                self.mem.broken,
                "the kernel reads only arrays the graph has"
            );
            return false;
        };
        let c = &mut self.cur[array];
        (c.bytes, c.on_device) = r.page(page);
        c.page = page;
        true
    }

    /// A warp's load of up to [`WARP`] 4-byte elements `i..end` of `array`,
    /// those in one page: one request per line they touch.
    #[inline]
    fn load_warp(&mut self, array: usize, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let off = i * 4;
        let shift = self.mem.page_shift;
        let page = (off >> shift) as usize;
        if page != self.cur[array].page && !self.switch_page(array, page) {
            out[0] = 0;
            return 1;
        }
        let within = (off & ((1u64 << shift) - 1)) as usize;
        let bytes = self.cur[array].bytes;
        let n = load_warp_from(bytes, within, end - i, out);
        if self.mem.counting {
            if let Some(r) = self.readers[array].as_mut() {
                for _ in 0..n {
                    r.touch(page);
                }
            }
            self.accesses += n as u64;
        }
        if self.mem.account {
            let last = off + 4 * n as u64 - 1;
            for sector in off / model::SECTOR..=last / model::SECTOR {
                self.note(array, sector * model::SECTOR, page);
            }
        }
        n
    }

    /// Gathers the access at byte `off` of `array` into the request of its
    /// line, issuing the previous request when the line changes.
    #[inline]
    fn note(&mut self, array: usize, off: u64, page: usize) {
        let line = off / model::LINE;
        let bit = 1u8 << ((off / model::SECTOR) & 3);
        let c = &mut self.cur[array];
        if line == c.line {
            c.mask |= bit;
            return;
        }
        let prev = (c.line, c.mask, c.line_device, c.line_page);
        c.line = line;
        c.mask = bit;
        c.line_page = page;
        c.line_device = match self.mem.place {
            Place::ByPage => c.on_device,
            Place::Device => true,
            Place::Host => false,
        } || array >= 5;
        if let Some(uvm) = &self.mem.uvm {
            // Checked at every request, not once per block: another task's
            // fault may have evicted the block since.
            let block = (off / model::UVM_BASIC_BLOCK) as usize;
            if array < 5 && !uvm.resident(array, block) {
                uvm.fault(array, block, &self.mem.platform);
            }
        }
        self.issue(array, prev);
    }

    /// Sends one request (line, sectors, in device memory, page) through
    /// the L2 to where it is served.
    #[inline]
    fn issue(&mut self, array: usize, (line, mask, device, page): (u64, u8, bool, usize)) {
        if mask == 0 {
            return;
        }
        let t = &mut self.traffic;
        let n = mask.count_ones() as u64;
        if array < 5 {
            t.graph_requests += 1;
            if self.mem.counting {
                t.translations += 1;
            }
        }
        self.random = self.random.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let missing = self
            .mem
            .l2
            .access((array as u64) << 50 | line, mask, self.random >> 40);
        let m = missing.count_ones() as u64;
        t.l2_sectors += n - m;
        if missing == 0 {
            t.l2_requests += 1;
        } else if device {
            t.hbm_requests += 1;
            t.hbm_sectors += m;
            t.hbm_full_lines += (m == 4) as u64;
        } else {
            t.host_requests += 1;
            t.host_sectors += m;
            if let Some(w) = &self.mem.weights {
                let wire = m * model::SECTOR + self.mem.platform.tlp_overhead as u64;
                w[array][page].fetch_add(wire, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for TieredRead<'_> {
    fn drop(&mut self) {
        if !self.mem.account {
            return;
        }
        for a in 0..ARRAYS {
            let c = &self.cur[a];
            let prev = (c.line, c.mask, c.line_device, c.line_page);
            self.issue(a, prev);
        }
        self.traffic.items += self.offsets / 2;
        if let Some(shift) = self.mem.graph.rt.sampling() {
            self.traffic.atomics += self.accesses >> shift;
        }
        self.mem.shared.add(&self.traffic);
    }
}

impl Read for TieredRead<'_> {
    #[inline(always)]
    fn offset(&mut self, v: usize) -> u64 {
        self.offsets += 1;
        self.load(OFFSETS, v as u64)
    }
    #[inline(always)]
    fn neighbor(&mut self, i: u64) -> u32 {
        self.load(NEIGHBORS, i)
    }
    #[inline(always)]
    fn weight(&mut self, i: u64) -> u32 {
        self.load(WEIGHTS, i)
    }
    #[inline(always)]
    fn in_offset(&mut self, v: usize) -> u64 {
        self.offsets += 1;
        if self.mem.graph.directed {
            self.load(IN_OFFSETS, v as u64)
        } else {
            self.load(OFFSETS, v as u64)
        }
    }
    #[inline(always)]
    fn in_neighbor(&mut self, i: u64) -> u32 {
        if self.mem.graph.directed {
            self.load(IN_NEIGHBORS, i)
        } else {
            self.load(NEIGHBORS, i)
        }
    }
    #[inline(always)]
    fn neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        self.load_warp(NEIGHBORS, i, end, out)
    }
    #[inline(always)]
    fn in_neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let a = if self.mem.graph.directed {
            IN_NEIGHBORS
        } else {
            NEIGHBORS
        };
        self.load_warp(a, i, end, out)
    }
    #[inline(always)]
    fn weights(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        self.load_warp(WEIGHTS, i, end, out)
    }
    #[inline(always)]
    fn state(&mut self, array: State, index: usize) {
        if self.mem.account {
            let a = 5 + array as usize;
            self.note(a, index as u64 * array.bytes(), 0);
        }
    }
}

/// The kernels' view of a [`TieredGraph`] with no model (`resident`): the
/// same device maps and pages, read through [`Reader::page`], nothing
/// counted — the simulation's own data path at its fastest.
pub struct ResidentMem<'m> {
    graph: &'m TieredGraph,
    launches: Vec<Option<Launch<'m>>>,
    page_shift: u32,
}

impl<'m> ResidentMem<'m> {
    /// Starts a run: launches over every map.
    pub fn new(graph: &'m TieredGraph, maps: &'m [Option<DeviceMap>]) -> Result<Self> {
        Ok(Self {
            graph,
            launches: maps
                .iter()
                .map(|m| m.as_ref().map(|m| m.prepare(Access::ReadOnly)).transpose())
                .collect::<Result<_>>()?,
            page_shift: graph.page_size.trailing_zeros(),
        })
    }
}

impl Mem for ResidentMem<'_> {
    type Reader<'a>
        = ResidentRead<'a>
    where
        Self: 'a;

    fn reader(&self, task: u64) -> ResidentRead<'_> {
        ResidentRead {
            readers: std::array::from_fn(|a| {
                self.launches
                    .get(a)
                    .and_then(Option::as_ref)
                    .map(|l| l.reader(task.wrapping_add(a as u64)))
            }),
            pages: [(usize::MAX, &[]); 5],
            shift: self.page_shift,
            directed: self.graph.directed,
        }
    }

    fn vertices(&self) -> usize {
        self.graph.vertices
    }

    fn directed(&self) -> bool {
        self.graph.directed
    }
}

/// A task's reads of [`ResidentMem`].
pub struct ResidentRead<'a> {
    readers: [Option<Reader<'a, 'a>>; 5],
    pages: [(usize, &'a [u8]); 5],
    shift: u32,
    directed: bool,
}

impl<'a> ResidentRead<'a> {
    /// The page holding byte `off` of `array` and the byte's offset in it.
    #[inline(always)]
    fn at(&mut self, array: usize, off: u64) -> (&'a [u8], usize) {
        let page = (off >> self.shift) as usize;
        if page != self.pages[array].0 {
            self.switch_page(array, page);
        }
        let within = (off & ((1u64 << self.shift) - 1)) as usize;
        (self.pages[array].1, within)
    }

    #[inline(always)]
    fn load<T: bytemuck::Pod>(&mut self, array: usize, index: u64) -> T {
        let size = std::mem::size_of::<T>();
        let (bytes, within) = self.at(array, index * size as u64);
        bytemuck::pod_read_unaligned(&bytes[within..within + size])
    }

    #[inline(always)]
    fn load_warp(&mut self, array: usize, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let (bytes, within) = self.at(array, i * 4);
        load_warp_from(bytes, within, end - i, out)
    }

    /// `array[v]` and `array[v + 1]` of a `u64` array, with one page
    /// lookup where both lie in one page.
    #[inline(always)]
    fn pair(&mut self, array: usize, v: usize) -> (u64, u64) {
        let (bytes, within) = self.at(array, v as u64 * 8);
        match bytes.get(within..within + 16) {
            Some(b) => {
                let [x, y]: [u64; 2] = bytemuck::pod_read_unaligned(b);
                (x, y)
            }
            None => (self.load(array, v as u64), self.load(array, v as u64 + 1)),
        }
    }

    /// The array of incoming offsets.
    fn in_offsets(&self) -> usize {
        if self.directed {
            IN_OFFSETS
        } else {
            OFFSETS
        }
    }

    /// The array of incoming neighbours.
    fn in_array(&self) -> usize {
        if self.directed {
            IN_NEIGHBORS
        } else {
            NEIGHBORS
        }
    }

    /// The first 4-byte element of `array[a..b]`, in order, for which `f`
    /// holds, read in place from the pages.
    #[inline(always)]
    fn find_u32(
        &mut self,
        array: usize,
        a: u64,
        b: u64,
        mut f: impl FnMut(&mut Self, u32) -> bool,
    ) -> Option<u32> {
        let mut i = a;
        while i < b {
            let (bytes, within) = self.at(array, i * 4);
            let k = ((b - i) as usize).min((bytes.len() - within) / 4);
            let run = &bytes[within..within + 4 * k];
            match bytemuck::try_cast_slice::<u8, u32>(run) {
                Ok(xs) => {
                    for &x in xs {
                        if f(self, x) {
                            return Some(x);
                        }
                    }
                }
                Err(_) => {
                    for e in run.chunks_exact(4) {
                        let x = u32::from_ne_bytes([e[0], e[1], e[2], e[3]]);
                        if f(self, x) {
                            return Some(x);
                        }
                    }
                }
            }
            i += k as u64;
        }
        None
    }

    #[cold]
    #[inline(never)]
    fn switch_page(&mut self, array: usize, page: usize) {
        let r = self.readers[array]
            .as_ref()
            .expect("the kernel reads only arrays the graph has");
        self.pages[array] = (page, r.page(page).0);
    }
}

impl Read for ResidentRead<'_> {
    #[inline(always)]
    fn offset(&mut self, v: usize) -> u64 {
        self.load(OFFSETS, v as u64)
    }
    #[inline(always)]
    fn neighbor(&mut self, i: u64) -> u32 {
        self.load(NEIGHBORS, i)
    }
    #[inline(always)]
    fn weight(&mut self, i: u64) -> u32 {
        self.load(WEIGHTS, i)
    }
    #[inline(always)]
    fn in_offset(&mut self, v: usize) -> u64 {
        let a = if self.directed { IN_OFFSETS } else { OFFSETS };
        self.load(a, v as u64)
    }
    #[inline(always)]
    fn in_neighbor(&mut self, i: u64) -> u32 {
        let a = if self.directed {
            IN_NEIGHBORS
        } else {
            NEIGHBORS
        };
        self.load(a, i)
    }
    #[inline(always)]
    fn neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        self.load_warp(NEIGHBORS, i, end, out)
    }
    #[inline(always)]
    fn in_neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let a = if self.directed {
            IN_NEIGHBORS
        } else {
            NEIGHBORS
        };
        self.load_warp(a, i, end, out)
    }
    #[inline(always)]
    fn weights(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        self.load_warp(WEIGHTS, i, end, out)
    }
    #[inline(always)]
    fn range(&mut self, v: usize) -> (u64, u64) {
        self.pair(OFFSETS, v)
    }
    #[inline(always)]
    fn in_range(&mut self, v: usize) -> (u64, u64) {
        let array = self.in_offsets();
        self.pair(array, v)
    }
    #[inline(always)]
    fn each_neighbor(&mut self, a: u64, b: u64, mut f: impl FnMut(&mut Self, u32)) {
        self.find_u32(NEIGHBORS, a, b, |r, v| {
            f(r, v);
            false
        });
    }
    #[inline(always)]
    fn each_in_neighbor(&mut self, a: u64, b: u64, mut f: impl FnMut(&mut Self, u32)) {
        let array = self.in_array();
        self.find_u32(array, a, b, |r, u| {
            f(r, u);
            false
        });
    }
    #[inline(always)]
    fn find_in_neighbor(
        &mut self,
        a: u64,
        b: u64,
        f: impl FnMut(&mut Self, u32) -> bool,
    ) -> Option<u32> {
        let array = self.in_array();
        self.find_u32(array, a, b, f)
    }
}

/// A warp's load from a page: as many of the `left` 4-byte elements from
/// byte `within` of `page` as a warp takes and the page holds (at least
/// one) into `out`; returns how many.
#[inline(always)]
fn load_warp_from(page: &[u8], within: usize, left: u64, out: &mut [u32; WARP]) -> usize {
    let n = (left as usize)
        .min(WARP)
        .min((page.len() - within) / 4)
        .max(1);
    copy_warp(page, within, n, out);
    n
}

/// Copies the `n` 4-byte elements at byte `within` of `page` into `out`:
/// where a whole warp's worth lies in the page, as one fixed-size read
/// (the elements past `n` are the page's next ones, unused), else one by
/// one (no call to `memcpy` for a few bytes).
#[inline(always)]
fn copy_warp(page: &[u8], within: usize, n: usize, out: &mut [u32; WARP]) {
    match page.get(within..within + 4 * WARP) {
        Some(src) => *out = bytemuck::pod_read_unaligned::<[u32; WARP]>(src),
        None => {
            let src = &page[within..within + 4 * n];
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = bytemuck::pod_read_unaligned(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{algo, verify};
    use super::*;

    /// The resident reader's in-place visits (across 4 KiB page
    /// boundaries, of outgoing and incoming arrays) give what the CSR
    /// holds, and every kernel run through it verifies.
    #[test]
    fn resident_reads_in_place_match_the_graph_and_kernels_verify() {
        let kron = Csr::load(&"kron:10".parse().unwrap(), 3).unwrap();
        let mut edges = Vec::new();
        for u in 0..kron.vertices() {
            for &v in kron.adjacency(u) {
                if (u + v as usize) % 3 != 0 {
                    edges.push((u as u32, v, 1 + (u as u32 % 7)));
                }
            }
        }
        let directed = Csr::from_edges(kron.vertices(), edges, true);
        for g in [&kron, &directed] {
            let tg = TieredGraph::build(g, Config::Resident, 0, 4096, true).unwrap();
            let maps = tg.maps().unwrap();
            let mut mem = ResidentMem::new(&tg, &maps).unwrap();
            {
                let mut r = mem.reader(0);
                for v in 0..g.vertices() {
                    let (a, b) = (r.offset(v), r.offset(v + 1));
                    let mut seen = Vec::new();
                    r.each_neighbor(a, b, |_, u| seen.push(u));
                    assert_eq!(seen, g.adjacency(v), "vertex {v}");
                    let (a, b) = (r.in_offset(v), r.in_offset(v + 1));
                    let mut seen = Vec::new();
                    r.each_in_neighbor(a, b, |_, u| seen.push(u));
                    assert_eq!(seen, g.incoming(v), "vertex {v}");
                    // The first match, and none where nothing matches.
                    let last = g.incoming(v).last().copied();
                    let mut looked = 0;
                    let found = r.find_in_neighbor(a, b, |_, u| {
                        looked += 1;
                        Some(u) == last
                    });
                    assert_eq!(found, last);
                    assert_eq!(looked, g.incoming(v).len());
                    assert_eq!(r.find_in_neighbor(a, b, |_, _| false), None);
                }
            }
            let source = (0..g.vertices()).find(|&v| g.degree(v) > 0).unwrap();
            verify::bfs(g, source, &algo::bfs(&mut mem, source)).unwrap();
            verify::sssp(g, source, &algo::sssp(&mut mem, source, 32)).unwrap();
            verify::pagerank(g, 1e-4, 100, &algo::pagerank(&mut mem, 1e-4, 100)).unwrap();
            verify::cc(g, &algo::cc(&mut mem)).unwrap();
        }
    }

    /// strata pays for its device maps at every launch over them (the map
    /// up, the counters back, one copy each way per buffer); a peer that
    /// reads in place pays nothing of the kind.
    #[test]
    fn strata_is_charged_for_its_device_maps() {
        let g = Csr::load(&"kron:10".parse().unwrap(), 3).unwrap();
        let p = model::H200_SXM5;
        let mut charged = Vec::new();
        for config in [Config::Strata, Config::ZeroCopy] {
            let tg = TieredGraph::build(&g, config, 64 << 10, 4096, true).unwrap();
            let maps = tg.maps().unwrap();
            let mut mem = TieredMem::new(&tg, &maps, &p, 64 << 10, false).unwrap();
            let source = (0..g.vertices()).find(|&v| g.degree(v) > 0).unwrap();
            algo::bfs(&mut mem, source);
            let cost = mem.finish();
            charged.push((config, cost));
            if config == Config::Strata {
                let buffers = maps.iter().flatten().count() as u64;
                assert_eq!(cost.map_launches, buffers * (cost.rounds + 1));
                let per_launch: f64 = maps
                    .iter()
                    .flatten()
                    .map(|m| {
                        let pages = m.pages() as u64;
                        p.h2d(8 * pages, 1) + p.d2h(4 * pages, 1)
                    })
                    .sum();
                let want = per_launch * (cost.rounds + 1) as f64;
                assert!(
                    (cost.maps_seconds - want).abs() <= 1e-12,
                    "{} against {want}",
                    cost.maps_seconds
                );
                assert!(cost.maps_seconds > 0.0);
            }
        }
        let (_, zero_copy) = charged[1];
        assert_eq!((zero_copy.maps_seconds, zero_copy.map_launches), (0.0, 0));
    }
}
