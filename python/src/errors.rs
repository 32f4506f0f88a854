//! Errors: `strata.StrataError` and one subclass per [`ErrorKind`], each
//! carrying strata's one-line message as its text and the kind's stable
//! name and code as the class attributes `kind` and `code`. Kinds with an
//! obvious built-in counterpart also derive from it (`InvalidArgumentError`
//! is a `ValueError`, `NotFoundError` a `FileNotFoundError`, ...), so
//! `except ValueError` keeps working for callers who do not know strata.

use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use strata::ErrorKind;

/// Each kind: the class name, its docstring, and a built-in base beside
/// `StrataError` (if any).
type BuiltinBase = fn(Python<'_>) -> Bound<'_, PyType>;

fn value_error(py: Python<'_>) -> Bound<'_, PyType> {
    py.get_type::<PyValueError>()
}
fn os_error(py: Python<'_>) -> Bound<'_, PyType> {
    py.get_type::<PyOSError>()
}
fn not_found(py: Python<'_>) -> Bound<'_, PyType> {
    py.get_type::<PyFileNotFoundError>()
}
fn permission(py: Python<'_>) -> Bound<'_, PyType> {
    py.get_type::<PyPermissionError>()
}

const KINDS: [(ErrorKind, &str, &str, Option<BuiltinBase>); 10] = [
    (
        ErrorKind::InvalidArgument,
        "InvalidArgumentError",
        "A parameter or input was malformed or out of range (also a ValueError).",
        Some(value_error),
    ),
    (
        ErrorKind::NoDevice,
        "NoDeviceError",
        "No GPU (or no CUDA driver library) is available.",
        None,
    ),
    (
        ErrorKind::OutOfCapacity,
        "OutOfCapacityError",
        "A tier (or every tier) is full.",
        None,
    ),
    (
        ErrorKind::Io,
        "IoError",
        "An I/O operation failed (EIO and friends; also an OSError).",
        Some(os_error),
    ),
    (
        ErrorKind::NoSpace,
        "NoSpaceError",
        "The storage medium ran out of space (ENOSPC; also an OSError).",
        Some(os_error),
    ),
    (
        ErrorKind::Corrupted,
        "CorruptedError",
        "Data read back does not match its checksum.",
        None,
    ),
    (
        ErrorKind::Unsupported,
        "UnsupportedError",
        "The operation is not supported here (e.g. O_DIRECT on tmpfs).",
        None,
    ),
    (
        ErrorKind::Closed,
        "ClosedError",
        "The object was closed or released.",
        None,
    ),
    (
        ErrorKind::NotFound,
        "NotFoundError",
        "A path or object does not exist (also a FileNotFoundError).",
        Some(not_found),
    ),
    (
        ErrorKind::PermissionDenied,
        "PermissionDeniedError",
        "Permission denied by the operating system (also a PermissionError).",
        Some(permission),
    ),
];

struct Classes {
    base: Py<PyType>,
    kinds: Vec<(ErrorKind, Py<PyType>)>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// A class made as `class name(*bases)` with `attrs`, in module `strata`.
fn new_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: Bound<'py, PyTuple>,
    doc: &str,
    kind: Option<ErrorKind>,
) -> PyResult<Bound<'py, PyType>> {
    let attrs = PyDict::new(py);
    attrs.set_item("__module__", "strata")?;
    attrs.set_item("__doc__", doc)?;
    attrs.set_item("kind", kind.map(ErrorKind::name))?;
    attrs.set_item("code", kind.map(ErrorKind::code))?;
    let class = py.get_type::<PyType>().call1((name, bases, attrs))?;
    Ok(class.cast_into::<PyType>()?)
}

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let base = new_class(
            py,
            "StrataError",
            PyTuple::new(py, [py.get_type::<PyException>()])?,
            "The base of every error strata raises. `str(e)` is strata's one-line \
             message; `kind` (e.g. \"invalid argument\") and `code` (the C ABI's \
             status, negated) name the ErrorKind, None on this base class.",
            None,
        )?;
        let mut kinds = Vec::with_capacity(KINDS.len());
        for (kind, name, doc, builtin) in KINDS {
            let mut bases = vec![base.clone()];
            bases.extend(builtin.map(|b| b(py)));
            let class = new_class(py, name, PyTuple::new(py, bases)?, doc, Some(kind))?;
            kinds.push((kind, class.unbind()));
        }
        Ok(Classes {
            base: base.unbind(),
            kinds,
        })
    })
}

/// Adds the classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py)?;
    m.add("StrataError", c.base.bind(py))?;
    for (_, class) in &c.kinds {
        let class = class.bind(py);
        m.add(class.name()?, class)?;
    }
    Ok(())
}

/// The Python exception for a strata error: the class of its kind (the
/// base class for a kind newer than this binding), with its message.
pub(crate) fn raise(e: strata::Error) -> PyErr {
    Python::attach(|py| {
        let c = match classes(py) {
            Ok(c) => c,
            Err(err) => return err,
        };
        let class = c
            .kinds
            .iter()
            .find(|(k, _)| *k == e.kind())
            .map_or(&c.base, |(_, class)| class);
        PyErr::from_type(class.bind(py).clone(), e.message().to_owned())
    })
}

/// An `InvalidArgumentError` with this message.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    raise(strata::Error::invalid(message))
}
