//! `strata info`: what this machine offers strata.
#![forbid(unsafe_code)]

use serde::Serialize;

use crate::config::Config;
use crate::device::{probe_gpus, GpuInfo};
use crate::sys::{MemoryTierInfo, NumaNode, Topology};
use crate::tier::Tier;

/// One configured tier.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TierInfo {
    /// Tier name.
    pub tier: Tier,
    /// Configured capacity in bytes.
    pub capacity_bytes: u64,
    /// Whether the tier is emulated.
    pub emulated: bool,
    /// What backs it.
    pub detail: String,
    /// What is wrong with the configured tier on this machine (a NUMA node
    /// that does not exist, an NVMe path that cannot hold it, ...), or
    /// null; `strata info` exits with status 2 when any tier has one.
    pub problem: Option<String>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Info {
    /// strata's version.
    pub version: &'static str,
    /// NUMA nodes.
    pub numa_nodes: Vec<NumaNode>,
    /// Kernel memory tiers (empty where the kernel has none).
    pub memory_tiers: Vec<MemoryTierInfo>,
    /// The first GPU, or null.
    pub gpu: Option<GpuInfo>,
    /// All GPUs.
    pub gpus: Vec<GpuInfo>,
    /// Why there is no GPU, when there is none.
    pub gpu_absent_reason: Option<String>,
    /// NVRTC's version ("12.8") where the library loads (the CUDA kernels
    /// compile with it at run time); null where it does not, or without
    /// the cuda feature.
    pub nvrtc: Option<String>,
    /// Whether io_uring works here.
    pub io_uring: bool,
    /// Why io_uring does not work, when it doesn't.
    pub io_uring_error: Option<String>,
    /// The io engine the NVMe tier will use.
    pub io_engine: String,
    /// Whether transparent huge pages can be requested.
    pub transparent_huge_pages: bool,
    /// The device backend strata would use: "cuda", "simulated", or null.
    pub backend: Option<&'static str>,
    /// Configured tiers.
    pub tiers: Vec<TierInfo>,
}

/// Gathers the report for `config`.
pub fn gather(config: &Config) -> Info {
    let topo = Topology::detect();
    let (gpus, gpu_absent_reason) = match probe_gpus() {
        Ok(g) => (g, None),
        Err(e) => (Vec::new(), Some(e.message().to_string())),
    };
    let nvrtc = crate::device::nvrtc_version().map(|(a, b)| format!("{a}.{b}"));
    let uring = crate::io::uring::probe();
    let io_engine = match &config.nvme {
        Some(n) => crate::io::engine(n.engine)
            .map(|e| e.kind().to_string())
            .unwrap_or_else(|e| format!("unavailable: {e}")),
        None => "none (no NVMe tier)".into(),
    };
    let mut tiers = Vec::new();
    let tier = |tier, capacity_bytes, emulated, detail: String, problem: Option<String>| TierInfo {
        tier,
        capacity_bytes,
        emulated,
        detail,
        problem,
    };
    use crate::device::DeviceChoice;
    match (gpus.first(), config.device, config.device_capacity) {
        (_, _, Some(0)) => {}
        (Some(g), DeviceChoice::Auto | DeviceChoice::Cuda, cap) => tiers.push(tier(
            Tier::Device,
            cap.map_or(g.memory_bytes, |c| c.min(g.memory_bytes)),
            false,
            // The GPU's total memory (or the configured cap below it): the
            // runtime takes its free memory less a reserve when it opens.
            format!(
                "GPU {} ({}){}",
                g.ordinal,
                g.name,
                if cap.is_some_and(|c| c < g.memory_bytes) {
                    ""
                } else {
                    ": its total memory; a runtime takes what is free, less a reserve"
                }
            ),
            None,
        )),
        (None, DeviceChoice::Cuda, _) => tiers.push(tier(
            Tier::Device,
            config.device_capacity.unwrap_or(0),
            false,
            "GPU".into(),
            Some(format!(
                "device = \"cuda\" but no GPU is usable: {}",
                gpu_absent_reason.as_deref().unwrap_or("none found")
            )),
        )),
        (_, _, cap) => tiers.push(tier(
            Tier::Device,
            cap.unwrap_or(crate::config::DEFAULT_SIM_DEVICE_CAPACITY),
            true,
            "simulated device: host memory behind a PCIe Gen4 x16 link model".into(),
            None,
        )),
    }
    let host_problem = config
        .host
        .numa_node
        .and_then(|n| {
            (!topo.numa_nodes.iter().any(|node| node.id == n)).then(|| {
                format!(
                    "[host] numa_node {n} does not exist (nodes: {})",
                    topo.numa_nodes
                        .iter()
                        .map(|node| node.id.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .or_else(|| {
            // The arena is mapped whole when the runtime starts: more than
            // the machine's memory is refused then (or thrashes).
            let memory: u64 = topo.numa_nodes.iter().map(|n| n.memory_bytes).sum();
            (memory > 0 && config.host.capacity > memory).then(|| {
                format!(
                    "[host] capacity {} is more than this machine's {} of memory",
                    crate::size::format_size(config.host.capacity),
                    crate::size::format_size(memory)
                )
            })
        });
    tiers.push(tier(
        Tier::Host,
        config.host.capacity,
        false,
        match config.host.numa_node {
            Some(n) => format!("DRAM arena bound to NUMA node {n}"),
            None => "DRAM arena".into(),
        },
        host_problem,
    ));
    if let Some(cxl) = &config.cxl {
        let (emulated, detail, problem) = match cxl.mode.backing(&topo) {
            crate::tier::CxlBacking::Node { id, .. } => (
                false,
                format!("CPU-less NUMA node {id}"),
                cxl.check(&topo).err().map(|e| e.message().to_string()),
            ),
            // No memory to give it: the runtime refuses such a tier, so
            // it is a problem here, not an emulated tier.
            crate::tier::CxlBacking::Absent => (
                false,
                "none".into(),
                cxl.check(&topo).err().map(|e| e.message().to_string()),
            ),
            crate::tier::CxlBacking::Emulated => (
                true,
                format!(
                    "emulated: DRAM capped at {}, +{} ns per transfer",
                    match cxl.bandwidth {
                        Some(b) => crate::size::format_rate(b),
                        None => "half of local memcpy bandwidth".into(),
                    },
                    cxl.latency_ns
                ),
                None,
            ),
        };
        tiers.push(tier(Tier::Cxl, cxl.capacity, emulated, detail, problem));
    }
    if let Some(nvme) = &config.nvme {
        let ram = crate::sys::ram_filesystem(&nvme.path).is_some();
        tiers.push(tier(
            Tier::Nvme,
            nvme.capacity,
            ram,
            if ram {
                format!(
                    "O_DIRECT swap at {} (a RAM-backed filesystem: this tier is memory, not a disk)",
                    nvme.path.display()
                )
            } else {
                format!("O_DIRECT swap at {}", nvme.path.display())
            },
            nvme.check().err().map(|e| e.message().to_string()),
        ));
    }
    Info {
        version: env!("CARGO_PKG_VERSION"),
        numa_nodes: topo.numa_nodes,
        memory_tiers: topo.memory_tiers,
        gpu: gpus.first().cloned(),
        gpus,
        gpu_absent_reason,
        nvrtc,
        io_uring: uring.is_ok(),
        io_uring_error: uring.err().map(|e| e.message().to_string()),
        io_engine,
        transparent_huge_pages: crate::sys::arena::thp_allowed(),
        backend: tiers.iter().find(|t| t.tier == Tier::Device).map(|t| {
            if t.emulated {
                "simulated"
            } else {
                "cuda"
            }
        }),
        tiers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::{CxlConfig, CxlMode, CxlStore};

    #[test]
    fn a_cxl_tier_the_machine_cannot_provide_is_a_problem_not_an_emulated_tier() {
        let topo = Topology::detect();
        if !topo.slow_memory_nodes().is_empty() {
            eprintln!("skipping: this machine has a memory-only node, so auto finds one");
            return;
        }
        let mut config = Config::from_settings(&Default::default(), &topo).unwrap();
        for mode in [CxlMode::Auto, CxlMode::Off] {
            let cxl = CxlConfig::new(mode, 1 << 20, config.page_size);
            let refused = CxlStore::new(&cxl, &topo).unwrap_err();
            config.cxl = Some(cxl);
            let info = gather(&config);
            let tier = info.tiers.iter().find(|t| t.tier == Tier::Cxl).unwrap();
            assert!(!tier.emulated, "{mode:?}: {tier:?}");
            assert_eq!(tier.problem.as_deref(), Some(refused.message()), "{mode:?}");
        }
    }
}
