//! Benchmarks behind `strata bench`: each measures strata beside the limit
//! or a peer in the same run and reports both.

pub mod copy;
pub mod io;
pub mod migrate;
