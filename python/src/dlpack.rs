//! `strata.Pin` and its DLPack export (the Python array API's exchange
//! protocol: `__dlpack__` returns a PyCapsule named "dltensor" holding a
//! `DLManagedTensor *`; the consumer renames it "used_dltensor" and owns the
//! tensor from then on).
//!
//! The tensor and its lifetime come from strata-ffi's
//! `dlpack_export_pinned`, the code behind the C ABI's
//! `strata_dlpack_export`: each tensor holds its own pin of the range (and
//! thereby the buffer and its tiers), released by the tensor's deleter.
//! That deleter needs no GIL and may run on any thread, so a tensor
//! outlives the Pin it came from, the Buffer and the Runtime alike.

use std::ffi::CStr;
use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use strata::runtime::OwnedPin;
use strata::{ErrorKind, Tier};
use strata_ffi::{DLDataType, DLDataTypeCode, DLManagedTensor};

use crate::errors::{invalid, raise};

const DLTENSOR: &CStr = c"dltensor";

/// The DLPack element type of a dtype name.
pub(crate) fn dtype(name: &str) -> PyResult<DLDataType> {
    use DLDataTypeCode::*;
    let (code, bits) = match name {
        "uint8" => (kDLUInt, 8),
        "uint16" => (kDLUInt, 16),
        "uint32" => (kDLUInt, 32),
        "uint64" => (kDLUInt, 64),
        "int8" => (kDLInt, 8),
        "int16" => (kDLInt, 16),
        "int32" => (kDLInt, 32),
        "int64" => (kDLInt, 64),
        "float16" => (kDLFloat, 16),
        "float32" => (kDLFloat, 32),
        "float64" => (kDLFloat, 64),
        "bfloat16" => (kDLBfloat, 16),
        "bool" => (kDLBool, 8),
        _ => {
            return Err(invalid(format!(
                "unknown dtype {name:?} (use uint8, int8, int16, int32, int64, uint16, \
                 uint32, uint64, float16, bfloat16, float32, float64 or bool)"
            )))
        }
    };
    Ok(DLDataType {
        code: code as u8,
        bits,
        lanes: 1,
    })
}

/// Pages held resident in one tier, with their addresses; see Buffer.pin.
///
/// Exports the range through DLPack: numpy.from_dlpack(pin) and
/// torch.from_dlpack(pin) wrap strata's memory in place (no copy), and each
/// exported tensor keeps the range pinned until the tensor itself is
/// gone, whether or not the Pin is released first. Writes through
/// Buffer.write reach the tensor's memory in place; ordering them with the
/// tensor's users is the caller's job.
#[pyclass(module = "strata", frozen)]
pub(crate) struct Pin {
    rt: strata::Runtime,
    buf: Arc<strata::Buffer>,
    pin: Mutex<Option<OwnedPin>>,
    range: Range<u64>,
    tier: Tier,
    dtype_name: String,
    dtype: DLDataType,
    /// The address of the range's first byte, and of each pinned page.
    address: u64,
    addresses: Vec<u64>,
    pages: Range<usize>,
    /// Whether the pin (and the tensors exported from it) may be written
    /// through; a read pin keeps the pages' clean copies valid.
    writable: bool,
}

impl Pin {
    /// A pin of `buf` (of runtime `rt`).
    pub(crate) fn new(
        rt: &strata::Runtime,
        buf: &Arc<strata::Buffer>,
        pin: OwnedPin,
        range: Range<u64>,
        dtype_name: &str,
        dtype: DLDataType,
        writable: bool,
    ) -> Self {
        let page = rt.page_size() as u64;
        let addresses = pin.addresses().to_vec();
        // A pin of an empty range holds no page and has no address.
        let address = addresses.first().map_or(0, |a| a + range.start % page);
        Self {
            rt: rt.clone(),
            buf: buf.clone(),
            tier: pin.tier(),
            pages: pin.pages(),
            pin: Mutex::new(Some(pin)),
            range,
            dtype_name: dtype_name.to_owned(),
            dtype,
            address,
            addresses,
            writable,
        }
    }

    fn check_pinned(&self) -> PyResult<()> {
        if self.pin.lock().is_none() {
            return Err(raise(strata::Error::new(
                ErrorKind::Closed,
                "the pin was released (unpin or the end of its with block)",
            )));
        }
        Ok(())
    }
}

/// A tensor fresh from `dlpack_export_pinned`, handed from the thread that
/// made it without the GIL to the one that wraps it.
struct Exported(std::ptr::NonNull<DLManagedTensor>);

// SAFETY: the tensor is owned by this value alone (nothing else refers to
// it yet), and everything it holds — an `OwnedPin`, plain integers — may
// move between threads; its deleter may run on any thread.
unsafe impl Send for Exported {}

/// The capsule's destructor: frees the tensor only if no consumer took it
/// (a consumer renames the capsule "used_dltensor" and calls the deleter
/// itself when done).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython passes the capsule being destroyed. PyCapsule_IsValid
    // sets no exception, so one in flight (this may run during unwinding)
    // is left alone.
    if unsafe { ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: valid under this name (checked above), so this cannot fail;
    // the pointer is the DLManagedTensor stored by `capsule`.
    let t =
        unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) }.cast::<DLManagedTensor>();
    // SAFETY: an unconsumed tensor from `dlpack_export_pinned`: live, and
    // its deleter has not run (no consumer took it).
    if let Some(deleter) = unsafe { t.as_ref() }.and_then(|t| t.deleter) {
        // SAFETY: called once, for this tensor (the capsule dies once).
        unsafe { deleter(t) };
    }
}

#[pymethods]
impl Pin {
    /// The tier the pages are pinned in.
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier.name()
    }

    /// The pinned byte range, (start, stop).
    #[getter]
    fn range(&self) -> (u64, u64) {
        (self.range.start, self.range.end)
    }

    /// The length of the range in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.range.end - self.range.start
    }

    /// The pinned pages (indices into the buffer), (start, stop).
    #[getter]
    fn pages(&self) -> (usize, usize) {
        (self.pages.start, self.pages.end)
    }

    /// The address of the range's first byte: a host address for host and
    /// CXL pins (and the simulated device), a device address on a GPU.
    /// The bytes after it are contiguous only within its page, or across
    /// pages whose addresses (see addresses) are adjacent.
    #[getter]
    fn address(&self) -> u64 {
        self.address
    }

    /// Each pinned page's address, in page order.
    #[getter]
    fn addresses(&self) -> Vec<u64> {
        self.addresses.clone()
    }

    /// The element type of the DLPack export.
    #[getter]
    fn dtype(&self) -> &str {
        &self.dtype_name
    }

    /// Whether the pin is still held (tensors exported from it hold their
    /// own pins either way).
    #[getter]
    fn pinned(&self) -> bool {
        self.pin.lock().is_some()
    }

    /// Releases the pin now (a no-op if released already). Tensors exported
    /// from it keep their own pins until they are gone.
    fn unpin(&self, py: Python<'_>) {
        let pin = self.pin.lock().take();
        py.detach(move || drop(pin));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.unpin(py);
        false
    }

    /// A DLPack capsule ("dltensor") over the pinned range: a 1-D tensor of
    /// this Pin's dtype, contiguous, on __dlpack_device__(). Keyword
    /// arguments follow the Python array API: stream is accepted and
    /// ignored (strata's writes are complete when they return);
    /// max_version is accepted (the capsule is the unversioned one);
    /// copy=True and a dl_device other than this one raise BufferError,
    /// since the export is always in place. Raises UnsupportedError where
    /// the range spans pages that are not adjacent in the tier (a range
    /// within one page always works), ClosedError after unpin().
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(i64, i64)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version);
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "strata exports its memory in place: copy=True is not supported",
            ));
        }
        if let Some(d) = dl_device {
            if d != self.__dlpack_device__() {
                return Err(PyBufferError::new_err(format!(
                    "the pin's memory is on DLPack device {:?}, not {d:?}",
                    self.__dlpack_device__()
                )));
            }
        }
        self.check_pinned()?;
        let len = self.range.end - self.range.start;
        let Exported(tensor) = py
            .detach(|| {
                strata_ffi::dlpack_export_pinned(
                    &self.rt,
                    &self.buf,
                    self.range.start,
                    len,
                    self.tier,
                    self.dtype,
                    self.writable,
                )
                .map(Exported)
            })
            .map_err(raise)?;
        let t = tensor.as_ptr();
        // SAFETY: `t` is a live tensor whose ownership passes to the
        // capsule; the name is a static string, as PyCapsule_New requires.
        let capsule =
            unsafe { ffi::PyCapsule_New(t.cast(), DLTENSOR.as_ptr(), Some(capsule_destructor)) };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so the tensor is still ours
            // and is deleted once, here.
            if let Some(deleter) = unsafe { (*t).deleter } {
                // SAFETY: as above.
                unsafe { deleter(t) };
            }
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new reference, just returned by PyCapsule_New.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
    }

    /// (device_type, device_id) of the pinned memory, as DLPack numbers
    /// them: (1, 0) for CPU memory (host, CXL, the simulated device), (2,
    /// 0) for a CUDA GPU's memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = strata_ffi::dlpack_device(&self.rt, self.tier);
        (d.device_type as i32, d.device_id)
    }

    fn __repr__(&self) -> String {
        format!(
            "strata.Pin(range=({}, {}), tier='{}', dtype='{}', pinned={})",
            self.range.start,
            self.range.end,
            self.tier.name(),
            self.dtype_name,
            if self.pinned() { "True" } else { "False" }
        )
    }
}
