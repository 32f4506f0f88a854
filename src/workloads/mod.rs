//! Bundled workloads people run: graph analytics over tiered CSR graphs.

pub mod graph;
pub mod recsys;
