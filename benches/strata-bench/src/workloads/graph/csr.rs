//! Graphs in compressed sparse row form, from the Graph500 Kronecker
//! generator, uniform random edges, or GAP edge-list files.
#![forbid(unsafe_code)]

use std::io::{BufRead, Read};
use std::path::Path;

use rayon::prelude::*;

use strata::error::{Error, Result};

/// Graph500's Kronecker initiator probabilities (D = 1 − A − B − C).
pub const KRON_A: f64 = 0.57;
/// See [`KRON_A`].
pub const KRON_B: f64 = 0.19;
/// See [`KRON_A`].
pub const KRON_C: f64 = 0.19;

/// Largest vertex id a file may use (2^28 vertices: 2 GiB of offsets).
pub const MAX_VERTEX: u32 = (1 << 28) - 1;
/// Largest edge weight a `.wel` file may use (delta-stepping's buckets are
/// dense up to the largest distance over the bucket width).
pub const MAX_WEIGHT: u32 = 1 << 16;

/// Longest line an edge-list file may have (a comment included).
pub const MAX_LINE: usize = 1 << 16;

/// Where a graph comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum GraphSpec {
    /// Kronecker (Graph500), 2^scale vertices, edge_factor·2^scale edges,
    /// undirected.
    Kron {
        /// log2 of the vertex count.
        scale: u32,
        /// Edges per vertex.
        edge_factor: u32,
    },
    /// Uniform random endpoints, undirected.
    Urand {
        /// log2 of the vertex count.
        scale: u32,
        /// Edges per vertex.
        edge_factor: u32,
    },
    /// A GAP `.el` / `.wel` file: one directed edge per line.
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Add the reverse of every edge.
        undirected: bool,
    },
}

impl std::str::FromStr for GraphSpec {
    type Err = Error;
    /// `kron:SCALE[:EDGEFACTOR]`, `urand:SCALE[:EDGEFACTOR]` or `file:PATH`
    /// (`--undirected` is set separately).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(format!(
                "graph {s:?}: use kron:SCALE[:EDGEFACTOR], urand:SCALE[:EDGEFACTOR] or file:PATH"
            ))
        };
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        if kind == "file" {
            if rest.is_empty() {
                return Err(bad());
            }
            return Ok(GraphSpec::File {
                path: rest.into(),
                undirected: false,
            });
        }
        let mut parts = rest.split(':');
        let scale: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let edge_factor: u32 = match parts.next() {
            Some(p) => p.parse().map_err(|_| bad())?,
            None => 16,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        if !(1..=30).contains(&scale) || !(1..=1024).contains(&edge_factor) {
            return Err(Error::invalid(format!(
                "graph {s:?}: scale must be 1..30 and the edge factor 1..1024"
            )));
        }
        match kind {
            "kron" => Ok(GraphSpec::Kron { scale, edge_factor }),
            "urand" => Ok(GraphSpec::Urand { scale, edge_factor }),
            _ => Err(bad()),
        }
    }
}

/// A graph in CSR form, in host memory. Directed graphs also carry their
/// transpose (incoming edges), which pull-style kernels read.
#[derive(Debug, Clone)]
pub struct Csr {
    /// `offsets[v]..offsets[v+1]` index `neighbors` (and `weights`).
    pub offsets: Vec<u64>,
    /// Out-neighbours, sorted per vertex, no self loops or duplicates.
    pub neighbors: Vec<u32>,
    /// Edge weights (1..=255 for generated graphs).
    pub weights: Vec<u32>,
    /// Incoming edges, for directed graphs (`None`: same as outgoing).
    pub incoming: Option<(Vec<u64>, Vec<u32>)>,
}

impl Csr {
    /// Vertex count.
    pub fn vertices(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Directed edge count (an undirected edge counts twice).
    pub fn edges(&self) -> u64 {
        self.neighbors.len() as u64
    }

    /// Out-degree of `v`.
    pub fn degree(&self, v: usize) -> u64 {
        self.offsets[v + 1] - self.offsets[v]
    }

    /// Out-neighbours of `v`.
    pub fn adjacency(&self, v: usize) -> &[u32] {
        &self.neighbors[self.offsets[v] as usize..self.offsets[v + 1] as usize]
    }

    /// In-neighbours of `v`.
    pub fn incoming(&self, v: usize) -> &[u32] {
        match &self.incoming {
            Some((o, n)) => &n[o[v] as usize..o[v + 1] as usize],
            None => self.adjacency(v),
        }
    }

    /// Whether edges have a direction.
    pub fn directed(&self) -> bool {
        self.incoming.is_some()
    }

    /// Bytes of the arrays a kernel reads.
    pub fn bytes(&self) -> u64 {
        let inc = self
            .incoming
            .as_ref()
            .map_or(0, |(o, n)| o.len() as u64 * 8 + n.len() as u64 * 4);
        self.offsets.len() as u64 * 8 + self.neighbors.len() as u64 * 8 + inc
    }

    /// An upper bound of the memory [`Csr::load`] needs at its peak, in
    /// bytes: generating holds every edge twice as (u32, u32, u32) while
    /// collecting (24 bytes per edge each way) beside the labels and the
    /// offsets; an edge-list file has at most one edge per 4 bytes, each
    /// held as a triple, in the CSR and (directed) in the transpose.
    pub fn memory_estimate(spec: &GraphSpec) -> u64 {
        match spec {
            GraphSpec::Kron { scale, edge_factor } | GraphSpec::Urand { scale, edge_factor } => {
                let n = 1u64 << scale;
                let m = n.saturating_mul(*edge_factor as u64);
                m.saturating_mul(48).saturating_add(n.saturating_mul(12))
            }
            GraphSpec::File { path, undirected } => {
                let len = std::fs::metadata(path).map_or(0, |m| m.len());
                (len / 4)
                    .saturating_mul(36)
                    .saturating_mul(if *undirected { 2 } else { 1 })
            }
        }
    }

    /// Builds the graph `spec` describes, after checking
    /// [`Csr::memory_estimate`] against the memory available.
    pub fn load(spec: &GraphSpec, seed: u64) -> Result<Self> {
        let what = match spec {
            GraphSpec::Kron { scale, edge_factor } => format!("--graph kron:{scale}:{edge_factor}"),
            GraphSpec::Urand { scale, edge_factor } => {
                format!("--graph urand:{scale}:{edge_factor}")
            }
            GraphSpec::File { path, .. } => format!("--graph file:{}", path.display()),
        };
        crate::machine::check_memory(
            what,
            "its edges and CSR arrays",
            Self::memory_estimate(spec),
        )?;
        match spec {
            GraphSpec::Kron { scale, edge_factor } => {
                Ok(generate(*scale, *edge_factor, seed, true))
            }
            GraphSpec::Urand { scale, edge_factor } => {
                Ok(generate(*scale, *edge_factor, seed, false))
            }
            GraphSpec::File { path, undirected } => read_edge_list(path, *undirected),
        }
    }

    /// From directed edges `(src, dst, weight)` over `n` vertices: self loops
    /// dropped, duplicates merged (the smallest weight kept, as the GAP
    /// suite's builder does), neighbours sorted.
    pub fn from_edges(n: usize, mut edges: Vec<(u32, u32, u32)>, directed: bool) -> Self {
        edges.retain(|e| e.0 != e.1);
        // Sorted by weight too, so the kept duplicate does not depend on
        // the sort's order among equal keys.
        edges.par_sort_unstable();
        edges.dedup_by_key(|e| (e.0, e.1));
        let (offsets, neighbors, weights) = compress(n, &edges);
        let incoming = directed.then(|| {
            let mut rev: Vec<(u32, u32, u32)> = edges.par_iter().map(|e| (e.1, e.0, e.2)).collect();
            rev.par_sort_unstable_by_key(|e| (e.0, e.1));
            let (o, n, _) = compress(n, &rev);
            (o, n)
        });
        Csr {
            offsets,
            neighbors,
            weights,
            incoming,
        }
    }
}

fn compress(n: usize, sorted: &[(u32, u32, u32)]) -> (Vec<u64>, Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0u64; n + 1];
    for e in sorted {
        offsets[e.0 as usize + 1] += 1;
    }
    for v in 0..n {
        offsets[v + 1] += offsets[v];
    }
    let neighbors = sorted.par_iter().map(|e| e.1).collect();
    let weights = sorted.par_iter().map(|e| e.2).collect();
    (offsets, neighbors, weights)
}

/// A weight in 1..=255 for the undirected edge {u, v}, the same both ways.
fn weight(u: u32, v: u32, seed: u64) -> u32 {
    let (a, b) = if u < v { (u, v) } else { (v, u) };
    (strata::hotness::mix(((a as u64) << 32 | b as u64) ^ seed) % 255) as u32 + 1
}

/// Kronecker (Graph500 initiator, vertex labels permuted) or uniform random
/// undirected graph with weights.
fn generate(scale: u32, edge_factor: u32, seed: u64, kron: bool) -> Csr {
    let n = 1usize << scale;
    let m = n as u64 * edge_factor as u64;
    // A random permutation of vertex labels, so that degree does not follow
    // the id (Graph500 does this too).
    let mut perm: Vec<u32> = (0..n as u32).collect();
    let mut s = strata::hotness::mix(seed ^ 0x5EED);
    for i in (1..n).rev() {
        s = strata::hotness::mix(s);
        perm.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let chunk = 1u64 << 16;
    let edges: Vec<(u32, u32, u32)> = (0..m.div_ceil(chunk))
        .into_par_iter()
        .flat_map_iter(|c| {
            let mut s = strata::hotness::mix(seed ^ (c + 1).wrapping_mul(0x9E37_79B9));
            let end = ((c + 1) * chunk).min(m);
            let perm = &perm;
            (c * chunk..end).flat_map(move |_| {
                let (mut u, mut v) = (0u64, 0u64);
                if kron {
                    for _ in 0..scale {
                        s = strata::hotness::mix(s);
                        let r = (s >> 11) as f64 / (1u64 << 53) as f64;
                        let (bu, bv) = if r < KRON_A {
                            (0, 0)
                        } else if r < KRON_A + KRON_B {
                            (0, 1)
                        } else if r < KRON_A + KRON_B + KRON_C {
                            (1, 0)
                        } else {
                            (1, 1)
                        };
                        u = u << 1 | bu;
                        v = v << 1 | bv;
                    }
                } else {
                    s = strata::hotness::mix(s);
                    u = s % n as u64;
                    s = strata::hotness::mix(s);
                    v = s % n as u64;
                }
                let (u, v) = (perm[u as usize], perm[v as usize]);
                let w = weight(u, v, seed);
                [(u, v, w), (v, u, w)]
            })
        })
        .collect();
    Csr::from_edges(n, edges, false)
}

/// A GAP edge list: `src dst` (`.el`) or `src dst weight` (`.wel`) per
/// line, `#` comments; vertex count = largest id + 1.
fn read_edge_list(path: &Path, undirected: bool) -> Result<Csr> {
    let file = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("opening graph {}", path.display()), e))?;
    let weighted = path.extension().is_some_and(|e| e == "wel");
    let mut edges = Vec::new();
    let mut max = 0u32;
    let mut reader = std::io::BufReader::new(file);
    let mut raw = Vec::new();
    for i in 0.. {
        raw.clear();
        // At most one line more than the longest an edge list has: a
        // binary file's "line" can be the whole file.
        let read = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut raw)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        if read == 0 {
            break;
        }
        // Bytes that are not text (a NUL, or not UTF-8), or a line longer
        // than any edge list has: not an edge list at all.
        let not_list = |why: &str| {
            Error::invalid(format!(
                "{} line {}: {why}, so not an edge list (one `src dst{}` per line)",
                path.display(),
                i + 1,
                if weighted { " weight" } else { "" }
            ))
        };
        if raw.len() > MAX_LINE {
            return Err(not_list(&format!("over {MAX_LINE} bytes")));
        }
        let line = std::str::from_utf8(&raw)
            .ok()
            .filter(|t| !t.contains('\0'))
            .ok_or_else(|| not_list("not text"))?;
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let bad =
            |why: &str| Error::invalid(format!("{} line {}: {why}: {t:?}", path.display(), i + 1));
        let f: Vec<&str> = t.split_whitespace().collect();
        let want = if weighted { 3 } else { 2 };
        if f.len() != want {
            return Err(bad(if weighted {
                "expected `src dst weight`"
            } else {
                "expected `src dst`"
            }));
        }
        let id = |s: &str| s.parse::<u32>().map_err(|_| bad("not a vertex id"));
        let (u, v) = (id(f[0])?, id(f[1])?);
        if u > MAX_VERTEX || v > MAX_VERTEX {
            return Err(bad(&format!("vertex id above {MAX_VERTEX}")));
        }
        let w = if weighted {
            match f[2].parse::<u32>() {
                Ok(w) if (1..=MAX_WEIGHT).contains(&w) => w,
                _ => return Err(bad(&format!("not an integer weight in 1..={MAX_WEIGHT}"))),
            }
        } else {
            weight(u, v, 0)
        };
        max = max.max(u).max(v);
        edges.push((u, v, w));
        if undirected {
            edges.push((v, u, w));
        }
    }
    // The file's length bounds its edges, not its vertices: an id far
    // above the others makes every per-vertex array that long (about 48
    // bytes a vertex over the CSR and the kernels' arrays).
    crate::machine::check_memory(
        format_args!("--graph file:{}", path.display()),
        &format!("vertex ids up to {max}, per-vertex arrays of that length"),
        (max as u64 + 1).saturating_mul(48),
    )?;
    let g = Csr::from_edges(max as usize + 1, edges, !undirected);
    if g.edges() == 0 {
        return Err(Error::invalid(format!(
            "{} holds no edge between two different vertices",
            path.display()
        )));
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_are_named() {
        assert_eq!(
            "kron:10".parse::<GraphSpec>().unwrap(),
            GraphSpec::Kron {
                scale: 10,
                edge_factor: 16
            }
        );
        assert_eq!(
            "urand:8:4".parse::<GraphSpec>().unwrap(),
            GraphSpec::Urand {
                scale: 8,
                edge_factor: 4
            }
        );
        for bad in ["kron", "kron:x", "kron:0", "torus:4", "file:", "kron:4:4:4"] {
            assert!(bad.parse::<GraphSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn duplicate_edges_keep_the_smallest_weight() {
        let edges = vec![
            (0, 1, 9),
            (0, 1, 3),
            (1, 2, 5),
            (0, 1, 7),
            (2, 2, 1),
            (1, 2, 4),
        ];
        let g = Csr::from_edges(3, edges, true);
        assert_eq!(g.edges(), 2);
        assert_eq!(g.adjacency(0), [1]);
        assert_eq!(g.adjacency(1), [2]);
        assert_eq!(g.weights, [3, 4]);
    }

    #[test]
    fn generated_graphs_are_symmetric_without_loops() {
        for kron in [true, false] {
            let g = generate(8, 8, 3, kron);
            assert_eq!(g.vertices(), 256);
            assert!(g.edges() > 0 && g.edges() <= 2 * 256 * 8);
            for v in 0..g.vertices() {
                let a = g.adjacency(v);
                assert!(a.windows(2).all(|w| w[0] < w[1]), "sorted, no duplicates");
                for &u in a {
                    assert_ne!(u as usize, v);
                    assert!(g.adjacency(u as usize).binary_search(&(v as u32)).is_ok());
                }
            }
        }
        // Kronecker degrees are skewed; uniform ones are not.
        let k = generate(12, 16, 1, true);
        let max = (0..k.vertices()).map(|v| k.degree(v)).max().unwrap();
        assert!(max > 20 * 32, "kron max degree {max}");
    }
}
