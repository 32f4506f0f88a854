//! Page-access traces: the file format, a reader and a writer. (The
//! synthetic generators live in the `strata-bench` crate.)
//!
//! The format (a stable interface: `strata trace`, tests and users read it)
//! is text, one decimal page id per access per line;
//! lines starting with `#` are comments and blank lines are ignored. Leading
//! and trailing whitespace on a line is ignored too.
//!
//! ```
//! use strata::trace;
//! let t = trace::parse("# a comment\n3\n\n 5\n3\n".as_bytes())?;
//! assert_eq!(t, [3, 5, 3]);
//! # Ok::<(), strata::Error>(())
//! ```

#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// Reads a trace file.
pub fn read(path: &Path) -> Result<Vec<u64>> {
    let file = File::open(path).map_err(|e| Error::io(format!("trace {}", path.display()), e))?;
    parse(BufReader::with_capacity(1 << 20, file))
        .map_err(|e| e.context(format!("trace {}", path.display())))
}

/// Parses a trace. A malformed line is an [`ErrorKind::InvalidArgument`]
/// error naming its line number.
///
/// [`ErrorKind::InvalidArgument`]: crate::error::ErrorKind::InvalidArgument
pub fn parse(mut reader: impl BufRead) -> Result<Vec<u64>> {
    let mut trace = Vec::new();
    let mut line = Vec::with_capacity(64);
    let mut number = 0u64;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| Error::io(format!("line {}", number + 1), e))?;
        if n == 0 {
            return Ok(trace);
        }
        number += 1;
        let text = line.trim_ascii();
        if text.is_empty() || text[0] == b'#' {
            continue;
        }
        match parse_page(text) {
            Some(page) => trace.push(page),
            None => {
                let shown: String = String::from_utf8_lossy(text).chars().take(40).collect();
                return Err(Error::invalid(format!(
                    "line {number}: expected a decimal page id, got {shown:?}"
                )));
            }
        }
    }
}

fn parse_page(text: &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for &b in text {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

/// Writes `trace` in the file format, after `comment` (each of its lines
/// prefixed with `# `; nothing when empty).
pub fn write(mut out: impl Write, trace: &[u64], comment: &str) -> std::io::Result<()> {
    for line in comment.lines() {
        writeln!(out, "# {line}")?;
    }
    let mut buf = [0u8; 21];
    for &page in trace {
        let mut i = buf.len() - 1;
        buf[i] = b'\n';
        let mut v = page;
        loop {
            i -= 1;
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        out.write_all(&buf[i..])?;
    }
    out.flush()
}

/// Writes `trace` to a new file at `path` (replacing one that exists).
pub fn write_file(path: &Path, trace: &[u64], comment: &str) -> Result<()> {
    let file = File::create(path).map_err(|e| Error::io(format!("{}", path.display()), e))?;
    write(BufWriter::with_capacity(1 << 20, file), trace, comment)
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let t = vec![0, 1, u64::MAX, 42];
        let mut out = Vec::new();
        write(&mut out, &t, "two\nlines").unwrap();
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(text.starts_with("# two\n# lines\n0\n1\n"));
        assert_eq!(parse(&out[..]).unwrap(), t);
    }

    #[test]
    fn malformed_lines_name_their_number() {
        let e = parse("1\n# c\n\n2x\n".as_bytes()).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidArgument);
        assert!(e.message().starts_with("line 4:"), "{}", e.message());
        let e = parse("99999999999999999999999\n".as_bytes()).unwrap_err();
        assert!(e.message().starts_with("line 1:"));
        assert!(parse("-1\n".as_bytes()).is_err());
        assert_eq!(parse("7\r\n8".as_bytes()).unwrap(), [7, 8]);
    }
}
