//! Synthetic data: the page-access trace generators (Zipf, loops, scan-polluted hot sets, and
//! the page traces of BFS and PageRank over a CSR graph) in the trace format
//! of [`strata::trace`].
//!
//! ```
//! let z = strata_bench::gen::zipf(1.0, 1000, 10_000, 7)?;
//! assert_eq!(z.len(), 10_000);
//! assert!(z.iter().all(|&p| p < 1000));
//! # Ok::<(), strata::Error>(())
//! ```
//!
//! Generators are deterministic for a seed, on every platform and release
//! (their random numbers come from [`crate::random`]'s SplitMix64, whose
//! generator, Zipf sampler and scramble are re-exported here).

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use strata::{Error, Result};

use crate::workloads::graph::{Csr, GraphSpec};

pub use crate::random::{Rng, Scramble, Zipf};

/// `accesses` accesses to `pages` pages drawn Zipf(`alpha`), the hottest
/// pages scattered over `0..pages`.
pub fn zipf(alpha: f64, pages: u64, accesses: usize, seed: u64) -> Result<Vec<u64>> {
    let z = Zipf::new(pages, alpha)?;
    let mut rng = Rng::new(seed);
    let scramble = Scramble::new(pages, &mut rng);
    Ok((0..accesses)
        .map(|_| scramble.apply(z.sample(&mut rng) - 1))
        .collect())
}

/// A cyclic scan of pages `0..pages`, `accesses` long.
pub fn looping(pages: u64, accesses: usize) -> Result<Vec<u64>> {
    if pages == 0 {
        return Err(Error::invalid("a loop needs at least 1 page"));
    }
    Ok((0..accesses as u64).map(|i| i % pages).collect())
}

/// A Zipf(`alpha`) hot set of `pages` pages polluted by one-pass scans:
/// `scan_fraction` of the `accesses` belong to scans of `scan_length` pages
/// each, never used again (ids from `pages` up), placed at random points.
pub fn mix(
    alpha: f64,
    pages: u64,
    accesses: usize,
    scan_fraction: f64,
    scan_length: u64,
    seed: u64,
) -> Result<Vec<u64>> {
    if !(0.0..1.0).contains(&scan_fraction) {
        return Err(Error::invalid(format!(
            "scan fraction {scan_fraction} is not in [0, 1)"
        )));
    }
    if scan_length == 0 {
        return Err(Error::invalid("scan length must be at least 1 page"));
    }
    let z = Zipf::new(pages, alpha)?;
    let mut rng = Rng::new(seed);
    let scramble = Scramble::new(pages, &mut rng);
    let scans = (accesses as f64 * scan_fraction / scan_length as f64).round() as usize;
    let hot = accesses.saturating_sub(scans * scan_length as usize);
    let mut starts: Vec<usize> = (0..scans)
        .map(|_| rng.below(hot as u64 + 1) as usize)
        .collect();
    starts.sort_unstable();
    let mut out = Vec::with_capacity(accesses);
    let mut next_scan_page = pages;
    let mut s = 0;
    for i in 0..=hot {
        while s < starts.len() && starts[s] == i {
            out.extend(next_scan_page..next_scan_page + scan_length);
            next_scan_page += scan_length;
            s += 1;
        }
        if i < hot {
            out.push(scramble.apply(z.sample(&mut rng) - 1));
        }
    }
    Ok(out)
}

/// The graph shapes [`generate`] builds its graph traces over (with the
/// benchmarks' one generator, [`Csr::load`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphKind {
    /// Kronecker (Graph500: A = 0.57, B = C = 0.19), vertex ids permuted.
    Kronecker,
    /// Endpoints uniform at random.
    Uniform,
}

impl FromStr for GraphKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kron" | "kronecker" => Ok(GraphKind::Kronecker),
            "uniform" | "urand" => Ok(GraphKind::Uniform),
            _ => Err(Error::invalid(format!(
                "unknown graph {s:?} (choose kron or uniform)"
            ))),
        }
    }
}

/// The undirected graph of `2^scale` vertices and `edge_factor · 2^scale`
/// generated edges of `kind`.
pub fn graph(kind: GraphKind, scale: u32, edge_factor: u32, seed: u64) -> Result<Csr> {
    if !(1..=28).contains(&scale) {
        return Err(Error::invalid(format!(
            "graph scale {scale} is not in 1..=28"
        )));
    }
    if edge_factor == 0 || u64::from(edge_factor) << scale > 1 << 31 {
        return Err(Error::invalid(format!(
            "edge factor {edge_factor} must be at least 1 and give under 2^31 edges"
        )));
    }
    let spec = match kind {
        GraphKind::Kronecker => GraphSpec::Kron { scale, edge_factor },
        GraphKind::Uniform => GraphSpec::Urand { scale, edge_factor },
    };
    Csr::load(&spec, seed)
}

/// Indices of `v`'s neighbours in `g.neighbors`.
fn edge_range(g: &Csr, v: usize) -> std::ops::Range<usize> {
    g.offsets[v] as usize..g.offsets[v + 1] as usize
}

/// Arrays laid out one after another in a virtual address space, each
/// starting on a page boundary, and the trace of pages their accesses touch
/// (a run of accesses to one page is one page access).
struct Layout {
    page_size: u64,
    next_base: u64,
    trace: Vec<u64>,
    limit: usize,
}

#[derive(Clone, Copy)]
struct Array {
    base: u64,
    elem: u64,
}

impl Layout {
    fn new(page_size: u64, limit: usize) -> Self {
        Self {
            page_size,
            next_base: 0,
            trace: Vec::new(),
            limit,
        }
    }

    fn array(&mut self, len: usize, elem: u64) -> Array {
        let a = Array {
            base: self.next_base,
            elem,
        };
        self.next_base += (len as u64 * elem).div_ceil(self.page_size) * self.page_size;
        a
    }

    /// Records an access to element `i` of `a`; false once the trace is full.
    #[inline]
    fn touch(&mut self, a: Array, i: usize) -> bool {
        let page = (a.base + i as u64 * a.elem) / self.page_size;
        if self.trace.last() != Some(&page) {
            if self.trace.len() == self.limit {
                return false;
            }
            self.trace.push(page);
        }
        true
    }
}

fn check_page_size(page_size: u64) -> Result<()> {
    if page_size < 8 {
        return Err(Error::invalid(format!(
            "page size {page_size} must be at least 8 bytes"
        )));
    }
    Ok(())
}

/// The page trace of `roots` top-down breadth-first searches over `g` from
/// random roots with edges: arrays `offsets` (8 B per vertex),
/// `neighbours` (4 B per entry), `parent` (4 B per vertex, reset by a sweep
/// before each search) and the frontier queue (4 B per vertex), in pages of
/// `page_size` bytes. Stops after `limit` accesses.
pub fn bfs(g: &Csr, page_size: u64, roots: usize, seed: u64, limit: usize) -> Result<Vec<u64>> {
    check_page_size(page_size)?;
    let n = g.vertices();
    let mut l = Layout::new(page_size, limit);
    let offsets = l.array(n + 1, 8);
    let neighbours = l.array(g.neighbors.len(), 4);
    let parent_a = l.array(n, 4);
    let queue_a = l.array(n, 4);
    let mut rng = Rng::new(seed);
    let mut parent = vec![u32::MAX; n];
    let mut queue = Vec::with_capacity(n);
    'roots: for _ in 0..roots {
        let root = (0..64)
            .map(|_| rng.below(n as u64) as usize)
            .find(|&v| !edge_range(g, v).is_empty())
            .unwrap_or(0);
        // The reset sweep over `parent`.
        for (v, p) in parent.iter_mut().enumerate() {
            *p = u32::MAX;
            if !l.touch(parent_a, v) {
                break 'roots;
            }
        }
        parent[root] = root as u32;
        queue.clear();
        queue.push(root as u32);
        let mut head = 0;
        while head < queue.len() {
            let u = queue[head] as usize;
            let ok = l.touch(queue_a, head) && l.touch(offsets, u) && l.touch(offsets, u + 1);
            if !ok {
                break 'roots;
            }
            head += 1;
            for j in edge_range(g, u) {
                let v = g.neighbors[j] as usize;
                if !(l.touch(neighbours, j) && l.touch(parent_a, v)) {
                    break 'roots;
                }
                if parent[v] == u32::MAX {
                    parent[v] = u as u32;
                    if !l.touch(queue_a, queue.len()) {
                        break 'roots;
                    }
                    queue.push(v as u32);
                }
            }
        }
    }
    Ok(l.trace)
}

/// The page trace of `iterations` pull-style PageRank sweeps over `g`: for
/// each vertex `v` in order, `offsets[v]`, then every neighbour `u` and
/// `contrib[u]`, then `rank[v]`; after each sweep, a pass computing
/// `contrib[v] = rank[v] / degree(v)` in order. 8 B offsets, 4 B neighbours,
/// ranks and contributions, in pages of `page_size` bytes. Stops after
/// `limit` accesses.
pub fn pagerank(g: &Csr, page_size: u64, iterations: usize, limit: usize) -> Result<Vec<u64>> {
    check_page_size(page_size)?;
    let n = g.vertices();
    let mut l = Layout::new(page_size, limit);
    let offsets = l.array(n + 1, 8);
    let neighbours = l.array(g.neighbors.len(), 4);
    let contrib = l.array(n, 4);
    let rank = l.array(n, 4);
    'sweeps: for _ in 0..iterations {
        for v in 0..n {
            if !(l.touch(offsets, v) && l.touch(offsets, v + 1)) {
                break 'sweeps;
            }
            for j in edge_range(g, v) {
                if !(l.touch(neighbours, j) && l.touch(contrib, g.neighbors[j] as usize)) {
                    break 'sweeps;
                }
            }
            if !l.touch(rank, v) {
                break 'sweeps;
            }
        }
        for v in 0..n {
            let ok = l.touch(rank, v) && l.touch(offsets, v) && l.touch(contrib, v);
            if !ok {
                break 'sweeps;
            }
        }
    }
    Ok(l.trace)
}

/// The page trace of delta-stepping SSSP (bucket width `delta`) from
/// `sources` random sources over `g`, run sequentially: per settled vertex
/// `dist[u]`, `offsets[u]`, `offsets[u + 1]`, then per edge `neighbours[j]`,
/// `weights[j]` and `dist[v]`, and an append to the bucket array when
/// `dist[v]` improves. 8 B offsets and distances, 4 B neighbours, weights
/// and bucket entries (a ring of `n` entries), in pages of `page_size`
/// bytes; `dist` is reset by a sweep before each search. Stops after `limit`
/// accesses.
pub fn sssp(
    g: &Csr,
    page_size: u64,
    sources: usize,
    delta: u64,
    seed: u64,
    limit: usize,
) -> Result<Vec<u64>> {
    check_page_size(page_size)?;
    let n = g.vertices();
    let delta = delta.max(1);
    let mut l = Layout::new(page_size, limit);
    let offsets = l.array(n + 1, 8);
    let neighbours = l.array(g.neighbors.len(), 4);
    let weights = l.array(g.neighbors.len(), 4);
    let dist_a = l.array(n, 8);
    let bucket_a = l.array(n.max(1), 4);
    let mut rng = Rng::new(seed ^ 0x55_5350);
    let mut dist = vec![u64::MAX; n];
    let mut pushed = 0usize;
    'sources: for _ in 0..sources {
        let source = (0..64)
            .map(|_| rng.below(n as u64) as usize)
            .find(|&v| !edge_range(g, v).is_empty())
            .unwrap_or(0);
        for (v, d) in dist.iter_mut().enumerate() {
            *d = u64::MAX;
            if !l.touch(dist_a, v) {
                break 'sources;
            }
        }
        dist[source] = 0;
        let mut buckets: Vec<Vec<u32>> = vec![vec![source as u32]];
        let mut b = 0;
        while b < buckets.len() {
            while let Some(u) = buckets[b].pop() {
                let u = u as usize;
                let du = dist[u];
                if !l.touch(dist_a, u) {
                    break 'sources;
                }
                if du / delta < b as u64 {
                    continue;
                }
                if !(l.touch(offsets, u) && l.touch(offsets, u + 1)) {
                    break 'sources;
                }
                for j in edge_range(g, u) {
                    let v = g.neighbors[j] as usize;
                    let ok = l.touch(neighbours, j) && l.touch(weights, j) && l.touch(dist_a, v);
                    if !ok {
                        break 'sources;
                    }
                    let nd = du + u64::from(g.weights[j]);
                    if nd < dist[v] {
                        dist[v] = nd;
                        let nb = (nd / delta) as usize;
                        if buckets.len() <= nb {
                            buckets.resize(nb + 1, Vec::new());
                        }
                        buckets[nb].push(v as u32);
                        if !l.touch(bucket_a, pushed % n.max(1)) {
                            break 'sources;
                        }
                        pushed += 1;
                    }
                }
            }
            b += 1;
        }
    }
    Ok(l.trace)
}

/// The page trace of connected components by Shiloach–Vishkin hooking and
/// pointer jumping (as `workloads::graph::algo::cc`, run sequentially):
/// per vertex `u` in order `offsets[u]`, `offsets[u + 1]`, then per edge
/// `neighbours[j]`, `comp[u]`, `comp[v]` (and the root hooked); then a
/// pointer-jumping sweep reading `comp[v]` and `comp[comp[v]]`. Until no
/// label changes or `limit` accesses.
pub fn cc(g: &Csr, page_size: u64, limit: usize) -> Result<Vec<u64>> {
    check_page_size(page_size)?;
    let n = g.vertices();
    let mut l = Layout::new(page_size, limit);
    let offsets = l.array(n + 1, 8);
    let neighbours = l.array(g.neighbors.len(), 4);
    let comp_a = l.array(n, 4);
    let mut comp: Vec<u32> = (0..n as u32).collect();
    'rounds: loop {
        let mut changed = false;
        for u in 0..n {
            if !(l.touch(offsets, u) && l.touch(offsets, u + 1)) {
                break 'rounds;
            }
            for j in edge_range(g, u) {
                let v = g.neighbors[j] as usize;
                let ok = l.touch(neighbours, j) && l.touch(comp_a, u) && l.touch(comp_a, v);
                if !ok {
                    break 'rounds;
                }
                let (cu, cv) = (comp[u], comp[v]);
                if cu == cv {
                    continue;
                }
                let (high, low) = if cu > cv { (cu, cv) } else { (cv, cu) };
                if !l.touch(comp_a, high as usize) {
                    break 'rounds;
                }
                if comp[high as usize] == high {
                    comp[high as usize] = low;
                    changed = true;
                }
            }
        }
        for v in 0..n {
            loop {
                let c = comp[v];
                if !(l.touch(comp_a, v) && l.touch(comp_a, c as usize)) {
                    break 'rounds;
                }
                let cc = comp[c as usize];
                if c == cc {
                    break;
                }
                comp[v] = cc;
            }
        }
        if !changed {
            break;
        }
    }
    Ok(l.trace)
}

/// The page trace of embedding-bag lookups: `batches` batches of
/// `workloads::recsys::generate` (Zipf over row ids, rank = id, as the
/// recommender benchmark draws them), one table per entry of `alphas` with
/// that skew (0: uniform), `rows` rows of `row_bytes` bytes each, tables laid
/// out one after another in pages of `page_size` bytes. Within a batch the
/// tables are read in order, each table's `batch × pooling` rows in bag
/// order. Stops after `limit` accesses.
#[allow(clippy::too_many_arguments)]
pub fn embedding(
    alphas: &[f64],
    rows: usize,
    row_bytes: u64,
    page_size: u64,
    batch: usize,
    pooling: usize,
    batches: usize,
    seed: u64,
    limit: usize,
) -> Result<Vec<u64>> {
    check_page_size(page_size)?;
    if alphas.is_empty() || rows == 0 || row_bytes == 0 || batch == 0 || pooling == 0 {
        return Err(Error::invalid(
            "an embedding trace needs at least one table, row, byte per row, bag and index per bag",
        ));
    }
    use crate::workloads::recsys::{generate as batches_of, Dist};
    let mut l = Layout::new(page_size, limit);
    let tables: Vec<Array> = alphas.iter().map(|_| l.array(rows, row_bytes)).collect();
    // Each table's batches (one table at a time, its own skew and seed).
    let per_table: Vec<Vec<Vec<u32>>> = alphas
        .iter()
        .enumerate()
        .map(|(t, &alpha)| {
            let dist = if alpha > 0.0 {
                Dist::Zipf { alpha }
            } else {
                Dist::Uniform
            };
            let b = batches_of(
                &dist,
                1,
                rows,
                batch,
                pooling,
                batches,
                seed.wrapping_add(t as u64 * 7919),
            )?;
            Ok(b.into_iter().map(|mut x| x.swap_remove(0)).collect())
        })
        .collect::<Result<_>>()?;
    'batches: for b in 0..batches {
        for (table, ids) in tables.iter().zip(&per_table) {
            for &row in &ids[b] {
                if !l.touch(*table, row as usize) {
                    break 'batches;
                }
            }
        }
    }
    Ok(l.trace)
}

/// The trace of MoE expert loads: `tokens` tokens of
/// `workloads::moe::SyntheticRouter` (Zipf(`alpha`) popularity over each
/// layer's experts, correlation 0.5, `drift` swaps of adjacent ranks per
/// token), each token's top-k experts read layer after layer; expert `e` of
/// layer `l` is page `l × experts + e`. Stops after `limit` accesses.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    layers: usize,
    experts: usize,
    top_k: usize,
    alpha: f64,
    drift: f64,
    tokens: usize,
    seed: u64,
    limit: usize,
) -> Result<Vec<u64>> {
    let mut router =
        crate::workloads::moe::SyntheticRouter::new(layers, experts, top_k, alpha, seed)?
            .with_model(0.5, drift);
    let mut out = Vec::new();
    'tokens: for _ in 0..tokens {
        for (l, chosen) in router.token().into_iter().enumerate() {
            for e in chosen {
                if out.len() == limit {
                    break 'tokens;
                }
                out.push((l * experts) as u64 + u64::from(e));
            }
        }
    }
    Ok(out)
}

/// A working set that shifts abruptly: phases of `phase` accesses, each
/// Zipf(`alpha`) over its own `pages` pages (scattered); consecutive phases
/// share `overlap` of their pages (0: disjoint, each phase new).
pub fn shift(
    alpha: f64,
    pages: u64,
    accesses: usize,
    phase: usize,
    overlap: f64,
    seed: u64,
) -> Result<Vec<u64>> {
    if !(0.0..1.0).contains(&overlap) {
        return Err(Error::invalid(format!(
            "overlap {overlap} is not in [0, 1)"
        )));
    }
    if phase == 0 {
        return Err(Error::invalid("a phase must be at least 1 access"));
    }
    let z = Zipf::new(pages, alpha)?;
    let mut rng = Rng::new(seed);
    let step = ((pages as f64 * (1.0 - overlap)).round() as u64).max(1);
    let mut out = Vec::with_capacity(accesses);
    let mut k = 0u64;
    while out.len() < accesses {
        // Each phase ranks its pages by a scramble of its own offset: the
        // last phase's ranking rotated by a random number of ranks (not an
        // independent draw; with overlap 0 the phases' pages are disjoint
        // and it makes no difference). The corpus's traces are made by it,
        // so it stays as it is.
        let scramble = Scramble::new(pages, &mut rng);
        let base = k * step;
        let n = phase.min(accesses - out.len());
        out.extend((0..n).map(|_| base + scramble.apply(z.sample(&mut rng) - 1)));
        k += 1;
    }
    Ok(out)
}

/// The kinds of trace [`generate`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenKind {
    /// [`zipf`].
    Zipf,
    /// [`looping`].
    Loop,
    /// [`mix`].
    Mix,
    /// [`shift`].
    Shift,
    /// [`bfs`] over a generated graph.
    Bfs,
    /// [`sssp`] over a generated graph.
    Sssp,
    /// [`pagerank`] over a generated graph.
    Pr,
    /// [`cc`] over a generated graph.
    Cc,
    /// [`embedding`].
    Emb,
    /// [`moe`].
    Moe,
}

impl GenKind {
    /// Every kind.
    pub const ALL: [GenKind; 10] = [
        GenKind::Zipf,
        GenKind::Loop,
        GenKind::Mix,
        GenKind::Shift,
        GenKind::Bfs,
        GenKind::Sssp,
        GenKind::Pr,
        GenKind::Cc,
        GenKind::Emb,
        GenKind::Moe,
    ];

    /// The name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            GenKind::Zipf => "zipf",
            GenKind::Loop => "loop",
            GenKind::Mix => "mix",
            GenKind::Shift => "shift",
            GenKind::Bfs => "bfs",
            GenKind::Sssp => "sssp",
            GenKind::Pr => "pr",
            GenKind::Cc => "cc",
            GenKind::Emb => "emb",
            GenKind::Moe => "moe",
        }
    }

    /// Whether the trace is recorded from a graph kernel (its length is the
    /// kernel's, `accesses` only a limit).
    pub fn is_graph(self) -> bool {
        matches!(
            self,
            GenKind::Bfs | GenKind::Sssp | GenKind::Pr | GenKind::Cc
        )
    }
}

impl fmt::Display for GenKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GenKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        GenKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown trace kind {s:?} (choose zipf, loop, mix, shift, bfs, sssp, pr, cc, emb or moe)"
                ))
            })
    }
}

/// Parameters of [`generate`]; each kind reads the fields it needs.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// What to generate.
    pub kind: GenKind,
    /// Pages: of the Zipf distribution, the loop, the hot set of a mix, a
    /// phase's working set (shift).
    pub pages: u64,
    /// Accesses (for the graph kinds: at most this many; 0 means no limit;
    /// for emb and moe a limit on top of their batches and tokens).
    pub accesses: usize,
    /// Zipf exponent (zipf, mix, shift, moe).
    pub alpha: f64,
    /// Seed of the random choices.
    pub seed: u64,
    /// Share of accesses in scans (mix).
    pub scan_fraction: f64,
    /// Pages per scan (mix).
    pub scan_length: u64,
    /// Accesses per phase (shift).
    pub phase: usize,
    /// Share of a phase's pages the next phase keeps (shift).
    pub overlap: f64,
    /// The graph (graph kinds).
    pub graph: GraphKind,
    /// log2 of the graph's vertices (graph kinds).
    pub scale: u32,
    /// Edges per vertex (graph kinds).
    pub edge_factor: u32,
    /// Bytes per page (graph kinds, emb).
    pub page_size: u64,
    /// Searches (bfs, sssp).
    pub roots: usize,
    /// Sweeps (pr).
    pub iterations: usize,
    /// Bucket width (sssp; weights are 1..=255).
    pub delta: u64,
    /// One Zipf exponent per table, 0 for uniform (emb).
    pub alphas: Vec<f64>,
    /// Rows per table (emb).
    pub rows: usize,
    /// Bytes per row (emb).
    pub row_bytes: u64,
    /// Bags per batch (emb).
    pub batch: usize,
    /// Indices per bag (emb).
    pub pooling: usize,
    /// Batches (emb).
    pub batches: usize,
    /// Layers (moe).
    pub layers: usize,
    /// Experts per layer (moe).
    pub experts: usize,
    /// Experts per token and layer (moe).
    pub top_k: usize,
    /// Per-token probability that a layer's popularity order swaps two
    /// adjacent ranks (moe).
    pub drift: f64,
    /// Tokens (moe).
    pub tokens: usize,
}

impl Default for GenParams {
    fn default() -> Self {
        Self {
            kind: GenKind::Zipf,
            pages: 65_536,
            accesses: 1_000_000,
            alpha: 1.0,
            seed: 1,
            scan_fraction: 0.2,
            scan_length: 16_384,
            phase: 100_000,
            overlap: 0.0,
            graph: GraphKind::Kronecker,
            scale: 16,
            edge_factor: 16,
            page_size: 4096,
            roots: 2,
            iterations: 2,
            delta: 32,
            alphas: vec![1.1, 0.9, 0.7, 0.5],
            rows: 100_000,
            row_bytes: 128,
            batch: 512,
            pooling: 16,
            batches: 64,
            layers: 32,
            experts: 64,
            top_k: 2,
            drift: 0.05,
            tokens: 16_384,
        }
    }
}

impl GenParams {
    /// One line naming the parameters that matter for the kind, for the
    /// trace file's header.
    pub fn describe(&self) -> String {
        let graph = || {
            format!(
                "graph={} scale={} edge_factor={} page_size={}",
                match self.graph {
                    GraphKind::Kronecker => "kron",
                    GraphKind::Uniform => "uniform",
                },
                self.scale,
                self.edge_factor,
                self.page_size
            )
        };
        match self.kind {
            GenKind::Zipf => format!(
                "zipf pages={} accesses={} alpha={} seed={}",
                self.pages, self.accesses, self.alpha, self.seed
            ),
            GenKind::Loop => format!("loop pages={} accesses={}", self.pages, self.accesses),
            GenKind::Mix => format!(
                "mix pages={} accesses={} alpha={} scan_fraction={} scan_length={} seed={}",
                self.pages,
                self.accesses,
                self.alpha,
                self.scan_fraction,
                self.scan_length,
                self.seed
            ),
            GenKind::Shift => format!(
                "shift pages={} accesses={} alpha={} phase={} overlap={} seed={}",
                self.pages, self.accesses, self.alpha, self.phase, self.overlap, self.seed
            ),
            GenKind::Bfs => format!("bfs {} roots={} seed={}", graph(), self.roots, self.seed),
            GenKind::Sssp => format!(
                "sssp {} roots={} delta={} seed={}",
                graph(),
                self.roots,
                self.delta,
                self.seed
            ),
            GenKind::Pr => format!(
                "pr {} iterations={} seed={}",
                graph(),
                self.iterations,
                self.seed
            ),
            GenKind::Cc => format!("cc {} seed={}", graph(), self.seed),
            GenKind::Emb => format!(
                "emb alphas={} rows={} row_bytes={} page_size={} batch={} pooling={} batches={} seed={}",
                self.alphas
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                self.rows,
                self.row_bytes,
                self.page_size,
                self.batch,
                self.pooling,
                self.batches,
                self.seed
            ),
            GenKind::Moe => format!(
                "moe layers={} experts={} top_k={} alpha={} drift={} tokens={} seed={}",
                self.layers, self.experts, self.top_k, self.alpha, self.drift, self.tokens, self.seed
            ),
        }
    }
}

/// Generates the trace `p` describes.
pub fn generate(p: &GenParams) -> Result<Vec<u64>> {
    // The counts that set a trace's length: none of them may be 0, or the
    // trace is empty (a replay of it measures nothing).
    let (count, flag, what) = match p.kind {
        GenKind::Bfs | GenKind::Sssp => (p.roots, "roots", "searches"),
        GenKind::Pr => (p.iterations, "iterations", "sweeps"),
        GenKind::Emb => (p.batches, "batches", "batches"),
        GenKind::Moe => (p.tokens, "tokens", "tokens"),
        _ => (1, "", ""),
    };
    if count == 0 {
        return Err(Error::invalid(format!(
            "--{flag} 0: the {} trace of no {what} would be empty (use at least 1)",
            p.kind.name()
        )));
    }
    let graph_kind = matches!(
        p.kind,
        GenKind::Bfs | GenKind::Sssp | GenKind::Pr | GenKind::Cc
    );
    // Before the size estimate, which would price an impossible graph.
    if graph_kind && !(1..=28).contains(&p.scale) {
        return Err(Error::invalid(format!(
            "--scale {} is not in 1..=28",
            p.scale
        )));
    }
    if p.kind == GenKind::Sssp && p.delta == 0 {
        return Err(Error::invalid("--delta 0: a bucket width is at least 1"));
    }
    // The generators check their own arguments too; here each is refused
    // under its flag's name (`GenParams` is what `strata trace gen` takes).
    let unit = |x: f64| (0.0..1.0).contains(&x);
    let refused = match p.kind {
        GenKind::Zipf | GenKind::Mix | GenKind::Shift
            if !(p.alpha.is_finite() && p.alpha > 0.0) =>
        {
            Some(format!("--alpha {} must be a positive number", p.alpha))
        }
        GenKind::Moe if !(p.alpha.is_finite() && p.alpha >= 0.0) => {
            Some(format!("--alpha {} must be a number ≥ 0", p.alpha))
        }
        GenKind::Mix if !unit(p.scan_fraction) => Some(format!(
            "--scan-fraction {} is not in [0, 1)",
            p.scan_fraction
        )),
        GenKind::Mix if p.scan_length == 0 => {
            Some("--scan-length 0: a scan is at least 1 page".to_string())
        }
        GenKind::Shift if !unit(p.overlap) => {
            Some(format!("--overlap {} is not in [0, 1)", p.overlap))
        }
        GenKind::Shift if p.phase == 0 => {
            Some("--phase 0: a phase is at least 1 access".to_string())
        }
        GenKind::Bfs | GenKind::Sssp | GenKind::Pr | GenKind::Cc | GenKind::Emb
            if p.page_size < 8 =>
        {
            Some(format!(
                "--page-size {} must be at least 8 bytes",
                p.page_size
            ))
        }
        _ => None,
    };
    if let Some(message) = refused {
        return Err(Error::invalid(message));
    }
    let limit = if p.accesses == 0 {
        usize::MAX
    } else {
        p.accesses
    };
    // The trace (8 bytes an access) and the caller's sorted copy of it; a
    // graph trace has at most a few accesses per edge and vertex per sweep.
    let accesses = match p.kind {
        GenKind::Zipf | GenKind::Loop | GenKind::Mix | GenKind::Shift => p.accesses as u64,
        GenKind::Bfs | GenKind::Sssp | GenKind::Pr | GenKind::Cc => {
            let n = 1u64 << p.scale.min(40);
            let sweep = n
                .saturating_mul(p.edge_factor as u64)
                .saturating_mul(2)
                .saturating_add(n)
                .saturating_mul(4);
            let sweeps = match p.kind {
                GenKind::Bfs | GenKind::Sssp => p.roots,
                GenKind::Pr => p.iterations,
                // Hooking rounds: a few dozen at most on generated graphs.
                _ => 32,
            };
            sweep.saturating_mul(sweeps as u64).min(limit as u64)
        }
        GenKind::Emb => (p.alphas.len() as u64)
            .saturating_mul(p.batch as u64)
            .saturating_mul(p.pooling as u64)
            .saturating_mul(p.batches as u64)
            .min(limit as u64),
        GenKind::Moe => (p.layers as u64)
            .saturating_mul(p.top_k as u64)
            .saturating_mul(p.tokens as u64)
            .min(limit as u64),
    };
    let what = match p.kind {
        GenKind::Bfs | GenKind::Sssp => format!(
            "--scale {} --roots {} ({accesses} accesses)",
            p.scale, p.roots
        ),
        GenKind::Pr => format!(
            "--scale {} --iterations {} ({accesses} accesses)",
            p.scale, p.iterations
        ),
        GenKind::Cc => format!("--scale {} ({accesses} accesses)", p.scale),
        GenKind::Emb => format!("--batches {} ({accesses} accesses)", p.batches),
        GenKind::Moe => format!("--tokens {} ({accesses} accesses)", p.tokens),
        _ => format!("--accesses {accesses}"),
    };
    crate::machine::check_memory(
        what,
        "the trace and a sorted copy",
        accesses.saturating_mul(16),
    )?;
    let g = || graph(p.graph, p.scale, p.edge_factor, p.seed);
    match p.kind {
        GenKind::Zipf => zipf(p.alpha, p.pages, p.accesses, p.seed),
        GenKind::Loop => looping(p.pages, p.accesses),
        GenKind::Mix => mix(
            p.alpha,
            p.pages,
            p.accesses,
            p.scan_fraction,
            p.scan_length,
            p.seed,
        ),
        GenKind::Shift => shift(p.alpha, p.pages, p.accesses, p.phase, p.overlap, p.seed),
        GenKind::Bfs => bfs(&g()?, p.page_size, p.roots, p.seed, limit),
        GenKind::Sssp => sssp(&g()?, p.page_size, p.roots, p.delta, p.seed, limit),
        GenKind::Pr => pagerank(&g()?, p.page_size, p.iterations, limit),
        GenKind::Cc => cc(&g()?, p.page_size, limit),
        GenKind::Emb => embedding(
            &p.alphas,
            p.rows,
            p.row_bytes,
            p.page_size,
            p.batch,
            p.pooling,
            p.batches,
            p.seed,
            limit,
        ),
        GenKind::Moe => moe(
            p.layers, p.experts, p.top_k, p.alpha, p.drift, p.tokens, p.seed, limit,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_is_skewed_like_zipf() {
        let n = 1000;
        let z = Zipf::new(n, 1.0).unwrap();
        let mut rng = Rng::new(3);
        let mut counts = vec![0u32; n as usize + 1];
        let samples = 200_000;
        for _ in 0..samples {
            counts[z.sample(&mut rng) as usize] += 1;
        }
        let h: f64 = (1..=n).map(|k| 1.0 / k as f64).sum();
        for k in [1usize, 2, 10] {
            let expect = samples as f64 / (k as f64 * h);
            let got = f64::from(counts[k]);
            assert!(
                (got - expect).abs() < 0.05 * expect,
                "rank {k}: {got} vs {expect}"
            );
        }
        assert!(Zipf::new(10, 0.0).is_err() && Zipf::new(0, 1.0).is_err());
    }

    #[test]
    fn scramble_is_a_bijection() {
        for n in [1u64, 2, 10, 64, 1000, 4096] {
            let s = Scramble::new(n, &mut Rng::new(n));
            let mut seen: Vec<u64> = (0..n).map(|r| s.apply(r)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn mix_scans_are_never_reused() {
        let t = mix(1.0, 100, 10_000, 0.3, 50, 1).unwrap();
        assert_eq!(t.len(), 10_000);
        let scan: Vec<u64> = t.iter().copied().filter(|&p| p >= 100).collect();
        assert_eq!(scan.len(), 3000);
        assert!(scan.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn graph_traces_touch_every_array() {
        let g = graph(GraphKind::Kronecker, 8, 4, 1).unwrap();
        assert_eq!(g.vertices(), 256);
        assert_eq!(g.neighbors.len() as u64, g.offsets[256]);
        let b = bfs(&g, 256, 2, 1, usize::MAX).unwrap();
        let p = pagerank(&g, 256, 2, usize::MAX).unwrap();
        let pages = |t: &[u64]| {
            let mut v = t.to_vec();
            v.sort_unstable();
            v.dedup();
            v.len()
        };
        // offsets 9 pages, neighbours ~gs, two 4-page vertex arrays
        let expect = (257 * 8usize).div_ceil(256) + (g.neighbors.len() * 4).div_ceil(256) + 8;
        assert!(pages(&p) == expect, "{} vs {expect}", pages(&p));
        assert!(pages(&b) <= expect);
        assert!(b.windows(2).all(|w| w[0] != w[1]));
        assert_eq!(pagerank(&g, 256, 2, 100).unwrap().len(), 100);
        let s = sssp(&g, 256, 2, 32, 1, usize::MAX).unwrap();
        let c = cc(&g, 256, usize::MAX).unwrap();
        assert!(s.windows(2).all(|w| w[0] != w[1]) && pages(&s) > expect);
        assert!(c.windows(2).all(|w| w[0] != w[1]) && pages(&c) <= expect);
    }

    #[test]
    fn workload_traces_have_their_shape() {
        // Two tables of 1000 rows of 512 B in 4 KiB pages: 125 pages each,
        // the skewed table's low rows hottest.
        let e = embedding(&[1.2, 0.0], 1000, 512, 4096, 8, 4, 50, 3, usize::MAX).unwrap();
        assert!(e.iter().all(|&p| p < 250));
        let first = e.iter().filter(|&&p| p == 0).count();
        let uniform = e.iter().filter(|&&p| p == 125).count();
        assert!(first > 3 * uniform, "{first} vs {uniform}");
        let m = moe(4, 16, 2, 1.0, 0.05, 100, 1, usize::MAX).unwrap();
        assert_eq!(m.len(), 4 * 2 * 100);
        assert!(m.iter().all(|&p| p < 64));
        // Layer order: the first two accesses of a token are layer 0's.
        assert!(m[..2].iter().all(|&p| p < 16) && (16..32).contains(&m[2]));
        let s = shift(1.0, 100, 1000, 250, 0.0, 1).unwrap();
        assert!(s[..250].iter().all(|&p| p < 100));
        assert!(s[750..].iter().all(|&p| (300..400).contains(&p)));
    }

    #[test]
    fn generators_are_deterministic() {
        let p = GenParams {
            kind: GenKind::Bfs,
            scale: 8,
            edge_factor: 4,
            page_size: 512,
            roots: 2,
            ..GenParams::default()
        };
        assert_eq!(generate(&p).unwrap(), generate(&p).unwrap());
        assert_eq!(
            zipf(0.8, 50, 100, 9).unwrap(),
            zipf(0.8, 50, 100, 9).unwrap()
        );
    }
}
