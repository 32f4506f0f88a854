//! Bundled workloads people run: graph analytics over tiered CSR graphs,
//! embedding bags over tiered tables, synthetic MoE routing.

pub mod graph;
pub mod moe;
pub mod recsys;
