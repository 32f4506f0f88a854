//! How to build an [`OffloadedAdam`](super::OffloadedAdam) and what a step
//! reports: where the states live, the chunk size, the hyper-parameters,
//! importance-aware mode and where the update runs.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use serde::Serialize;

use crate::adam::AdamParams;
use crate::error::{Error, Result};

/// Where the states live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateTier {
    /// Host DRAM.
    Host,
    /// CXL memory: a CPU-less node if there is one, else emulated.
    Cxl,
    /// An NVMe tier in this directory (a disk, not tmpfs).
    Nvme(PathBuf),
}

impl StateTier {
    /// "host", "cxl" or "nvme".
    pub fn name(&self) -> &'static str {
        match self {
            StateTier::Host => "host",
            StateTier::Cxl => "cxl",
            StateTier::Nvme(_) => "nvme",
        }
    }
}

/// Importance-aware mode; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Importance {
    /// Share of each chunk's elements updated every step (0 < f ≤ 1).
    pub fraction: f64,
    /// The rest are updated every this many steps.
    pub every: u64,
}

/// Where the element-wise update runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Updater {
    /// On the CPU (vectorized; host-tier chunks over rayon's threads).
    #[default]
    Cpu,
    /// On GPU 0 with `kernels/adam.cu` (cargo feature `cuda`); building
    /// the optimizer fails with `NoDevice` ("no CUDA device: …") where
    /// there is no GPU, driver or NVRTC.
    Cuda,
}

impl Updater {
    /// "cpu" or "cuda".
    pub fn name(self) -> &'static str {
        match self {
            Updater::Cpu => "cpu",
            Updater::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for Updater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Updater {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Updater::Cpu),
            "cuda" => Ok(Updater::Cuda),
            _ => Err(Error::invalid(format!(
                "unknown updater {s:?} (use cpu or cuda)"
            ))),
        }
    }
}

/// How to build an [`OffloadedAdam`](super::OffloadedAdam).
#[derive(Debug, Clone)]
pub struct OptimConfig {
    /// Where the states live.
    pub tier: StateTier,
    /// Bytes of one chunk of one state array (the store's page size).
    pub chunk_bytes: usize,
    /// Hyper-parameters.
    pub adam: AdamParams,
    /// Importance-aware mode, or every element every step.
    pub importance: Option<Importance>,
    /// Where the update runs.
    pub updater: Updater,
}

impl OptimConfig {
    /// States in `tier`, 1 MiB chunks, default Adam, plain mode, the
    /// update on the CPU.
    pub fn new(tier: StateTier) -> Self {
        Self {
            tier,
            chunk_bytes: 1 << 20,
            adam: AdamParams::default(),
            importance: None,
            updater: Updater::Cpu,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StepStats {
    /// Wall seconds of the step.
    pub seconds: f64,
    /// State bytes read.
    pub bytes_read: u64,
    /// State bytes written.
    pub bytes_written: u64,
    /// Seconds the update waited for I/O.
    pub io_wait_seconds: f64,
}
