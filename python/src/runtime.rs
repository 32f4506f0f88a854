//! `strata.Runtime`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyType;
use strata::config::DEFAULT_SIM_DEVICE_CAPACITY;
use strata::sys::Topology;
use strata::{
    Config, CxlConfig, CxlMode, DeviceChoice, EngineChoice, NvmeConfig, Placement, PolicyKind,
    RuntimeBuilder, Watermarks,
};

use crate::buffer::Buffer;
use crate::convert::{offset, tier};
use crate::errors::{invalid, raise};

/// The tiers and everything allocated in them.
///
/// Build one from keyword arguments (below) or from the TOML of the
/// `strata` command's config file with `Runtime.from_toml(text)`.
/// Capacities are in bytes.
///
/// device: "auto" (a GPU where present, else the simulated one), "sim",
///     "cuda" (a GPU, else NoDeviceError), or None for no device tier.
/// device_capacity: the device tier's size (the simulated GPU's, or a cap
///     on a real one); None for the default (sim: 1 GiB; cuda: the GPU's
///     free memory less a reserve); 0 for no device tier.
/// host_capacity: the host DRAM tier (always present).
/// page_size: the page of every tier: a power of two, 4 KiB ... 2 MiB.
/// cxl_capacity: a CXL tier of this size (0: none); cxl_mode "emulated"
///     (DRAM behind a bandwidth cap) or "auto" (a CPU-less NUMA node).
/// nvme_path: a directory (a private swap file is made in it), a new file
///     name or a block device for an NVMe tier of nvme_capacity bytes; None
///     for no NVMe tier. nvme_engine: "auto", "uring" or "psync".
/// watermarks: (low, high) fractions for background eviction.
/// policy: the balancer's placement policy ("default", "lru", ...).
#[pyclass(module = "strata", frozen)]
pub(crate) struct Runtime {
    pub(crate) rt: strata::Runtime,
}

fn device_choice(name: &str) -> PyResult<DeviceChoice> {
    name.parse().map_err(raise)
}

#[pymethods]
impl Runtime {
    #[new]
    #[pyo3(signature = (
        *,
        device = Some("auto".to_owned()),
        device_capacity = None,
        host_capacity = 256 << 20,
        page_size = strata::config::DEFAULT_PAGE_SIZE as i64,
        cxl_capacity = 0,
        cxl_mode = "emulated".to_owned(),
        nvme_path = None,
        nvme_capacity = 256 << 20,
        nvme_engine = "auto".to_owned(),
        nvme_queue_depth = 32,
        background_eviction = true,
        watermarks = None,
        policy = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: Option<String>,
        device_capacity: Option<i64>,
        host_capacity: i64,
        page_size: i64,
        cxl_capacity: i64,
        cxl_mode: String,
        nvme_path: Option<PathBuf>,
        nvme_capacity: i64,
        nvme_engine: String,
        nvme_queue_depth: i64,
        background_eviction: bool,
        watermarks: Option<(f64, f64)>,
        policy: Option<String>,
    ) -> PyResult<Self> {
        let page = usize::try_from(offset(page_size, "page_size")?)
            .map_err(|_| invalid(format!("page_size {page_size} is too large")))?;
        let mut b = RuntimeBuilder::default()
            .page_size(page)
            .host(offset(host_capacity, "host_capacity")?)
            .background_eviction(background_eviction);
        if let Some(name) = device {
            let choice = device_choice(&name)?;
            let capacity = match device_capacity {
                Some(c) => offset(c, "device_capacity")?,
                // The defaults of the config file's `device_capacity`.
                None => match choice {
                    DeviceChoice::Sim => DEFAULT_SIM_DEVICE_CAPACITY,
                    DeviceChoice::Cuda => u64::MAX,
                    _ => match strata::device::probe_gpus() {
                        Ok(_) => u64::MAX,
                        Err(_) => DEFAULT_SIM_DEVICE_CAPACITY,
                    },
                },
            };
            b = b.device(choice, capacity);
        }
        let cxl_capacity = offset(cxl_capacity, "cxl_capacity")?;
        if cxl_capacity > 0 {
            let mode = match cxl_mode.to_ascii_lowercase().as_str() {
                "emulated" => CxlMode::Emulated,
                "auto" => CxlMode::Auto,
                _ => {
                    return Err(invalid(format!(
                        "unknown cxl_mode {cxl_mode:?} (use emulated or auto)"
                    )))
                }
            };
            b = b.cxl(CxlConfig::new(mode, cxl_capacity, page));
        }
        if let Some(path) = nvme_path {
            if path.as_os_str().is_empty() {
                return Err(invalid("nvme_path is empty (None means no NVMe tier)"));
            }
            let mut nvme = NvmeConfig::new(path, offset(nvme_capacity, "nvme_capacity")?, page);
            nvme.engine = nvme_engine.parse::<EngineChoice>().map_err(raise)?;
            nvme.queue_depth = match offset(nvme_queue_depth, "nvme_queue_depth")? {
                0 => return Err(invalid("nvme_queue_depth is 0")),
                d => usize::try_from(d).map_err(|_| invalid("nvme_queue_depth is too large"))?,
            };
            b = b.nvme(nvme);
        }
        if let Some((low, high)) = watermarks {
            b = b.watermarks(Watermarks::new(low, high));
        }
        if let Some(p) = policy {
            b = b.policy(p.parse::<PolicyKind>().map_err(raise)?);
        }
        // Opening tiers can take a while (an NVMe file, CXL bandwidth).
        let rt = py.detach(|| b.build()).map_err(raise)?;
        Ok(Self { rt })
    }

    /// A runtime from TOML text in the format of the `strata` command's
    /// config file (`page_size`, `device`, `device_capacity`, `[host]`,
    /// `[cxl]`, `[nvme]`, watermarks, `policy`; see the README). Every
    /// value left out takes its default, the NVMe tier included (a private
    /// file in the temporary directory). With use_env=True, `STRATA_*`
    /// environment variables override the text, as for the command.
    #[classmethod]
    #[pyo3(signature = (text, *, use_env = false))]
    fn from_toml(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        text: &str,
        use_env: bool,
    ) -> PyResult<Self> {
        let text = text.to_owned();
        let rt = py
            .detach(move || {
                let config = if use_env {
                    Config::resolve(Some(&text), &|k| std::env::var(k).ok(), &Topology::detect())?
                } else {
                    Config::resolve(Some(&text), &|_| None, &Topology::detect())?
                };
                RuntimeBuilder::from_config(&config).build()
            })
            .map_err(raise)?;
        Ok(Self { rt })
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
    /// "emulated"), "reserved_pages", "moves", "failed_moves",
    /// "first_writes", "abandoned_moves", "faults", "reclaimed_pages",
    /// "in_flight_moves", "promotions", "promotions_on_read", "demotions",
    /// "bypasses", "lost_count_readbacks", "lost_pages", "background_errors",
    /// "device_links", "links", "engine" (the migration engine's batches
    /// and mean queueing time per priority).
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
    /// background threads.
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
