//! The graph kernels on a GPU: `kernels/graph.cu`, compiled with NVRTC on
//! first use and cached per context, in two flavours from the one source:
//!
//! | flavour | the CSR arrays are | used by |
//! |---|---|---|
//! | [`Flavour::Mapped`] | tiered buffers read through their device maps (`strata_load`), every access sampled into per-page counters the balancer harvests between steps | [`StrataGpu`]: the `strata` configuration |
//! | [`Flavour::Plain`] | plain pointers | [`PlainGpu`]: `uvm` (Unified Memory), `zero-copy` (mapped host memory), `all-device` |
//!
//! [`bfs`], [`sssp`], [`pagerank`] and [`cc`] follow the CPU kernels of
//! [`algo`](super::algo) step for step (same levels, bucket rounds,
//! iterations and rounds, with the balancer run between them) and return
//! the same result types, so [`verify`](super::verify) checks both.
//!
//! The kernels' working memory (per-vertex state, queues, bitmaps) is plain
//! device memory outside the device budget, in every configuration.
//!
//! Everything CUDA goes through strata's safe layer
//! ([`strata::device::cuda`]); the one `unsafe` block here is the kernel
//! launch.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::{Pod, Zeroable};

use super::algo::{BfsResult, PrResult, SsspResult};
use super::tiered::TieredGraph;
use super::Csr;
use strata::device::cuda::{
    Context, DeviceBuffer, Kernel, LaunchConfig, ManagedBuffer, PinnedBuffer, Ptx, Stream,
};
use strata::error::{Error, Result};
use strata::runtime::{Access, DeviceMap, OwnedLaunch};
use strata::tier::Tier;

const SOURCE: &str = include_str!("../../../../../kernels/graph.cu");

/// Every kernel of `graph.cu`, loaded when the module is.
const KERNELS: [&str; 16] = [
    "graph_bfs_init",
    "graph_bfs_frontier_edges",
    "graph_bfs_top_down",
    "graph_bfs_bottom_up",
    "graph_bfs_queue_to_bitmap",
    "graph_bfs_bitmap_to_queue",
    "graph_sssp_init",
    "graph_sssp_relax",
    "graph_sssp_far_min",
    "graph_sssp_far_split",
    "graph_pr_init",
    "graph_pr_contrib",
    "graph_pr_pull",
    "graph_cc_init",
    "graph_cc_hook_edges",
    "graph_cc_compress",
];

/// Threads per block (a multiple of 32: several kernels give each vertex a
/// warp).
const BLOCK: u32 = 256;
/// Blocks per launch at most; kernels stride over the rest. Also the
/// length of PageRank's per-block partial sums.
const MAX_BLOCKS: u64 = 4096;

/// How the kernels read the CSR arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavour {
    /// Through strata device maps, counting accesses.
    Mapped,
    /// Through plain pointers (`STRATA_GRAPH_PLAIN`).
    Plain,
}

/// `graph.cu` as NVRTC compiles it (the runtime's options and header
/// substitution, `strata::device::nvrtc`), with `STRATA_GRAPH_PLAIN`
/// defined for [`Flavour::Plain`].
pub fn compile_ptx(flavour: Flavour) -> Result<Ptx> {
    let source = match flavour {
        Flavour::Mapped => SOURCE.to_string(),
        Flavour::Plain => format!("#define STRATA_GRAPH_PLAIN 1\n{SOURCE}"),
    };
    strata::device::nvrtc::compile("graph.cu", &source)
}

/// The compiled graph kernels of one context and flavour, and the stream
/// they run on.
pub struct GraphKernels {
    stream: Stream,
    functions: HashMap<&'static str, Kernel>,
}

impl GraphKernels {
    /// The kernels of `flavour` for `ctx` (the module compiled and loaded
    /// the first time, cached by the context), on a new stream.
    pub fn for_context(ctx: &Context, flavour: Flavour) -> Result<Arc<Self>> {
        let key = match flavour {
            Flavour::Mapped => "graph.cu",
            Flavour::Plain => "graph.cu (plain)",
        };
        let module = ctx.module(key, || compile_ptx(flavour))?;
        let mut functions = HashMap::new();
        for name in KERNELS {
            functions.insert(name, module.kernel(name)?);
        }
        Ok(Arc::new(Self {
            stream: ctx.stream()?,
            functions,
        }))
    }

    /// The stream the kernels run on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn function(&self, name: &str) -> &Kernel {
        // The names are the constants of KERNELS, every one loaded.
        &self.functions[name]
    }
}

/// GPU 0's primary context: the one strata's cuda backend opens, so device
/// maps and registered host memory of a cuda runtime are valid in it.
/// Held for the process, so the kernels compile once.
pub fn context() -> Result<Context> {
    static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);
    let mut slot = CONTEXT.lock().expect("context lock");
    if let Some(ctx) = &*slot {
        return Ok(ctx.clone());
    }
    let ctx = Context::open(0)?;
    *slot = Some(ctx.clone());
    Ok(ctx)
}

/// Where a kernel finds the CSR arrays: `graph_view` in `graph.cu`, passed
/// by value to every kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
pub struct GraphView {
    /// Per array (offsets, neighbours, weights, incoming offsets, incoming
    /// neighbours): its device map's address, or its data's.
    pub base: [u64; 5],
    /// Per array: the device address of its per-page u32 access counters
    /// (0: not counting).
    pub counters: [u64; 5],
    /// Vertex count.
    pub vertices: u64,
    /// Seed of the kernel threads' samplers.
    pub seed: u64,
    /// log2 of the page size (mapped flavour).
    pub page_shift: u32,
    /// Count one access in 2^sample_shift.
    pub sample_shift: u32,
}

// Laid out as graph.cu's graph_view: five u64, five u64, two u64, two u32,
// no padding on either side (which `Pod` checks).

/// A graph the GPU kernels read: where its arrays are, and what happens
/// between steps.
pub trait GpuGraph {
    /// The kernels that read it.
    fn kernels(&self) -> &Arc<GraphKernels>;
    /// The view for the next launch.
    fn view(&mut self) -> GraphView;
    /// Vertex count.
    fn vertices(&self) -> usize;
    /// Directed edge count (`offsets[n]`).
    fn edges(&self) -> u64;
    /// Whether the arrays include the weights.
    fn weighted(&self) -> bool;
    /// Whether the graph is directed (carries its transpose).
    fn directed(&self) -> bool;
    /// Called between steps (BFS levels, SSSP bucket rounds, PageRank
    /// iterations, CC rounds), with the stream idle.
    fn between_steps(&mut self) -> Result<()> {
        Ok(())
    }
}

fn grid(threads: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            threads.div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `$name` of `$k` over `$threads` threads (grid-striding
/// beyond [`MAX_BLOCKS`]) with the arguments given.
macro_rules! launch {
    ($k:expr, $name:literal, $threads:expr; $($arg:expr),* $(,)?) => {{
        let k: &GraphKernels = &$k;
        let mut b = k.stream.launch(k.function($name));
        $( b.arg($arg); )*
        // SAFETY: each call site passes the arguments of the kernel's
        // signature in graph.cu, in order and type; every buffer holds the
        // elements the kernel indexes (vertex arrays `n`, queues `n`,
        // bitmaps `ceil(n/32)` words, counters one) and lives until the
        // stream is synchronized (every function below reads a result back,
        // which waits, before its buffers drop; the graphs' drops wait for
        // the stream before freeing the arrays the views point at), and the
        // kernels stride over their work whatever the grid.
        unsafe { b.launch(grid($threads))? };
    }};
}

fn zeros<T: Pod>(s: &Stream, n: usize) -> Result<DeviceBuffer<T>> {
    s.alloc_zeros::<T>(n.max(1))
}

fn clear<T>(s: &Stream, x: &mut DeviceBuffer<T>) -> Result<()> {
    s.memset_zeros(x)
}

fn first<T: Pod>(s: &Stream, x: &DeviceBuffer<T>) -> Result<T> {
    let mut v = [T::zeroed()];
    s.memcpy_dtoh(x, &mut v)?;
    Ok(v[0])
}

fn set_first<T: Pod>(s: &Stream, x: &mut DeviceBuffer<T>, value: T) -> Result<()> {
    s.memcpy_htod(&[value], x)
}

fn to_host<T: Pod>(s: &Stream, x: &DeviceBuffer<T>, n: usize) -> Result<Vec<T>> {
    let mut v = s.clone_dtoh(x)?;
    v.truncate(n);
    Ok(v)
}

/// Vertex ids are u32 (as the CSR's neighbours).
fn vertex_count(g: &dyn GpuGraph) -> Result<usize> {
    let n = g.vertices();
    if n == 0 || n as u64 > u32::MAX as u64 {
        return Err(Error::invalid(format!(
            "the GPU kernels take 1..2^32 vertices, not {n}"
        )));
    }
    Ok(n)
}

/// Direction-optimizing BFS, as [`algo::bfs`](super::algo::bfs) (α = 15,
/// β = 18): top-down steps over a vertex queue, bottom-up steps over
/// frontier bitmaps.
pub fn bfs(g: &mut dyn GpuGraph, source: usize) -> Result<BfsResult> {
    let n = vertex_count(g)?;
    if source >= n {
        return Err(Error::invalid(format!("source {source} is not a vertex")));
    }
    let k = g.kernels().clone();
    let s = k.stream();
    let n64 = n as u64;
    let words = n.div_ceil(32);
    let mut depth = zeros::<i32>(s, n)?;
    let mut parent = zeros::<u32>(s, n)?;
    let (mut queue, mut next) = (zeros::<u32>(s, n)?, zeros::<u32>(s, n)?);
    let (mut front, mut next_front) = (zeros::<u32>(s, words)?, zeros::<u32>(s, words)?);
    let mut len_dev = zeros::<u32>(s, 1)?;
    let (mut sum, mut found, mut examined) = (
        zeros::<u64>(s, 1)?,
        zeros::<u64>(s, 1)?,
        zeros::<u64>(s, 1)?,
    );
    let src = source as u32;
    launch!(k, "graph_bfs_init", n64; &mut depth, &mut parent, &n64, &src);
    set_first(s, &mut queue, source as u32)?;
    let mut len = 1u32;
    let mut level = 0i32;
    let (alpha, beta) = (15u64, 18u64);
    let mut edges_unexplored = g.edges();
    while len > 0 {
        clear(s, &mut sum)?;
        let view = g.view();
        launch!(k, "graph_bfs_frontier_edges", len as u64; &view, &queue, &len, &mut sum);
        let frontier_edges = first(s, &sum)?;
        if frontier_edges > edges_unexplored / alpha {
            // Bottom-up steps while the frontier is large.
            clear(s, &mut front)?;
            launch!(k, "graph_bfs_queue_to_bitmap", len as u64; &queue, &len, &mut front);
            let mut awake = len as u64;
            loop {
                clear(s, &mut next_front)?;
                clear(s, &mut found)?;
                let view = g.view();
                launch!(k, "graph_bfs_bottom_up", n64 * 32;
                    &view, &mut depth, &mut parent, &front, &mut next_front, &level,
                    &mut found, &mut examined);
                let count = first(s, &found)?;
                level += 1;
                g.between_steps()?;
                std::mem::swap(&mut front, &mut next_front);
                let grew = count > awake;
                awake = count;
                if count == 0 || (!grew && count < n64 / beta) {
                    break;
                }
            }
            // Back to top-down with the last bottom-up frontier.
            clear(s, &mut len_dev)?;
            launch!(k, "graph_bfs_bitmap_to_queue", n64; &front, &n64, &mut queue, &mut len_dev);
            len = first(s, &len_dev)?;
        } else {
            clear(s, &mut len_dev)?;
            let view = g.view();
            launch!(k, "graph_bfs_top_down", len as u64 * 32;
                &view, &queue, &len, &mut depth, &mut parent, &level, &mut next,
                &mut len_dev, &mut examined);
            len = first(s, &len_dev)?;
            std::mem::swap(&mut queue, &mut next);
            level += 1;
            g.between_steps()?;
        }
        edges_unexplored = edges_unexplored.saturating_sub(frontier_edges);
    }
    Ok(BfsResult {
        depth: to_host(s, &depth, n)?,
        parent: to_host(s, &parent, n)?,
        edges: first(s, &examined)?,
    })
}

/// Delta-stepping SSSP with bucket width `delta`, as
/// [`algo::sssp`](super::algo::sssp): a bucket's vertices are relaxed in
/// rounds until none of it is left; improved vertices of later buckets
/// wait in a far queue until their bucket is the smallest left.
pub fn sssp(g: &mut dyn GpuGraph, source: usize, delta: u64) -> Result<SsspResult> {
    let n = vertex_count(g)?;
    if source >= n {
        return Err(Error::invalid(format!("source {source} is not a vertex")));
    }
    if !g.weighted() {
        return Err(Error::invalid("SSSP needs the graph's weights on the GPU"));
    }
    if delta == 0 {
        return Err(Error::invalid("the bucket width must be positive"));
    }
    let k = g.kernels().clone();
    let s = k.stream();
    let n64 = n as u64;
    let mut dist = zeros::<u64>(s, n)?;
    let (mut near_stamp, mut far_stamp) = (zeros::<u32>(s, n)?, zeros::<u32>(s, n)?);
    let (mut near, mut next_near) = (zeros::<u32>(s, n)?, zeros::<u32>(s, n)?);
    let (mut far, mut far_out) = (zeros::<u32>(s, n)?, zeros::<u32>(s, n)?);
    let mut near_len_dev = zeros::<u32>(s, 1)?;
    let (mut far_len_dev, mut far_out_len_dev) = (zeros::<u32>(s, 1)?, zeros::<u32>(s, 1)?);
    let (mut relaxed, mut next_bucket) = (zeros::<u64>(s, 1)?, zeros::<u64>(s, 1)?);
    let src = source as u32;
    launch!(k, "graph_sssp_init", n64;
        &mut dist, &mut near_stamp, &mut far_stamp, &n64, &src);
    set_first(s, &mut near, source as u32)?;
    let (mut near_len, mut bucket) = (1u32, 0u64);
    let (mut near_tag, mut far_tag) = (0u32, 1u32);
    loop {
        while near_len > 0 {
            near_tag += 1;
            clear(s, &mut near_len_dev)?;
            let view = g.view();
            launch!(k, "graph_sssp_relax", near_len as u64 * 32;
                &view, &near, &near_len, &mut dist, &delta, &bucket, &mut next_near,
                &mut near_len_dev, &mut near_stamp, &near_tag, &mut far, &mut far_len_dev,
                &mut far_stamp, &far_tag, &mut relaxed);
            near_len = first(s, &near_len_dev)?;
            std::mem::swap(&mut near, &mut next_near);
            g.between_steps()?;
        }
        let far_len = first(s, &far_len_dev)?;
        if far_len == 0 {
            break;
        }
        set_first(s, &mut next_bucket, u64::MAX)?;
        launch!(k, "graph_sssp_far_min", far_len as u64;
            &far, &far_len, &dist, &delta, &bucket, &mut next_bucket);
        let b = first(s, &next_bucket)?;
        if b == u64::MAX {
            break;
        }
        bucket = b;
        far_tag += 1;
        clear(s, &mut near_len_dev)?;
        clear(s, &mut far_out_len_dev)?;
        launch!(k, "graph_sssp_far_split", far_len as u64;
            &far, &far_len, &dist, &delta, &bucket, &mut near, &mut near_len_dev,
            &mut far_out, &mut far_out_len_dev, &mut far_stamp, &far_tag);
        near_len = first(s, &near_len_dev)?;
        std::mem::swap(&mut far, &mut far_out);
        std::mem::swap(&mut far_len_dev, &mut far_out_len_dev);
    }
    Ok(SsspResult {
        dist: to_host(s, &dist, n)?,
        edges: first(s, &relaxed)?,
    })
}

/// Pull PageRank as GAP defines it and as
/// [`algo::pagerank`](super::algo::pagerank) computes it (f32 scores, the
/// change summed in f64).
pub fn pagerank(g: &mut dyn GpuGraph, tolerance: f64, max_iterations: u32) -> Result<PrResult> {
    let n = vertex_count(g)?;
    let k = g.kernels().clone();
    let s = k.stream();
    let n64 = n as u64;
    let damping = 0.85f32;
    let base = (1.0 - damping) / n as f32;
    let mut scores = zeros::<f32>(s, n)?;
    let mut contrib = zeros::<f32>(s, n)?;
    let mut partial = zeros::<f64>(s, MAX_BLOCKS as usize)?;
    let init = 1.0 / n as f32;
    launch!(k, "graph_pr_init", n64; &mut scores, &n64, &init);
    let mut iterations = 0;
    for _ in 0..max_iterations {
        iterations += 1;
        let view = g.view();
        launch!(k, "graph_pr_contrib", n64; &view, &scores, &mut contrib);
        clear(s, &mut partial)?;
        let view = g.view();
        launch!(k, "graph_pr_pull", n64 * 32;
            &view, &contrib, &mut scores, &base, &damping, &mut partial);
        let change: f64 = s.clone_dtoh(&partial)?.iter().sum();
        g.between_steps()?;
        if change < tolerance {
            break;
        }
    }
    Ok(PrResult {
        scores: to_host(s, &scores, n)?,
        iterations,
    })
}

/// Connected components (weakly, on directed graphs), as
/// [`algo::cc`](super::algo::cc): hooking rounds with pointer jumping
/// until no hook succeeds.
pub fn cc(g: &mut dyn GpuGraph) -> Result<Vec<u32>> {
    let n = vertex_count(g)?;
    let k = g.kernels().clone();
    let s = k.stream();
    let n64 = n as u64;
    let directed = g.directed() as u32;
    let mut comp = zeros::<u32>(s, n)?;
    let mut changed = zeros::<u32>(s, 1)?;
    launch!(k, "graph_cc_init", n64; &mut comp, &n64);
    loop {
        clear(s, &mut changed)?;
        let view = g.view();
        launch!(k, "graph_cc_hook_edges", n64 * 32; &view, &mut comp, &directed, &mut changed);
        launch!(k, "graph_cc_compress", n64; &mut comp, &n64);
        let again = first(s, &changed)? != 0;
        g.between_steps()?;
        if !again {
            break;
        }
    }
    to_host(s, &comp, n)
}

/// Bytes of device memory the kernels allocate for a graph of `n`
/// vertices, at most (BFS's is the largest), for holding device memory
/// back around them.
pub fn working_bytes(n: usize) -> u64 {
    let n = n.max(1) as u64;
    // BFS: depth, parent, two queues (4 bytes per vertex each), two bitmaps.
    // SSSP: distances (8), two stamps and four queues (4 each). PageRank:
    // scores, contributions (8 each) and the partial sums.
    let bfs = 16 * n + 2 * n.div_ceil(32) * 4;
    let sssp = 8 * n + 6 * 4 * n;
    let pr = 16 * n + MAX_BLOCKS * 8;
    // Allocation granularity (2 MiB) for each of at most ten arrays.
    bfs.max(sssp).max(pr) + 10 * (2 << 20)
}

/// The `strata` configuration on a GPU: the arrays are a [`TieredGraph`]
/// on a cuda runtime, read through device maps by the mapped kernels.
/// Kernels count accesses into device memory (one u32 per page per array);
/// between steps the counts are added to the runtime's and a balancer
/// round runs, as on the simulated device.
pub struct StrataGpu<'g> {
    graph: &'g TieredGraph,
    kernels: Arc<GraphKernels>,
    maps: Vec<Option<DeviceMap>>,
    launches: Vec<Option<OwnedLaunch>>,
    /// Whether kernels count accesses (the runtime samples).
    counting: bool,
    view: GraphView,
    edges: u64,
    launch_seed: u64,
    /// Sampled accesses to pages in device memory when counted.
    pub device_accesses: u64,
    /// All sampled accesses.
    pub sampled_accesses: u64,
}

impl<'g> StrataGpu<'g> {
    /// Starts a run over `graph` (built on a cuda runtime) with `kernels`
    /// of the mapped flavour: one read-only launch per array.
    pub fn new(graph: &'g TieredGraph, kernels: Arc<GraphKernels>) -> Result<Self> {
        if graph.rt.device_backend() != Some(strata::device::BackendKind::Cuda) {
            return Err(Error::invalid(
                "the GPU kernels need the graph on a cuda runtime",
            ));
        }
        let maps = graph.maps()?;
        let counting = graph.rt.sampling().is_some();
        let edges = match &graph.buffers()[1] {
            Some(b) => b.len() / 4,
            None => 0,
        };
        let mut me = Self {
            graph,
            kernels,
            maps,
            launches: Vec::new(),
            counting,
            view: GraphView {
                vertices: graph.vertices() as u64,
                page_shift: graph.rt.page_size().trailing_zeros(),
                sample_shift: graph.rt.sampling().unwrap_or(0),
                ..Default::default()
            },
            edges,
            launch_seed: 0,
            device_accesses: 0,
            sampled_accesses: 0,
        };
        me.prepare()?;
        Ok(me)
    }

    fn prepare(&mut self) -> Result<()> {
        self.launches = self
            .maps
            .iter()
            .map(|m| {
                m.as_ref()
                    .map(|m| m.prepare_owned(Access::ReadOnly))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        for a in 0..5 {
            let launch = self.launches[a].as_ref();
            self.view.base[a] = launch.map_or(0, |l| l.map_address());
            // The runtime's per-page counters in device memory, drained
            // into the buffer's counters when the launch ends.
            self.view.counters[a] = match launch {
                Some(l) if self.counting => l.counters_address(),
                _ => 0,
            };
        }
        if !self.graph.directed() {
            // The transpose of an undirected graph is the graph.
            self.view.base[3] = self.view.base[0];
            self.view.base[4] = self.view.base[1];
            self.view.counters[3] = self.view.counters[0];
            self.view.counters[4] = self.view.counters[1];
        }
        Ok(())
    }

    /// Device hits among the sampled accesses (1 where none were sampled).
    pub fn hit_rate(&self) -> f64 {
        if self.sampled_accesses == 0 {
            1.0
        } else {
            self.device_accesses as f64 / self.sampled_accesses as f64
        }
    }
}

impl GpuGraph for StrataGpu<'_> {
    fn kernels(&self) -> &Arc<GraphKernels> {
        &self.kernels
    }

    fn view(&mut self) -> GraphView {
        self.launch_seed += 1;
        self.view.seed = strata::hotness::mix(self.launch_seed);
        self.view
    }

    fn vertices(&self) -> usize {
        self.graph.vertices()
    }

    fn edges(&self) -> u64 {
        self.edges
    }

    fn weighted(&self) -> bool {
        self.graph.buffers()[2].is_some()
    }

    fn directed(&self) -> bool {
        self.graph.directed()
    }

    fn between_steps(&mut self) -> Result<()> {
        self.kernels.stream().synchronize()?;
        // The launches end: the kernels' counts land in the buffers'
        // counters (the runtime drains its device counters), where this
        // step's accesses are tallied by where the pages were, and the
        // balancer harvests them; the next launches begin.
        self.launches.clear();
        for a in 0..5 {
            let (Some(map), Some(buf)) = (self.maps[a].as_ref(), self.graph.buffers()[a].as_ref())
            else {
                continue;
            };
            for (p, c) in map.counts().into_iter().enumerate() {
                if c != 0 {
                    self.sampled_accesses += c as u64;
                    if buf.tier_of(p)? == Some(Tier::Device) {
                        self.device_accesses += c as u64;
                    }
                }
            }
        }
        self.graph.rt.balance_once()?;
        self.prepare()
    }
}

impl Drop for StrataGpu<'_> {
    fn drop(&mut self) {
        // A kernel may still read through the maps (a run that failed
        // half-way): the launches must outlive it (they drop after this,
        // freeing retired pages and draining the device counters). The
        // layer's wait waits even after an unrelated earlier error.
        self.kernels.stream().synchronize_quietly();
    }
}

/// Where a [`PlainGpu`] keeps the arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainKind {
    /// CUDA Unified Memory (`cuMemAllocManaged`), filled from the host:
    /// pages migrate to the GPU on fault and back under pressure.
    Managed,
    /// Pinned host memory mapped for the GPU (`cuMemHostAlloc` with
    /// `DEVICEMAP`): every read crosses PCIe (EMOGI's zero-copy).
    HostMapped,
    /// Device memory (`cuMemAlloc`).
    Device,
}

/// One array of a [`PlainGpu`], freed on drop.
enum Array {
    Managed(ManagedBuffer<u8>),
    HostMapped(PinnedBuffer<u8>),
    Device(DeviceBuffer<u8>),
}

impl Array {
    /// A copy of `data` in `kind` memory of `kernels`' context, complete on
    /// return (device copies go on the kernels' stream and are waited for).
    fn new(kernels: &GraphKernels, kind: PlainKind, data: &[u8]) -> Result<Self> {
        let ctx = kernels.stream().context();
        Ok(match kind {
            PlainKind::Managed => Array::Managed(ManagedBuffer::from_slice(ctx, data)?),
            PlainKind::HostMapped => Array::HostMapped(PinnedBuffer::mapped_from_slice(ctx, data)?),
            PlainKind::Device => {
                let mut b = DeviceBuffer::alloc(ctx, data.len())?;
                kernels.stream().memcpy_htod(data, &mut b)?;
                Array::Device(b)
            }
        })
    }

    /// The address kernels use.
    fn device(&self) -> u64 {
        match self {
            Array::Managed(b) => b.device_address(),
            Array::HostMapped(b) => b
                .device_address()
                .expect("mapped_from_slice maps the buffer"),
            Array::Device(b) => b.device_address(),
        }
    }
}

/// The baselines on a GPU: the CSR arrays copied into plain memory of one
/// [`PlainKind`], read by the plain kernels.
pub struct PlainGpu {
    kernels: Arc<GraphKernels>,
    arrays: Vec<Option<Array>>,
    balloon: Option<DeviceBuffer<u8>>,
    kind: PlainKind,
    view: GraphView,
    vertices: usize,
    edges: u64,
    directed: bool,
    launch_seed: u64,
}

impl PlainGpu {
    /// `g`'s arrays (with the weights if `weights`) in `kind` memory of
    /// `ctx`, and the plain kernels.
    pub fn new(ctx: &Context, g: &Csr, kind: PlainKind, weights: bool) -> Result<Self> {
        let kernels = GraphKernels::for_context(ctx, Flavour::Plain)?;
        let array = |bytes: &[u8]| Array::new(&kernels, kind, bytes);
        let mut arrays: Vec<Option<Array>> = (0..5).map(|_| None).collect();
        arrays[0] = Some(array(bytemuck::cast_slice(&g.offsets))?);
        arrays[1] = Some(array(bytemuck::cast_slice(&g.neighbors))?);
        if weights {
            arrays[2] = Some(array(bytemuck::cast_slice(&g.weights))?);
        }
        if let Some((o, n)) = &g.incoming {
            arrays[3] = Some(array(bytemuck::cast_slice(o))?);
            arrays[4] = Some(array(bytemuck::cast_slice(n))?);
        }
        let mut view = GraphView {
            vertices: g.vertices() as u64,
            ..Default::default()
        };
        for (a, x) in arrays.iter().enumerate() {
            view.base[a] = x.as_ref().map_or(0, Array::device);
        }
        if !g.directed() {
            view.base[3] = view.base[0];
            view.base[4] = view.base[1];
        }
        Ok(Self {
            kernels,
            arrays,
            balloon: None,
            kind,
            view,
            vertices: g.vertices(),
            edges: g.edges(),
            directed: g.directed(),
            launch_seed: 0,
        })
    }

    /// Holds device memory back so that only `leave_free` bytes stay free
    /// (Unified Memory then keeps at most that much of the graph on the
    /// GPU): one `cuMemAlloc` of the rest, freed on drop. Replaces an
    /// earlier hold.
    pub fn hold_back(&mut self, ctx: &Context, leave_free: u64) -> Result<u64> {
        self.balloon = None;
        let (free, _) = ctx.memory_info()?;
        let held = free.saturating_sub(leave_free);
        if held > 0 {
            self.balloon = Some(DeviceBuffer::alloc(ctx, held as usize)?);
        }
        Ok(held)
    }

    /// Starts a trial cold: Unified Memory pages back to the host.
    pub fn reset(&self) -> Result<()> {
        if self.kind != PlainKind::Managed {
            return Ok(());
        }
        let s = self.kernels.stream();
        for a in self.arrays.iter().flatten() {
            if let Array::Managed(b) = a {
                s.prefetch_to_host(b)?;
            }
        }
        s.synchronize()
    }
}

impl GpuGraph for PlainGpu {
    fn kernels(&self) -> &Arc<GraphKernels> {
        &self.kernels
    }

    fn view(&mut self) -> GraphView {
        self.launch_seed += 1;
        self.view.seed = strata::hotness::mix(self.launch_seed);
        self.view
    }

    fn vertices(&self) -> usize {
        self.vertices
    }

    fn edges(&self) -> u64 {
        self.edges
    }

    fn weighted(&self) -> bool {
        self.arrays[2].is_some()
    }

    fn directed(&self) -> bool {
        self.directed
    }
}

impl Drop for PlainGpu {
    fn drop(&mut self) {
        // Kernels may still read the arrays: wait for them before freeing.
        self.kernels.stream().synchronize_quietly();
    }
}
