//! Configuration: every setting of a runtime, its default, and its check,
//! in one place. Each front end builds a partial configuration,
//! [`Settings`] (every field optional: "not set"), and [`Config`] merges it
//! over the defaults and checks it:
//!
//! - Rust: [`Settings`] and [`Config::from_settings`], or [`Config::resolve`]
//!   for TOML text and the environment;
//! - TOML (the `strata` command's `--config`, `strata_runtime_from_toml`,
//!   `Runtime.from_toml`) and `STRATA_*` environment variables, which
//!   override the file;
//! - C: `strata_config` (`strata_config_init` leaves each field at its
//!   default);
//! - Python: `strata.Runtime(**settings)`.
//!
//! The same settings through any of them give the same [`Config`], and a
//! bad value the same message. One difference is by design: a program (C,
//! Python) gets a CXL or NVMe tier only when it asks for one (a CXL mode, an
//! NVMe path), while a config file gets the machine's by default.
//!
//! ```toml
//! page_size = "64k"
//! device = "auto"          # auto | cuda | sim
//! device_capacity = "8G"   # cap on the GPU (default: its free memory less
//!                          # a reserve); the simulated GPU's size (1 GiB);
//!                          # 0: no device tier
//! watermark_low = 0.85     # background eviction keeps each tier but the
//! watermark_high = 0.95    # slowest between these fractions of it
//! background_eviction = true
//! policy = "default"       # the balancer's policy (lru, lfu, arc, ...)
//! sampling = 0             # count 1 in 2^k accesses (0..16), or "off"
//! [host]
//! capacity = "8G"          # default: a quarter of physical memory
//! huge_pages = true
//! numa_node = 0            # optional mbind
//! [cxl]
//! mode = "auto"            # auto | emulated | off
//! capacity = "4G"          # default: the CXL node's size, else half the
//!                          # host tier; 0: no CXL tier
//! bandwidth = "20G"        # emulated only: bytes/s, binary suffixes as every size (20 GiB/s); default half of local memcpy
//! latency_ns = 100         # emulated only
//! [nvme]
//! path = "/var/tmp"        # directory, new file name, or block device
//!                          # (default: the temporary directory)
//! capacity = "16G"         # default: 16 GiB or half the free space (a block device: its size); 0: no NVMe tier
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
use crate::policy::PolicyKind;
use crate::runtime::{RuntimeBuilder, Watermarks};
use crate::size::{check_page_size, parse_size};
use crate::sys::Topology;
use crate::tier::{CxlBacking, CxlConfig, CxlMode, HostConfig, NvmeConfig};

pub use crate::size::DEFAULT_PAGE_SIZE;

/// The simulated GPU's default size.
pub const DEFAULT_SIM_DEVICE_CAPACITY: u64 = crate::device::sim::DEFAULT_CAPACITY;

/// Default NVMe operations in flight per queue.
pub const DEFAULT_NVME_QUEUE_DEPTH: usize = 32;

/// Default access counting: every access (1 in 2^0).
pub const DEFAULT_SAMPLING: Option<u32> = Some(0);

/// The sparsest access counting: 1 in 2^16.
pub const MAX_SAMPLING_SHIFT: u32 = 16;

/// Whether the host tier asks for transparent huge pages by default.
pub const DEFAULT_HUGE_PAGES: bool = true;

/// Whether background eviction runs by default.
pub const DEFAULT_BACKGROUND_EVICTION: bool = true;

/// A byte size that reads from TOML as an integer or a string with a suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeRepr", into = "u64")]
pub struct Size(pub u64);

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "expected a size: a whole number of bytes, or text such as \"64K\" or \"4G\""
)]
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

/// `sampling` in TOML: a shift (1 in 2^k accesses) or "off".
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a sampling shift k (count 1 in 2^k accesses) or \"off\""
)]
enum SamplingRepr {
    Shift(u32),
    Text(String),
}

impl SamplingRepr {
    fn value(self) -> Result<Option<u32>> {
        match self {
            SamplingRepr::Shift(k) => Ok(Some(k)),
            SamplingRepr::Text(t) => parse_sampling(&t),
        }
    }
}

/// Access counting from its name: a shift `k` (count 1 in 2^k accesses)
/// or `off`.
pub fn parse_sampling(text: &str) -> Result<Option<u32>> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    t.parse::<u32>().map(Some).map_err(|_| {
        Error::invalid(format!(
            "sampling {text:?} is not a shift 0..{MAX_SAMPLING_SHIFT} or off"
        ))
    })
}

/// A CXL mode from its name: `auto`, `emulated` or `off`.
pub fn parse_cxl_mode(name: &str) -> Result<CxlMode> {
    match name.to_ascii_lowercase().as_str() {
        "auto" => Ok(CxlMode::Auto),
        "emulated" => Ok(CxlMode::Emulated),
        "off" => Ok(CxlMode::Off),
        _ => Err(Error::invalid(format!(
            "unknown cxl mode {name:?} (use auto, emulated or off)"
        ))),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    page_size: Option<Size>,
    device: Option<String>,
    device_capacity: Option<Size>,
    watermark_low: Option<f64>,
    watermark_high: Option<f64>,
    policy: Option<String>,
    background_eviction: Option<bool>,
    sampling: Option<SamplingRepr>,
    #[serde(default)]
    host: FileHost,
    #[serde(default)]
    cxl: FileCxl,
    #[serde(default)]
    nvme: FileNvme,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [host] table")]
struct FileHost {
    capacity: Option<Size>,
    huge_pages: Option<bool>,
    numa_node: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [cxl] table")]
struct FileCxl {
    mode: Option<String>,
    capacity: Option<Size>,
    bandwidth: Option<Size>,
    latency_ns: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [nvme] table")]
struct FileNvme {
    path: Option<PathBuf>,
    capacity: Option<Size>,
    engine: Option<String>,
    queue_depth: Option<u64>,
}

/// A partial configuration: every setting optional, `None` meaning "not
/// set" (the default applies). Each front end builds one (TOML text, the
/// environment, C's `strata_config`, Python's keywords, or Rust code) and
/// [`Config::from_settings`] merges it over the defaults and checks it.
///
/// Capacities are in bytes; a device, CXL or NVMe capacity of 0 turns that
/// tier off (the host tier is always present).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Settings {
    /// Page size of every tier: a power of two, 4 KiB … 2 MiB (default
    /// [`DEFAULT_PAGE_SIZE`]).
    pub page_size: Option<u64>,
    /// Device backend (default `auto`: a GPU where present, else the
    /// simulated one).
    pub device: Option<DeviceChoice>,
    /// Device tier capacity: the simulated GPU's size, or a cap on a real
    /// one (default: [`DEFAULT_SIM_DEVICE_CAPACITY`] on sim, the GPU's free
    /// memory less a reserve on cuda). 0: no device tier.
    pub device_capacity: Option<u64>,
    /// Host DRAM tier capacity (default: a quarter of physical memory).
    pub host_capacity: Option<u64>,
    /// Transparent huge pages for the host tier (default
    /// [`DEFAULT_HUGE_PAGES`]).
    pub huge_pages: Option<bool>,
    /// Bind the host tier to this NUMA node (default: no binding).
    pub numa_node: Option<u32>,
    /// Where a CXL tier comes from (default `auto`: a CPU-less NUMA node if
    /// the machine has one; `off`: no CXL tier).
    pub cxl_mode: Option<CxlMode>,
    /// CXL tier capacity (default: the CXL node's memory, else half the
    /// host tier). 0: no CXL tier.
    pub cxl_capacity: Option<u64>,
    /// Emulated CXL: bandwidth cap in bytes/s (default: half of this
    /// machine's measured memcpy bandwidth).
    pub cxl_bandwidth: Option<u64>,
    /// Emulated CXL: added latency per transfer in nanoseconds (default
    /// [`CXL_DEFAULT_LATENCY_NS`](crate::tier::cxl::CXL_DEFAULT_LATENCY_NS)).
    pub cxl_latency_ns: Option<u64>,
    /// NVMe tier: a directory (a private swap file is made in it), a new
    /// file name, or a block device (default: the temporary directory).
    pub nvme_path: Option<PathBuf>,
    /// NVMe tier capacity, a whole number of pages (default: 16 GiB or half
    /// the free space under the path, whichever is less). 0: no NVMe tier.
    pub nvme_capacity: Option<u64>,
    /// The NVMe tier's I/O engine (default `auto`: io_uring where it works).
    pub nvme_engine: Option<EngineChoice>,
    /// NVMe operations in flight per queue, at least 1 (default
    /// [`DEFAULT_NVME_QUEUE_DEPTH`]).
    pub nvme_queue_depth: Option<u64>,
    /// Background eviction stops at this fraction of a tier (default 0.85).
    pub watermark_low: Option<f64>,
    /// Background eviction starts above this fraction of a tier (default
    /// 0.95); `0 < low <= high <= 1`.
    pub watermark_high: Option<f64>,
    /// The balancer's placement policy (default: the default policy).
    pub policy: Option<PolicyKind>,
    /// Background eviction on or off (default
    /// [`DEFAULT_BACKGROUND_EVICTION`]).
    pub background_eviction: Option<bool>,
    /// Access counting: `Some(Some(k))` counts 1 in 2^k accesses (k ≤
    /// [`MAX_SAMPLING_SHIFT`]), `Some(None)` none (default
    /// [`DEFAULT_SAMPLING`]: every access).
    pub sampling: Option<Option<u32>>,
}

impl Settings {
    /// The settings of TOML text in the format of the config file (see the
    /// module documentation).
    pub fn from_toml(text: &str) -> Result<Self> {
        let f: FileConfig = toml::from_str(text).map_err(|e| {
            // The value the message is about, where it is short enough to show.
            let found = e
                .span()
                .and_then(|r| text.get(r))
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.len() <= 40 && !v.contains('\n'))
                .map_or(String::new(), |v| format!(" (found {v})"));
            Error::invalid(format!("config: {}{found}", e.message()))
        })?;
        Ok(Self {
            page_size: f.page_size.map(u64::from),
            device: f.device.map(|d| d.parse()).transpose()?,
            device_capacity: f.device_capacity.map(u64::from),
            host_capacity: f.host.capacity.map(u64::from),
            huge_pages: f.host.huge_pages,
            numa_node: f.host.numa_node,
            cxl_mode: f.cxl.mode.as_deref().map(parse_cxl_mode).transpose()?,
            cxl_capacity: f.cxl.capacity.map(u64::from),
            cxl_bandwidth: f.cxl.bandwidth.map(u64::from),
            cxl_latency_ns: f.cxl.latency_ns,
            nvme_path: f.nvme.path,
            nvme_capacity: f.nvme.capacity.map(u64::from),
            nvme_engine: f.nvme.engine.map(|e| e.parse()).transpose()?,
            nvme_queue_depth: f.nvme.queue_depth,
            watermark_low: f.watermark_low,
            watermark_high: f.watermark_high,
            policy: f.policy.map(|p| p.parse()).transpose()?,
            background_eviction: f.background_eviction,
            sampling: f.sampling.map(SamplingRepr::value).transpose()?,
        })
    }

    /// The settings of `STRATA_*` environment variables (see the module
    /// documentation), looked up with `env`; a bad value's error names its
    /// variable.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let size = |key: &str| -> Result<Option<u64>> {
            env(key)
                .map(|v| parse_size(&v).map_err(|e| e.context(key)))
                .transpose()
        };
        let fraction = |key: &str| -> Result<Option<f64>> {
            env(key)
                .map(|v| {
                    v.trim()
                        .parse::<f64>()
                        .map_err(|_| Error::invalid(format!("{key} {v:?} is not a number")))
                })
                .transpose()
        };
        let parsed = |key: &str| env(key).map(|v| (key.to_owned(), v));
        let mut s = Self {
            page_size: size("STRATA_PAGE_SIZE")?,
            host_capacity: size("STRATA_HOST_CAPACITY")?,
            ..Self::default()
        };
        if let Some((key, v)) = parsed("STRATA_CXL_MODE") {
            s.cxl_mode = Some(parse_cxl_mode(&v).map_err(|e| e.context(key))?);
        }
        s.cxl_capacity = size("STRATA_CXL_CAPACITY")?;
        s.nvme_path = env("STRATA_NVME_PATH").map(PathBuf::from);
        s.nvme_capacity = size("STRATA_NVME_CAPACITY")?;
        if let Some((key, v)) = parsed("STRATA_IO_ENGINE") {
            s.nvme_engine = Some(v.parse().map_err(|e: Error| e.context(key))?);
        }
        if let Some((key, v)) = parsed("STRATA_DEVICE") {
            s.device = Some(v.parse().map_err(|e: Error| e.context(key))?);
        }
        s.device_capacity = size("STRATA_DEVICE_CAPACITY")?;
        s.watermark_low = fraction("STRATA_WATERMARK_LOW")?;
        s.watermark_high = fraction("STRATA_WATERMARK_HIGH")?;
        if let Some((key, v)) = parsed("STRATA_POLICY") {
            s.policy = Some(v.parse().map_err(|e: Error| e.context(key))?);
        }
        Ok(s)
    }

    /// These settings where set, else those of `base` (the environment
    /// over a file: `env.or(file)`).
    pub fn or(self, base: Settings) -> Settings {
        Settings {
            page_size: self.page_size.or(base.page_size),
            device: self.device.or(base.device),
            device_capacity: self.device_capacity.or(base.device_capacity),
            host_capacity: self.host_capacity.or(base.host_capacity),
            huge_pages: self.huge_pages.or(base.huge_pages),
            numa_node: self.numa_node.or(base.numa_node),
            cxl_mode: self.cxl_mode.or(base.cxl_mode),
            cxl_capacity: self.cxl_capacity.or(base.cxl_capacity),
            cxl_bandwidth: self.cxl_bandwidth.or(base.cxl_bandwidth),
            cxl_latency_ns: self.cxl_latency_ns.or(base.cxl_latency_ns),
            nvme_path: self.nvme_path.or(base.nvme_path),
            nvme_capacity: self.nvme_capacity.or(base.nvme_capacity),
            nvme_engine: self.nvme_engine.or(base.nvme_engine),
            nvme_queue_depth: self.nvme_queue_depth.or(base.nvme_queue_depth),
            watermark_low: self.watermark_low.or(base.watermark_low),
            watermark_high: self.watermark_high.or(base.watermark_high),
            policy: self.policy.or(base.policy),
            background_eviction: self.background_eviction.or(base.background_eviction),
            sampling: self.sampling.or(base.sampling),
        }
    }
}

/// The resolved configuration of a runtime: every setting of [`Settings`]
/// with its default applied, checked. [`Config::builder`] builds the
/// runtime; [`Config::to_json`] shows it.
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
    pub watermarks: Watermarks,
    /// The balancer's placement policy.
    pub policy: PolicyKind,
    /// Whether background eviction runs.
    pub background_eviction: bool,
    /// Access counting: 1 in 2^k accesses, `None` for none.
    pub sampling: Option<u32>,
}

/// A config file's text: a regular file (a device or a pipe could be
/// endless) of UTF-8 TOML.
fn read_config(path: &Path) -> Result<String> {
    let shown = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io(format!("reading config {shown}"), e))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!(
            "config {shown} is not a regular file"
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(format!("reading config {shown}"), e))?;
    String::from_utf8(bytes)
        .map_err(|_| Error::invalid(format!("config {shown} is not UTF-8 text")))
}

impl Config {
    /// Defaults for this machine, then `file` (or `$STRATA_CONFIG`), then
    /// the environment.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let env_file = std::env::var_os("STRATA_CONFIG").map(PathBuf::from);
        if file.is_none() && env_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(Error::invalid(
                "STRATA_CONFIG is set but empty: name a config file, or unset it",
            ));
        }
        let text = match file.map(Path::to_path_buf).or(env_file) {
            Some(path) => Some(read_config(&path)?),
            None => None,
        };
        Self::resolve(
            text.as_deref(),
            &|k| std::env::var(k).ok(),
            &Topology::detect(),
        )
    }

    /// Resolves a config from TOML text, an environment lookup (which
    /// overrides the text) and a topology (pure, for tests).
    pub fn resolve(
        toml_text: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
        topology: &Topology,
    ) -> Result<Self> {
        let file = match toml_text {
            Some(t) => Settings::from_toml(t)?,
            None => Settings::default(),
        };
        let env = Settings::from_env(env)?;
        Self::from_settings(&env.or(file), topology)
    }

    /// The defaults with `settings` over them, checked: the one place where
    /// defaults are applied. `topology` tells whether `auto` finds CXL
    /// memory (and how much).
    pub fn from_settings(settings: &Settings, topology: &Topology) -> Result<Self> {
        let s = settings;
        let page_size = s.page_size.unwrap_or(DEFAULT_PAGE_SIZE as u64);
        let page_size = usize::try_from(page_size)
            .map_err(|_| Error::invalid(format!("page size {page_size} is too large")))?;
        check_page_size(page_size)?;

        let host_capacity = s
            .host_capacity
            .unwrap_or_else(|| default_host_capacity(page_size));
        let host = HostConfig {
            capacity: host_capacity,
            page_size,
            huge_pages: s.huge_pages.unwrap_or(DEFAULT_HUGE_PAGES),
            numa_node: s.numa_node,
        };

        let cxl_mode = s.cxl_mode.unwrap_or_default();
        // The default capacity is the CXL node's size where the machine has
        // one, also for an emulated tier (as a stand-in of that size).
        let node_bytes = match CxlMode::Auto.backing(topology) {
            CxlBacking::Node { memory_bytes, .. } => Some(memory_bytes),
            _ => None,
        };
        let cxl = match cxl_mode.backing(topology) {
            CxlBacking::Absent => None,
            // As for the device and NVMe tiers, capacity 0 turns it off.
            _ if s.cxl_capacity == Some(0) => None,
            _ => Some(CxlConfig {
                mode: cxl_mode,
                capacity: s.cxl_capacity.or(node_bytes).unwrap_or(host_capacity / 2),
                page_size,
                bandwidth: s.cxl_bandwidth.map(|b| b as f64),
                latency_ns: s
                    .cxl_latency_ns
                    .unwrap_or(crate::tier::cxl::CXL_DEFAULT_LATENCY_NS),
            }),
        };

        let nvme = match s.nvme_capacity {
            Some(0) => None,
            capacity => {
                let path = s.nvme_path.clone().unwrap_or_else(std::env::temp_dir);
                if path.as_os_str().is_empty() {
                    return Err(Error::invalid(
                        "nvme path is empty (name a directory, a new file or a block device)",
                    ));
                }
                let queue_depth = match s.nvme_queue_depth {
                    None => DEFAULT_NVME_QUEUE_DEPTH,
                    Some(0) => return Err(Error::invalid("nvme queue depth 0: at least 1")),
                    Some(d) => usize::try_from(d).map_err(|_| {
                        Error::invalid(format!("nvme queue depth {d} is too large"))
                    })?,
                };
                let capacity = match capacity {
                    Some(c) => c,
                    None => default_nvme_capacity(&path, page_size)?,
                };
                Some(NvmeConfig {
                    engine: s.nvme_engine.unwrap_or_default(),
                    queue_depth,
                    ..NvmeConfig::new(path, capacity, page_size)
                })
            }
        };

        let defaults = Watermarks::default();
        let watermarks = Watermarks::new(
            s.watermark_low.unwrap_or(defaults.low),
            s.watermark_high.unwrap_or(defaults.high),
        );
        watermarks.check()?;
        let sampling = s.sampling.unwrap_or(DEFAULT_SAMPLING);
        if let Some(k) = sampling.filter(|&k| k > MAX_SAMPLING_SHIFT) {
            return Err(Error::invalid(format!(
                "sampling 1 in 2^{k} accesses: at most 2^{MAX_SAMPLING_SHIFT}"
            )));
        }
        let config = Self {
            page_size,
            device: s.device.unwrap_or_default(),
            device_capacity: s.device_capacity,
            host,
            cxl,
            nvme,
            watermarks,
            policy: s.policy.unwrap_or(PolicyKind::Default),
            background_eviction: s.background_eviction.unwrap_or(DEFAULT_BACKGROUND_EVICTION),
            sampling,
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
            // Each tier counts its pages in 32 bits.
            if capacity / page > u64::from(u32::MAX) {
                return Err(Error::invalid(format!(
                    "{tier} capacity {capacity} has too many pages"
                )));
            }
        }
        // A device capacity of 0 turns the tier off; any other holds a
        // page, and the simulated device counts its pages in 32 bits (a
        // GPU's capacity is capped by its free memory when it opens).
        if let Some(capacity) = self.device_capacity.filter(|&c| c > 0) {
            if capacity < page {
                return Err(Error::invalid(format!(
                    "device capacity {capacity} holds no whole page of {page} bytes"
                )));
            }
            if self.device == DeviceChoice::Sim && capacity / page > u64::from(u32::MAX) {
                return Err(Error::invalid(format!(
                    "device capacity {capacity} has too many pages"
                )));
            }
        }
        if self.policy.needs_trace() {
            return Err(Error::invalid(format!(
                "policy {}: it needs the whole trace in advance, and the balancer runs online",
                self.policy.name()
            )));
        }
        if let Some(nvme) = &self.nvme {
            if nvme.capacity % page != 0 {
                return Err(Error::invalid(format!(
                    "nvme capacity {} is not a multiple of the page size {page}",
                    nvme.capacity
                )));
            }
            if nvme.capacity / page < 2 {
                return Err(Error::invalid(format!(
                    "nvme capacity {} holds {} page of {page} bytes; the tier needs at least 2 (one is held back for copy-then-commit writes)",
                    nvme.capacity,
                    nvme.capacity / page
                )));
            }
            if !(1..=4096).contains(&nvme.queue_depth) {
                return Err(Error::invalid(format!(
                    "queue depth {} is outside 1..=4096",
                    nvme.queue_depth
                )));
            }
        }
        // An emulated CXL tier's link, as the tier checks it (the measured
        // bandwidth it takes where none is given is always usable).
        if let Some(cxl) = self.cxl.as_ref().filter(|c| c.mode == CxlMode::Emulated) {
            let model = crate::link::LinkModel {
                bandwidth: cxl.bandwidth.unwrap_or(f64::MAX),
                latency_ns: cxl.latency_ns,
            };
            model.check().map_err(|e| e.context("emulated cxl"))?;
        }
        Ok(())
    }

    /// A [`RuntimeBuilder`] for this configuration, every setting included
    /// (background eviction and sampling as well as the tiers). Without a
    /// configured device capacity the simulated device is
    /// [`DEFAULT_SIM_DEVICE_CAPACITY`] and a GPU's own limit (its free
    /// memory less a reserve) applies; `auto` is a GPU where one is present.
    pub fn builder(&self) -> RuntimeBuilder {
        let device_capacity = self.device_capacity.unwrap_or(match self.device {
            DeviceChoice::Sim => DEFAULT_SIM_DEVICE_CAPACITY,
            DeviceChoice::Cuda => u64::MAX,
            DeviceChoice::Auto => match crate::device::probe_gpus() {
                Ok(_) => u64::MAX,
                Err(_) => DEFAULT_SIM_DEVICE_CAPACITY,
            },
        });
        let mut b = RuntimeBuilder::default()
            .page_size(self.page_size)
            .device(self.device, device_capacity)
            .host_config(self.host.clone())
            .watermarks(self.watermarks)
            .policy(self.policy)
            .background_eviction(self.background_eviction)
            .sampling(self.sampling);
        if let Some(cxl) = &self.cxl {
            b = b.cxl(cxl.clone());
        }
        if let Some(nvme) = &self.nvme {
            b = b.nvme(nvme.clone());
        }
        b
    }

    /// Opens the tiers of this configuration.
    pub fn build(&self) -> Result<crate::runtime::Runtime> {
        self.builder().build()
    }

    /// The configuration as a JSON object: `page_size`, `device`,
    /// `device_capacity` (null: the default), `host` (`capacity`,
    /// `page_size`, `huge_pages`, `numa_node`), `cxl` and `nvme` (null
    /// without the tier), `watermarks` (`low`, `high`), `policy`,
    /// `background_eviction`, `sampling` (the shift, null for none).
    /// An NVMe path that is not UTF-8 is shown lossily.
    pub fn to_json(&self) -> String {
        let mut shown = self.clone();
        if let Some(nvme) = &mut shown.nvme {
            nvme.path = PathBuf::from(nvme.path.to_string_lossy().into_owned());
        }
        // Every path is UTF-8 now, and no map has keys that are not strings.
        serde_json::to_string(&shown).expect("a config serializes")
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

/// 16 GiB, or half the free space of the filesystem holding `path` (the
/// device's size where `path` is a block device), whichever is less; an
/// error naming the setting where that holds fewer than the tier's two
/// pages.
fn default_nvme_capacity(path: &Path, page_size: usize) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::FileTypeExt;
    let block = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    let room = if block {
        std::fs::File::open(path)
            .and_then(|mut f| f.seek(SeekFrom::End(0)))
            .ok()
    } else {
        crate::sys::fs_free_bytes(path).map(|free| free / 2)
    };
    let capacity = round_down((16u64 << 30).min(room.unwrap_or(u64::MAX)), page_size);
    if capacity < 2 * page_size as u64 {
        return Err(Error::invalid(format!(
            "nvme path {}: {} leaves the NVMe tier's default capacity under two pages of {} \
             bytes; set [nvme] capacity (STRATA_NVME_CAPACITY), or 0 for no NVMe tier",
            path.display(),
            if block {
                "the device's size"
            } else {
                "half the free space"
            },
            page_size
        )));
    }
    Ok(capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn an_nvme_default_that_holds_no_two_pages_says_which_setting_to_set() {
        // /proc has no free space: half of none is no tier.
        let toml = "[nvme]\npath = \"/proc\"\n";
        let e = Config::resolve(Some(toml), &no_env, &Topology::default()).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("/proc") && m.contains("set [nvme] capacity"),
            "{m}"
        );
        // Set, it is taken as given (and checked as every capacity).
        let toml = "[nvme]\npath = \"/proc\"\ncapacity = 0\n";
        let c = Config::resolve(Some(toml), &no_env, &Topology::default()).unwrap();
        assert!(c.nvme.is_none());
    }

    #[test]
    fn policy_names_are_read_in_any_case() {
        let env = |k: &str| (k == "STRATA_POLICY").then(|| " ARC ".to_string());
        let c = Config::resolve(None, &env, &Topology::default()).unwrap();
        assert_eq!(c.policy, crate::PolicyKind::Arc);
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
