//! The C ABI's enumerations: plain integers in C, validated here before they
//! become Rust enums (an out-of-range value from C is an error, never an
//! invalid Rust enum).
#![forbid(unsafe_code)]
#![allow(non_camel_case_types)]

use strata::device::DeviceChoice;
use strata::io::EngineChoice;
use strata::offload::optim::Updater;
use strata::runtime::Access;
use strata::tier::CxlMode;
use strata::Tier;

use crate::status::{Fail, R};

/// A memory tier (`STRATA_TIER_*`), ordered fastest first.
pub type strata_tier = i32;
/// GPU memory (HBM), or the simulated device.
pub const STRATA_TIER_DEVICE: strata_tier = 0;
/// Host DRAM.
pub const STRATA_TIER_HOST: strata_tier = 1;
/// CXL-attached memory (real or emulated).
pub const STRATA_TIER_CXL: strata_tier = 2;
/// NVMe storage.
pub const STRATA_TIER_NVME: strata_tier = 3;
/// No tier: a page never written (`strata_buffer_tier_of`).
pub const STRATA_TIER_NONE: strata_tier = -1;

/// The device backend (`STRATA_DEVICE_*`).
pub type strata_device = i32;
/// CUDA where a GPU is present, else the simulated device.
pub const STRATA_DEVICE_AUTO: strata_device = 0;
/// A CUDA GPU, or `STRATA_ERR_NO_DEVICE`.
pub const STRATA_DEVICE_CUDA: strata_device = 1;
/// The simulated device (host memory behind a PCIe link model).
pub const STRATA_DEVICE_SIM: strata_device = 2;

/// Where a CXL tier comes from (`STRATA_CXL_*`).
pub type strata_cxl_mode = i32;
/// No CXL tier.
pub const STRATA_CXL_OFF: strata_cxl_mode = 0;
/// A CPU-less NUMA node slower than DRAM (where the kernel has memory
/// tiers, one it ranks below the nodes with CPUs) if the machine has one,
/// else no CXL tier.
pub const STRATA_CXL_AUTO: strata_cxl_mode = 1;
/// DRAM behind a bandwidth cap and added latency.
pub const STRATA_CXL_EMULATED: strata_cxl_mode = 2;

/// The NVMe tier's I/O engine (`STRATA_IO_*`).
pub type strata_io_engine = i32;
/// io_uring where it works, else psync.
pub const STRATA_IO_AUTO: strata_io_engine = 0;
/// io_uring, or an error where it is unavailable.
pub const STRATA_IO_URING: strata_io_engine = 1;
/// A pool of threads doing pread/pwrite.
pub const STRATA_IO_PSYNC: strata_io_engine = 2;

/// What a launch's kernels do with the buffer (`STRATA_ACCESS_*`).
pub type strata_access = i32;
/// Kernels only read: pages may be promoted while they run; writes through
/// strata are refused until the launch ends.
pub const STRATA_ACCESS_READ_ONLY: strata_access = 0;
/// Kernels may write: no page in memory moves while they run.
pub const STRATA_ACCESS_READ_WRITE: strata_access = 1;

/// A placement policy for the balancer (`STRATA_POLICY_*`).
pub type strata_policy = i32;
/// The default policy (W-TinyLFU with an adaptive window, or ARC where
/// the policy's simulations find it missing less).
pub const STRATA_POLICY_DEFAULT: strata_policy = 0;
/// Least recently used.
pub const STRATA_POLICY_LRU: strata_policy = 1;
/// Decayed access counts.
pub const STRATA_POLICY_LFU: strata_policy = 2;
/// Reuse-predicting admission (GMT).
pub const STRATA_POLICY_GMT: strata_policy = 3;
/// Honours prefetch hints.
pub const STRATA_POLICY_LOOKAHEAD: strata_policy = 4;
/// ARC (Megiddo and Modha, FAST 2003), a reference policy.
pub const STRATA_POLICY_ARC: strata_policy = 5;
/// S3-FIFO (Yang et al., SOSP 2023), a reference policy.
pub const STRATA_POLICY_S3FIFO: strata_policy = 6;
/// SIEVE (Zhang et al., NSDI 2024), a reference policy.
pub const STRATA_POLICY_SIEVE: strata_policy = 7;
/// LRFU (Lee et al., 2001): decayed counts of uses, the expert cache's eviction.
pub const STRATA_POLICY_LRFU: strata_policy = 8;
/// Exact access counts without admission, a reference for comparison.
pub const STRATA_POLICY_PERFECT_LFU: strata_policy = 9;
/// Exact access counts with admission, a reference for comparison.
pub const STRATA_POLICY_LFU_ADMISSION: strata_policy = 10;
/// Belady's MIN, offline: it needs the whole trace, so a runtime's
/// configuration refuses it (STRATA_ERR_INVALID_ARGUMENT); for replays.
pub const STRATA_POLICY_BELADY: strata_policy = 11;

/// Where the offloaded optimizer's update runs (`STRATA_UPDATE_*`).
pub type strata_updater = i32;
/// On the CPU (vectorized; host-tier chunks over all threads).
pub const STRATA_UPDATE_CPU: strata_updater = 0;
/// On GPU 0 with the CUDA kernel, bitwise the same result as the CPU;
/// `strata_optim_create` fails with `STRATA_ERR_NO_DEVICE` where there is
/// no GPU, CUDA driver or NVRTC, or libstrata was built without the `cuda`
/// feature.
pub const STRATA_UPDATE_CUDA: strata_updater = 1;

#[cold]
fn unknown(what: &str, value: i32, known: &str) -> Fail {
    Fail::invalid(format!("unknown {what} {value} (use {known})"))
}

pub(crate) fn tier(t: strata_tier) -> R<Tier> {
    match t {
        STRATA_TIER_DEVICE => Ok(Tier::Device),
        STRATA_TIER_HOST => Ok(Tier::Host),
        STRATA_TIER_CXL => Ok(Tier::Cxl),
        STRATA_TIER_NVME => Ok(Tier::Nvme),
        _ => Err(unknown(
            "tier",
            t,
            "STRATA_TIER_DEVICE, _HOST, _CXL or _NVME",
        )),
    }
}

pub(crate) fn tier_code(t: Option<Tier>) -> strata_tier {
    match t {
        Some(Tier::Device) => STRATA_TIER_DEVICE,
        Some(Tier::Host) => STRATA_TIER_HOST,
        Some(Tier::Cxl) => STRATA_TIER_CXL,
        Some(Tier::Nvme) => STRATA_TIER_NVME,
        None => STRATA_TIER_NONE,
    }
}

pub(crate) fn device(d: strata_device) -> R<DeviceChoice> {
    match d {
        STRATA_DEVICE_AUTO => Ok(DeviceChoice::Auto),
        STRATA_DEVICE_CUDA => Ok(DeviceChoice::Cuda),
        STRATA_DEVICE_SIM => Ok(DeviceChoice::Sim),
        _ => Err(unknown("device", d, "STRATA_DEVICE_AUTO, _CUDA or _SIM")),
    }
}

pub(crate) fn cxl_mode(m: strata_cxl_mode) -> R<CxlMode> {
    match m {
        STRATA_CXL_OFF => Ok(CxlMode::Off),
        STRATA_CXL_AUTO => Ok(CxlMode::Auto),
        STRATA_CXL_EMULATED => Ok(CxlMode::Emulated),
        _ => Err(unknown("cxl mode", m, "STRATA_CXL_OFF, _AUTO or _EMULATED")),
    }
}

pub(crate) fn io_engine(e: strata_io_engine) -> R<EngineChoice> {
    match e {
        STRATA_IO_AUTO => Ok(EngineChoice::Auto),
        STRATA_IO_URING => Ok(EngineChoice::Uring),
        STRATA_IO_PSYNC => Ok(EngineChoice::Psync),
        _ => Err(unknown("io engine", e, "STRATA_IO_AUTO, _URING or _PSYNC")),
    }
}

pub(crate) fn access(a: strata_access) -> R<Access> {
    match a {
        STRATA_ACCESS_READ_ONLY => Ok(Access::ReadOnly),
        STRATA_ACCESS_READ_WRITE => Ok(Access::ReadWrite),
        _ => Err(unknown(
            "access",
            a,
            "STRATA_ACCESS_READ_ONLY or _READ_WRITE",
        )),
    }
}

pub(crate) fn policy(p: strata_policy) -> R<strata::policy::PolicyKind> {
    use strata::policy::PolicyKind;
    match p {
        STRATA_POLICY_DEFAULT => Ok(PolicyKind::Default),
        STRATA_POLICY_LRU => Ok(PolicyKind::Lru),
        STRATA_POLICY_LFU => Ok(PolicyKind::Lfu),
        STRATA_POLICY_GMT => Ok(PolicyKind::Gmt),
        STRATA_POLICY_LOOKAHEAD => Ok(PolicyKind::Lookahead),
        STRATA_POLICY_ARC => Ok(PolicyKind::Arc),
        STRATA_POLICY_S3FIFO => Ok(PolicyKind::S3Fifo),
        STRATA_POLICY_SIEVE => Ok(PolicyKind::Sieve),
        STRATA_POLICY_LRFU => Ok(PolicyKind::Lrfu),
        STRATA_POLICY_PERFECT_LFU => Ok(PolicyKind::PerfectLfu),
        STRATA_POLICY_LFU_ADMISSION => Ok(PolicyKind::LfuAdmission),
        STRATA_POLICY_BELADY => Ok(PolicyKind::Belady),
        _ => Err(unknown(
            "policy",
            p,
            "STRATA_POLICY_DEFAULT, _LRU, _LFU, _GMT, _LOOKAHEAD, _ARC, _S3FIFO, _SIEVE, _LRFU, \
             _PERFECT_LFU, _LFU_ADMISSION or _BELADY",
        )),
    }
}

pub(crate) fn updater(u: strata_updater) -> R<Updater> {
    match u {
        STRATA_UPDATE_CPU => Ok(Updater::Cpu),
        STRATA_UPDATE_CUDA => Ok(Updater::Cuda),
        _ => Err(unknown("updater", u, "STRATA_UPDATE_CPU or _CUDA")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_strangers_are_refused() {
        for t in Tier::ALL {
            assert_eq!(tier(tier_code(Some(t))).unwrap(), t);
        }
        assert!(tier(STRATA_TIER_NONE).is_err());
        assert!(tier(4).is_err());
        assert!(device(3).is_err());
        assert!(cxl_mode(-1).is_err());
        assert!(io_engine(i32::MAX).is_err());
        assert!(access(2).is_err());
        assert!(updater(2).is_err());
        assert_eq!(updater(STRATA_UPDATE_CUDA).unwrap(), Updater::Cuda);
    }
}
