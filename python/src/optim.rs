//! `strata._strata.OffloadedAdam`: the offloaded Adam/AdamW of
//! `strata::offload::optim`, one per parameter tensor under
//! `strata.optim.Adam`/`AdamW` (which hold the torch side). Arrays are
//! float32 buffer-protocol objects (NumPy views of CPU tensors), read and
//! written in place.

use std::borrow::Cow;
use std::path::PathBuf;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::types::PyDict;
use strata::offload::optim::{
    bf16, f16, AdamParams, Element, Importance, ImportanceWindow, OptimConfig, StateTier,
    StepStats, Updater,
};

use crate::errors::{invalid, raise};
use crate::pybuf::Contiguous;

/// float32's `struct` code.
const F32: &[&str] = &["f"];

/// The float32 values of a buffer's bytes (borrowed where aligned).
fn floats(bytes: &[u8]) -> PyResult<Cow<'_, [f32]>> {
    if bytes.len() % 4 != 0 {
        return Err(invalid(format!(
            "{} bytes are not a whole number of float32 values",
            bytes.len()
        )));
    }
    Ok(match bytemuck::try_cast_slice(bytes) {
        Ok(f) => Cow::Borrowed(f),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
    })
}

fn floats_mut(bytes: &mut [u8]) -> PyResult<&mut [f32]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|_| invalid("the output is not an aligned array of float32 values"))
}

/// An element type by torch's name for it.
#[derive(Clone, Copy, PartialEq)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// Refuses a buffer declared to hold another element type (16-bit
    /// floats come as float16 or as 16-bit integers of the same bytes, as
    /// NumPy lacks bfloat16).
    fn check(self, view: &Contiguous<'_>, what: &str) -> PyResult<()> {
        match self {
            Self::F32 => view.check_type(F32, "float32", what),
            Self::Bf16 | Self::F16 => view.check_type(&["e", "h", "H"], "16-bit values", what),
        }
    }

    fn parse(name: &str, what: &str) -> PyResult<Self> {
        match name {
            "float32" => Ok(Self::F32),
            "bfloat16" => Ok(Self::Bf16),
            "float16" => Ok(Self::F16),
            _ => Err(invalid(format!(
                "{what} dtype {name:?}: use float32, bfloat16 or float16"
            ))),
        }
    }
}

/// A buffer's bytes as values of `T` (borrowed where aligned).
fn elems<'a, T: Element>(bytes: &'a [u8], what: &str) -> PyResult<Cow<'a, [T]>> {
    if bytes.len() % T::BYTES != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes are not a whole number of {} values",
            bytes.len(),
            T::NAME
        )));
    }
    Ok(match bytemuck::try_cast_slice(bytes) {
        Ok(v) => Cow::Borrowed(v),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    })
}

fn elems_mut<'a, T: Element>(bytes: &'a mut [u8], what: &str) -> PyResult<&'a mut [T]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| {
        invalid(format!(
            "{what} is not an aligned array of {} values",
            T::NAME
        ))
    })
}

/// The mixed-precision step, gradients of type `G` and weights of the
/// type `out_dtype` names; `None`: the aliased step, `out` the fp32
/// master weights themselves.
fn step_mixed_as<G: Element>(
    py: Python<'_>,
    adam: &Mutex<strata::offload::optim::OffloadedAdam>,
    grads: &[u8],
    out: &mut [u8],
    out_dtype: Option<Dtype>,
    unscale: f32,
) -> PyResult<StepStats> {
    fn run<G: Element, W: Element>(
        py: Python<'_>,
        adam: &Mutex<strata::offload::optim::OffloadedAdam>,
        grads: &[u8],
        out: &mut [u8],
        unscale: f32,
    ) -> PyResult<StepStats> {
        let g = elems::<G>(grads, "grads")?;
        let w = elems_mut::<W>(out, "out")?;
        py.detach(|| adam.lock().step_mixed(&g, unscale, w))
            .map_err(raise)
    }
    match out_dtype {
        None => {
            let g = elems::<G>(grads, "grads")?;
            let w = elems_mut::<f32>(out, "out")?;
            py.detach(|| adam.lock().step_aliased(&g, unscale, w))
                .map_err(raise)
        }
        Some(Dtype::F32) => run::<G, f32>(py, adam, grads, out, unscale),
        Some(Dtype::Bf16) => run::<G, bf16>(py, adam, grads, out, unscale),
        Some(Dtype::F16) => run::<G, f16>(py, adam, grads, out, unscale),
    }
}

/// The hyper-parameters as the step takes them (f32), checked there: a
/// value that is only in range as an f64 (a beta that rounds to 1) is
/// refused too.
fn adam(lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> PyResult<AdamParams> {
    let p = AdamParams {
        lr: lr as f32,
        beta1: betas.0 as f32,
        beta2: betas.1 as f32,
        eps: eps as f32,
        weight_decay: weight_decay as f32,
    };
    p.check().map_err(raise)?;
    Ok(p)
}

/// Adam/AdamW state (fp32 master weights, both moments) for one array of
/// parameters, kept in a tier ("host", "cxl", or "nvme" in the directory
/// nvme_path) and streamed through in chunks of chunk_bytes at each step.
/// The update is decoupled weight decay (AdamW; weight_decay 0 is Adam):
///
///     m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
///     w = w - (lr/bc1)*(m/(sqrt(v)/sqrt(bc2) + eps)) - lr*weight_decay*w
///
/// updater "cpu" or "cuda" (the same result bitwise). importance =
/// (fraction, every): the importance-aware mode (ZenFlow's idea; see the
/// Rust `strata::offload::optim` docs): per chunk, the fraction of
/// elements with the largest |g| at a flush update every step, the others
/// once every `every` steps with their mean gradient. runtime: a
/// strata.Runtime shared with the caller's buffers — the states then live
/// in that runtime's `tier` under its budgets (for "nvme" its own NVMe
/// tier: no nvme_path), in chunks of its page size, updated on the CPU.
/// Every call that touches the state releases the GIL.
#[pyclass(module = "strata", frozen)]
pub(crate) struct OffloadedAdam {
    inner: Mutex<strata::offload::optim::OffloadedAdam>,
    tier: &'static str,
}

#[pymethods]
impl OffloadedAdam {
    #[new]
    #[pyo3(signature = (
        weights, *, tier = "host", nvme_path = None, chunk_bytes = 1 << 20,
        lr = 1e-3, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0, updater = "cpu",
        importance = None, runtime = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        weights: &Bound<'_, PyAny>,
        tier: &str,
        nvme_path: Option<PathBuf>,
        chunk_bytes: usize,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        updater: &str,
        importance: Option<(f64, u64)>,
        runtime: Option<PyRef<'_, crate::runtime::Runtime>>,
    ) -> PyResult<Self> {
        // On a shared runtime the NVMe tier is the runtime's own.
        let nvme_path =
            match (&runtime, tier, nvme_path) {
                (Some(_), _, Some(_)) => return Err(invalid(
                    "nvme_path is the runtime's own for an optimizer on a runtime; leave it None",
                )),
                (Some(_), "nvme", None) => Some(PathBuf::new()),
                (_, _, p) => p,
            };
        let state_tier = match (tier, nvme_path) {
            ("host", None) => StateTier::Host,
            ("cxl", None) => StateTier::Cxl,
            ("nvme", Some(dir)) => StateTier::Nvme(dir),
            ("nvme", None) => return Err(invalid("tier \"nvme\" needs nvme_path (a directory)")),
            ("host" | "cxl", Some(_)) => {
                return Err(invalid(format!(
                    "nvme_path is for tier \"nvme\", not {tier:?}"
                )))
            }
            _ => {
                return Err(invalid(format!(
                    "unknown optimizer state tier {tier:?} (use host, cxl or nvme)"
                )))
            }
        };
        let mut config = OptimConfig::new(state_tier);
        // On a runtime a chunk is one of its pages.
        config.chunk_bytes = runtime.as_ref().map_or(chunk_bytes, |r| r.rt.page_size());
        config.adam = adam(lr, betas, eps, weight_decay)?;
        config.updater = updater.parse::<Updater>().map_err(raise)?;
        config.importance = importance.map(|(fraction, every)| Importance { fraction, every });
        let view = Contiguous::readable(weights)?;
        view.check_type(F32, "float32", "weights")?;
        let w = floats(view.as_slice())?;
        let shared = runtime.as_ref().map(|r| r.rt.clone());
        let inner = py
            .detach(|| match &shared {
                Some(rt) => strata::offload::optim::OffloadedAdam::on(rt, &w, config),
                None => strata::offload::optim::OffloadedAdam::new(&w, config),
            })
            .map_err(raise)?;
        let tier = match tier {
            "host" => "host",
            "cxl" => "cxl",
            _ => "nvme",
        };
        Ok(Self {
            inner: Mutex::new(inner),
            tier,
        })
    }

    /// Sets the hyper-parameters of the next steps.
    #[pyo3(signature = (*, lr, betas, eps, weight_decay))]
    fn configure(
        &self,
        py: Python<'_>,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
    ) -> PyResult<()> {
        let p = adam(lr, betas, eps, weight_decay)?;
        // The lock may be held by a step on another thread: wait without
        // the GIL (so do the other accessors below).
        py.detach(|| self.inner.lock().set_adam(p)).map_err(raise)
    }

    /// One step with these gradients (float32, one per parameter); with
    /// out (a writable float32 array of the same length), the updated
    /// weights are then read into it. Returns the step's stats: seconds,
    /// bytes_read, bytes_written, io_wait_seconds.
    ///
    /// in_place=True: out already holds the weights as the previous step
    /// left them (the parameter tensor the optimizer keeps in step), and
    /// only the elements this step changes are written; in importance
    /// mode a step inside a window then touches only the resident ones.
    ///
    /// Mixed precision (with in_place=True): grads_dtype and out_dtype
    /// ("float32", "bfloat16" or "float16") say what the arrays hold (a
    /// bf16 tensor viewed as int16, say); the gradients are widened to
    /// fp32 and multiplied by unscale (1 / a loss scale), the fp32 master
    /// weights and moments updated, and the masters rounded to nearest
    /// even into out.
    ///
    /// alias=True (with in_place=True and float32 out): out is the master
    /// weights themselves (the parameter tensor), updated in place with no
    /// copy in the tier; from then on every step must be aliased, and
    /// read_state(0) is refused; in CXL or on NVMe only the moments stream.
    /// Plain mode, cpu updater only.
    #[pyo3(signature = (
        grads, out = None, *, in_place = false, grads_dtype = "float32",
        out_dtype = "float32", unscale = 1.0, alias = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        &self,
        py: Python<'py>,
        grads: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        in_place: bool,
        grads_dtype: &str,
        out_dtype: &str,
        unscale: f64,
        alias: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        if in_place && out.is_none() {
            return Err(invalid("in_place=True needs out (the weights to update)"));
        }
        let g_dtype = Dtype::parse(grads_dtype, "grads")?;
        let o_dtype = Dtype::parse(out_dtype, "out")?;
        if alias && !(in_place && o_dtype == Dtype::F32) {
            return Err(invalid(
                "alias=True needs out, in_place=True and float32 weights (out_dtype)",
            ));
        }
        let mixed = alias || g_dtype != Dtype::F32 || o_dtype != Dtype::F32 || unscale != 1.0;
        if mixed && !in_place {
            return Err(invalid(
                "a mixed-precision step (grads_dtype, out_dtype or unscale) needs out and in_place=True",
            ));
        }
        let g_view = Contiguous::readable(grads)?;
        g_dtype.check(&g_view, "grads")?;
        let mut out_view = out.map(Contiguous::writable).transpose()?;
        if let Some(o) = &out_view {
            o_dtype.check(o, "out")?;
        }
        if let Some(o) = &out_view {
            // The gradients are read while the weights are written.
            let (a, b) = (
                g_view.as_slice().as_ptr_range(),
                o.as_slice().as_ptr_range(),
            );
            if a.start < b.end && b.start < a.end {
                return Err(invalid("out and grads share memory: pass separate arrays"));
            }
        }
        let stats = if mixed {
            let out = out_view
                .as_mut()
                .expect("in_place checked above")
                .as_mut_slice();
            let (g, u) = (g_view.as_slice(), unscale as f32);
            let o = if alias { None } else { Some(o_dtype) };
            match g_dtype {
                Dtype::F32 => step_mixed_as::<f32>(py, &self.inner, g, out, o, u)?,
                Dtype::Bf16 => step_mixed_as::<bf16>(py, &self.inner, g, out, o, u)?,
                Dtype::F16 => step_mixed_as::<f16>(py, &self.inner, g, out, o, u)?,
            }
        } else {
            let g = floats(g_view.as_slice())?;
            let out = match out_view.as_mut() {
                Some(v) => Some(floats_mut(v.as_mut_slice())?),
                None => None,
            };
            py.detach(|| {
                let mut a = self.inner.lock();
                if let Some(o) = &out {
                    if o.len() != a.len() {
                        return Err(strata::Error::invalid(format!(
                            "out holds {} values for {} parameters",
                            o.len(),
                            a.len()
                        )));
                    }
                }
                // The new weights go straight into `out` (the parameter).
                match out {
                    Some(o) if in_place => a.step_in_place(&g, o),
                    out => a.step_into(&g, out),
                }
            })
            .map_err(raise)?
        };
        let d = PyDict::new(py);
        d.set_item("seconds", stats.seconds)?;
        d.set_item("bytes_read", stats.bytes_read)?;
        d.set_item("bytes_written", stats.bytes_written)?;
        d.set_item("io_wait_seconds", stats.io_wait_seconds)?;
        Ok(d)
    }

    /// Reads a state array (0 weights, 1 first moment, 2 second moment)
    /// into out, a writable float32 array of one value per parameter.
    fn read_state(&self, py: Python<'_>, which: usize, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut view = Contiguous::writable(out)?;
        view.check_type(F32, "float32", "out")?;
        let out = floats_mut(view.as_mut_slice())?;
        py.detach(|| {
            let a = self.inner.lock();
            if out.len() != a.len() {
                return Err(strata::Error::invalid(format!(
                    "out holds {} values for {} parameters",
                    out.len(),
                    a.len()
                )));
            }
            a.read_state_into(which, out)
        })
        .map_err(raise)
    }

    /// Overwrites a state array (0, 1 or 2, as read_state) from data, one
    /// float32 per parameter.
    fn write_state(&self, py: Python<'_>, which: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let view = Contiguous::readable(data)?;
        view.check_type(F32, "float32", "data")?;
        let values = floats(view.as_slice())?;
        py.detach(|| self.inner.lock().write_state(which, &values))
            .map_err(raise)
    }

    /// Importance mode's window since the last flush, for a checkpoint:
    /// (deferred_steps, started, resident, accumulated), resident the
    /// parameter indices updated every step (native-endian uint64 bytes),
    /// accumulated the gradient sums (float32 bytes). None in plain mode.
    #[allow(clippy::type_complexity)]
    fn importance_window<'py>(
        &self,
        py: Python<'py>,
    ) -> Option<(u64, bool, Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let w = py.detach(|| self.inner.lock().importance_window())?;
        Some((
            w.deferred_steps,
            w.started,
            PyBytes::new(py, bytemuck::cast_slice(&w.resident)),
            PyBytes::new(py, bytemuck::cast_slice(&w.accumulated)),
        ))
    }

    /// Restores a window read by importance_window (after the state
    /// arrays): resident as uint64 values, accumulated as float32 values
    /// (any buffer-protocol objects).
    fn set_importance_window(
        &self,
        py: Python<'_>,
        deferred_steps: u64,
        started: bool,
        resident: &Bound<'_, PyAny>,
        accumulated: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let r_view = Contiguous::readable(resident)?;
        r_view.check_type(&["q", "l", "Q", "L"], "64-bit integers", "resident")?;
        let r = r_view.as_slice();
        if r.len() % 8 != 0 {
            return Err(invalid(format!(
                "{} bytes of resident indices are not a whole number of uint64 values",
                r.len()
            )));
        }
        let resident: Vec<u64> = r
            .chunks_exact(8)
            .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let a_view = Contiguous::readable(accumulated)?;
        a_view.check_type(F32, "float32", "accumulated")?;
        let window = ImportanceWindow {
            deferred_steps,
            accumulated: floats(a_view.as_slice())?.into_owned(),
            resident,
            started,
        };
        py.detach(|| self.inner.lock().set_importance_window(&window))
            .map_err(raise)
    }

    /// Steps taken (the next step's bias correction uses steps + 1).
    #[getter]
    fn steps(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.inner.lock().steps())
    }

    /// Sets the step count (restoring a saved optimizer).
    fn set_steps(&self, py: Python<'_>, steps: u64) {
        py.detach(|| self.inner.lock().set_steps(steps));
    }

    /// The tier the state lives in.
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier
    }

    /// Whether that tier is emulated (CXL without a CPU-less node).
    #[getter]
    fn emulated(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.lock().emulated())
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.lock().len())
    }
}
