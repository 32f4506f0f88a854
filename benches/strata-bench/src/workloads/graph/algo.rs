//! The graph kernels, GAP-style, parallel with rayon, generic over how the
//! CSR arrays are read ([`Mem`]): straight from host memory, or through the
//! device maps of tiered buffers on the simulated device. Vertex state
//! (parents, distances, scores, labels) is working memory of the kernel and
//! is not tiered; the kernels report each access of it ([`Read::state`])
//! so that a model can charge it.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};

use rayon::prelude::*;

/// Vertices per parallel task.
const GRAIN: usize = 1024;
const _: () = assert!(GRAIN % 64 == 0, "a task's vertices own whole bitmap words");

/// How a kernel reads the graph. Each parallel task takes its own reader.
pub trait Mem: Sync {
    /// A task's reader.
    type Reader<'a>: Read
    where
        Self: 'a;
    /// A reader for task `task`.
    fn reader(&self, task: u64) -> Self::Reader<'_>;
    /// Vertex count.
    fn vertices(&self) -> usize;
    /// Whether in-neighbours differ from out-neighbours.
    fn directed(&self) -> bool;
    /// Called between kernel launches — iterations, levels, rounds — and
    /// never after the last (the strata configuration runs a balancer round
    /// there, which nothing after the last launch would use).
    fn between_steps(&mut self) {}
}

/// Calls [`Mem::between_steps`] before every launch but the first.
#[derive(Default)]
struct Steps {
    started: bool,
}

impl Steps {
    /// A launch begins.
    fn next<M: Mem>(&mut self, g: &mut M) {
        if self.started {
            g.between_steps();
        }
        self.started = true;
    }
}

/// One task's reads of the CSR arrays.
pub trait Read {
    /// `offsets[v]`.
    fn offset(&mut self, v: usize) -> u64;
    /// `neighbors[i]`.
    fn neighbor(&mut self, i: u64) -> u32;
    /// `weights[i]`.
    fn weight(&mut self, i: u64) -> u32;
    /// Incoming `offsets[v]` (directed graphs; otherwise the outgoing).
    fn in_offset(&mut self, v: usize) -> u64;
    /// Incoming `neighbors[i]`.
    fn in_neighbor(&mut self, i: u64) -> u32;
    /// A warp's load of `neighbors[i..end]` (`i < end`): up to [`WARP`] of
    /// them into `out`, those in one page; returns how many (at least one).
    #[inline]
    fn neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let n = (end - i).min(WARP as u64) as usize;
        for (k, o) in out[..n].iter_mut().enumerate() {
            *o = self.neighbor(i + k as u64);
        }
        n
    }
    /// As [`neighbors`](Self::neighbors), of the incoming neighbours.
    #[inline]
    fn in_neighbors(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let n = (end - i).min(WARP as u64) as usize;
        for (k, o) in out[..n].iter_mut().enumerate() {
            *o = self.in_neighbor(i + k as u64);
        }
        n
    }
    /// As [`neighbors`](Self::neighbors), of the weights.
    #[inline]
    fn weights(&mut self, i: u64, end: u64, out: &mut [u32; WARP]) -> usize {
        let n = (end - i).min(WARP as u64) as usize;
        for (k, o) in out[..n].iter_mut().enumerate() {
            *o = self.weight(i + k as u64);
        }
        n
    }
    /// `(offsets[v], offsets[v + 1])`: vertex `v`'s neighbours.
    #[inline]
    fn range(&mut self, v: usize) -> (u64, u64) {
        (self.offset(v), self.offset(v + 1))
    }
    /// As [`range`](Self::range), of the incoming offsets.
    #[inline]
    fn in_range(&mut self, v: usize) -> (u64, u64) {
        (self.in_offset(v), self.in_offset(v + 1))
    }
    /// Calls `f` with each of `neighbors[a..b]`, in order. The default
    /// loads them a warp at a time through [`neighbors`](Self::neighbors)
    /// (what the model accounts); readers of plain memory read them in
    /// place instead: a copy through a warp buffer took 1.7× the time of
    /// PageRank's pull loop.
    #[inline]
    fn each_neighbor(&mut self, a: u64, b: u64, f: impl FnMut(&mut Self, u32))
    where
        Self: Sized,
    {
        each_by_warp(self, a, b, Self::neighbors, f)
    }
    /// As [`each_neighbor`](Self::each_neighbor), of the incoming
    /// neighbours.
    #[inline]
    fn each_in_neighbor(&mut self, a: u64, b: u64, f: impl FnMut(&mut Self, u32))
    where
        Self: Sized,
    {
        each_by_warp(self, a, b, Self::in_neighbors, f)
    }
    /// The first of the incoming `neighbors[a..b]`, in order, for which
    /// `f` holds (each loaded on its own, as a thread of a bottom-up step
    /// does: it stops at the first parent found).
    #[inline]
    fn find_in_neighbor(
        &mut self,
        a: u64,
        b: u64,
        mut f: impl FnMut(&mut Self, u32) -> bool,
    ) -> Option<u32>
    where
        Self: Sized,
    {
        for i in a..b {
            let u = self.in_neighbor(i);
            if f(self, u) {
                return Some(u);
            }
        }
        None
    }
    /// The kernel read or wrote element `index` of a vertex-state array
    /// (for accounting; nothing is read through it).
    #[inline]
    fn state(&mut self, _array: State, _index: usize) {}
}

/// Elements of an edge list a warp loads at once (one 128-byte line of
/// 4-byte neighbours).
pub const WARP: usize = 32;

/// The kernels' vertex-state arrays, in device memory on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// BFS depths (i32).
    Depth,
    /// BFS parents (u32).
    Parent,
    /// BFS frontier bitmap (a byte per vertex here).
    Front,
    /// BFS/SSSP frontier queues (u32 vertex ids).
    Queue,
    /// SSSP distances (u64).
    Dist,
    /// PageRank scores (f64).
    Score,
    /// PageRank contributions (f64).
    Contrib,
    /// CC labels (u32).
    Comp,
}

impl State {
    /// Every state array.
    pub const ALL: [State; 8] = [
        State::Depth,
        State::Parent,
        State::Front,
        State::Queue,
        State::Dist,
        State::Score,
        State::Contrib,
        State::Comp,
    ];

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            State::Front => 1,
            State::Depth
            | State::Parent
            | State::Queue
            | State::Comp
            | State::Score
            | State::Contrib => 4,
            State::Dist => 8,
        }
    }
}

/// The CSR arrays read straight from host memory.
pub struct HostMem<'g>(pub &'g super::Csr);

/// A reader of [`HostMem`].
pub struct HostRead<'g>(&'g super::Csr);

impl Read for HostRead<'_> {
    #[inline]
    fn offset(&mut self, v: usize) -> u64 {
        self.0.offsets[v]
    }
    #[inline]
    fn neighbor(&mut self, i: u64) -> u32 {
        self.0.neighbors[i as usize]
    }
    #[inline]
    fn weight(&mut self, i: u64) -> u32 {
        self.0.weights[i as usize]
    }
    #[inline]
    fn in_offset(&mut self, v: usize) -> u64 {
        match &self.0.incoming {
            Some((o, _)) => o[v],
            None => self.0.offsets[v],
        }
    }
    #[inline]
    fn in_neighbor(&mut self, i: u64) -> u32 {
        self.incoming()[i as usize]
    }
    #[inline]
    fn each_neighbor(&mut self, a: u64, b: u64, mut f: impl FnMut(&mut Self, u32)) {
        let g = self.0;
        for &v in &g.neighbors[a as usize..b as usize] {
            f(self, v);
        }
    }
    #[inline]
    fn each_in_neighbor(&mut self, a: u64, b: u64, mut f: impl FnMut(&mut Self, u32)) {
        for &v in &self.incoming()[a as usize..b as usize] {
            f(self, v);
        }
    }
    #[inline]
    fn find_in_neighbor(
        &mut self,
        a: u64,
        b: u64,
        mut f: impl FnMut(&mut Self, u32) -> bool,
    ) -> Option<u32> {
        self.incoming()[a as usize..b as usize]
            .iter()
            .copied()
            .find(|&u| f(self, u))
    }
}

impl<'g> HostRead<'g> {
    /// The incoming neighbours' array (the outgoing one for an undirected
    /// graph).
    #[inline]
    fn incoming(&self) -> &'g [u32] {
        match &self.0.incoming {
            Some((_, n)) => n,
            None => &self.0.neighbors,
        }
    }
}

impl Mem for HostMem<'_> {
    type Reader<'a>
        = HostRead<'a>
    where
        Self: 'a;
    fn reader(&self, _task: u64) -> HostRead<'_> {
        HostRead(self.0)
    }
    fn vertices(&self) -> usize {
        self.0.vertices()
    }
    fn directed(&self) -> bool {
        self.0.directed()
    }
}

/// Calls `f` with each element of `a..b` that `load` (a warp load of
/// [`Read`]) returns, a warp at a time: the default neighbour visits.
#[inline]
fn each_by_warp<R: Read>(
    r: &mut R,
    a: u64,
    b: u64,
    load: impl Fn(&mut R, u64, u64, &mut [u32; WARP]) -> usize,
    mut f: impl FnMut(&mut R, u32),
) {
    let mut buf = [0u32; WARP];
    let mut i = a;
    while i < b {
        let k = load(r, i, b, &mut buf);
        i += k as u64;
        for &v in &buf[..k] {
            f(r, v);
        }
    }
}

/// One bit per vertex (the bottom-up frontier, as GAP's `Bitmap`): an
/// eighth of a byte array's footprint, so it stays in the cache.
struct Bitmap(Vec<AtomicU64>);

impl Bitmap {
    fn new(n: usize) -> Self {
        Self((0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }
    #[inline]
    fn get(&self, i: usize) -> bool {
        self.0[i / 64].load(Ordering::Relaxed) >> (i % 64) & 1 != 0
    }
    /// Sets bit `i`, whose word only the calling task writes (a task's
    /// vertices are a whole number of words: [`GRAIN`] is a multiple of
    /// 64): a plain read and write, not a locked one, as GAP's.
    #[inline]
    fn set_owned(&self, i: usize) {
        let w = &self.0[i / 64];
        w.store(w.load(Ordering::Relaxed) | 1 << (i % 64), Ordering::Relaxed);
    }
    /// The set bits' indices, in order (GAP's `BitmapToQueue`): a word
    /// at a time, each task's words in one vector.
    fn to_queue(&self) -> Vec<u32> {
        self.0
            .par_chunks(GRAIN / 64)
            .enumerate()
            .flat_map_iter(|(c, words)| {
                let mut out = Vec::new();
                for (k, w) in words.iter().enumerate() {
                    let mut bits = w.load(Ordering::Relaxed);
                    let base = ((c * GRAIN / 64 + k) * 64) as u32;
                    while bits != 0 {
                        out.push(base + bits.trailing_zeros());
                        bits &= bits - 1;
                    }
                }
                out
            })
            .collect()
    }
    fn set_mut(&mut self, i: usize) {
        *self.0[i / 64].get_mut() |= 1 << (i % 64);
    }
}

fn tasks(n: usize) -> impl IndexedParallelIterator<Item = std::ops::Range<usize>> {
    (0..n.div_ceil(GRAIN))
        .into_par_iter()
        .map(move |c| c * GRAIN..((c + 1) * GRAIN).min(n))
}

/// BFS result: depth per vertex (−1: unreachable) and the parent tree.
#[derive(Debug, Clone)]
pub struct BfsResult {
    /// Depth from the source.
    pub depth: Vec<i32>,
    /// Parent in the BFS tree (the source is its own; u32::MAX unreached).
    pub parent: Vec<u32>,
    /// Edges examined.
    pub edges: u64,
}

/// Direction-optimizing BFS (Beamer et al.; α = 15, β = 18, as GAP).
pub fn bfs<M: Mem>(g: &mut M, source: usize) -> BfsResult {
    let n = g.vertices();
    // Filled in parallel, as GAP's: first touches (page faults) split
    // across the threads.
    let parent: Vec<AtomicU32> = (0..n)
        .into_par_iter()
        .map(|_| AtomicU32::new(u32::MAX))
        .collect();
    let depth: Vec<AtomicI32> = (0..n).into_par_iter().map(|_| AtomicI32::new(-1)).collect();
    let examined = AtomicU64::new(0);
    parent[source].store(source as u32, Ordering::Relaxed);
    depth[source].store(0, Ordering::Relaxed);
    let mut frontier = vec![source as u32];
    let mut level = 0i32;
    let (alpha, beta) = (15u64, 18u64);
    // Edges still to be checked from unvisited vertices (GAP's m_u).
    let total_edges: u64 = {
        let mut r = g.reader(u64::MAX);
        r.offset(n)
    };
    let mut edges_unexplored = total_edges;
    let mut steps = Steps::default();
    while !frontier.is_empty() {
        steps.next(g);
        let frontier_edges: u64 = frontier
            .par_chunks(GRAIN)
            .enumerate()
            .map(|(c, chunk)| {
                let mut r = g.reader(c as u64);
                chunk
                    .iter()
                    .enumerate()
                    .map(|(j, &u)| {
                        r.state(State::Queue, c * GRAIN + j);
                        r.offset(u as usize + 1) - r.offset(u as usize)
                    })
                    .sum::<u64>()
            })
            .sum();
        let next: Vec<u32> = if frontier_edges > edges_unexplored / alpha {
            // Bottom-up steps while the frontier is large.
            let mut front = Bitmap::new(n);
            for &u in &frontier {
                front.set_mut(u as usize);
            }
            let mut awake = frontier.len() as u64;
            let mut first = true;
            loop {
                if !first {
                    steps.next(g);
                }
                first = false;
                let next_front = Bitmap::new(n);
                let count: u64 = tasks(n)
                    .enumerate()
                    .map(|(c, range)| {
                        let mut r = g.reader(c as u64 + 1_000_000);
                        let mut found = 0u64;
                        let mut checked = 0u64;
                        for v in range {
                            r.state(State::Depth, v);
                            if depth[v].load(Ordering::Relaxed) >= 0 {
                                continue;
                            }
                            let (a, b) = r.in_range(v);
                            let in_front = r.find_in_neighbor(a, b, |r, u| {
                                checked += 1;
                                r.state(State::Front, u as usize);
                                front.get(u as usize)
                            });
                            if let Some(u) = in_front {
                                r.state(State::Parent, v);
                                r.state(State::Depth, v);
                                r.state(State::Front, v);
                                parent[v].store(u, Ordering::Relaxed);
                                depth[v].store(level + 1, Ordering::Relaxed);
                                next_front.set_owned(v);
                                found += 1;
                            }
                        }
                        examined.fetch_add(checked, Ordering::Relaxed);
                        found
                    })
                    .sum();
                level += 1;
                front = next_front;
                let grew = count > awake;
                awake = count;
                if count == 0 || (!grew && count < n as u64 / beta) {
                    break;
                }
            }
            // Back to top-down with the last bottom-up frontier.
            let f = front.to_queue();
            edges_unexplored = edges_unexplored.saturating_sub(frontier_edges);
            f
        } else {
            let next: Vec<u32> = frontier
                .par_chunks(GRAIN)
                .enumerate()
                .flat_map_iter(|(c, chunk)| {
                    let mut r = g.reader(c as u64 + 2_000_000);
                    let mut out = Vec::new();
                    let mut checked = 0u64;
                    for (j, &u) in chunk.iter().enumerate() {
                        r.state(State::Queue, c * GRAIN + j);
                        let (a, b) = r.range(u as usize);
                        checked += b - a;
                        r.each_neighbor(a, b, |r, v| {
                            let v = v as usize;
                            r.state(State::Depth, v);
                            if depth[v].load(Ordering::Relaxed) < 0
                                && parent[v]
                                    .compare_exchange(
                                        u32::MAX,
                                        u,
                                        Ordering::Relaxed,
                                        Ordering::Relaxed,
                                    )
                                    .is_ok()
                            {
                                r.state(State::Parent, v);
                                r.state(State::Depth, v);
                                depth[v].store(level + 1, Ordering::Relaxed);
                                out.push(v as u32);
                            }
                        });
                    }
                    examined.fetch_add(checked, Ordering::Relaxed);
                    out
                })
                .collect();
            level += 1;
            edges_unexplored = edges_unexplored.saturating_sub(frontier_edges);
            next
        };
        frontier = next;
    }
    BfsResult {
        depth: depth.into_iter().map(AtomicI32::into_inner).collect(),
        parent: parent.into_iter().map(AtomicU32::into_inner).collect(),
        edges: examined.into_inner(),
    }
}

/// SSSP result: distance per vertex (`u64::MAX`: unreachable).
#[derive(Debug, Clone)]
pub struct SsspResult {
    /// Distance from the source.
    pub dist: Vec<u64>,
    /// Edges relaxed.
    pub edges: u64,
}

/// Delta-stepping (Meyer and Sanders) with GAP's bucket width for weights
/// in 1..=255.
pub fn sssp<M: Mem>(g: &mut M, source: usize, delta: u64) -> SsspResult {
    let n = g.vertices();
    let dist: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(u64::MAX)).collect();
    dist[source].store(0, Ordering::Relaxed);
    let relaxed = AtomicU64::new(0);
    let mut buckets: Vec<Vec<u32>> = vec![vec![source as u32]];
    let mut b = 0usize;
    let mut steps = Steps::default();
    while b < buckets.len() {
        while !buckets[b].is_empty() {
            steps.next(g);
            let current = std::mem::take(&mut buckets[b]);
            let found: Vec<(usize, u32)> = current
                .par_chunks(GRAIN)
                .enumerate()
                .flat_map_iter(|(c, chunk)| {
                    let mut r = g.reader(c as u64 + 3_000_000);
                    let mut out = Vec::new();
                    let mut count = 0u64;
                    for (j, &u) in chunk.iter().enumerate() {
                        r.state(State::Queue, c * GRAIN + j);
                        r.state(State::Dist, u as usize);
                        let du = dist[u as usize].load(Ordering::Relaxed);
                        // Stale entries (settled in a lower bucket) skip.
                        if du / delta < b as u64 {
                            continue;
                        }
                        let (a, e) = r.range(u as usize);
                        let (mut nb, mut wt) = ([0u32; WARP], [0u32; WARP]);
                        let mut i = a;
                        while i < e {
                            let k = r.neighbors(i, e, &mut nb);
                            // The weights' pages break where the neighbours'
                            // do (same element size, both from page 0).
                            let k = r.weights(i, i + k as u64, &mut wt).min(k);
                            i += k as u64;
                            count += k as u64;
                            for (&v, &w) in nb[..k].iter().zip(&wt[..k]) {
                                let v = v as usize;
                                let nd = du + w as u64;
                                r.state(State::Dist, v);
                                if dist[v].fetch_min(nd, Ordering::Relaxed) > nd {
                                    out.push(((nd / delta) as usize, v as u32));
                                }
                            }
                        }
                    }
                    relaxed.fetch_add(count, Ordering::Relaxed);
                    out
                })
                .collect();
            for (bucket, v) in found {
                if buckets.len() <= bucket {
                    buckets.resize(bucket + 1, Vec::new());
                }
                buckets[bucket].push(v);
            }
        }
        b += 1;
    }
    SsspResult {
        dist: dist.into_iter().map(AtomicU64::into_inner).collect(),
        edges: relaxed.into_inner(),
    }
}

/// PageRank result.
#[derive(Debug, Clone)]
pub struct PrResult {
    /// Score per vertex (f32, GAP's `ScoreT`).
    pub scores: Vec<f32>,
    /// Iterations run.
    pub iterations: u32,
}

/// PageRank, pull direction, as GAP defines it: damping 0.85, no
/// redistribution of dangling mass, until the L1 change is below
/// `tolerance` or `max_iterations`; scores and contributions in f32 and the
/// change summed in f64, as GAP's `pr_spmv`.
pub fn pagerank<M: Mem>(g: &mut M, tolerance: f64, max_iterations: u32) -> PrResult {
    let n = g.vertices();
    let d = 0.85f32;
    let base = (1.0 - d) / n as f32;
    let mut scores = vec![1.0 / n as f32; n];
    let mut contrib = vec![0.0f32; n];
    let mut iterations = 0;
    let mut steps = Steps::default();
    for _ in 0..max_iterations {
        steps.next(g);
        iterations += 1;
        contrib
            .par_chunks_mut(GRAIN)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut r = g.reader(c as u64 + 4_000_000);
                for (j, x) in chunk.iter_mut().enumerate() {
                    let v = c * GRAIN + j;
                    let deg = r.offset(v + 1) - r.offset(v);
                    r.state(State::Score, v);
                    r.state(State::Contrib, v);
                    *x = if deg > 0 { scores[v] / deg as f32 } else { 0.0 };
                }
            });
        let error: f64 = scores
            .par_chunks_mut(GRAIN)
            .enumerate()
            .map(|(c, chunk)| {
                let mut r = g.reader(c as u64 + 5_000_000);
                let mut err = 0.0f64;
                for (j, s) in chunk.iter_mut().enumerate() {
                    let v = c * GRAIN + j;
                    let (a, b) = r.in_range(v);
                    let mut sum = 0.0f32;
                    r.each_in_neighbor(a, b, |r, u| {
                        r.state(State::Contrib, u as usize);
                        sum += contrib[u as usize];
                    });
                    r.state(State::Score, v);
                    let new = base + d * sum;
                    err += f64::from((new - *s).abs());
                    *s = new;
                }
                err
            })
            .sum();
        if error < tolerance {
            break;
        }
    }
    PrResult { scores, iterations }
}

/// Connected components (weakly connected for directed graphs):
/// Shiloach–Vishkin hooking with pointer jumping. Labels are the smallest
/// vertex of each component.
pub fn cc<M: Mem>(g: &mut M) -> Vec<u32> {
    let n = g.vertices();
    let comp: Vec<AtomicU32> = (0..n as u32).map(AtomicU32::new).collect();
    let directed = g.directed();
    let mut steps = Steps::default();
    loop {
        steps.next(g);
        let changed = AtomicBool::new(false);
        tasks(n).enumerate().for_each(|(c, range)| {
            let mut r = g.reader(c as u64 + 6_000_000);
            for u in range {
                let hook = |r: &mut M::Reader<'_>, v: usize| {
                    r.state(State::Comp, u);
                    r.state(State::Comp, v);
                    let (cu, cv) = (
                        comp[u].load(Ordering::Relaxed),
                        comp[v].load(Ordering::Relaxed),
                    );
                    if cu == cv {
                        return;
                    }
                    let (high, low) = if cu > cv { (cu, cv) } else { (cv, cu) };
                    // Only roots are hooked, onto a smaller label.
                    r.state(State::Comp, high as usize);
                    if comp[high as usize]
                        .compare_exchange(high, low, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                    {
                        changed.store(true, Ordering::Relaxed);
                    }
                };
                let mut buf = [0u32; WARP];
                let (a, b) = r.range(u);
                let mut i = a;
                while i < b {
                    let k = r.neighbors(i, b, &mut buf);
                    i += k as u64;
                    for &v in &buf[..k] {
                        hook(&mut r, v as usize);
                    }
                }
                if directed {
                    let (a, b) = r.in_range(u);
                    let mut i = a;
                    while i < b {
                        let k = r.in_neighbors(i, b, &mut buf);
                        i += k as u64;
                        for &v in &buf[..k] {
                            hook(&mut r, v as usize);
                        }
                    }
                }
            }
        });
        tasks(n).enumerate().for_each(|(c, range)| {
            let mut r = g.reader(c as u64 + 7_000_000);
            for v in range {
                loop {
                    r.state(State::Comp, v);
                    let c = comp[v].load(Ordering::Relaxed);
                    r.state(State::Comp, c as usize);
                    let cc = comp[c as usize].load(Ordering::Relaxed);
                    if c == cc {
                        break;
                    }
                    comp[v].store(cc, Ordering::Relaxed);
                }
            }
        });
        if !changed.into_inner() {
            break;
        }
    }
    comp.into_iter().map(AtomicU32::into_inner).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bitmap_lists_its_set_bits_in_order_across_tasks() {
        let n = 3 * GRAIN + 77;
        let mut b = Bitmap::new(n);
        let set: Vec<u32> = (0..n as u32)
            .filter(|v| v % 7 == 3 || *v == n as u32 - 1)
            .collect();
        for &v in &set {
            b.set_mut(v as usize);
        }
        assert_eq!(b.to_queue(), set);
        assert!(Bitmap::new(n).to_queue().is_empty());
    }
}
