//! Configuration: a TOML file and `STRATA_*` environment variables over
//! defaults derived from the machine.
//!
//! ```toml
//! page_size = "64k"
//! device = "auto"          # auto | cuda | sim
//! device_capacity = "8G"   # cap on the GPU (default: its free memory less
//!                          # a reserve); the simulated GPU's size (1 GiB)
//! [host]
//! capacity = "8G"
//! huge_pages = true
//! numa_node = 0            # optional mbind
//! [cxl]
//! mode = "auto"            # auto | emulated | off
//! capacity = "4G"
//! bandwidth = "20G"        # emulated only: bytes/s (default: half of local memcpy)
//! latency_ns = 100         # emulated only
//! [nvme]
//! path = "/var/tmp"        # directory, new file name, or block device
//! capacity = "16G"         # 0: no NVMe tier
//! engine = "auto"          # auto | uring | psync
//! queue_depth = 32
//! ```
//!
//! Environment (overrides the file): `STRATA_CONFIG` (the file),
//! `STRATA_DEVICE`, `STRATA_DEVICE_CAPACITY`, `STRATA_PAGE_SIZE`, `STRATA_HOST_CAPACITY`, `STRATA_CXL_MODE`,
//! `STRATA_CXL_CAPACITY`, `STRATA_NVME_PATH`, `STRATA_NVME_CAPACITY`,
//! `STRATA_IO_ENGINE`, `STRATA_WATERMARK_LOW`, `STRATA_WATERMARK_HIGH`,
//! `STRATA_POLICY`.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::device::DeviceChoice;
use crate::error::{Error, Result};
use crate::io::EngineChoice;
use crate::size::{check_page_size, parse_size};
use crate::sys::Topology;
use crate::tier::{CxlBacking, CxlConfig, CxlMode, HostConfig, NvmeConfig};

/// Default page size: 64 KiB.
pub const DEFAULT_PAGE_SIZE: usize = 64 << 10;

/// A byte size that reads from TOML as an integer or a string with a suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeRepr", into = "u64")]
pub struct Size(pub u64);

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Int(u64),
    Text(String),
}

impl TryFrom<SizeRepr> for Size {
    type Error = Error;
    fn try_from(r: SizeRepr) -> Result<Self> {
        match r {
            SizeRepr::Int(v) => Ok(Size(v)),
            SizeRepr::Text(t) => parse_size(&t).map(Size),
        }
    }
}

impl From<Size> for u64 {
    fn from(s: Size) -> u64 {
        s.0
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    page_size: Option<Size>,
    device: Option<DeviceChoice>,
    device_capacity: Option<Size>,
    watermark_low: Option<f64>,
    watermark_high: Option<f64>,
    policy: Option<String>,
    #[serde(default)]
    host: FileHost,
    #[serde(default)]
    cxl: FileCxl,
    #[serde(default)]
    nvme: FileNvme,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHost {
    capacity: Option<Size>,
    huge_pages: Option<bool>,
    numa_node: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileCxl {
    mode: Option<CxlMode>,
    capacity: Option<Size>,
    bandwidth: Option<Size>,
    latency_ns: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNvme {
    path: Option<PathBuf>,
    capacity: Option<Size>,
    engine: Option<EngineChoice>,
    queue_depth: Option<usize>,
}

/// The simulated GPU's default size.
pub const DEFAULT_SIM_DEVICE_CAPACITY: u64 = 1 << 30;

/// The resolved configuration of the tiers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// Page size of every tier.
    pub page_size: usize,
    /// Device backend.
    pub device: DeviceChoice,
    /// Device tier capacity: a cap on a GPU, the size of the simulated one;
    /// `None` for the defaults (GPU: free memory less a reserve; sim:
    /// [`DEFAULT_SIM_DEVICE_CAPACITY`]). 0 turns the device tier off.
    pub device_capacity: Option<u64>,
    /// Host DRAM tier.
    pub host: HostConfig,
    /// CXL tier; `None` when off, or `auto` on a machine without CXL memory.
    pub cxl: Option<CxlConfig>,
    /// NVMe tier; `None` when its capacity is configured 0.
    pub nvme: Option<NvmeConfig>,
    /// Background eviction keeps each tier but the slowest between these
    /// fractions of its capacity.
    pub watermarks: crate::runtime::Watermarks,
    /// The balancer's placement policy.
    pub policy: crate::policy::PolicyKind,
}

impl Config {
    /// Defaults for this machine, then `file` (or `$STRATA_CONFIG`), then
    /// the environment.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let env_file = std::env::var_os("STRATA_CONFIG").map(PathBuf::from);
        let text = match file.map(Path::to_path_buf).or(env_file) {
            Some(path) => Some(
                std::fs::read_to_string(&path)
                    .map_err(|e| Error::io(format!("reading config {}", path.display()), e))?,
            ),
            None => None,
        };
        Self::resolve(
            text.as_deref(),
            &|k| std::env::var(k).ok(),
            &Topology::detect(),
        )
    }

    /// Resolves a config from TOML text, an environment lookup and a
    /// topology (pure, for tests).
    pub fn resolve(
        toml_text: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
        topology: &Topology,
    ) -> Result<Self> {
        let file: FileConfig = match toml_text {
            Some(t) => {
                toml::from_str(t).map_err(|e| Error::invalid(format!("config: {}", e.message())))?
            }
            None => FileConfig::default(),
        };
        let env_size = |key: &str| -> Result<Option<u64>> {
            env(key)
                .map(|v| parse_size(&v).map_err(|e| e.context(key)))
                .transpose()
        };
        let page_size = match env_size("STRATA_PAGE_SIZE")? {
            Some(v) => v,
            None => file.page_size.map_or(DEFAULT_PAGE_SIZE as u64, |s| s.0),
        };
        let page_size = usize::try_from(page_size)
            .map_err(|_| Error::invalid(format!("page size {page_size} is too large")))?;
        check_page_size(page_size)?;

        let host_capacity = env_size("STRATA_HOST_CAPACITY")?
            .or(file.host.capacity.map(|s| s.0))
            .unwrap_or_else(|| default_host_capacity(page_size));
        let host = HostConfig {
            capacity: host_capacity,
            page_size,
            huge_pages: file.host.huge_pages.unwrap_or(true),
            numa_node: file.host.numa_node,
        };

        let cxl_mode = match env("STRATA_CXL_MODE") {
            Some(m) => match m.to_ascii_lowercase().as_str() {
                "auto" => CxlMode::Auto,
                "emulated" => CxlMode::Emulated,
                "off" => CxlMode::Off,
                _ => {
                    return Err(Error::invalid(format!(
                        "STRATA_CXL_MODE {m:?} is not auto, emulated or off"
                    )))
                }
            },
            None => file.cxl.mode.unwrap_or_default(),
        };
        let cxl_capacity = env_size("STRATA_CXL_CAPACITY")?.or(file.cxl.capacity.map(|s| s.0));
        // The default capacity is the CXL node's size where the machine has
        // one, also for an emulated tier (as a stand-in of that size).
        let node_bytes = match CxlMode::Auto.backing(topology) {
            CxlBacking::Node { memory_bytes, .. } => Some(memory_bytes),
            _ => None,
        };
        let cxl = match cxl_mode.backing(topology) {
            CxlBacking::Absent => None,
            _ => Some(CxlConfig {
                mode: cxl_mode,
                capacity: cxl_capacity.or(node_bytes).unwrap_or(host_capacity / 2),
                page_size,
                bandwidth: file.cxl.bandwidth.map(|s| s.0 as f64),
                latency_ns: file
                    .cxl
                    .latency_ns
                    .unwrap_or(crate::tier::cxl::CXL_DEFAULT_LATENCY_NS),
            }),
        };

        let nvme_path = env("STRATA_NVME_PATH")
            .map(PathBuf::from)
            .or(file.nvme.path)
            .unwrap_or_else(std::env::temp_dir);
        let nvme_capacity = env_size("STRATA_NVME_CAPACITY")?
            .or(file.nvme.capacity.map(|s| s.0))
            .unwrap_or_else(|| default_nvme_capacity(&nvme_path, page_size));
        let engine = match env("STRATA_IO_ENGINE") {
            Some(e) => e.parse()?,
            None => file.nvme.engine.unwrap_or_default(),
        };
        // As `device_capacity = 0`, an nvme capacity of 0 turns the tier off.
        let nvme = (nvme_capacity > 0).then(|| NvmeConfig {
            path: nvme_path,
            capacity: nvme_capacity,
            page_size,
            engine,
            queue_depth: file.nvme.queue_depth.unwrap_or(32),
        });
        let device = match env("STRATA_DEVICE") {
            Some(d) => d.parse().map_err(|e: Error| e.context("STRATA_DEVICE"))?,
            None => file.device.unwrap_or_default(),
        };
        let device_capacity =
            env_size("STRATA_DEVICE_CAPACITY")?.or(file.device_capacity.map(|s| s.0));
        let env_fraction = |key: &str| -> Result<Option<f64>> {
            env(key)
                .map(|v| {
                    v.trim()
                        .parse::<f64>()
                        .map_err(|_| Error::invalid(format!("{key} {v:?} is not a number")))
                })
                .transpose()
        };
        let defaults = crate::runtime::Watermarks::default();
        let watermarks = crate::runtime::Watermarks {
            low: env_fraction("STRATA_WATERMARK_LOW")?
                .or(file.watermark_low)
                .unwrap_or(defaults.low),
            high: env_fraction("STRATA_WATERMARK_HIGH")?
                .or(file.watermark_high)
                .unwrap_or(defaults.high),
        };
        watermarks.check()?;
        let policy = match env("STRATA_POLICY").or(file.policy) {
            Some(p) => p.parse().map_err(|e: Error| e.context("policy"))?,
            None => crate::policy::PolicyKind::Default,
        };
        let config = Self {
            page_size,
            device,
            device_capacity,
            host,
            cxl,
            nvme,
            watermarks,
            policy,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks capacities against the page size, naming the offending key.
    pub fn validate(&self) -> Result<()> {
        let page = self.page_size as u64;
        let mut tiers = vec![("host", self.host.capacity)];
        if let Some(nvme) = &self.nvme {
            tiers.push(("nvme", nvme.capacity));
        }
        if let Some(cxl) = &self.cxl {
            tiers.push(("cxl", cxl.capacity));
        }
        for (tier, capacity) in tiers {
            if capacity < page {
                return Err(Error::invalid(format!(
                    "{tier} capacity {capacity} holds no whole page of {page} bytes"
                )));
            }
        }
        if let Some(nvme) = self.nvme.as_ref().filter(|n| n.capacity % page != 0) {
            return Err(Error::invalid(format!(
                "nvme capacity {} is not a multiple of the page size {page}",
                nvme.capacity
            )));
        }
        Ok(())
    }
}

fn round_down(bytes: u64, page_size: usize) -> u64 {
    bytes / page_size as u64 * page_size as u64
}

/// A quarter of physical memory.
fn default_host_capacity(page_size: usize) -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(4 << 30, |kb| kb * 1024);
    round_down(total / 4, page_size).max(page_size as u64)
}

/// 16 GiB, or half the free space of the filesystem holding `path`.
fn default_nvme_capacity(path: &Path, page_size: usize) -> u64 {
    let free = crate::sys::fs_free_bytes(path).unwrap_or(u64::MAX);
    round_down((16u64 << 30).min(free / 2), page_size).max(page_size as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn file_then_env() {
        let toml = r#"
            page_size = "4k"
            [host]
            capacity = "1G"
            [cxl]
            mode = "emulated"
            capacity = 1048576
            [nvme]
            path = "/somewhere"
            capacity = "2G"
            engine = "psync"
        "#;
        let c = Config::resolve(Some(toml), &no_env, &Topology::default()).unwrap();
        assert_eq!(c.page_size, 4096);
        assert_eq!(c.host.capacity, 1 << 30);
        assert_eq!(c.cxl.as_ref().unwrap().capacity, 1 << 20);
        assert_eq!(c.nvme.as_ref().unwrap().engine, EngineChoice::Psync);
        let env = |k: &str| (k == "STRATA_HOST_CAPACITY").then(|| "2G".to_string());
        let c = Config::resolve(Some(toml), &env, &Topology::default()).unwrap();
        assert_eq!(c.host.capacity, 2 << 30);
        let env = |k: &str| match k {
            "STRATA_DEVICE" => Some("sim".to_string()),
            "STRATA_DEVICE_CAPACITY" => Some("256M".to_string()),
            _ => None,
        };
        let c = Config::resolve(None, &env, &Topology::default()).unwrap();
        assert_eq!(c.device, DeviceChoice::Sim);
        assert_eq!(c.device_capacity, Some(256 << 20));
        let env = |k: &str| (k == "STRATA_DEVICE").then(|| "gpu0".to_string());
        let e = Config::resolve(None, &env, &Topology::default()).unwrap_err();
        assert!(e.message().contains("STRATA_DEVICE"), "{e}");
    }

    #[test]
    fn auto_cxl_is_absent_without_a_cpu_less_node() {
        let c = Config::resolve(None, &no_env, &Topology::default()).unwrap();
        assert!(c.cxl.is_none());
        assert_eq!(c.page_size, DEFAULT_PAGE_SIZE);
    }

    #[test]
    fn bad_values_name_the_problem() {
        let e =
            Config::resolve(Some("page_size = \"3k\""), &no_env, &Topology::default()).unwrap_err();
        assert!(e.message().contains("power of two"), "{e}");
        let e = Config::resolve(Some("[host]\ncapacty = 1"), &no_env, &Topology::default())
            .unwrap_err();
        assert!(e.message().contains("capacty"), "{e}");
        let env = |k: &str| (k == "STRATA_NVME_CAPACITY").then(|| "lots".to_string());
        let e = Config::resolve(None, &env, &Topology::default()).unwrap_err();
        assert!(e.message().contains("STRATA_NVME_CAPACITY"), "{e}");
        let e = Config::resolve(
            Some("watermark_low = 0.9\nwatermark_high = 0.5"),
            &no_env,
            &Topology::default(),
        )
        .unwrap_err();
        assert!(e.message().contains("watermarks"), "{e}");
        let e =
            Config::resolve(Some("policy = \"mru\""), &no_env, &Topology::default()).unwrap_err();
        assert!(e.message().contains("policy"), "{e}");
        let env = |k: &str| (k == "STRATA_POLICY").then(|| "lfu".to_string());
        let c = Config::resolve(None, &env, &Topology::default()).unwrap();
        assert_eq!(c.policy, crate::policy::PolicyKind::Lfu);
        let env = |k: &str| (k == "STRATA_WATERMARK_HIGH").then(|| "high".to_string());
        let e = Config::resolve(None, &env, &Topology::default()).unwrap_err();
        assert!(e.message().contains("STRATA_WATERMARK_HIGH"), "{e}");
    }
}
