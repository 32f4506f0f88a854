//! Reading the benches' input files.

use std::path::Path;

use strata::error::Error;

/// The error of a failed `action` ("reading") of `path`: bytes that are
/// not UTF-8 text are bad input, not an I/O failure.
pub fn read_error(action: &str, path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::InvalidData {
        Error::invalid(format!("{} is not a text file ({e})", path.display()))
    } else {
        Error::io(format!("{action} {}", path.display()), e)
    }
}
