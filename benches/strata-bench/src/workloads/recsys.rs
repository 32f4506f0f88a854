//! The recommender workload: DLRM-style embedding bags (sum pooling) over
//! embedding tables in tiered buffers, read through device maps on the
//! simulated device, beside an FBGEMM-style LRU row cache, zero-copy and
//! everything on the device (`strata bench recsys`).
//!
//! Indices are drawn per table from Zipf(α) over row ids with rank = id (row
//! 0 the most popular, as the synthetic generators of DLRM and FBGEMM's
//! benchmarks do), uniformly, or replayed from a file (one batch per line,
//! `table:row` items separated by spaces; the items of a line are split
//! into the batch's bags in order).
#![forbid(unsafe_code)]

use std::io::BufRead;
use std::path::Path;

use rayon::prelude::*;

use strata::{Error, Result};

use crate::random::{Rng, Zipf};

/// How indices are drawn.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Dist {
    /// Zipf(α) over row ids, rank = id.
    Zipf {
        /// The exponent.
        alpha: f64,
    },
    /// Uniform over rows.
    Uniform,
    /// Batches replayed from a file.
    File {
        /// The file.
        path: std::path::PathBuf,
    },
}

impl std::str::FromStr for Dist {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "uniform" {
            return Ok(Dist::Uniform);
        }
        if let Some(a) = s.strip_prefix("zipf:") {
            let alpha: f64 = a
                .parse()
                .map_err(|_| Error::invalid(format!("--dist {s:?}: not a number after zipf:")))?;
            if !(alpha > 0.0 && alpha < 10.0) {
                return Err(Error::invalid(format!(
                    "--dist {s:?}: α must be in (0, 10)"
                )));
            }
            return Ok(Dist::Zipf { alpha });
        }
        if let Some(p) = s.strip_prefix("file:") {
            if !p.is_empty() {
                return Ok(Dist::File { path: p.into() });
            }
        }
        Err(Error::invalid(format!(
            "--dist {s:?}: use zipf:ALPHA, uniform or file:PATH"
        )))
    }
}

/// One batch: for each table, `batch` bags of `pooling` row ids each,
/// flattened (`ids[table][bag * pooling + k]`).
pub type Batch = Vec<Vec<u32>>;

/// Generates `batches` batches.
pub fn generate(
    dist: &Dist,
    tables: usize,
    rows: usize,
    batch: usize,
    pooling: usize,
    batches: usize,
    seed: u64,
) -> Result<Vec<Batch>> {
    let zipf = match dist {
        Dist::Zipf { alpha } => Some(Zipf::new(rows as u64, *alpha)?),
        Dist::Uniform => None,
        Dist::File { path } => return read_batches(path, tables, rows, batch, pooling),
    };
    Ok((0..batches)
        .into_par_iter()
        .map(|b| {
            (0..tables)
                .map(|t| {
                    let mut rng = Rng::new(stream(seed, b, t));
                    (0..batch * pooling)
                        .map(|_| match &zipf {
                            Some(z) => (z.sample(&mut rng) - 1) as u32,
                            None => rng.below(rows as u64) as u32,
                        })
                        .collect()
                })
                .collect()
        })
        .collect())
}

/// The seed of table `t`'s draws in batch `b`: the seed, the batch in bits
/// 20 and up, and for every table but the first a hash of its number.
/// XORing the table number itself made every seed below 8 draw the same
/// streams for 8 tables, handed to the tables in another order (the same
/// workload under another seed). Table 0 keeps the stream it has always
/// had: `strata trace gen --kind emb` draws its tables one at a time
/// through it, and its traces are the same in every release.
fn stream(seed: u64, b: usize, t: usize) -> u64 {
    let table = if t == 0 {
        0
    } else {
        strata::hotness::mix(t as u64)
    };
    seed ^ table ^ (b as u64) << 20
}

fn read_batches(
    path: &Path,
    tables: usize,
    rows: usize,
    batch: usize,
    pooling: usize,
) -> Result<Vec<Batch>> {
    let file = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| crate::files::read_error("reading", path, e))?;
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let bad = |why: String| Error::invalid(format!("{} line {}: {why}", path.display(), i + 1));
        let mut b: Batch = vec![Vec::new(); tables];
        for item in t.split_whitespace() {
            let (tab, row) = item
                .split_once(':')
                .ok_or_else(|| bad(format!("{item:?} is not table:row")))?;
            let tab: usize = tab
                .parse()
                .map_err(|_| bad(format!("{item:?}: bad table")))?;
            let row: u32 = row.parse().map_err(|_| bad(format!("{item:?}: bad row")))?;
            if tab >= tables || row as usize >= rows {
                return Err(bad(format!(
                    "{item:?} is outside {tables} tables of {rows} rows"
                )));
            }
            b[tab].push(row);
        }
        // Each table's items fill `batch` bags of `pooling`, cycling when
        // the line has fewer; more would be dropped.
        for (tab, ids) in b.iter_mut().enumerate() {
            if ids.is_empty() {
                return Err(bad("a table has no item on this line".into()));
            }
            if ids.len() > batch * pooling {
                return Err(bad(format!(
                    "table {tab} has {} items, more than --batch {batch} × --pooling {pooling}",
                    ids.len()
                )));
            }
            let src = ids.clone();
            *ids = (0..batch * pooling).map(|k| src[k % src.len()]).collect();
        }
        out.push(b);
    }
    if out.is_empty() {
        return Err(Error::invalid(format!("{} holds no batch", path.display())));
    }
    Ok(out)
}

/// The value of element `d` of row `r` of table `t` (tables are filled
/// with it, and verification recomputes it).
#[inline]
pub fn value(t: usize, r: usize, d: usize) -> f32 {
    let h = strata::hotness::mix((t as u64) << 40 ^ (r as u64) << 12 ^ d as u64);
    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_puts_most_mass_on_low_ranks() {
        let b = generate(&Dist::Zipf { alpha: 1.05 }, 1, 1000, 100, 100, 1, 7).unwrap();
        let draws = &b[0][0];
        assert_eq!(draws.len(), 10_000);
        let top = draws.iter().filter(|&&r| r < 100).count();
        assert!(top > 6_000, "{top}");
        assert!(draws.iter().all(|&r| r < 1000));
    }

    #[test]
    fn another_seed_is_another_draw() {
        // 8 tables: seeds 1 and 2 once drew the same 8 streams, permuted.
        let dist = Dist::Zipf { alpha: 1.05 };
        let a = generate(&dist, 8, 100_000, 64, 4, 2, 1).unwrap();
        let b = generate(&dist, 8, 100_000, 64, 4, 2, 2).unwrap();
        for (ba, bb) in a.iter().zip(&b) {
            for ta in ba {
                assert!(
                    bb.iter().all(|tb| tb != ta),
                    "a table's draws repeat under another seed"
                );
            }
        }
        // The same seed, the same draws.
        assert_eq!(a, generate(&dist, 8, 100_000, 64, 4, 2, 1).unwrap());
    }

    #[test]
    fn a_single_table_draws_as_it_always_has() {
        // `strata trace gen --kind emb`'s traces depend on it.
        let dist = Dist::Zipf { alpha: 1.05 };
        let z = Zipf::new(1000, 1.05).unwrap();
        let got = generate(&dist, 1, 1000, 8, 2, 3, 42).unwrap();
        for (b, batch) in got.iter().enumerate() {
            let mut rng = Rng::new(42 ^ (b as u64) << 20);
            let want: Vec<u32> = (0..16).map(|_| (z.sample(&mut rng) - 1) as u32).collect();
            assert_eq!(batch[0], want, "batch {b}");
        }
    }

    #[test]
    fn dists_parse() {
        assert_eq!(
            "zipf:1.05".parse::<Dist>().unwrap(),
            Dist::Zipf { alpha: 1.05 }
        );
        assert_eq!("uniform".parse::<Dist>().unwrap(), Dist::Uniform);
        for bad in ["zipf:", "zipf:x", "zipf:-1", "normal", "file:"] {
            assert!(bad.parse::<Dist>().is_err(), "{bad}");
        }
    }
}
