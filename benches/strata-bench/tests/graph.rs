//! The graph kernels on a GPU (`kernels/graph.cu`, `--features cuda`):
//!
//! - both flavours compile with NVRTC wherever libnvrtc loads (no GPU
//!   needed);
//! - every algorithm, on small generated and directed graphs, through each
//!   way the kernels read the CSR (strata device maps over a cuda runtime,
//!   Unified Memory, mapped host memory, device memory), matches the
//!   serial references of `verify.rs`.
//!
//! Without NVRTC or a GPU the tests skip with a printed reason;
//! `STRATA_REQUIRE_GPU=1` turns the skips into failures, and
//! `STRATA_REQUIRE_NVRTC=1` (CI's setting) the skip of the compile.
#![cfg(feature = "cuda")]

use strata::device::DeviceChoice;
use strata_bench::workloads::graph::cuda::{
    self, Flavour, GpuGraph, PlainGpu, PlainKind, StrataGpu,
};
use strata_bench::workloads::graph::tiered::{Config, TieredGraph};
use strata_bench::workloads::graph::{verify, Csr};

fn skip(what: &str, why: impl std::fmt::Display) {
    assert!(
        std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
        "STRATA_REQUIRE_GPU is set but {what}: {why}"
    );
    eprintln!("skipping: {what}: {why}");
}

#[test]
fn kernels_compile_with_nvrtc() {
    for flavour in [Flavour::Mapped, Flavour::Plain] {
        match cuda::compile_ptx(flavour) {
            Ok(ptx) => {
                let text = ptx.to_src();
                for name in ["graph_bfs_top_down", "graph_sssp_relax", "graph_pr_pull"] {
                    assert!(text.contains(name), "{flavour:?}: {name} missing");
                }
            }
            Err(e) if e.kind() == strata::ErrorKind::NoDevice => {
                assert!(
                    std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(),
                    "STRATA_REQUIRE_NVRTC is set but NVRTC is not available: {e}"
                );
                return skip("NVRTC is not available", e);
            }
            Err(e) => panic!("{flavour:?}: {e}"),
        }
    }
}

fn graphs() -> Vec<Csr> {
    // A directed graph with a dangling vertex, a self loop (dropped) and
    // two components.
    let edges = vec![
        (0, 1, 3),
        (1, 2, 4),
        (2, 0, 1),
        (2, 3, 9),
        (5, 6, 2),
        (4, 4, 1),
    ];
    vec![
        Csr::load(&"kron:10".parse().unwrap(), 7).unwrap(),
        Csr::load(&"urand:9:4".parse().unwrap(), 7).unwrap(),
        Csr::from_edges(7, edges, true),
    ]
}

/// Runs every algorithm on `gpu` and checks it against the references.
fn check_all(g: &Csr, gpu: &mut dyn GpuGraph, what: &str) {
    let source = (0..g.vertices()).find(|&v| g.degree(v) > 0).unwrap();
    let r = cuda::bfs(gpu, source).unwrap();
    verify::bfs(g, source, &r).unwrap_or_else(|e| panic!("{what}: bfs: {e}"));
    let r = cuda::sssp(gpu, source, 32).unwrap();
    verify::sssp(g, source, &r).unwrap_or_else(|e| panic!("{what}: sssp: {e}"));
    let r = cuda::pagerank(gpu, 1e-4, 100).unwrap();
    verify::pagerank(g, 1e-4, 100, &r).unwrap_or_else(|e| panic!("{what}: pr: {e}"));
    let labels = cuda::cc(gpu).unwrap();
    verify::cc(g, &labels).unwrap_or_else(|e| panic!("{what}: cc: {e}"));
}

#[test]
fn every_algorithm_verifies_through_plain_pointers() {
    let ctx = match cuda::context() {
        Ok(c) => c,
        Err(e) => return skip("no GPU", e),
    };
    for (i, g) in graphs().iter().enumerate() {
        for kind in [PlainKind::Device, PlainKind::HostMapped, PlainKind::Managed] {
            let mut gpu = PlainGpu::new(&ctx, g, kind, true).unwrap();
            gpu.reset().unwrap();
            check_all(g, &mut gpu, &format!("graph {i}, {kind:?}"));
        }
    }
}

#[test]
fn every_algorithm_verifies_through_device_maps() {
    if let Err(e) = cuda::context() {
        return skip("no GPU", e);
    }
    for (i, g) in graphs().iter().enumerate() {
        // A quarter of the graph on the GPU, 4 KiB pages: the balancer
        // moves pages between the kernels' steps.
        let page = 4096;
        let budget = (TieredGraph::footprint(g, true) / 4).max(page as u64);
        let tg = TieredGraph::build_on(g, Config::Strata, budget, page, true, DeviceChoice::Cuda)
            .unwrap();
        tg.reset(Default::default()).unwrap();
        let kernels =
            cuda::GraphKernels::for_context(&cuda::context().unwrap(), Flavour::Mapped).unwrap();
        let mut gpu = StrataGpu::new(&tg, kernels).unwrap();
        check_all(g, &mut gpu, &format!("graph {i}, strata"));
        assert!(gpu.sampled_accesses > 0, "the kernels counted accesses");
    }
}
