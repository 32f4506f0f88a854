//! # strata-bench
//!
//! The benchmarks bundled with [strata] and the `strata`
//! command-line tool that runs them, built only on strata's public API:
//!
//! | module | what |
//! |---|---|
//! | [`bench`](mod@bench) | `strata bench io|copy|migrate|graph|recsys|moe|optim`: each runs a workload beside its baselines and returns a report (the JSON `--json` writes) |
//! | [`workloads`] | graph analytics over tiered CSR graphs (BFS, SSSP, PageRank, CC; on the simulated device and as CUDA kernels), DLRM-style embedding bags, a synthetic MoE router |
//! | [`gen`] | synthetic data: page-trace generators |
//! | [`random`] | one random-number generator, one Zipf sampler, a scramble of ranks |
//! | [`machine`] | what a run may use: available memory (checked against every bench's estimate before it allocates), RAM-backed filesystems |
//!
//! The library crate `strata` holds the runtime and does not depend on this
//! one; nothing here is needed to use it.

pub mod bench;
pub mod files;
pub mod gen;
pub mod machine;
pub mod random;
pub mod sys;
pub mod workloads;
