//! `strata._strata.ExpertCache` and `ExpertSlot`: the MoE expert cache of
//! `strata::offload::moe` (experts in the host tier or on NVMe, a fixed
//! number of device slots, prefetch), under `strata.moe.offload`. Plus
//! `parse_moe_trace`, the parser of the routing traces that
//! `strata bench moe --routing file:PATH` replays.
//!
//! A fetched expert is an `ExpertSlot`: the expert pinned where it is read
//! (device memory, or host memory for one read in place) until the slot is
//! released. Its bytes reach torch without a copy
//! through `ExpertSlot.pin(range, dtype)`, a `strata.Pin` over a range of
//! the slot (DLPack), so the pinning and export code is `Pin`'s.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use strata::offload::moe::{self as cache, Eviction, MoeConfig, OwnedExpertPin, TokenRoute};
use strata::{DeviceChoice, NvmeConfig, Tier};

use crate::buffer::Buffer;
use crate::convert::{byte_range, offset};
use crate::dlpack::{self, Pin};
use crate::errors::{invalid, raise};
use crate::pybuf::Contiguous;

fn u32_of(value: i64, what: &str) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| invalid(format!("{what} {value} is not in 0 ... 2^32-1")))
}

/// An MoE expert cache: experts registered into the host tier (cascading to
/// NVMe when host_bytes is full), `device_slots` of them in device memory
/// at once.
///
/// device: "sim" (the simulated device: slots are host memory, stall time
///     is modelled on a PCIe link, see advance()), "cuda" or "auto".
/// device_slots / device_bytes: the slot budget, as a count or as bytes
///     (device_bytes // slot_bytes slots); give exactly one.
/// slot_bytes: the bytes of the largest expert.
/// host_bytes: host memory for the experts.
/// nvme_path, nvme_capacity: an NVMe tier for experts beyond host_bytes (a
///     directory, a new file name or a block device; capacity a whole
///     number of pages).
/// page_size: the runtime's page (a power of two, 4 KiB ... 2 MiB).
/// eviction: "lrfu" (with decay in (0, 1], per fetch), "reuse" (the
///     expert whose next use is expected farthest away, from the share of
///     its layer's visits that used it; decay per visit, in (0, 1]), "lru"
///     or "no-cache".
/// per_layer, layers: slots split evenly between layers, victims from the
///     same layer only (the mixtral-offloading design).
/// protect_fetches: a prefetched expert not yet used is protected from
///     eviction for this many fetches.
/// nvme_miss_cost: with "reuse", a miss of an expert registered on NVMe
///     weighs this many misses of one in host memory when a victim is
///     chosen (about the device link's bandwidth over the disk's; 1 weighs
///     them alike).
/// host_cache: once the host tier cannot hold every expert, it caches
///     them: the experts registered in it get an NVMe copy too (written
///     once), an expert moved into device memory leaves host memory, and an
///     evicted one is copied there, in place of the one least worth keeping
///     (False, the default: the host tier keeps the experts registered
///     first).
/// host_in_place: an expert in host memory and not in a slot is fetched
///     where it is (ExpertSlot.tier "host"): no slot taken, nothing moved
///     (stats()["served_in_place"]). Only on the simulated device, whose
///     slots are host memory too; UnsupportedError on a GPU.
/// link_priority: on the simulated link, demand transfers go ahead of
///     queued prefetches (False: one FIFO of whole transfers).
/// runtime: a strata.Runtime shared with your own buffers: the experts then
///     live in its host tier (cascading to its NVMe) under its budgets, and
///     device_slots is the cache's share of its device tier; device,
///     host_bytes, nvme_path, nvme_capacity and page_size are the runtime's
///     own (leave them unset). An expert the runtime moved away between
///     fetches is found gone and moved again (stats()["displaced"]).
///
/// Experts are registered before use; fetch, prefetch and the rest are
/// thread-safe and release the GIL.
#[pyclass(module = "strata", frozen)]
pub(crate) struct ExpertCache {
    /// Shared with the slots fetched from it; registering needs it alone.
    cache: RwLock<Arc<cache::ExpertCache>>,
    slot_bytes: u64,
    device_slots: usize,
}

impl ExpertCache {
    /// `start(cache, layer, experts)` (a prefetch or reads ahead) without
    /// the GIL, on checked ids.
    fn start(
        &self,
        py: Python<'_>,
        layer: i64,
        experts: Vec<i64>,
        start: fn(&cache::ExpertCache, u32, &[u32]) -> strata::Result<usize>,
    ) -> PyResult<usize> {
        let l = u32_of(layer, "layer")?;
        let es = experts
            .into_iter()
            .map(|e| u32_of(e, "expert"))
            .collect::<PyResult<Vec<_>>>()?;
        let c = self.cache.read().clone();
        py.detach(|| start(&c, l, &es)).map_err(raise)
    }
}

#[pymethods]
impl ExpertCache {
    #[new]
    #[pyo3(signature = (
        *,
        slot_bytes,
        host_bytes = None,
        device_slots = None,
        device_bytes = None,
        device = "sim".to_owned(),
        nvme_path = None,
        nvme_capacity = None,
        page_size = 64 << 10,
        eviction = "lrfu".to_owned(),
        decay = 0.999,
        per_layer = false,
        layers = 1,
        protect_fetches = 16,
        nvme_miss_cost = 4.0,
        host_cache = false,
        host_in_place = false,
        link_priority = true,
        runtime = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        slot_bytes: i64,
        host_bytes: Option<i64>,
        device_slots: Option<i64>,
        device_bytes: Option<i64>,
        device: String,
        nvme_path: Option<PathBuf>,
        nvme_capacity: Option<i64>,
        page_size: i64,
        eviction: String,
        decay: f64,
        per_layer: bool,
        layers: i64,
        protect_fetches: i64,
        nvme_miss_cost: f64,
        host_cache: bool,
        host_in_place: bool,
        link_priority: bool,
        runtime: Option<PyRef<'_, crate::runtime::Runtime>>,
    ) -> PyResult<Self> {
        let host_bytes = match (&runtime, host_bytes) {
            (None, Some(h)) => h,
            (None, None) => return Err(invalid("host_bytes is needed without a runtime")),
            // On a runtime the experts share its host tier.
            (Some(_), None) => 0,
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "host_bytes is the runtime's own for a cache on a runtime; leave it None",
                ))
            }
        };
        if runtime.is_some() && (nvme_path.is_some() || nvme_capacity.is_some()) {
            return Err(invalid(
                "the NVMe tier is the runtime's own for a cache on a runtime; leave nvme_path None",
            ));
        }
        let slot = offset(slot_bytes, "slot_bytes")?;
        if slot == 0 {
            return Err(invalid("slot_bytes is 0"));
        }
        let page = usize::try_from(offset(page_size, "page_size")?)
            .map_err(|_| invalid(format!("page_size {page_size} is too large")))?;
        strata::size::check_page_size(page).map_err(|e| raise(e.context("page_size")))?;
        // A slot takes whole pages of the device tier.
        let slot_room = slot.div_ceil(page as u64).saturating_mul(page as u64);
        let slots = match (device_slots, device_bytes) {
            (Some(n), None) => offset(n, "device_slots")?,
            (None, Some(b)) => {
                let b = offset(b, "device_bytes")?;
                if b < slot_room {
                    return Err(invalid(format!(
                        "device_bytes {b} holds no slot: one takes {slot_room} bytes ({slot} and its page padding)"
                    )));
                }
                b / slot_room
            }
            _ => return Err(invalid("give exactly one of device_slots and device_bytes")),
        };
        let slots =
            usize::try_from(slots).map_err(|_| invalid(format!("{slots} slots are too many")))?;
        let mut cfg = MoeConfig::new(slots, slot, offset(host_bytes, "host_bytes")?);
        cfg.device = device.parse::<DeviceChoice>().map_err(raise)?;
        cfg.page_size = page;
        cfg.eviction = match eviction.to_ascii_lowercase().as_str() {
            "lrfu" => Eviction::Lrfu { decay },
            "reuse" => Eviction::Reuse { decay },
            "lru" => Eviction::Lru,
            "no-cache" | "nocache" | "none" => Eviction::NoCache,
            _ => {
                return Err(invalid(format!(
                    "unknown eviction {eviction:?} (use lrfu, reuse, lru or no-cache)"
                )))
            }
        };
        cfg.per_layer = per_layer;
        cfg.layers = usize::try_from(offset(layers, "layers")?)
            .map_err(|_| invalid("layers is too large"))?;
        cfg.protect_fetches = offset(protect_fetches, "protect_fetches")?;
        cfg.nvme_miss_cost = nvme_miss_cost;
        cfg.host_cache = host_cache;
        cfg.host_in_place = host_in_place;
        cfg.link_priority = link_priority;
        match (nvme_path, nvme_capacity) {
            (Some(path), Some(cap)) => {
                if path.as_os_str().is_empty() {
                    return Err(invalid("nvme_path is empty (None means no NVMe tier)"));
                }
                let mut n = NvmeConfig::new(path, offset(cap, "nvme_capacity")?, page);
                // The cache's reads land in its device slots: the registered
                // pool serves only the registration's writes, and a page of
                // it is enough (an I/O beyond it takes a heap buffer).
                n.pool_bytes = page as u64;
                cfg.nvme = Some(n);
            }
            (None, None) => {}
            (Some(_), None) => return Err(invalid("nvme_path needs an nvme_capacity")),
            (None, Some(_)) => return Err(invalid("nvme_capacity needs an nvme_path")),
        }
        // Opening the tiers can take a while (an NVMe file).
        let shared = runtime.as_ref().map(|r| r.rt.clone());
        let c = py
            .detach(move || match &shared {
                Some(rt) => cache::ExpertCache::on(rt, cfg),
                None => cache::ExpertCache::new(cfg),
            })
            .map_err(raise)?;
        Ok(Self {
            cache: RwLock::new(Arc::new(c)),
            slot_bytes: slot,
            device_slots: slots,
        })
    }

    /// The bytes one slot holds (the largest expert allowed).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// The number of device slots.
    #[getter]
    fn device_slots(&self) -> usize {
        self.device_slots
    }

    /// The runtime's page size in bytes.
    #[getter]
    fn page_size(&self) -> usize {
        self.cache.read().runtime().page_size()
    }

    /// The device backend: "simulated" or "cuda".
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.cache
            .read()
            .runtime()
            .device_backend()
            .map(|b| b.label())
    }

    /// Registers expert `expert` of `layer` with its weights, the bytes of
    /// any C-contiguous buffer-protocol object (1 to slot_bytes of them),
    /// copied into the host tier (NVMe when host_bytes is full). Refused
    /// while a fetched slot is held.
    fn register(
        &self,
        py: Python<'_>,
        layer: i64,
        expert: i64,
        weights: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (l, e) = (u32_of(layer, "layer")?, u32_of(expert, "expert")?);
        let view = Contiguous::readable(weights)?;
        let src = view.as_slice();
        // The write lock is taken and let go without the GIL: another
        // thread holding the GIL may be waiting for a read lock.
        py.detach(|| {
            let mut guard = self.cache.write();
            let Some(c) = Arc::get_mut(&mut guard) else {
                return Err(strata::Error::invalid(
                    "experts cannot be registered while a fetched ExpertSlot is held: release it first",
                ));
            };
            c.register(l, e, src)
        })
        .map_err(raise)
    }

    /// The expert pinned where it is read until the returned ExpertSlot is
    /// released: in device memory, or in host memory for an expert read
    /// in place (host_in_place; the slot's tier says which). Blocks
    /// (without the GIL) only on a miss or a prefetch still in flight.
    fn fetch(&self, py: Python<'_>, layer: i64, expert: i64) -> PyResult<ExpertSlot> {
        let (l, e) = (u32_of(layer, "layer")?, u32_of(expert, "expert")?);
        let c = self.cache.read().clone();
        let pin = py.detach(|| c.fetch_owned(l, e)).map_err(raise)?;
        Ok(ExpertSlot::new(l, e, pin))
    }

    /// Starts moving `experts` of `layer` into device memory in the
    /// background; experts already there are skipped, predictions no slot
    /// can be freed for are dropped. Returns how many moves started.
    fn prefetch(&self, py: Python<'_>, layer: i64, experts: Vec<i64>) -> PyResult<usize> {
        self.start(py, layer, experts, cache::ExpertCache::prefetch)
    }

    /// Starts the reads of `experts` of `layer`, which the caller is about
    /// to fetch, so that they run while it computes on others: misses
    /// whose fetch waits only for what is left of its read (counted as
    /// "reads_ahead", not as hits or prefetches). Experts already there,
    /// and those no unprotected slot can be freed for, are skipped.
    /// Returns how many reads started.
    fn read_ahead(&self, py: Python<'_>, layer: i64, experts: Vec<i64>) -> PyResult<usize> {
        self.start(py, layer, experts, cache::ExpertCache::read_ahead)
    }

    /// Cancels the prefetches of `layer` that no fetch used and that have
    /// not finished (call it once the layer has run, or with `keep`, the
    /// experts its router picked, as soon as it has picked them): what
    /// they had not read yet is never read. Finished ones no fetch used
    /// stay, no longer protected. Returns how many were cancelled.
    #[pyo3(signature = (layer, keep = None))]
    fn cancel_prefetches(
        &self,
        py: Python<'_>,
        layer: i64,
        keep: Option<Vec<i64>>,
    ) -> PyResult<usize> {
        self.start(
            py,
            layer,
            keep.unwrap_or_default(),
            cache::ExpertCache::cancel_prefetches_except,
        )
    }

    /// Advances the modelled clock of the simulated device by the caller's
    /// compute time, seconds (a no-op on a GPU).
    fn advance(&self, seconds: f64) -> PyResult<()> {
        self.cache.read().advance(seconds).map_err(raise)
    }

    /// The modelled clock, seconds (simulated device); None on a GPU.
    fn modelled_now(&self) -> Option<f64> {
        self.cache.read().modelled_now()
    }

    /// Whether the expert is in device memory (or on its way).
    fn is_resident(&self, layer: i64, expert: i64) -> PyResult<bool> {
        let (l, e) = (u32_of(layer, "layer")?, u32_of(expert, "expert")?);
        self.cache.read().is_resident(l, e).map_err(raise)
    }

    /// Whether a fetch of the expert needs no read of its own: it is in
    /// device memory (or on its way), or read in place from host memory
    /// (host_in_place).
    fn is_ready(&self, layer: i64, expert: i64) -> PyResult<bool> {
        let (l, e) = (u32_of(layer, "layer")?, u32_of(expert, "expert")?);
        self.cache.read().is_ready(l, e).map_err(raise)
    }

    /// Counters so far: "fetches", "hits", "late_prefetch_hits",
    /// "prefetches", "prefetches_used", "prefetches_dropped",
    /// "prefetches_cancelled", "evictions", "bytes_moved", "stall_seconds"
    /// (modelled on the simulated device, measured on a GPU),
    /// "stall_modelled", "displaced", "reads_ahead", "hit_rate",
    /// "prefetch_accuracy", "moves" (experts moved into device memory:
    /// misses and prefetches), "moves_paid" (of those, the ones fetched
    /// before they left: every miss's, the prefetches used),
    /// "served_in_place" (fetches read from host memory where the expert
    /// is, host_in_place: neither hits nor moves).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.cache.read().stats();
        let d = PyDict::new(py);
        d.set_item("fetches", s.fetches)?;
        d.set_item("hits", s.hits)?;
        d.set_item("late_prefetch_hits", s.late_prefetch_hits)?;
        d.set_item("prefetches", s.prefetches)?;
        d.set_item("prefetches_used", s.prefetches_used)?;
        d.set_item("prefetches_dropped", s.prefetches_dropped)?;
        d.set_item("prefetches_declined", s.prefetches_declined)?;
        d.set_item("prefetches_cancelled", s.prefetches_cancelled)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("bytes_moved", s.bytes_moved)?;
        d.set_item("stall_seconds", s.stall_seconds)?;
        d.set_item("stall_modelled", s.stall_modelled)?;
        d.set_item("displaced", s.displaced)?;
        d.set_item("reads_ahead", s.reads_ahead)?;
        d.set_item("moves_from_nvme", s.moves_from_nvme)?;
        d.set_item("host_swaps", s.host_swaps)?;
        d.set_item("served_in_place", s.served_in_place)?;
        d.set_item("hit_rate", s.hit_rate())?;
        d.set_item("prefetch_accuracy", s.prefetch_accuracy())?;
        d.set_item("moves", s.moves())?;
        d.set_item("moves_paid", s.moves_paid())?;
        Ok(d)
    }

    /// The NVMe tier's counters, None without one: "reads", "writes",
    /// "bytes_read", "bytes_written", "errors" and "busy_seconds" (the time
    /// it had I/O in flight: bytes_read over it is the rate the disk gave
    /// the cache while it was reading).
    fn nvme_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.cache.read().runtime().nvme_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("reads", s.reads)?;
        d.set_item("writes", s.writes)?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("errors", s.errors)?;
        d.set_item("busy_seconds", s.busy_seconds)?;
        Ok(Some(d))
    }

    /// The underlying runtime's stats as JSON (tiers, moves, links).
    fn runtime_stats_json(&self) -> String {
        self.cache.read().runtime().stats_json()
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.ExpertCache(device_slots={}, slot_bytes={}, backend={:?})",
            self.device_slots,
            self.slot_bytes,
            self.backend().unwrap_or("none")
        )
    }
}

/// A fetched expert, pinned where it is read (tier: the device, or the
/// host for an expert read in place) until release() (or the end of its
/// with block, or its collection).
///
/// pin(range, dtype) exports a byte range of it through DLPack
/// (torch.from_dlpack(slot.pin((0, n), "float32"))) without a copy; a
/// range must lie on pages adjacent in that tier's memory (see addresses;
/// a range within one page always does). Tensors so made hold their own
/// pins of the pages: drop them before releasing the slot, or the cache
/// cannot evict those pages and a later fetch may find no free slot. The
/// tensors are for reading: the expert's copy in host memory stays valid
/// while it is on the device, so evicting it moves nothing, and a write
/// through such a tensor would be lost at the next eviction (write the
/// expert's buffer instead).
#[pyclass(module = "strata", frozen)]
pub(crate) struct ExpertSlot {
    layer: u32,
    expert: u32,
    rt: strata::Runtime,
    buf: Arc<strata::Buffer>,
    addresses: Vec<u64>,
    tier: Tier,
    pin: Mutex<Option<OwnedExpertPin>>,
}

impl ExpertSlot {
    fn new(layer: u32, expert: u32, pin: OwnedExpertPin) -> Self {
        Self {
            layer,
            expert,
            rt: pin.cache().runtime().clone(),
            buf: pin.buffer().clone(),
            addresses: pin.addresses().to_vec(),
            tier: pin.tier(),
            pin: Mutex::new(Some(pin)),
        }
    }
}

#[pymethods]
impl ExpertSlot {
    /// (layer, expert).
    #[getter]
    fn key(&self) -> (u32, u32) {
        (self.layer, self.expert)
    }

    /// The expert's size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.buf.len()
    }

    /// The runtime's page size.
    #[getter]
    fn page_size(&self) -> usize {
        self.rt.page_size()
    }

    /// The address of each page of the expert in its tier, in order.
    #[getter]
    fn addresses(&self) -> Vec<u64> {
        self.addresses.clone()
    }

    /// Where the expert is read from: "device", or "host" for an expert
    /// read in place from host memory (host_in_place).
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier.name()
    }

    /// Whether every page follows the one before in the memory of the
    /// slot's tier (then pin(None, ...) exports the whole expert as one
    /// tensor).
    #[getter]
    fn contiguous(&self) -> bool {
        let page = self.rt.page_size() as u64;
        self.addresses.windows(2).all(|w| w[1] == w[0] + page)
    }

    /// Whether the slot is still held.
    #[getter]
    fn held(&self) -> bool {
        self.pin.lock().is_some()
    }

    /// The expert's buffer (to read it, say).
    #[getter]
    fn buffer(&self) -> Buffer {
        Buffer {
            rt: self.rt.clone(),
            buf: self.buf.clone(),
        }
    }

    /// A strata.Pin over `range` of the expert in its tier, exporting
    /// it through DLPack as a 1-D tensor of dtype. ClosedError after
    /// release().
    #[pyo3(signature = (range = None, dtype = "uint8"))]
    fn pin(&self, py: Python<'_>, range: Option<(i64, i64)>, dtype: &str) -> PyResult<Pin> {
        if !self.held() {
            return Err(raise(strata::Error::new(
                strata::ErrorKind::Closed,
                format!(
                    "expert ({}, {}) was released: fetch it again",
                    self.layer, self.expert
                ),
            )));
        }
        let r = byte_range(range, self.buf.len(), "expert")?;
        let dt = dlpack::dtype(dtype)?;
        strata_ffi::dlpack_elements(r.start, r.end - r.start, dt).map_err(raise)?;
        let pin = py
            .detach(|| self.buf.pin_read_owned(r.clone(), self.tier))
            .map_err(raise)?;
        Ok(Pin::new(&self.rt, &self.buf, pin, r, dtype, dt, false))
    }

    /// Unpins the expert (a no-op if released already).
    fn release(&self, py: Python<'_>) {
        let pin = self.pin.lock().take();
        py.detach(move || drop(pin));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.ExpertSlot(layer={}, expert={}, nbytes={}, held={})",
            self.layer,
            self.expert,
            self.buf.len(),
            if self.held() { "True" } else { "False" }
        )
    }
}

/// Parses a routing trace, `token layer expert` per line (blank lines and
/// `#` comments skipped, tokens non-decreasing), as
/// `strata bench moe --routing file:PATH` does. Returns (routes, layers,
/// experts): routes[token][layer] lists that token's experts at that layer
/// in first-seen order. InvalidArgumentError names the first bad line.
#[pyfunction]
#[pyo3(signature = (text, source = "<trace>"))]
pub(crate) fn parse_moe_trace(
    text: &str,
    source: &str,
) -> PyResult<(Vec<TokenRoute>, usize, usize)> {
    cache::parse_trace(text, source).map_err(raise)
}
