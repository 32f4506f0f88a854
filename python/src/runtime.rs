//! `strata.Runtime`: its keywords are a partial configuration
//! (`strata::config::Settings`) that `Config` merges over the defaults and
//! checks, as for TOML and C.

use std::path::PathBuf;

use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyType};
use strata::config::{parse_cxl_mode, Config, Settings};
use strata::sys::Topology;
use strata::{CxlMode, Placement};

use crate::buffer::Buffer;
use crate::convert::{offset, tier};
use crate::errors::{invalid, raise};

/// The tiers and everything allocated in them.
///
/// Build one from keyword arguments (below) or from the TOML of the
/// `strata` command's config file with `Runtime.from_toml(text)`. A keyword
/// left out, or None, keeps the configuration's default, the same as TOML's
/// and C's (`Runtime.config()` shows the result); only `device=None` means
/// something else: no device tier. Capacities are in bytes.
///
/// device: "auto" (the default: a GPU where present, else the simulated
///     one), "sim", "cuda" (a GPU, else NoDeviceError), or None for no
///     device tier.
/// device_capacity: the device tier's size (the simulated GPU's, or a cap
///     on a real one); default (or None): sim 1 GiB, cuda the GPU's free
///     memory less a reserve; 0 for no device tier.
/// host_capacity: the host DRAM tier, always present (default: a quarter
///     of physical memory).
/// huge_pages: transparent huge pages for the host tier (default True).
/// numa_node: bind the host tier to this NUMA node (default None: no
///     binding).
/// page_size: the page of every tier: a power of two, 4 KiB ... 2 MiB
///     (default 64 KiB).
/// cxl_mode: "auto" (a CPU-less NUMA node slower than DRAM, if the
///     machine has one),
///     "emulated" (DRAM behind a bandwidth cap) or "off" (the default: no
///     CXL tier). cxl_capacity: its size (default: the node's memory, else
///     half the host tier; 0: none). cxl_bandwidth (bytes/s, default half
///     of local memcpy) and cxl_latency_ns (default 100): emulation.
/// nvme_path: a directory (a private swap file is made in it), a new file
///     name or a block device for an NVMe tier; None (the default) for
///     none. nvme_capacity: its size (default: 16 GiB or half the free
///     space, whichever is less; 0: none). nvme_engine: "auto" (default),
///     "uring" or "psync". nvme_queue_depth: operations in flight per queue
///     (default 32).
/// background_eviction: keep tiers between the watermarks (default True).
/// watermarks: (low, high) fractions for background eviction (default
///     (0.85, 0.95)).
/// policy: the balancer's placement policy ("default", "lru", ...).
/// sampling: count 1 in 2**k accesses (k 0 ... 16; default 0: every
///     access), or "off".
#[pyclass(module = "strata", frozen)]
pub(crate) struct Runtime {
    pub(crate) rt: strata::Runtime,
    config: Config,
}

/// The keywords `Runtime` takes, in the order of its documentation.
const KEYWORDS: [&str; 18] = [
    "device",
    "device_capacity",
    "host_capacity",
    "huge_pages",
    "numa_node",
    "page_size",
    "cxl_mode",
    "cxl_capacity",
    "cxl_bandwidth",
    "cxl_latency_ns",
    "nvme_path",
    "nvme_capacity",
    "nvme_engine",
    "nvme_queue_depth",
    "background_eviction",
    "watermarks",
    "policy",
    "sampling",
];

/// A non-negative int keyword.
fn bytes(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    // True is an int to Python; as a size or a count it is a mistake.
    if v.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} takes an int, not a bool"
        )));
    }
    offset(v.extract::<i64>()?, name)
}

/// A conversion's TypeError or OverflowError (which name only the types)
/// with the keyword at fault in front; strata's own errors name it already.
fn naming(py: Python<'_>, key: &str, e: PyErr) -> PyErr {
    if e.value(py).to_string().starts_with(key) {
        e
    } else if e.is_instance_of::<PyTypeError>(py) {
        PyTypeError::new_err(format!("{key}: {}", e.value(py)))
    } else if e.is_instance_of::<PyOverflowError>(py) {
        PyOverflowError::new_err(format!("{key}: {}", e.value(py)))
    } else {
        e
    }
}

/// The partial configuration of `Runtime`'s keywords: what is left out (or
/// None) stays unset. A program gets a CXL tier only with a cxl_mode and an
/// NVMe tier only with an nvme_path; `device=None` means no device tier.
fn settings(kw: Option<&Bound<'_, PyDict>>) -> PyResult<Settings> {
    let mut s = Settings::default();
    s.cxl_mode = Some(CxlMode::Off);
    let Some(kw) = kw else {
        s.nvme_capacity = Some(0);
        return Ok(s);
    };
    for (key, v) in kw.iter() {
        let key: String = key.extract()?;
        // None leaves a setting to its default (`device=None`: see below).
        if v.is_none() && KEYWORDS.contains(&key.as_str()) {
            continue;
        }
        if !KEYWORDS.contains(&key.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "Runtime() got an unexpected keyword argument '{key}' (takes {})",
                KEYWORDS.join(", ")
            )));
        }
        let mut set = || -> PyResult<()> {
            match key.as_str() {
                "device" => s.device = Some(v.extract::<String>()?.parse().map_err(raise)?),
                "device_capacity" => s.device_capacity = Some(bytes(&v, "device_capacity")?),
                "host_capacity" => s.host_capacity = Some(bytes(&v, "host_capacity")?),
                "huge_pages" => s.huge_pages = Some(v.extract()?),
                "numa_node" => {
                    let n = bytes(&v, "numa_node")?;
                    s.numa_node = Some(
                        u32::try_from(n)
                            .map_err(|_| invalid(format!("numa_node {n} is too large")))?,
                    );
                }
                "page_size" => s.page_size = Some(bytes(&v, "page_size")?),
                "cxl_mode" => {
                    s.cxl_mode = Some(parse_cxl_mode(&v.extract::<String>()?).map_err(raise)?)
                }
                "cxl_capacity" => s.cxl_capacity = Some(bytes(&v, "cxl_capacity")?),
                "cxl_bandwidth" => s.cxl_bandwidth = Some(bytes(&v, "cxl_bandwidth")?),
                "cxl_latency_ns" => s.cxl_latency_ns = Some(bytes(&v, "cxl_latency_ns")?),
                "nvme_path" => s.nvme_path = Some(v.extract::<PathBuf>()?),
                "nvme_capacity" => s.nvme_capacity = Some(bytes(&v, "nvme_capacity")?),
                "nvme_engine" => {
                    s.nvme_engine = Some(v.extract::<String>()?.parse().map_err(raise)?)
                }
                "nvme_queue_depth" => s.nvme_queue_depth = Some(bytes(&v, "nvme_queue_depth")?),
                "background_eviction" => s.background_eviction = Some(v.extract()?),
                "watermarks" => {
                    // Any sequence of two numbers (a tuple or a list); a value
                    // of another type is a TypeError, as for the other keys.
                    let said = || v.repr().map_or_else(|_| "that".into(), |r| r.to_string());
                    let pair = v.extract::<Vec<f64>>().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "watermarks takes (low, high), two fractions, not {}",
                            said()
                        ))
                    })?;
                    if pair.len() != 2 {
                        return Err(invalid(format!(
                            "watermarks takes (low, high), two fractions, not {}",
                            said()
                        )));
                    }
                    s.watermark_low = Some(pair[0]);
                    s.watermark_high = Some(pair[1]);
                }
                "policy" => s.policy = Some(v.extract::<String>()?.parse().map_err(raise)?),
                "sampling" => {
                    s.sampling = Some(match v.extract::<String>() {
                        Ok(text) => strata::config::parse_sampling(&text).map_err(raise)?,
                        Err(_) => {
                            let k = bytes(&v, "sampling")?;
                            Some(u32::try_from(k).map_err(|_| {
                                invalid(format!("sampling 1 in 2^{k} accesses: at most 2^16"))
                            })?)
                        }
                    })
                }
                _ => unreachable!("every keyword of KEYWORDS has its arm"),
            }
            Ok(())
        };
        set().map_err(|e| naming(kw.py(), &key, e))?;
    }
    // `device=None`: no device tier, whatever the capacity says.
    if kw.get_item("device")?.is_some_and(|d| d.is_none()) {
        s.device_capacity = Some(0);
    }
    // An NVMe tier needs its path; a capacity alone leaves it off, as in C.
    if s.nvme_path.is_none() {
        s.nvme_capacity = Some(0);
    }
    Ok(s)
}

/// The resolved configuration of `settings`, checked (every default
/// applied).
fn resolve(settings: &Settings) -> PyResult<Config> {
    Config::from_settings(settings, &Topology::detect()).map_err(raise)
}

fn config_dict<'py>(py: Python<'py>, config: &Config) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?
        .call_method1("loads", (config.to_json(),))
}

/// The configuration that `Runtime(**settings)` would build, as a dict (see
/// `Runtime.config()`), without opening any tier. A bad value raises what
/// `Runtime(**settings)` would.
#[pyfunction]
#[pyo3(signature = (**settings))]
pub(crate) fn resolve_config<'py>(
    py: Python<'py>,
    settings: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let config = resolve(&self::settings(settings)?)?;
    config_dict(py, &config)
}

#[pymethods]
impl Runtime {
    #[new]
    #[pyo3(signature = (**settings))]
    fn new(py: Python<'_>, settings: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let config = resolve(&self::settings(settings)?)?;
        // Opening tiers can take a while (an NVMe file, CXL bandwidth).
        let rt = py.detach(|| config.build()).map_err(raise)?;
        Ok(Self { rt, config })
    }

    /// A runtime from TOML text in the format of the `strata` command's
    /// config file (`page_size`, `device`, `device_capacity`, watermarks,
    /// `policy`, `background_eviction`, `sampling`, `[host]`, `[cxl]`,
    /// `[nvme]`; see the README). Every value left out takes its default,
    /// the NVMe tier included (a private file in the temporary directory).
    /// With use_env=True, `STRATA_*` environment variables override the
    /// text, as for the command.
    #[classmethod]
    #[pyo3(signature = (text, *, use_env = false))]
    fn from_toml(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        text: &str,
        use_env: bool,
    ) -> PyResult<Self> {
        let text = text.to_owned();
        let (rt, config) = py
            .detach(move || {
                let config = if use_env {
                    Config::resolve(Some(&text), &|k| std::env::var(k).ok(), &Topology::detect())?
                } else {
                    Config::resolve(Some(&text), &|_| None, &Topology::detect())?
                };
                Ok::<_, strata::Error>((config.build()?, config))
            })
            .map_err(raise)?;
        Ok(Self { rt, config })
    }

    /// The resolved configuration this runtime was built from, as a dict:
    /// "page_size", "device", "device_capacity" (None: the default),
    /// "host" ("capacity", "page_size", "huge_pages", "numa_node"), "cxl"
    /// and "nvme" (None without the tier), "watermarks" ("low", "high"),
    /// "policy", "background_eviction", "sampling" (the shift; None:
    /// none). The same settings through keywords, TOML or C give the same
    /// dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        config_dict(py, &self.config)
    }

    /// Allocates nbytes (rounded up to whole pages; pages take room in a
    /// tier when first written). prefer: a tier name whose room the pages
    /// take first ("device", "host", "cxl", "nvme"); None for the fastest
    /// tier with room. Raises OutOfCapacityError when the tiers together
    /// cannot promise that much.
    #[pyo3(signature = (nbytes, *, prefer = None))]
    fn alloc(&self, nbytes: i64, prefer: Option<&str>) -> PyResult<Buffer> {
        let placement = match prefer {
            Some(t) => Placement::Prefer(tier(t)?),
            None => Placement::Fastest,
        };
        let buf = self
            .rt
            .alloc_with(offset(nbytes, "nbytes")?, placement)
            .map_err(raise)?;
        Ok(Buffer::new(self.rt.clone(), buf))
    }

    /// Current use and traffic as a dict: "backend", "page_size", "tiers"
    /// (per tier: "tier", "used_pages", "free_pages", "pinned_pages",
    /// "clean_copies", "emulated"), "reserved_pages", "moves",
    /// "failed_moves", "first_writes", "abandoned_moves", "faults",
    /// "reclaimed_pages", "in_flight_moves", "clean_kept",
    /// "clean_demotions", "clean_dropped", "clean_invalidated", "promotions",
    /// "promotions_paid", "promotions_unpaid", "promotions_held_back", "promotions_on_read", "demotions",
    /// "bypasses", "lost_count_readbacks", "lost_pages", "background_errors",
    /// "device_links", "links", "engine" (per priority, the migration
    /// engine's batches, mean queueing time, and its lanes' wall and CPU
    /// seconds running them).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = self.rt.stats_json();
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Raises the first failure of background work (background eviction,
    /// the balancer) since the last check, and clears it; returns None if
    /// there was none.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.rt.check()).map_err(crate::errors::raise)
    }

    /// Stops the background work of this runtime (every handle of it),
    /// waits for the moves in flight, and raises the first background
    /// failure not yet raised by check(). Buffers go on working, without
    /// background threads (start_balancer() starts the balancer again;
    /// background eviction stays off).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.rt.clone().shutdown())
            .map_err(crate::errors::raise)
    }

    /// stats() as a JSON string.
    fn stats_json(&self) -> String {
        self.rt.stats_json()
    }

    /// The page size in bytes.
    #[getter]
    fn page_size(&self) -> usize {
        self.rt.page_size()
    }

    /// The configured tiers, fastest first (e.g. ["device", "host"]).
    #[getter]
    fn tiers(&self) -> Vec<&'static str> {
        self.rt.tiers().into_iter().map(|t| t.name()).collect()
    }

    /// The device tier's backend ("simulated" or "cuda"), None without one.
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.rt.device_backend().map(|b| b.label())
    }

    fn __repr__(&self) -> String {
        let tiers: Vec<String> = self.tiers().iter().map(|t| format!("'{t}'")).collect();
        let backend = self
            .backend()
            .map_or("None".to_owned(), |b| format!("'{b}'"));
        format!(
            "strata.Runtime(tiers=[{}], page_size={}, backend={backend})",
            tiers.join(", "),
            self.rt.page_size(),
        )
    }
}
