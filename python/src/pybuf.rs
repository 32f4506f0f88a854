//! The buffer protocol (PEP 3118): borrow the bytes of any contiguous
//! buffer-protocol object (bytes, bytearray, memoryview, array.array, a
//! NumPy array …) for the length of one call.
//!
//! `Py_buffer`, `PyObject_GetBuffer` and `PyBuffer_Release` entered the
//! stable ABI only in Python 3.11, so PyO3 offers `PyBuffer` to abi3
//! builds for 3.11+ only. This module declares the three itself, for the
//! abi3-py39 build: on CPython they are public API with this exact layout
//! since 3.3 (3.11 froze the layout as it was), so the declarations hold on
//! every version the wheel loads into.

use std::ffi::{c_char, c_int, c_void};
use std::marker::PhantomData;

use pyo3::ffi;
use pyo3::prelude::*;

/// CPython's `Py_buffer`.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// The bytes of a C-contiguous buffer-protocol object, exported to us until
/// this guard drops (with the GIL held: the guard lives in `'py` and is not
/// `Send`, so it cannot be dropped inside `Python::detach`).
pub(crate) struct Contiguous<'py> {
    /// Boxed: an exporter may keep the view's address until its release.
    view: Box<RawBuffer>,
    _gil: PhantomData<Python<'py>>,
}

impl<'py> Contiguous<'py> {
    fn get(obj: &Bound<'py, PyAny>, flags: c_int) -> PyResult<Self> {
        let mut view = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (we hold the GIL through `'py`);
        // `view` is a writable Py_buffer. On failure the exporter raised
        // (TypeError for a non-buffer, BufferError for a non-contiguous or
        // read-only one) and filled nothing that needs releasing.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Self {
            view,
            _gil: PhantomData,
        })
    }

    /// Any C-contiguous buffer, read-only or not.
    pub(crate) fn readable(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Self::get(obj, PYBUF_C_CONTIGUOUS | PYBUF_FORMAT)
    }

    /// A C-contiguous buffer we may write into (bytes, for one, is refused
    /// by its exporter with a BufferError).
    pub(crate) fn writable(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Self::get(obj, PYBUF_C_CONTIGUOUS | PYBUF_WRITABLE | PYBUF_FORMAT)
    }

    /// Refuses a buffer whose elements are declared to be of another type
    /// than `codes` (the `struct` codes of the type wanted, native order):
    /// a float64 array read as float32 would be garbage. Untyped bytes
    /// ("B") pass as they are.
    pub(crate) fn check_type(&self, codes: &[&str], wanted: &str, what: &str) -> PyResult<()> {
        let format = self.format();
        let code = format.trim_start_matches(['@', '=', '<']);
        if code == "B" || codes.contains(&code) {
            return Ok(());
        }
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} holds elements of format {format:?}; it must be {wanted}"
        )))
    }

    /// The element type in `struct` module syntax ("f", "<q", ...); "B"
    /// (unsigned bytes) where the exporter names none, as PEP 3118 reads it.
    pub(crate) fn format(&self) -> std::borrow::Cow<'_, str> {
        if self.view.format.is_null() {
            return "B".into();
        }
        // SAFETY: asked for with PyBUF_FORMAT, a non-null `format` is a
        // NUL-terminated string the exporter keeps until the release in
        // `drop`, which the borrow of `self` outlasts.
        unsafe { std::ffi::CStr::from_ptr(self.view.format) }.to_string_lossy()
    }

    fn len(&self) -> usize {
        // A length is never negative (CPython's invariant).
        usize::try_from(self.view.len).unwrap_or(0)
    }

    /// The exported bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.len() == 0 || self.view.buf.is_null() {
            return &[];
        }
        // SAFETY: the exporter guarantees `len` contiguous bytes at `buf`
        // until the release in `drop`, which the borrow of `self` outlasts.
        // Another Python thread may write into a mutable buffer meanwhile,
        // as with `FileIO.write`, which also reads a buffer with the GIL
        // released: the bytes read are then the caller's race, not unsound
        // memory.
        unsafe { std::slice::from_raw_parts(self.view.buf.cast::<u8>(), self.len()) }
    }

    /// The exported bytes, to write into (only from [`Self::writable`]).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len() == 0 || self.view.buf.is_null() || self.view.readonly != 0 {
            return &mut [];
        }
        // SAFETY: as in `as_slice`; the exporter granted PyBUF_WRITABLE
        // (`readonly` is 0), and `&mut self` keeps this the only slice.
        unsafe { std::slice::from_raw_parts_mut(self.view.buf.cast::<u8>(), self.len()) }
    }
}

impl Drop for Contiguous<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer
        // and is released exactly once, here, with the GIL held (`'py`).
        unsafe { PyBuffer_Release(&mut *self.view) };
    }
}
