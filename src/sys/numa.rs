//! NUMA nodes and kernel memory tiers, read from sysfs.
//!
//! CXL memory expanders show up on Linux as NUMA nodes that have memory and
//! no CPUs; kernels with memory tiering list them in a lower tier under
//! `/sys/devices/virtual/memory_tiering`.
#![forbid(unsafe_code)]

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// Node id.
    pub id: u32,
    /// CPUs on the node.
    pub cpus: Vec<u32>,
    /// Memory on the node, in bytes.
    pub memory_bytes: u64,
    /// True for a memory-only node (how CXL memory appears).
    pub cpu_less: bool,
}

/// One kernel memory tier (lower ids are faster).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryTierInfo {
    /// The tier's id (`memory_tierN`).
    pub id: u32,
    /// NUMA nodes in the tier.
    pub nodes: Vec<u32>,
}

/// The machine's NUMA nodes and memory tiers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// NUMA nodes, by id.
    pub numa_nodes: Vec<NumaNode>,
    /// Kernel memory tiers; empty where the kernel has none.
    pub memory_tiers: Vec<MemoryTierInfo>,
}

impl Topology {
    /// Reads the running machine's topology.
    pub fn detect() -> Self {
        Self::read_from(Path::new("/sys"))
    }

    /// Reads a topology from a sysfs tree rooted at `sys` (for tests).
    /// Missing or unreadable files yield an empty (or single-node) picture
    /// rather than an error: a machine without NUMA support is one node.
    pub fn read_from(sys: &Path) -> Self {
        let node_dir = sys.join("devices/system/node");
        let mut numa_nodes: Vec<NumaNode> = numbered_entries(&node_dir, "node")
            .into_iter()
            .map(|(id, dir)| {
                let cpus = fs::read_to_string(dir.join("cpulist"))
                    .map(|s| parse_list(&s))
                    .unwrap_or_default();
                let memory_bytes = fs::read_to_string(dir.join("meminfo"))
                    .map(|s| parse_mem_total(&s))
                    .unwrap_or(0);
                NumaNode {
                    id,
                    cpu_less: cpus.is_empty() && memory_bytes > 0,
                    cpus,
                    memory_bytes,
                }
            })
            .collect();
        numa_nodes.sort_by_key(|n| n.id);
        let tier_dir = sys.join("devices/virtual/memory_tiering");
        let mut memory_tiers: Vec<MemoryTierInfo> = numbered_entries(&tier_dir, "memory_tier")
            .into_iter()
            .map(|(id, dir)| MemoryTierInfo {
                id,
                nodes: fs::read_to_string(dir.join("nodelist"))
                    .map(|s| parse_list(&s))
                    .unwrap_or_default(),
            })
            .collect();
        memory_tiers.sort_by_key(|t| t.id);
        Self {
            numa_nodes,
            memory_tiers,
        }
    }

    /// Memory-only nodes.
    pub fn cpu_less_nodes(&self) -> impl Iterator<Item = &NumaNode> {
        self.numa_nodes.iter().filter(|n| n.cpu_less)
    }

    /// The kernel memory tier that lists node `id`, if any.
    fn tier_of(&self, id: u32) -> Option<u32> {
        self.memory_tiers
            .iter()
            .find(|t| t.nodes.contains(&id))
            .map(|t| t.id)
    }

    /// Memory-only nodes slower than DRAM: the candidates for a real CXL
    /// tier, those the kernel ranks in a slower memory tier first. Where
    /// the kernel has memory tiers, a memory-only node it puts in the
    /// tier of the nodes with CPUs or a faster one (high-bandwidth memory
    /// in flat mode, say) is no CXL tier and is left out; without memory
    /// tiers, every memory-only node is a candidate.
    pub fn slow_memory_nodes(&self) -> Vec<&NumaNode> {
        let dram = self
            .numa_nodes
            .iter()
            .filter(|n| !n.cpus.is_empty())
            .filter_map(|n| self.tier_of(n.id))
            .min();
        let mut nodes: Vec<(&NumaNode, bool)> = self
            .cpu_less_nodes()
            .filter_map(|n| match (self.tier_of(n.id), dram) {
                (Some(t), Some(d)) if t <= d => None,
                (Some(_), Some(_)) => Some((n, true)),
                _ => Some((n, false)),
            })
            .collect();
        // Stable: ranked slower first, then in node order.
        nodes.sort_by_key(|&(_, slower)| !slower);
        nodes.into_iter().map(|(n, _)| n).collect()
    }
}

fn numbered_entries(dir: &Path, prefix: &str) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id = name.strip_prefix(prefix)?.parse().ok()?;
            Some((id, e.path()))
        })
        .collect()
}

/// Parses a kernel list such as `0-3,8,10-11`.
pub fn parse_list(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => {
                if let Ok(v) = part.trim().parse() {
                    out.push(v);
                }
            }
        }
    }
    out
}

fn parse_mem_total(meminfo: &str) -> u64 {
    meminfo
        .lines()
        .find(|l| l.contains("MemTotal:"))
        .and_then(|l| l.split_whitespace().rev().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        // Checked: a size past u64 is as unreadable as a missing one.
        .and_then(|kb| kb.checked_mul(1024))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists() {
        assert_eq!(parse_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_list("\n"), Vec::<u32>::new());
    }

    #[test]
    fn fake_sysfs_with_a_cxl_node() {
        let root = tempfile::tempdir().unwrap();
        let node = |id: u32, cpus: &str, kb: u64| {
            let d = root.path().join(format!("devices/system/node/node{id}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("cpulist"), cpus).unwrap();
            fs::write(
                d.join("meminfo"),
                format!("Node {id} MemTotal:       {kb} kB\nNode {id} MemFree: 1 kB\n"),
            )
            .unwrap();
        };
        node(0, "0-3\n", 1024);
        node(1, "\n", 2048);
        for (tier, nodes) in [(4, "0"), (22, "1")] {
            let d = root
                .path()
                .join(format!("devices/virtual/memory_tiering/memory_tier{tier}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("nodelist"), nodes).unwrap();
        }
        let t = Topology::read_from(root.path());
        assert_eq!(t.numa_nodes.len(), 2);
        assert_eq!(t.numa_nodes[0].cpus, vec![0, 1, 2, 3]);
        assert!(!t.numa_nodes[0].cpu_less);
        assert!(t.numa_nodes[1].cpu_less);
        assert_eq!(t.numa_nodes[1].memory_bytes, 2048 * 1024);
        assert_eq!(
            t.cpu_less_nodes().map(|n| n.id).collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(
            t.memory_tiers[1],
            MemoryTierInfo {
                id: 22,
                nodes: vec![1]
            }
        );
        assert_eq!(
            t.slow_memory_nodes()
                .iter()
                .map(|n| n.id)
                .collect::<Vec<_>>(),
            vec![1]
        );
    }

    #[test]
    fn a_memory_only_node_as_fast_as_dram_is_no_cxl_candidate() {
        let node = |id: u32, cpus: &[u32], tier: Option<u32>| {
            (
                NumaNode {
                    id,
                    cpus: cpus.to_vec(),
                    memory_bytes: 1 << 30,
                    cpu_less: cpus.is_empty(),
                },
                tier,
            )
        };
        let topology = |nodes: Vec<(NumaNode, Option<u32>)>| {
            let mut memory_tiers: Vec<MemoryTierInfo> = Vec::new();
            for (n, tier) in &nodes {
                let Some(tier) = *tier else { continue };
                match memory_tiers.iter_mut().find(|t| t.id == tier) {
                    Some(t) => t.nodes.push(n.id),
                    None => memory_tiers.push(MemoryTierInfo {
                        id: tier,
                        nodes: vec![n.id],
                    }),
                }
            }
            Topology {
                numa_nodes: nodes.into_iter().map(|(n, _)| n).collect(),
                memory_tiers,
            }
        };
        let ids = |t: &Topology| {
            t.slow_memory_nodes()
                .iter()
                .map(|n| n.id)
                .collect::<Vec<_>>()
        };
        // Node 1 (high-bandwidth memory, DRAM's tier) is passed over for
        // node 2, in a slower tier.
        let t = topology(vec![
            node(0, &[0, 1], Some(4)),
            node(1, &[], Some(4)),
            node(2, &[], Some(22)),
        ]);
        assert_eq!(ids(&t), vec![2]);
        // A node the kernel lists in no tier comes after the slower tier's.
        let t = topology(vec![
            node(0, &[0], Some(4)),
            node(1, &[], None),
            node(2, &[], Some(22)),
        ]);
        assert_eq!(ids(&t), vec![2, 1]);
        // Without memory tiers, every memory-only node, by id.
        let t = topology(vec![
            node(0, &[0], None),
            node(1, &[], None),
            node(3, &[], None),
        ]);
        assert_eq!(ids(&t), vec![1, 3]);
    }

    #[test]
    fn a_size_past_u64_reads_as_unknown() {
        // Unreadable sizes yield 0, as a missing file does, not a panic.
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("devices/system/node/node0");
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("cpulist"), "0\n").unwrap();
        fs::write(
            d.join("meminfo"),
            format!("Node 0 MemTotal: {} kB\n", u64::MAX),
        )
        .unwrap();
        let t = Topology::read_from(root.path());
        assert_eq!(t.numa_nodes[0].memory_bytes, 0);
    }

    #[test]
    fn this_machine_has_a_node() {
        let t = Topology::detect();
        if Path::new("/sys/devices/system/node/node0").exists() {
            assert!(t.numa_nodes.iter().any(|n| !n.cpus.is_empty()));
        }
    }
}
