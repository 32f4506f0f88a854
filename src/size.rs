//! Byte sizes as people write them on a command line or in a config file:
//! `4096`, `4k`, `64KiB`, `1M`, `2G`. Suffixes are binary (k = 1024).

use crate::error::{Error, Result};

/// Parses a byte size with an optional binary suffix (k, m, g, t; an optional
/// trailing `b`/`ib`; case-insensitive).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(Error::invalid(format!(
            "size {text:?} is not a number (expected e.g. 4096, 4k, 1M, 2G)"
        )));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| Error::invalid(format!("size {text:?} is too large")))?;
    if suffix.starts_with(['.', ',']) {
        return Err(Error::invalid(format!(
            "size {text:?} is not a whole number of its unit (write e.g. 1536k for 1.5M)"
        )));
    }
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(Error::invalid(format!(
                "size {text:?} has an unknown suffix {:?} (use k, M, G or T)",
                suffix.trim()
            )))
        }
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| Error::invalid(format!("size {text:?} is too large")))
}

/// Formats a byte count compactly with a binary suffix (`64K`, `1.5G`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut unit = 0;
    let mut v = bytes as f64;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else if v.fract() == 0.0 {
        format!("{}{}", v as u64, UNITS[unit])
    } else {
        format!("{v:.1}{}", UNITS[unit])
    }
}

/// Formats a rate in bytes per second in decimal units (as disks and links are quoted).
pub fn format_rate(bytes_per_sec: f64) -> String {
    if bytes_per_sec >= 1e9 {
        format!("{:.2} GB/s", bytes_per_sec / 1e9)
    } else {
        format!("{:.1} MB/s", bytes_per_sec / 1e6)
    }
}

/// The smallest and largest page sizes strata supports.
pub const MIN_PAGE_SIZE: usize = 4096;
/// Default page size: 64 KiB.
pub const DEFAULT_PAGE_SIZE: usize = 64 << 10;
/// See [`MIN_PAGE_SIZE`].
pub const MAX_PAGE_SIZE: usize = 2 << 20;

/// Checks that `page_size` is a power of two between 4 KiB and 2 MiB.
pub fn check_page_size(page_size: usize) -> Result<()> {
    if !page_size.is_power_of_two() {
        return Err(Error::invalid(format!(
            "page size {page_size} is not a power of two"
        )));
    }
    if !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size) {
        return Err(Error::invalid(format!(
            "page size {} is outside 4K..2M",
            format_size(page_size as u64)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size(" 3 gb ").unwrap(), 3 << 30);
    }

    #[test]
    fn a_fraction_or_an_unknown_suffix_is_named_as_typed() {
        let e = parse_size("1.5M").unwrap_err();
        assert!(e.message().contains("whole number"), "{e}");
        let e = parse_size("4Q").unwrap_err();
        assert!(e.message().contains("suffix \"Q\""), "{e}");
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "k", "12q", "-4k", "99999999999999999999", "16777216T"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn page_sizes() {
        assert!(check_page_size(4096).is_ok());
        assert!(check_page_size(2 << 20).is_ok());
        assert!(check_page_size(3 << 12)
            .unwrap_err()
            .message()
            .contains("power of two"));
        assert!(check_page_size(2048).is_err());
        assert!(check_page_size(4 << 20).is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(65536), "64K");
        assert_eq!(format_size(1536 << 20), "1.5G");
        assert_eq!(format_size(100), "100B");
    }
}
