//! `strata._strata.RowTable`: the binding of
//! [`strata::offload::embedding::EmbeddingTable`] (fp32 rows in a strata
//! buffer), under `strata.nn.EmbeddingBag` (which holds the torch side).
//! Each method converts its arrays (C-contiguous buffer-protocol objects),
//! calls the table with the GIL released and converts the error: an index
//! or row range outside the table is an `IndexError`, any other error its
//! strata exception. Plus the balancer's controls, which a table's hot
//! rows depend on: `start_balancer`, `stop_balancer`, `balance_once`.

use std::time::Duration;

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use strata::offload::embedding::{
    Bags, EmbeddingError, EmbeddingTable, Lookups, Pooling, RowCacheOptions, TableOptions, Update,
};
use strata::runtime::BalancerConfig;
use strata::PolicyKind;

use crate::buffer::Buffer;
use crate::errors::{invalid, raise};
use crate::pybuf::Contiguous;
use crate::runtime::Runtime;

/// int64 values of an index buffer.
fn int64s(view: &Contiguous<'_>, what: &str) -> PyResult<Vec<i64>> {
    view.check_type(&["q", "l"], "int64", what)?;
    ints(view.as_slice(), what)
}

/// float32 values of a buffer.
fn float32s(view: &Contiguous<'_>, what: &str) -> PyResult<Vec<f32>> {
    view.check_type(&["f"], "float32", what)?;
    floats(view.as_slice(), what)
}

/// A writable buffer's float32 values.
fn float32s_mut<'a>(view: &'a mut Contiguous<'_>, what: &str) -> PyResult<&'a mut [f32]> {
    view.check_type(&["f"], "float32", what)?;
    floats_mut(view.as_mut_slice(), what)
}

fn ints(bytes: &[u8], what: &str) -> PyResult<Vec<i64>> {
    if bytes.len() % 8 != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes are not a whole number of int64 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| i64::from_ne_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

fn floats(bytes: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if bytes.len() % 4 != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes are not a whole number of float32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
        .collect())
}

fn floats_mut<'a>(bytes: &'a mut [u8], what: &str) -> PyResult<&'a mut [f32]> {
    if bytes.is_empty() {
        // An empty buffer's pointer may be anything (1, say): no values.
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|_| invalid(format!("{what} is not an aligned array of float32 values")))
}

/// The Python exception of a table's error.
fn raise_table(e: EmbeddingError) -> PyErr {
    if e.is_out_of_range() {
        PyIndexError::new_err(e.to_string())
    } else {
        raise(e.into())
    }
}

/// An embedding table of `rows` rows of `dim` float32 values in a strata
/// buffer of `runtime` (row r at byte r*dim*4; rows may straddle pages).
/// Arrays passed in are C-contiguous buffer-protocol objects (NumPy views
/// of CPU tensors): indices and offsets int64, values float32. Every call
/// refuses an out-of-range index (IndexError) or malformed offsets
/// (InvalidArgumentError) before it reads or writes anything, and runs
/// with the GIL released. threads: worker threads for NVMe page reads and
/// for updates (the reads in flight at once).
#[pyclass(module = "strata", frozen)]
pub(crate) struct RowTable {
    table: EmbeddingTable,
}

#[pymethods]
impl RowTable {
    #[new]
    #[pyo3(signature = (runtime, rows, dim, *, prefer = None, threads = 16, row_cache = 0, row_cache_policy = None))]
    fn new(
        runtime: &Runtime,
        rows: i64,
        dim: i64,
        prefer: Option<&str>,
        threads: i64,
        row_cache: i64,
        row_cache_policy: Option<&str>,
    ) -> PyResult<Self> {
        if rows < 0 || dim < 0 {
            return Err(invalid(format!(
                "an embedding table needs at least one row and one column ({rows} x {dim})"
            )));
        }
        let placement = match prefer {
            Some(t) => strata::Placement::Prefer(crate::convert::tier(t)?),
            None => strata::Placement::Fastest,
        };
        let options = TableOptions {
            placement,
            threads: usize::try_from(threads)
                .map_err(|_| invalid(format!("threads {threads} is not in 1..=1024")))?,
            row_cache: match usize::try_from(row_cache) {
                Ok(0) => None,
                Ok(rows) => Some(RowCacheOptions {
                    rows,
                    policy: policy(row_cache_policy)?,
                }),
                Err(_) => {
                    return Err(invalid(format!(
                        "row_cache {row_cache} must be a number of rows (0: none)"
                    )))
                }
            },
        };
        let table = EmbeddingTable::with_options(&runtime.rt, rows as u64, dim as usize, options)
            .map_err(raise_table)?;
        Ok(Self { table })
    }

    /// Rows in the table.
    #[getter]
    fn rows(&self) -> u64 {
        self.table.rows()
    }

    /// float32 values per row.
    #[getter]
    fn dim(&self) -> usize {
        self.table.dim()
    }

    /// The strata buffer holding the rows. With a row cache, a row updated
    /// in the cache reaches the buffer when it leaves the cache or at
    /// flush(); read_rows and the gathers see it at once (a buffer kept
    /// past the table holds what was written back by then: flush first).
    #[getter]
    fn buffer(&self) -> Buffer {
        Buffer {
            rt: self.table.runtime().clone(),
            buf: self.table.buffer().clone(),
        }
    }

    /// The runtime's fastest tier, whose lookups count as hits.
    #[getter]
    fn fast_tier(&self) -> &'static str {
        self.table.fast_tier().name()
    }

    /// The page (an index) row `row` starts in.
    fn page_of_row(&self, row: i64) -> PyResult<u64> {
        self.table.page_of_row(row).map_err(raise_table)
    }

    /// The tier of the page row `row` starts in (None: never written).
    fn tier_of_row(&self, row: i64) -> PyResult<Option<&'static str>> {
        let tier = self.table.tier_of_row(row).map_err(raise_table)?;
        Ok(tier.map(strata::Tier::name))
    }

    /// Writes back every row the row cache holds changed, so that the
    /// buffer holds every row as the gathers see it (a no-op without a row
    /// cache).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.table.flush()).map_err(raise_table)
    }

    /// Writes data (float32, a whole number of rows) as rows start, start+1, ...
    fn write_rows(&self, py: Python<'_>, start: i64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let view = Contiguous::readable(data)?;
        view.check_type(&["f"], "float32", "data")?;
        let src = view.as_slice();
        // An unaligned source goes through a copy (and strata's own memory
        // does in EmbeddingTable::write_rows).
        let copy = match bytemuck::try_cast_slice::<u8, f32>(src) {
            Ok(_) => None,
            Err(_) => Some(floats(src, "data")?),
        };
        let values: &[f32] = match &copy {
            Some(v) => v,
            None => bytemuck::cast_slice(src),
        };
        py.detach(|| self.table.write_rows(start, values))
            .map_err(raise_table)
    }

    /// Reads the rows of indices (int64) into out (float32, len(indices)
    /// rows).
    fn read_rows(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let idx = int64s(&Contiguous::readable(indices)?, "indices")?;
        let mut view = Contiguous::writable(out)?;
        let dst = float32s_mut(&mut view, "out")?;
        py.detach(|| self.table.read_rows(&idx, dst))
            .map_err(raise_table)
    }

    /// Pools bags of rows into out (float32, one row per bag): bag b is
    /// indices[offsets[b]:offsets[b+1]] (offsets int64, one more than the
    /// bags, from 0 to len(indices), non-decreasing), summed with weights
    /// (float32, one per index) or without, or averaged (mean=True).
    /// Indices equal to padding_idx are left out (of a mean's count too).
    /// An empty bag gives zeros. Returns (lookups, fast_tier_hits) of the
    /// call, which also add to stats().
    #[pyo3(signature = (indices, offsets, out, *, weights = None, mean = false, padding_idx = None))]
    #[allow(clippy::too_many_arguments)]
    fn bag(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
        mean: bool,
        padding_idx: Option<i64>,
    ) -> PyResult<(u64, u64)> {
        let given = GivenBags::read(indices, offsets, weights, mean, padding_idx)?;
        let bags = given.bags();
        let mut view = Contiguous::writable(out)?;
        let dst = float32s_mut(&mut view, "out")?;
        let l = py
            .detach(|| self.table.gather(&bags, dst))
            .map_err(raise_table)?;
        Ok((l.lookups, l.fast_hits))
    }

    /// The fused backward of bag(): grad (float32, one row per bag) spread
    /// over each bag's rows (times their weights, divided by the bag's
    /// count for mean=True, padding_idx left out), summed per distinct row
    /// in lookup order, and the optimizer applied to each row once:
    /// optimizer="sgd" (lr) or "rowwise_adagrad" (lr, eps, state: float32,
    /// one accumulator per table row, updated in place).
    #[pyo3(signature = (
        indices, offsets, grad, *, weights = None, mean = false, padding_idx = None,
        optimizer, lr, eps = 1e-8, state = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn bag_backward(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
        mean: bool,
        padding_idx: Option<i64>,
        optimizer: &str,
        lr: f64,
        eps: f64,
        state: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let given = GivenBags::read(indices, offsets, weights, mean, padding_idx)?;
        let bags = given.bags();
        let grad = float32s(&Contiguous::readable(grad)?, "grad")?;
        let (lr, eps) = (lr as f32, eps as f32);
        match (optimizer, state) {
            ("sgd", None) => py
                .detach(|| self.table.backward(&bags, &grad, Update::Sgd { lr }))
                .map_err(raise_table),
            ("rowwise_adagrad", Some(state)) => {
                let mut view = Contiguous::writable(state)?;
                let state = float32s_mut(&mut view, "state")?;
                py.detach(|| {
                    self.table
                        .backward(&bags, &grad, Update::RowwiseAdagrad { lr, eps, state })
                })
                .map_err(raise_table)
            }
            _ => Err(invalid(format!(
                "optimizer {optimizer:?}: \"sgd\" (no state) or \"rowwise_adagrad\" (with state)"
            ))),
        }
    }

    /// SGD on the distinct rows `rows` (int64) with their gradients
    /// `grads` (float32, len(rows) x dim): w -= lr * g, in place.
    fn sgd(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        lr: f64,
    ) -> PyResult<()> {
        let (rows, grads) = rows_and_grads(rows, grads)?;
        py.detach(|| self.table.sgd(&rows, &grads, lr as f32))
            .map_err(raise_table)
    }

    /// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) on the distinct
    /// rows `rows` with gradients `grads`; `state` (float32, one per table
    /// row) holds the accumulators, updated in place:
    ///
    ///     state[r] += mean(g * g);  w -= lr / (sqrt(state[r]) + eps) * g
    fn rowwise_adagrad(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        state: &Bound<'_, PyAny>,
        lr: f64,
        eps: f64,
    ) -> PyResult<()> {
        let (rows, grads) = rows_and_grads(rows, grads)?;
        let mut view = Contiguous::writable(state)?;
        let st = float32s_mut(&mut view, "state")?;
        py.detach(|| {
            self.table
                .rowwise_adagrad(&rows, &grads, st, lr as f32, eps as f32)
        })
        .map_err(raise_table)
    }

    /// {"lookups": n, "fast_hits": n, "cache_hits": n, "cache_fills": n}:
    /// since the table was made or reset_stats() last ran (the row
    /// cache's hits are among the fast hits).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Lookups {
            lookups,
            fast_hits,
            cache_hits,
            cache_fills,
        } = self.table.stats();
        let d = PyDict::new(py);
        d.set_item("lookups", lookups)?;
        d.set_item("fast_hits", fast_hits)?;
        d.set_item("cache_hits", cache_hits)?;
        d.set_item("cache_fills", cache_fills)?;
        Ok(d)
    }

    /// Sets stats() back to zero.
    fn reset_stats(&self) {
        self.table.reset_stats();
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.RowTable(rows={}, dim={}, pages={})",
            self.table.rows(),
            self.table.dim(),
            self.table.buffer().page_count()
        )
    }
}

/// Bags as Python gives them (int64 indices and offsets, float32 weights),
/// copied out of their buffers.
struct GivenBags {
    indices: Vec<i64>,
    offsets: Vec<i64>,
    weights: Option<Vec<f32>>,
    mean: bool,
    padding_idx: Option<i64>,
}

impl GivenBags {
    fn read(
        indices: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
        mean: bool,
        padding_idx: Option<i64>,
    ) -> PyResult<Self> {
        Ok(Self {
            indices: int64s(&Contiguous::readable(indices)?, "indices")?,
            offsets: int64s(&Contiguous::readable(offsets)?, "offsets")?,
            weights: match weights {
                Some(w) => Some(float32s(&Contiguous::readable(w)?, "weights")?),
                None => None,
            },
            mean,
            padding_idx,
        })
    }

    fn bags(&self) -> Bags<'_> {
        let bags = Bags::new(&self.indices, &self.offsets)
            .pooling(if self.mean {
                Pooling::Mean
            } else {
                Pooling::Sum
            })
            .padding_idx(self.padding_idx);
        match &self.weights {
            Some(w) => bags.weights(w),
            None => bags,
        }
    }
}

/// A fused update's rows (int64) and gradients (float32).
fn rows_and_grads(
    rows: &Bound<'_, PyAny>,
    grads: &Bound<'_, PyAny>,
) -> PyResult<(Vec<i64>, Vec<f32>)> {
    let rows = int64s(&Contiguous::readable(rows)?, "rows")?;
    let grads = float32s(&Contiguous::readable(grads)?, "grads")?;
    Ok((rows, grads))
}

fn policy(name: Option<&str>) -> PyResult<PolicyKind> {
    match name {
        Some(p) => p.parse::<PolicyKind>().map_err(raise),
        None => Ok(PolicyKind::Default),
    }
}

/// Starts (or restarts, with a fresh policy) the runtime's balancer in the
/// background: every interval seconds it promotes the pages read most into
/// the fastest tier (the device tier; on the simulated device a host DRAM
/// arena) and demotes others. Needs a device tier.
#[pyfunction]
#[pyo3(signature = (runtime, *, interval = 0.01, min_accesses = 0, policy = None))]
pub(crate) fn start_balancer(
    runtime: &Runtime,
    interval: f64,
    min_accesses: i64,
    policy: Option<&str>,
) -> PyResult<()> {
    let interval = match Duration::try_from_secs_f64(interval) {
        Ok(d) if !d.is_zero() => d,
        _ => {
            return Err(invalid(format!(
                "interval {interval} is not a positive number of seconds"
            )))
        }
    };
    let min = crate::convert::offset(min_accesses, "min_accesses")?;
    let config = BalancerConfig::default()
        .with_interval(interval)
        .with_min_accesses(min)
        .with_policy(self::policy(policy)?);
    runtime.rt.start_balancer(config).map_err(raise)
}

/// Stops the runtime's background balancer (its policy state is kept for
/// balance_once).
#[pyfunction]
pub(crate) fn stop_balancer(py: Python<'_>, runtime: &Runtime) {
    py.detach(|| runtime.rt.stop_balancer());
}

/// Runs one balancer round now and returns what it did: {"promotions",
/// "demotions", "bypasses", "deferred", "promotions_below",
/// "demotions_below", "marked", "held_back", "replayed"}: "replayed" is
/// the touched pages replayed into the policy, 0 when every resident page
/// was already in the fastest tier with room to spare (the round skips
/// its policy). Needs a tier below the fastest.
#[pyfunction]
pub(crate) fn balance_once<'py>(
    py: Python<'py>,
    runtime: &Runtime,
) -> PyResult<Bound<'py, PyDict>> {
    let r = py.detach(|| runtime.rt.balance_once()).map_err(raise)?;
    let d = PyDict::new(py);
    d.set_item("promotions", r.promotions)?;
    d.set_item("demotions", r.demotions)?;
    d.set_item("bypasses", r.bypasses)?;
    d.set_item("deferred", r.deferred)?;
    d.set_item("promotions_below", r.promotions_below)?;
    d.set_item("demotions_below", r.demotions_below)?;
    d.set_item("marked", r.marked)?;
    d.set_item("held_back", r.held_back)?;
    d.set_item("replayed", r.replayed)?;
    Ok(d)
}

/// Adds the table class and the balancer functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RowTable>()?;
    m.add_function(wrap_pyfunction!(start_balancer, m)?)?;
    m.add_function(wrap_pyfunction!(stop_balancer, m)?)?;
    m.add_function(wrap_pyfunction!(balance_once, m)?)?;
    Ok(())
}
