//! Python values to strata's: tiers from their names, byte ranges from
//! `(start, stop)` tuples, offsets from ints. Bad values become
//! `InvalidArgumentError`s (a `ValueError`) with a one-line message; values
//! of the wrong type stay `TypeError`s, as Python reports them.

use std::ops::Range;

use pyo3::prelude::*;
use strata::Tier;

use crate::errors::{invalid, raise};

/// A tier from its name: "device", "host", "cxl" or "nvme".
pub(crate) fn tier(name: &str) -> PyResult<Tier> {
    name.parse().map_err(raise)
}

/// A byte offset or count: a non-negative int.
pub(crate) fn offset(value: i64, what: &str) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| invalid(format!("{what} {value} is negative")))
}

/// A byte range: `None` for the whole buffer of `len` bytes, or a
/// `(start, stop)` tuple of byte offsets, half-open like a slice, within
/// the `len` bytes of the object `of` names ("buffer", "expert").
pub(crate) fn byte_range(range: Option<(i64, i64)>, len: u64, of: &str) -> PyResult<Range<u64>> {
    let Some((start, stop)) = range else {
        return Ok(0..len);
    };
    let (Ok(s), Ok(e)) = (u64::try_from(start), u64::try_from(stop)) else {
        return Err(invalid(format!(
            "range ({start}, {stop}): offsets must be non-negative"
        )));
    };
    if e < s {
        return Err(invalid(format!(
            "range ({start}, {stop}) ends before it starts"
        )));
    }
    if e > len {
        return Err(invalid(format!(
            "range {s}..{e} is outside the {of}'s {len} bytes"
        )));
    }
    Ok(s..e)
}
