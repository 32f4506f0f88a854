//! The graph workload: CSR graphs in tiered buffers, GAP-style kernels
//! (BFS, SSSP, PageRank, connected components) run through device maps —
//! Rust kernels on the simulated device ([`algo`]), CUDA kernels on a GPU
//! (`cuda`, cargo feature `cuda`) — verified, and compared against Unified
//! Memory and zero-copy baselines (`strata bench graph`).

pub mod algo;
pub mod csr;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod model;
pub mod tiered;
pub mod verify;

pub use csr::{Csr, GraphSpec};

#[cfg(test)]
mod tests {
    use super::algo::{self, HostMem};
    use super::*;

    #[test]
    fn every_kernel_verifies_on_generated_and_directed_graphs() {
        let kron = Csr::load(&"kron:10".parse().unwrap(), 7).unwrap();
        let urand = Csr::load(&"urand:9:4".parse().unwrap(), 7).unwrap();
        // A small directed graph with a dangling vertex and two components.
        let edges = vec![
            (0, 1, 3),
            (1, 2, 4),
            (2, 0, 1),
            (2, 3, 9),
            (5, 6, 2),
            (4, 4, 1),
        ];
        let directed = Csr::from_edges(7, edges, true);
        for g in [&kron, &urand, &directed] {
            let source = (0..g.vertices()).find(|&v| g.degree(v) > 0).unwrap();
            let r = algo::bfs(&mut HostMem(g), source);
            verify::bfs(g, source, &r).unwrap();
            let r = algo::sssp(&mut HostMem(g), source, 32);
            verify::sssp(g, source, &r).unwrap();
            let r = algo::pagerank(&mut HostMem(g), 1e-4, 100);
            verify::pagerank(g, 1e-4, 100, &r).unwrap();
            let labels = algo::cc(&mut HostMem(g));
            verify::cc(g, &labels).unwrap();
        }
        // The verifiers catch wrong answers.
        let mut r = algo::bfs(&mut HostMem(&kron), 0);
        let v = (1..kron.vertices()).find(|&v| r.depth[v] > 1).unwrap();
        r.depth[v] += 1;
        assert!(verify::bfs(&kron, 0, &r).is_err());
        let mut labels = algo::cc(&mut HostMem(&directed));
        labels[3] = 6;
        assert!(verify::cc(&directed, &labels).is_err());
    }
}
