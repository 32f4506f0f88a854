//! What an embedding table refuses, as typed errors: each names the bad
//! argument, and every refusal happens before anything is read or written.
#![forbid(unsafe_code)]

use crate::error::{Error, ErrorKind};

/// An embedding table's error: bad input (an index, offsets, a length, a
/// hyperparameter), or a failure of the runtime under the table.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddingError {
    /// An index outside `0..rows`.
    #[error("index {index} is out of range for an embedding table of {rows} rows")]
    IndexOutOfRange {
        /// The index.
        index: i64,
        /// Rows in the table.
        rows: u64,
    },
    /// A range of rows reaching outside the table (`write_rows`).
    #[error("rows {start}..{end} are out of range for an embedding table of {rows} rows")]
    RowsOutOfRange {
        /// The first row.
        start: i64,
        /// One past the last row.
        end: i128,
        /// Rows in the table.
        rows: u64,
    },
    /// Offsets that do not describe bags of the indices: they must start
    /// at 0, never decrease, and end at the number of indices.
    #[error("{0}")]
    Offsets(String),
    /// An array of the wrong length for the call.
    #[error("{what} holds {len} values, not {want} ({why})")]
    Length {
        /// The argument.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The length it must have.
        want: usize,
        /// Where that length comes from.
        why: String,
    },
    /// A row given twice to a fused update.
    #[error("rows repeat: a fused update takes each row once, its gradients summed (row {row})")]
    RepeatedRow {
        /// The first row seen twice.
        row: i64,
    },
    /// A table shape, option or hyperparameter out of range.
    #[error("{0}")]
    Invalid(String),
    /// The runtime failed (I/O, capacity, a lost page, ...).
    #[error(transparent)]
    Runtime(#[from] Error),
}

impl EmbeddingError {
    /// The [`ErrorKind`] of the error: `InvalidArgument` for every bad
    /// input, the runtime's own kind otherwise.
    pub fn kind(&self) -> ErrorKind {
        match self {
            EmbeddingError::Runtime(e) => e.kind(),
            _ => ErrorKind::InvalidArgument,
        }
    }

    /// Whether the error is an index or row range outside the table (what
    /// Python raises as `IndexError`).
    pub fn is_out_of_range(&self) -> bool {
        matches!(
            self,
            EmbeddingError::IndexOutOfRange { .. } | EmbeddingError::RowsOutOfRange { .. }
        )
    }
}

impl From<EmbeddingError> for Error {
    fn from(e: EmbeddingError) -> Self {
        match e {
            EmbeddingError::Runtime(e) => e,
            other => Error::new(other.kind(), other.to_string()),
        }
    }
}

/// `Result` with [`EmbeddingError`].
pub type Result<T, E = EmbeddingError> = std::result::Result<T, E>;
