//! The modelled GPU behind `strata bench graph --device sim`: platform
//! presets, an L2 filter, the Unified Memory driver as published, and the
//! cost of one kernel launch from what it read.
//!
//! Mechanisms, not constants per configuration:
//! - Reads are counted per *request*: the 32-byte sectors of one 128-byte
//!   line that a warp's load touches (consecutive loads of one task in one
//!   line are one request, as a warp's coalesced loads are). Every request
//!   goes through a model of the L2 ([`L2`]: sectored, sized by the
//!   platform); what misses goes to HBM or, for a page in host memory, over
//!   the link.
//! - Over the link (zero-copy, strata's host pages), a request costs its
//!   sectors plus one completion TLP's overhead at the link's raw rate, and
//!   no more requests are in flight than the link's outstanding-request cap
//!   (Little's law); each launch also waits for its dependent chain
//!   (offset → neighbour → vertex state) once.
//! - HBM: whole lines at its streaming bandwidth, partial lines by sectors
//!   at its random-sector bandwidth, with the same Little's-law bound at
//!   its own cap.
//! - Vertex state (parents, depths, distances, scores, contributions,
//!   labels, frontiers) is charged in every configuration, in HBM.
//! - strata pays for its own work: one translation load per request
//!   through the device map (an L2 access), the sampled counter atomics,
//!   the balancer's CPU time (measured) and its migrations.
//! - Unified Memory ([`Uvm`]) is the driver as described by its source and
//!   by Allen & Ge (SC'21): faults serviced in batches of up to 256,
//!   migration in 64 KiB basic blocks that the tree prefetcher escalates
//!   towards the 2 MiB VA block when more than half of a subtree is
//!   resident, eviction of whole 2 MiB VA blocks oldest-first (by when they
//!   last had memory allocated, not by access, which the driver cannot
//!   see), evicted pages copied back unless the allocation is read-mostly
//!   (the driver keeps no dirty state); a batch costs a fixed time plus a
//!   time per fault plus its migrations at the link's DMA rate.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use strata::error::{Error, Result};

/// Bytes per sector, the unit of a GPU memory transaction.
pub const SECTOR: u64 = 32;
/// Bytes per cache line (four sectors).
pub const LINE: u64 = 128;
/// Unified Memory's basic block: the unit of a fault's migration.
pub const UVM_BASIC_BLOCK: u64 = 64 << 10;
/// Unified Memory's VA block: the unit of eviction and of the prefetcher's
/// tree (32 basic blocks).
pub const UVM_VA_BLOCK: u64 = 2 << 20;

/// A GPU platform's figures, each with where it comes from.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Platform {
    /// Preset name (`--platform`).
    pub name: &'static str,
    /// HBM streaming bandwidth (STREAM-like), bytes/s: whole lines.
    pub hbm_bandwidth: f64,
    /// HBM bandwidth for random 32-byte sectors, bytes/s.
    pub hbm_sector_bandwidth: f64,
    /// HBM load latency, seconds.
    pub hbm_latency: f64,
    /// Outstanding HBM requests the GPU sustains (an assumption: not
    /// found published; high enough not to bind at these sizes).
    pub hbm_outstanding: f64,
    /// L2 capacity, bytes.
    pub l2_bytes: u64,
    /// L2 bandwidth, bytes/s (hits, translations).
    pub l2_bandwidth: f64,
    /// L2 atomics per second on distinct-ish addresses (counters).
    pub l2_atomics: f64,
    /// Link raw rate per direction after line encoding, bytes/s: what TLPs
    /// (payload and overhead) share.
    pub link_raw: f64,
    /// Bulk DMA rate host→device (`cudaMemcpyAsync` of pinned memory,
    /// migrations, prefetches), bytes/s.
    pub dma_h2d: f64,
    /// Bulk DMA rate device→host, bytes/s.
    pub dma_d2h: f64,
    /// Fixed cost of one DMA batch (launch and setup), seconds.
    pub dma_latency: f64,
    /// Bytes of overhead per read-completion TLP (header, framing, CRC,
    /// the share of flow-control DLLPs).
    pub tlp_overhead: f64,
    /// Round trip of one zero-copy read from the GPU to host memory,
    /// seconds.
    pub link_latency: f64,
    /// Read requests the GPU keeps in flight on the link (PCIe tags).
    pub link_outstanding: f64,
    /// Unified Memory: fixed cost of servicing one fault batch, seconds.
    pub uvm_batch_seconds: f64,
    /// Unified Memory: cost per fault in a batch, beyond its transfer.
    pub uvm_fault_seconds: f64,
    /// Unified Memory: cost of evicting one VA block (unmap, TLB
    /// invalidation), beyond any write-back.
    pub uvm_evict_seconds: f64,
    /// Faults per batch at most.
    pub uvm_batch_faults: u32,
    /// Launching a kernel and synchronising with it, seconds.
    pub launch_seconds: f64,
    /// Where these figures come from.
    pub sources: &'static str,
}

/// Common to every preset: the Unified Memory driver's and the PCIe
/// protocol's figures (independent of the GPU generation); sources in
/// `docs/perf.md`'s calibration table.
/// Fixed cost of a fault batch, and cost per fault beyond its transfer:
/// EMOGI measured Unified Memory moving about 9 GB/s during BFS on a
/// 12.3 GB/s Gen3 link, about 2 µs of overhead per 64 KiB fault. (Allen &
/// Ge, SC'21, found transfers under 25% of a batch's time for sgemm on a
/// Titan V, which would mean 15 µs or more per fault; the graph figure is
/// the one this model is for.)
const UVM_BATCH_SECONDS: f64 = 20e-6;
const UVM_FAULT_SECONDS: f64 = 2e-6;
/// Unmapping a VA block and invalidating its translations (not sourced:
/// an estimate, a fraction of a fault's service).
const UVM_EVICT_SECONDS: f64 = 10e-6;
/// PCIe overhead per completion TLP: at least 18 bytes of header (EMOGI,
/// Sec. 3.3) plus framing and flow control; 30 bytes puts 128-byte reads
/// at 12.8 GB/s on Gen3 (EMOGI measured 12.23), 25.5 on Gen4 (24.8–25.1
/// measured) and 51 on Gen5 (52 measured, nvbandwidth).
const TLP_OVERHEAD: f64 = 30.0;
/// A zero-copy read's round trip under load: EMOGI's 32-byte bandwidth
/// (4.74 GB/s with 256 tags) implies 1.7 µs on Gen3 (EMOGI measured 1.0 to
/// 1.6 µs unloaded); assumed the same on later generations.
const LINK_LATENCY: f64 = 1.7e-6;
/// Fixed cost per queued copy (a migration batch, a page): pinned copies of
/// 64 KiB reach about half the link's rate in `bandwidthTest`-style size
/// sweeps (an estimate from their shape, not a sourced figure).
const DMA_LATENCY: f64 = 2.5e-6;
/// Random 32-byte sectors reach this share of HBM's streaming bandwidth
/// (not found in a publication: an assumption, to be fitted on a GPU).
const SECTOR_SHARE: f64 = 0.5;

/// NVIDIA H200 SXM5 (HBM3e, PCIe Gen5 x16): the GPU this project's GPU
/// checks run on; the default.
pub const H200_SXM5: Platform = Platform {
    name: "h200-sxm5",
    // STREAM-like triad 4.15, dot 4.48 TB/s (Azure's benchmarking guide).
    hbm_bandwidth: 4.3e12,
    hbm_sector_bandwidth: SECTOR_SHARE * 4.3e12,
    // GH200 pointer chase: ~684 cycles at 1.98 GHz (RRZE gpu-benches).
    hbm_latency: 345e-9,
    hbm_outstanding: 65536.0,
    // GH100's 50 MB (the H200's own figure was not found).
    l2_bytes: 50 << 20,
    l2_bandwidth: 10e12,
    l2_atomics: 100e9,
    // 32 GT/s × 16 lanes, 128b/130b.
    link_raw: 63.0e9,
    // nvbandwidth on H200: 52 / 52 GB/s.
    dma_h2d: 52e9,
    dma_d2h: 52e9,
    dma_latency: DMA_LATENCY,
    tlp_overhead: TLP_OVERHEAD,
    link_latency: LINK_LATENCY,
    // 10-bit tags (PCIe 4.0 and later): what reaching the measured Gen4
    // and Gen5 rates at 1.7 µs needs (an assumption; not documented).
    link_outstanding: 768.0,
    uvm_batch_seconds: UVM_BATCH_SECONDS,
    uvm_fault_seconds: UVM_FAULT_SECONDS,
    uvm_evict_seconds: UVM_EVICT_SECONDS,
    uvm_batch_faults: 256,
    launch_seconds: 5e-6,
    sources: "docs/perf.md, calibration table (2026-12-01)",
};

/// NVIDIA H100 PCIe (HBM2e, PCIe Gen5 x16).
pub const H100_PCIE5: Platform = Platform {
    name: "h100-pcie5",
    // Read bandwidth 1.94 TB/s (RRZE gpu-benches).
    hbm_bandwidth: 1.94e12,
    hbm_sector_bandwidth: SECTOR_SHARE * 1.94e12,
    l2_bandwidth: 7e12,
    l2_atomics: 80e9,
    // nvbandwidth on H100: 51 / 52 GB/s.
    dma_h2d: 51e9,
    dma_d2h: 52e9,
    ..H200_SXM5
};

/// NVIDIA A100 PCIe 40 GB (HBM2, PCIe Gen4 x16).
pub const A100_PCIE4: Platform = Platform {
    name: "a100-pcie4",
    // Read bandwidth 1.50 TB/s (RRZE gpu-benches).
    hbm_bandwidth: 1.50e12,
    hbm_sector_bandwidth: SECTOR_SHARE * 1.50e12,
    // ~546 cycles at 1.41 GHz.
    hbm_latency: 390e-9,
    l2_bytes: 40 << 20,
    l2_bandwidth: 5e12,
    l2_atomics: 60e9,
    link_raw: 31.5e9,
    dma_h2d: 24.8e9,
    dma_d2h: 24.8e9,
    ..H200_SXM5
};

/// NVIDIA V100 (HBM2, PCIe Gen3 x16): EMOGI's platform, for calibration.
pub const V100_PCIE3: Platform = Platform {
    name: "v100-pcie3",
    // ~90% of 900 GB/s.
    hbm_bandwidth: 0.81e12,
    hbm_sector_bandwidth: SECTOR_SHARE * 0.81e12,
    hbm_latency: 400e-9,
    l2_bytes: 6 << 20,
    l2_bandwidth: 2.5e12,
    l2_atomics: 30e9,
    link_raw: 15.75e9,
    // cudaMemcpy 12.3 GB/s (EMOGI).
    dma_h2d: 12.3e9,
    dma_d2h: 12.3e9,
    // 8-bit tags (EMOGI, Sec. 3.3).
    link_outstanding: 256.0,
    ..H200_SXM5
};

/// Every preset.
pub const PLATFORMS: [Platform; 4] = [H200_SXM5, H100_PCIE5, A100_PCIE4, V100_PCIE3];

impl Default for Platform {
    fn default() -> Self {
        H200_SXM5
    }
}

impl std::str::FromStr for Platform {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        PLATFORMS
            .iter()
            .find(|p| p.name == s)
            .copied()
            .ok_or_else(|| {
                let names: Vec<_> = PLATFORMS.iter().map(|p| p.name).collect();
                Error::invalid(format!("unknown platform {s:?} (use {})", names.join(", ")))
            })
    }
}

impl Platform {
    /// Time of one bulk DMA of `bytes` host→device in `ops` batches.
    pub fn h2d(&self, bytes: u64, ops: u64) -> f64 {
        bytes as f64 / self.dma_h2d + ops as f64 * self.dma_latency
    }

    /// As [`h2d`](Self::h2d), device→host.
    pub fn d2h(&self, bytes: u64, ops: u64) -> f64 {
        bytes as f64 / self.dma_d2h + ops as f64 * self.dma_latency
    }

    /// Seconds of zero-copy reads: `requests` of `sectors` in all. Every
    /// request of a launch can be in flight at once (a warp issues its
    /// loads of an edge list without waiting for one another) up to the
    /// link's tags: bandwidth-bound, or Little's law at the cap. (The one
    /// round trip every launch waits is its dependent chain, charged by
    /// [`Traffic::seconds`].)
    pub fn link_time(&self, requests: u64, sectors: u64) -> f64 {
        let wire = (sectors * SECTOR) as f64 + requests as f64 * self.tlp_overhead;
        let bandwidth = wire / self.link_raw;
        let latency = requests as f64 * self.link_latency / self.link_outstanding;
        bandwidth.max(latency)
    }

    /// Seconds of HBM reads: whole 128-byte lines at the streaming rate,
    /// the sectors of partial lines at the random-sector rate, and the
    /// same Little's-law bound as the link's at HBM's cap.
    pub fn hbm_time(&self, requests: u64, sectors: u64, full_lines: u64) -> f64 {
        let partial = sectors.saturating_sub(full_lines * 4);
        let bandwidth = (full_lines * LINE) as f64 / self.hbm_bandwidth
            + (partial * SECTOR) as f64 / self.hbm_sector_bandwidth;
        let latency = requests as f64 * self.hbm_latency / self.hbm_outstanding;
        bandwidth.max(latency)
    }
}

/// What one launch (or one task of it) read, by where it went.
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Traffic {
    /// Requests and sectors that hit in L2.
    pub l2_requests: u64,
    /// See `l2_requests`.
    pub l2_sectors: u64,
    /// Requests and sectors served by HBM.
    pub hbm_requests: u64,
    /// See `hbm_requests`.
    pub hbm_sectors: u64,
    /// HBM requests of a whole line (four sectors).
    pub hbm_full_lines: u64,
    /// Requests and sectors served over the link (zero-copy).
    pub host_requests: u64,
    /// See `host_requests`.
    pub host_sectors: u64,
    /// strata's translation loads (one per request through a device map).
    pub translations: u64,
    /// strata's counter atomics (sampled accesses).
    pub atomics: u64,
    /// Independent items of work (vertices whose edges were read).
    pub items: u64,
    /// Requests to the graph's arrays (before the L2), for hit rates.
    pub graph_requests: u64,
}

impl Traffic {
    /// Adds `o`.
    pub fn add(&mut self, o: &Traffic) {
        self.l2_requests += o.l2_requests;
        self.l2_sectors += o.l2_sectors;
        self.hbm_requests += o.hbm_requests;
        self.hbm_sectors += o.hbm_sectors;
        self.hbm_full_lines += o.hbm_full_lines;
        self.host_requests += o.host_requests;
        self.host_sectors += o.host_sectors;
        self.translations += o.translations;
        self.atomics += o.atomics;
        self.items += o.items;
        self.graph_requests += o.graph_requests;
    }

    /// Modelled seconds of a launch that read this (kernel time only: no
    /// launch overhead, faults or migrations).
    pub fn seconds(&self, p: &Platform) -> f64 {
        let link = p.link_time(self.host_requests, self.host_sectors);
        let hbm = p.hbm_time(self.hbm_requests, self.hbm_sectors, self.hbm_full_lines);
        let l2 = ((self.l2_sectors + self.hbm_sectors + self.host_sectors + self.translations)
            * SECTOR) as f64
            / p.l2_bandwidth
            + self.atomics as f64 / p.l2_atomics;
        // The dependent chain offset → neighbour → vertex state, waited for
        // once per launch: two round trips where the graph was read over
        // the link, two HBM ones otherwise, and one for the state.
        let chain = if self.host_requests > 0 {
            2.0 * p.link_latency + p.hbm_latency
        } else if self.hbm_requests + self.l2_requests > 0 {
            3.0 * p.hbm_latency
        } else {
            0.0
        };
        link.max(hbm).max(l2) + chain
    }
}

/// Shared counters of [`Traffic`], added to by tasks as they finish.
#[derive(Debug, Default)]
pub struct SharedTraffic([AtomicU64; 11]);

impl SharedTraffic {
    /// Adds a task's traffic.
    pub fn add(&self, t: &Traffic) {
        let v = [
            t.l2_requests,
            t.l2_sectors,
            t.hbm_requests,
            t.hbm_sectors,
            t.host_requests,
            t.host_sectors,
            t.translations,
            t.atomics,
            t.items,
            t.graph_requests,
            t.hbm_full_lines,
        ];
        for (c, x) in self.0.iter().zip(v) {
            if x != 0 {
                c.fetch_add(x, Ordering::Relaxed);
            }
        }
    }

    /// Takes what was added since the last take.
    pub fn take(&self) -> Traffic {
        let v: Vec<u64> = self
            .0
            .iter()
            .map(|c| c.swap(0, Ordering::Relaxed))
            .collect();
        Traffic {
            l2_requests: v[0],
            l2_sectors: v[1],
            hbm_requests: v[2],
            hbm_sectors: v[3],
            host_requests: v[4],
            host_sectors: v[5],
            translations: v[6],
            atomics: v[7],
            items: v[8],
            graph_requests: v[9],
            hbm_full_lines: v[10],
        }
    }
}

/// A sectored L2: sets of eight ways, each tag with the sectors present,
/// random replacement. Shared by the kernel's threads without locks: a
/// race loses an update, as the model's precision allows.
pub struct L2 {
    tags: Box<[AtomicU64]>,
    sets: usize,
}

/// Ways per L2 set.
const WAYS: usize = 8;
const EMPTY: u64 = u64::MAX;

impl L2 {
    /// An empty L2 of `bytes`.
    pub fn new(bytes: u64) -> Self {
        let sets = ((bytes / LINE) as usize / WAYS).max(1);
        Self {
            tags: (0..sets * WAYS).map(|_| AtomicU64::new(EMPTY)).collect(),
            sets,
        }
    }

    /// Looks up `sectors` (a 4-bit mask) of line `id` (unique across
    /// arrays, below 2^56), fills them, and returns those that missed.
    /// `random` picks the victim way on a miss (any value; callers pass a
    /// cheap per-task sequence).
    #[inline]
    pub fn access(&self, id: u64, sectors: u8, random: u64) -> u8 {
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let set = ((h as u128 * self.sets as u128) >> 64) as usize * WAYS;
        let ways = &self.tags[set..set + WAYS];
        let mut victim = None;
        for w in ways {
            let old = w.load(Ordering::Relaxed);
            if old != EMPTY && old >> 4 == id {
                let present = old as u8 & 15;
                let missing = sectors & !present;
                if missing != 0 {
                    w.store(id << 4 | (present | sectors) as u64, Ordering::Relaxed);
                }
                return missing;
            }
            if old == EMPTY && victim.is_none() {
                victim = Some(w);
            }
        }
        let w = victim.unwrap_or(&ways[(random as usize) % WAYS]);
        w.store(id << 4 | sectors as u64, Ordering::Relaxed);
        sectors
    }
}

/// What the Unified Memory driver did in a run.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct UvmStats {
    /// Faults (basic blocks not resident when first read).
    pub faults: u64,
    /// Fault batches serviced.
    pub batches: u64,
    /// Basic blocks migrated in (faulted and prefetched).
    pub blocks_in: u64,
    /// Bytes migrated in (capped at each array's end).
    pub bytes_in: u64,
    /// Basic blocks of those the tree prefetcher added.
    pub prefetched: u64,
    /// VA blocks evicted.
    pub evictions: u64,
    /// Bytes written back on eviction (without read-mostly advice the
    /// driver copies evicted pages back: it tracks no dirty state).
    pub bytes_out: u64,
    /// Bytes bulk-prefetched at the start (`uvm-advised`).
    pub advised_bytes: u64,
}

/// Unified Memory's driver over the graph's arrays (each its own managed
/// allocation), holding at most `budget` bytes of them in device memory.
pub struct Uvm {
    /// Residency per basic block, per array (read without the lock).
    resident: Vec<Box<[AtomicU8]>>,
    state: Mutex<UvmState>,
}

struct UvmState {
    array_bytes: Vec<u64>,
    write_back: bool,
    budget_blocks: u64,
    resident_blocks: u64,
    /// Resident basic blocks per VA block, per array (a 32-bit mask).
    masks: Vec<Vec<u32>>,
    /// VA blocks with resident data, oldest first; a fault moves its VA
    /// block to the back (the driver's "LRU" follows faults and
    /// migrations, not accesses, which it cannot see).
    age: VecDeque<(usize, usize)>,
    /// Faults in the batch being gathered.
    pending: u32,
    batch_faults: u32,
    stats: UvmStats,
    /// Seconds of service so far.
    seconds: f64,
    pending_bytes: u64,
    pending_prefetched: u64,
}

const BLOCKS_PER_VA: usize = (UVM_VA_BLOCK / UVM_BASIC_BLOCK) as usize;

impl Uvm {
    /// The driver over arrays of `array_bytes`, nothing resident;
    /// `read_mostly`: `cudaMemAdviseSetReadMostly` (evicted pages are
    /// dropped, not copied back).
    pub fn new(array_bytes: &[u64], budget: u64, batch_faults: u32, read_mostly: bool) -> Self {
        let blocks = |b: u64| b.div_ceil(UVM_BASIC_BLOCK) as usize;
        Self {
            resident: array_bytes
                .iter()
                .map(|&b| (0..blocks(b)).map(|_| AtomicU8::new(0)).collect())
                .collect(),
            state: Mutex::new(UvmState {
                array_bytes: array_bytes.to_vec(),
                write_back: !read_mostly,
                budget_blocks: (budget / UVM_BASIC_BLOCK).max(1),
                resident_blocks: 0,
                masks: array_bytes
                    .iter()
                    .map(|&b| vec![0; b.div_ceil(UVM_VA_BLOCK) as usize])
                    .collect(),
                age: VecDeque::new(),
                pending: 0,
                batch_faults: batch_faults.max(1),
                stats: UvmStats::default(),
                seconds: 0.0,
                pending_bytes: 0,
                pending_prefetched: 0,
            }),
        }
    }

    /// Whether basic block `block` of `array` is resident (the fast path).
    #[inline]
    pub fn resident(&self, array: usize, block: usize) -> bool {
        self.resident[array][block].load(Ordering::Relaxed) != 0
    }

    /// A read of a basic block that was not resident: a fault in the
    /// current batch, serviced when the batch fills or the launch ends.
    pub fn fault(&self, array: usize, block: usize, p: &Platform) {
        let mut s = self.state.lock();
        if self.resident(array, block) {
            return; // another thread's fault brought it in this batch
        }
        s.stats.faults += 1;
        s.pending += 1;
        let va = block / BLOCKS_PER_VA;
        let first = va * BLOCKS_PER_VA;
        let in_va = block - first;
        let mut mask = s.masks[array][va];
        let was_empty = mask == 0;
        let valid = {
            let blocks = self.resident[array].len() - first;
            if blocks >= 32 {
                u32::MAX
            } else {
                (1u32 << blocks) - 1
            }
        };
        let mut want = 1u32 << in_va;
        // The tree prefetcher: the largest subtree around the fault more
        // than half resident (counting the fault) is brought in whole.
        for level in 1..=5 {
            let size = 1u32 << level;
            let start = (in_va as u32 / size) * size;
            let sub = if size == 32 {
                u32::MAX
            } else {
                ((1u32 << size) - 1) << start
            } & valid;
            // Resident pages and the fault, not what lower levels would
            // prefetch (the driver counts what is there).
            let have = ((mask | 1 << in_va) & sub).count_ones();
            if have * 2 > sub.count_ones() {
                want |= sub;
            }
        }
        want &= !mask;
        let array_bytes = s.array_bytes[array];
        let mut bytes = 0;
        for b in 0..32 {
            if want & (1 << b) != 0 {
                let blk = first + b;
                self.resident[array][blk].store(1, Ordering::Relaxed);
                let start = blk as u64 * UVM_BASIC_BLOCK;
                bytes += UVM_BASIC_BLOCK.min(array_bytes - start);
            }
        }
        let n = want.count_ones() as u64;
        mask |= want;
        s.masks[array][va] = mask;
        s.resident_blocks += n;
        s.stats.blocks_in += n;
        s.stats.prefetched += n - 1;
        s.stats.bytes_in += bytes;
        s.pending_bytes += bytes;
        s.pending_prefetched += n - 1;
        if was_empty {
            s.age.push_back((array, va));
        } else if let Some(i) = s.age.iter().position(|&e| e == (array, va)) {
            s.age.remove(i);
            s.age.push_back((array, va));
        }
        self.evict(&mut s, (array, va), p);
        if s.pending >= s.batch_faults {
            Self::service(&mut s, p);
        }
    }

    /// Evicts the oldest VA blocks (never `keep`) while over budget,
    /// copying them back unless the allocation is read-mostly.
    fn evict(&self, s: &mut UvmState, keep: (usize, usize), p: &Platform) {
        while s.resident_blocks > s.budget_blocks {
            let Some(pos) = s.age.iter().position(|&e| e != keep) else {
                break;
            };
            let (a, va) = s.age.remove(pos).expect("position is in range");
            let mask = std::mem::take(&mut s.masks[a][va]);
            let mut bytes = 0;
            for b in 0..32 {
                if mask & (1 << b) != 0 {
                    let blk = va * BLOCKS_PER_VA + b;
                    self.resident[a][blk].store(0, Ordering::Relaxed);
                    bytes += UVM_BASIC_BLOCK.min(s.array_bytes[a] - blk as u64 * UVM_BASIC_BLOCK);
                }
            }
            if s.write_back {
                s.stats.bytes_out += bytes;
                s.seconds += bytes as f64 / p.dma_d2h;
            }
            s.resident_blocks -= mask.count_ones() as u64;
            s.stats.evictions += 1;
            s.seconds += p.uvm_evict_seconds;
        }
    }

    fn service(s: &mut UvmState, p: &Platform) {
        if s.pending == 0 {
            return;
        }
        s.stats.batches += 1;
        s.seconds += p.uvm_batch_seconds
            + s.pending as f64 * p.uvm_fault_seconds
            + s.pending_bytes as f64 / p.dma_h2d;
        s.pending = 0;
        s.pending_bytes = 0;
        s.pending_prefetched = 0;
    }

    /// A launch ends: its last batch is serviced (the kernel cannot finish
    /// before its faulted warps do).
    pub fn end_launch(&self, p: &Platform) {
        Self::service(&mut self.state.lock(), p);
    }

    /// `cudaMemPrefetchAsync` of every array where all of them fit in the
    /// budget: bulk DMA, no faults (`uvm-advised`; EMOGI's optimized UVM
    /// prefetches nothing when the graph does not fit). Returns whether it
    /// prefetched.
    pub fn prefetch_if_fits(&self, p: &Platform) -> bool {
        let mut s = self.state.lock();
        let total: u64 = self.resident.iter().map(|r| r.len() as u64).sum();
        if total > s.budget_blocks {
            return false;
        }
        let mut bytes = 0;
        for a in 0..self.resident.len() {
            for va in 0..s.masks[a].len() {
                let first = va * BLOCKS_PER_VA;
                let blocks = (self.resident[a].len() - first).min(32) as u64;
                if s.resident_blocks + blocks > s.budget_blocks {
                    break;
                }
                for b in 0..blocks as usize {
                    self.resident[a][first + b].store(1, Ordering::Relaxed);
                }
                s.masks[a][va] = if blocks == 32 {
                    u32::MAX
                } else {
                    (1u32 << blocks) - 1
                };
                s.resident_blocks += blocks;
                s.age.push_back((a, va));
                bytes += (blocks * UVM_BASIC_BLOCK)
                    .min(s.array_bytes[a] - first as u64 * UVM_BASIC_BLOCK);
            }
        }
        s.stats.advised_bytes += bytes;
        s.seconds += p.h2d(bytes, 1);
        true
    }

    /// What the driver did, and its seconds of service.
    pub fn stats(&self) -> (UvmStats, f64) {
        let s = self.state.lock();
        (s.stats, s.seconds)
    }

    /// [`stats`](Self::stats), then zeroes them; what is resident stays
    /// (a later run starts where this one left off).
    pub fn take_stats(&self) -> (UvmStats, f64) {
        let mut s = self.state.lock();
        let out = (s.stats, s.seconds);
        s.stats = UvmStats::default();
        s.seconds = 0.0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l2_hits_the_sectors_it_holds_and_misses_the_rest() {
        let l2 = L2::new(1 << 20);
        assert_eq!(l2.access(7, 0b0011, 0), 0b0011);
        assert_eq!(l2.access(7, 0b0011, 1), 0);
        assert_eq!(l2.access(7, 0b0110, 2), 0b0100);
        assert_eq!(l2.access(7, 0b0111, 3), 0);
    }

    #[test]
    fn an_l2_smaller_than_the_data_misses_on_a_second_pass() {
        let l2 = L2::new(64 * LINE);
        let pass = |l2: &L2| (0..10_000u64).filter(|&i| l2.access(i, 1, i) != 0).count();
        assert_eq!(pass(&l2), 10_000);
        assert!(pass(&l2) > 9_000);
        // 10,000 lines in an L2 of 32,768: almost all of them stay.
        let big = L2::new(4 << 20);
        pass(&big);
        let misses = pass(&big);
        assert!(misses < 100, "{misses}");
    }

    #[test]
    fn link_time_charges_overhead_per_request_and_latency_without_parallelism() {
        let p = H200_SXM5;
        // 128-byte requests with plenty of parallelism: bandwidth-bound at
        // the raw rate less TLP overhead.
        let t = p.link_time(1_000_000, 4_000_000);
        let bw = 128e6 / t;
        assert!((bw - p.link_raw * 128.0 / (128.0 + p.tlp_overhead)).abs() < 1e3);
        // 32-byte requests deliver less than a quarter of that per byte.
        let t32 = p.link_time(1_000_000, 1_000_000);
        assert!(32e6 / t32 < bw / 2.0);
        // On Gen3's 256 tags, 32-byte requests are latency-bound near
        // EMOGI's 4.74 GB/s.
        let v = V100_PCIE3;
        let gbs = 32e6 / v.link_time(1_000_000, 1_000_000) / 1e9;
        assert!((gbs - 4.74).abs() < 0.2, "{gbs}");
    }

    #[test]
    fn uvm_faults_batch_prefetch_and_evict_by_age() {
        let p = H200_SXM5;
        // One array of 4 VA blocks, a budget of 2.
        let uvm = Uvm::new(&[4 * UVM_VA_BLOCK], 2 * UVM_VA_BLOCK, 256, false);
        // A scan of the first VA block faults at basic blocks 0, 1, 2, 4, 8
        // and 16: the tree prefetcher brings the rest.
        for b in 0..32 {
            if !uvm.resident(0, b) {
                uvm.fault(0, b, &p);
            }
        }
        let (s, _) = uvm.stats();
        assert_eq!(s.faults, 6, "{s:?}");
        assert_eq!(s.blocks_in, 32);
        assert!((0..32).all(|b| uvm.resident(0, b)));
        // Two more VA blocks: the first (oldest) is evicted.
        for va in 1..3 {
            for b in 0..32 {
                let blk = va * 32 + b;
                if !uvm.resident(0, blk) {
                    uvm.fault(0, blk, &p);
                }
            }
        }
        uvm.end_launch(&p);
        let (s, secs) = uvm.stats();
        assert_eq!(s.evictions, 1);
        assert_eq!(s.bytes_out, UVM_VA_BLOCK, "not read-mostly: copied back");
        assert!(!uvm.resident(0, 0) && uvm.resident(0, 64));
        assert_eq!(s.bytes_in, 3 * UVM_VA_BLOCK);
        assert!(s.batches >= 1);
        assert!(secs > 3.0 * UVM_VA_BLOCK as f64 / p.dma_h2d);
    }

    #[test]
    fn a_lone_fault_migrates_one_basic_block() {
        let p = H200_SXM5;
        let uvm = Uvm::new(&[UVM_VA_BLOCK], UVM_VA_BLOCK, 256, true);
        uvm.fault(0, 5, &p);
        uvm.end_launch(&p);
        let (s, secs) = uvm.stats();
        assert_eq!((s.faults, s.blocks_in, s.batches), (1, 1, 1));
        let want = p.uvm_batch_seconds + p.uvm_fault_seconds + UVM_BASIC_BLOCK as f64 / p.dma_h2d;
        assert!((secs - want).abs() < 1e-12);
    }

    #[test]
    fn platforms_parse_by_name() {
        assert_eq!("a100-pcie4".parse::<Platform>().unwrap().name, "a100-pcie4");
        assert!("gtx480".parse::<Platform>().is_err());
    }
}
