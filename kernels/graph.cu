/*
 * The graph kernels on a GPU: BFS (direction-optimizing), SSSP
 * (delta-stepping, near/far queues), PageRank (pull) and connected
 * components (Shiloach-Vishkin hooking with pointer jumping).
 * src/workloads/graph/cuda.rs drives them; src/workloads/graph/algo.rs is
 * the CPU version they follow step for step (the same levels, bucket
 * rounds, iterations and rounds, between which strata's balancer runs).
 *
 * The CSR arrays (u64 offsets, u32 neighbours, u32 weights; the transpose
 * for directed graphs) are read through graph_load, compiled one of two
 * ways from this one source:
 *
 * - default: each array is a tiered buffer read through its strata device
 *   map (strata_load), every access sampled into the array's per-page
 *   access counters, which the balancer harvests between steps;
 * - STRATA_GRAPH_PLAIN defined: each array is a plain pointer (Unified
 *   Memory, mapped host memory or device memory), no counters: the
 *   baselines.
 *
 * Vertex state (depths, parents, distances, scores, labels, queues,
 * bitmaps) is plain device memory: working memory, not tiered.
 *
 * Work is spread by grid-stride loops, one thread per vertex or one warp
 * per vertex where a whole neighbour list is read (coalesced reads: what
 * zero-copy and tiered reads over PCIe need). Launch with blocks of a
 * multiple of 32 threads.
 *
 * The Rust side compiles it with NVRTC with strata_device.cuh prepended
 * (the guard below then skips the #include); compiled on its own (nvcc, or
 * NVRTC from a file), it needs -I include.
 */
#ifndef STRATA_DEVICE_CUH
#include "strata_device.cuh"
#endif

/* Indices of the arrays in graph_view (src/workloads/graph/cuda.rs:
 * GraphView). On undirected graphs the incoming arrays are the outgoing
 * ones. */
#define GRAPH_OFFSETS 0
#define GRAPH_NEIGHBORS 1
#define GRAPH_WEIGHTS 2
#define GRAPH_IN_OFFSETS 3
#define GRAPH_IN_NEIGHBORS 4

#define GRAPH_NONE 0xFFFFFFFFu
#define GRAPH_FULL_WARP 0xFFFFFFFFu

/* Where a kernel finds the CSR arrays; passed by value to every kernel.
 * Layout shared with GraphView in src/workloads/graph/cuda.rs. */
struct graph_view {
    /* Per array: its device map (default) or its data (plain). */
    unsigned long long base[5];
    /* Per array: its per-page access counters (u32 each), 0 for none. */
    unsigned long long counters[5];
    /* Vertex count. */
    unsigned long long vertices;
    /* Seed of the threads' samplers (new per launch). */
    unsigned long long seed;
    /* log2 of the tiered buffers' page size. */
    unsigned int page_shift;
    /* Count one access in 2^sample_shift. */
    unsigned int sample_shift;
};

/* Element i of array a. */
template <typename T>
__device__ __forceinline__ T graph_load(const graph_view &g, int a, unsigned long long i,
                                        strata_sampler *s) {
#ifdef STRATA_GRAPH_PLAIN
    (void)s;
    return ((const T *)g.base[a])[i];
#else
    return strata_load<T>((const unsigned long long *)g.base[a], (unsigned int *)g.counters[a], i,
                          g.page_shift, s, g.sample_shift);
#endif
}

__device__ __forceinline__ unsigned long long graph_thread() {
    return (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long graph_threads() {
    return (unsigned long long)gridDim.x * blockDim.x;
}

__device__ __forceinline__ strata_sampler graph_sampler(const graph_view &g) {
    return strata_sampler_new(g.seed ^ (graph_thread() * 0x9E3779B97F4A7C15ull));
}

/* Offsets [v], [v+1] of array a (GRAPH_OFFSETS or GRAPH_IN_OFFSETS), read
 * by lane 0 and shared with the warp (one counted access, as one read). */
__device__ __forceinline__ void graph_range(const graph_view &g, int a, unsigned long long v,
                                            strata_sampler *s, unsigned long long *begin,
                                            unsigned long long *end) {
    unsigned long long b = 0, e = 0;
    if ((threadIdx.x & 31) == 0) {
        b = graph_load<unsigned long long>(g, a, v, s);
        e = graph_load<unsigned long long>(g, a, v + 1, s);
    }
    *begin = __shfl_sync(GRAPH_FULL_WARP, b, 0);
    *end = __shfl_sync(GRAPH_FULL_WARP, e, 0);
}

__device__ __forceinline__ unsigned long long warp_sum(unsigned long long x) {
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_down_sync(GRAPH_FULL_WARP, x, o);
    }
    return x;
}

__device__ __forceinline__ float warp_sum_f32(float x) {
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_down_sync(GRAPH_FULL_WARP, x, o);
    }
    return x;
}

/* Adds each thread's x into *total, one atomic per warp. Every thread of
 * the warp must call it. */
__device__ __forceinline__ void add_to(unsigned long long *total, unsigned long long x) {
    x = warp_sum(x);
    if ((threadIdx.x & 31) == 0 && x != 0) {
        atomicAdd(total, x);
    }
}

/* ---- BFS ---------------------------------------------------------------- */

extern "C" __global__ void graph_bfs_init(int *depth, unsigned int *parent, unsigned long long n,
                                          unsigned int source) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        depth[v] = v == source ? 0 : -1;
        parent[v] = v == source ? source : GRAPH_NONE;
    }
}

/* *sum += the out-degrees of the queued vertices. */
extern "C" __global__ void graph_bfs_frontier_edges(graph_view g, const unsigned int *queue,
                                                    unsigned int len, unsigned long long *sum) {
    strata_sampler s = graph_sampler(g);
    unsigned long long local = 0;
    for (unsigned long long i = graph_thread(); i < len; i += graph_threads()) {
        unsigned long long u = queue[i];
        local += graph_load<unsigned long long>(g, GRAPH_OFFSETS, u + 1, &s) -
                 graph_load<unsigned long long>(g, GRAPH_OFFSETS, u, &s);
    }
    add_to(sum, local);
}

/* A top-down step, one warp per queued vertex: unvisited out-neighbours
 * are claimed (the parent's compare-and-swap decides) and queued. */
extern "C" __global__ void graph_bfs_top_down(graph_view g, const unsigned int *queue,
                                              unsigned int len, int *depth, unsigned int *parent,
                                              int level, unsigned int *next,
                                              unsigned int *next_len,
                                              unsigned long long *examined) {
    strata_sampler s = graph_sampler(g);
    unsigned long long lane = threadIdx.x & 31;
    unsigned long long checked = 0;
    for (unsigned long long w = graph_thread() >> 5; w < len; w += graph_threads() >> 5) {
        unsigned int u = queue[w];
        unsigned long long a, b;
        graph_range(g, GRAPH_OFFSETS, u, &s, &a, &b);
        for (unsigned long long i = a + lane; i < b; i += 32) {
            checked++;
            unsigned int v = graph_load<unsigned int>(g, GRAPH_NEIGHBORS, i, &s);
            if (depth[v] < 0 && atomicCAS(&parent[v], GRAPH_NONE, u) == GRAPH_NONE) {
                depth[v] = level + 1;
                next[atomicAdd(next_len, 1u)] = v;
            }
        }
    }
    add_to(examined, checked);
}

/* A bottom-up step, one warp per unvisited vertex: its in-neighbours are
 * checked 32 at a time against the frontier bitmap until one is in it. */
extern "C" __global__ void graph_bfs_bottom_up(graph_view g, int *depth, unsigned int *parent,
                                               const unsigned int *front,
                                               unsigned int *next_front, int level,
                                               unsigned long long *found,
                                               unsigned long long *examined) {
    strata_sampler s = graph_sampler(g);
    unsigned long long lane = threadIdx.x & 31;
    unsigned long long checked = 0, discovered = 0;
    for (unsigned long long v = graph_thread() >> 5; v < g.vertices; v += graph_threads() >> 5) {
        /* Only this warp writes depth[v] during the step: the same value
         * for every lane. */
        if (depth[v] >= 0) {
            continue;
        }
        unsigned long long a, b;
        graph_range(g, GRAPH_IN_OFFSETS, v, &s, &a, &b);
        for (unsigned long long base = a; base < b; base += 32) {
            unsigned long long i = base + lane;
            unsigned int u = 0;
            bool hit = false;
            if (i < b) {
                checked++;
                u = graph_load<unsigned int>(g, GRAPH_IN_NEIGHBORS, i, &s);
                hit = (front[u >> 5] >> (u & 31)) & 1u;
            }
            unsigned int mask = __ballot_sync(GRAPH_FULL_WARP, hit);
            if (mask != 0) {
                unsigned int p = __shfl_sync(GRAPH_FULL_WARP, u, __ffs(mask) - 1);
                if (lane == 0) {
                    parent[v] = p;
                    depth[v] = level + 1;
                    atomicOr(&next_front[v >> 5], 1u << (v & 31));
                    discovered++;
                }
                break;
            }
        }
    }
    add_to(found, discovered);
    add_to(examined, checked);
}

extern "C" __global__ void graph_bfs_queue_to_bitmap(const unsigned int *queue, unsigned int len,
                                                     unsigned int *bitmap) {
    for (unsigned long long i = graph_thread(); i < len; i += graph_threads()) {
        unsigned int v = queue[i];
        atomicOr(&bitmap[v >> 5], 1u << (v & 31));
    }
}

extern "C" __global__ void graph_bfs_bitmap_to_queue(const unsigned int *bitmap,
                                                     unsigned long long n, unsigned int *queue,
                                                     unsigned int *len) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        if ((bitmap[v >> 5] >> (v & 31)) & 1u) {
            queue[atomicAdd(len, 1u)] = (unsigned int)v;
        }
    }
}

/* ---- SSSP --------------------------------------------------------------- */
/*
 * Delta-stepping with two queues. `near` holds the vertices of the current
 * bucket still to relax; a round relaxes them all (one warp per vertex)
 * and queues the improved vertices of the same bucket for the next round,
 * those of later buckets in `far`. Stamps keep each queue free of
 * duplicates (a vertex enters a queue once per tag), so no queue outgrows
 * the vertex count. When the bucket is empty, the smallest bucket in `far`
 * is next: its vertices move to `near`, later ones to a new `far`, and
 * entries already settled in an earlier bucket are dropped.
 */

extern "C" __global__ void graph_sssp_init(unsigned long long *dist, unsigned int *near_stamp,
                                           unsigned int *far_stamp, unsigned long long n,
                                           unsigned int source) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        dist[v] = v == source ? 0ull : ~0ull;
        near_stamp[v] = 0;
        far_stamp[v] = 0;
    }
}

extern "C" __global__ void graph_sssp_relax(graph_view g, const unsigned int *near,
                                            unsigned int near_len, unsigned long long *dist,
                                            unsigned long long delta, unsigned long long bucket,
                                            unsigned int *next_near, unsigned int *next_near_len,
                                            unsigned int *near_stamp, unsigned int near_tag,
                                            unsigned int *far, unsigned int *far_len,
                                            unsigned int *far_stamp, unsigned int far_tag,
                                            unsigned long long *relaxed) {
    strata_sampler s = graph_sampler(g);
    unsigned long long lane = threadIdx.x & 31;
    unsigned long long count = 0;
    for (unsigned long long w = graph_thread() >> 5; w < near_len; w += graph_threads() >> 5) {
        unsigned int u = near[w];
        /* Read once for the warp: other warps may lower it meanwhile (then
         * u is queued again and relaxed once more). */
        unsigned long long du = lane == 0 ? dist[u] : 0;
        du = __shfl_sync(GRAPH_FULL_WARP, du, 0);
        if (du / delta < bucket) {
            continue;
        }
        unsigned long long a, b;
        graph_range(g, GRAPH_OFFSETS, u, &s, &a, &b);
        for (unsigned long long i = a + lane; i < b; i += 32) {
            count++;
            unsigned int v = graph_load<unsigned int>(g, GRAPH_NEIGHBORS, i, &s);
            unsigned long long nd = du + graph_load<unsigned int>(g, GRAPH_WEIGHTS, i, &s);
            if (nd < atomicMin(&dist[v], nd)) {
                if (nd / delta == bucket) {
                    if (atomicExch(&near_stamp[v], near_tag) != near_tag) {
                        next_near[atomicAdd(next_near_len, 1u)] = v;
                    }
                } else if (atomicExch(&far_stamp[v], far_tag) != far_tag) {
                    far[atomicAdd(far_len, 1u)] = v;
                }
            }
        }
    }
    add_to(relaxed, count);
}

/* *next = the smallest bucket after `bucket` among the far vertices. */
extern "C" __global__ void graph_sssp_far_min(const unsigned int *far, unsigned int far_len,
                                              const unsigned long long *dist,
                                              unsigned long long delta, unsigned long long bucket,
                                              unsigned long long *next) {
    for (unsigned long long i = graph_thread(); i < far_len; i += graph_threads()) {
        unsigned long long b = dist[far[i]] / delta;
        if (b > bucket) {
            atomicMin(next, b);
        }
    }
}

/* Far vertices of bucket `bucket` into `near`, later ones into `far_out`
 * (stamped with the new far tag), settled ones dropped. */
extern "C" __global__ void graph_sssp_far_split(const unsigned int *far, unsigned int far_len,
                                                const unsigned long long *dist,
                                                unsigned long long delta,
                                                unsigned long long bucket, unsigned int *near,
                                                unsigned int *near_len, unsigned int *far_out,
                                                unsigned int *far_out_len,
                                                unsigned int *far_stamp, unsigned int far_tag) {
    for (unsigned long long i = graph_thread(); i < far_len; i += graph_threads()) {
        unsigned int v = far[i];
        unsigned long long b = dist[v] / delta;
        if (b == bucket) {
            near[atomicAdd(near_len, 1u)] = v;
        } else if (b > bucket) {
            far_stamp[v] = far_tag;
            far_out[atomicAdd(far_out_len, 1u)] = v;
        }
    }
}

/* ---- PageRank ----------------------------------------------------------- */

extern "C" __global__ void graph_pr_init(float *scores, unsigned long long n, float value) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        scores[v] = value;
    }
}

/* contrib[v] = score(v) / outdeg(v), 0 for vertices without out-edges. */
extern "C" __global__ void graph_pr_contrib(graph_view g, const float *scores, float *contrib) {
    strata_sampler s = graph_sampler(g);
    for (unsigned long long v = graph_thread(); v < g.vertices; v += graph_threads()) {
        unsigned long long deg = graph_load<unsigned long long>(g, GRAPH_OFFSETS, v + 1, &s) -
                                 graph_load<unsigned long long>(g, GRAPH_OFFSETS, v, &s);
        contrib[v] = deg > 0 ? scores[v] / (float)deg : 0.0f;
    }
}

/* score(v) = base + damping * sum of contrib over in-neighbours, one warp
 * per vertex; partial[blockIdx.x] = the block's L1 change. */
extern "C" __global__ void graph_pr_pull(graph_view g, const float *contrib, float *scores,
                                         float base, float damping, double *partial) {
    __shared__ double warp_change[32];
    strata_sampler s = graph_sampler(g);
    unsigned long long lane = threadIdx.x & 31;
    double change = 0.0;
    for (unsigned long long v = graph_thread() >> 5; v < g.vertices; v += graph_threads() >> 5) {
        unsigned long long a, b;
        graph_range(g, GRAPH_IN_OFFSETS, v, &s, &a, &b);
        float sum = 0.0f;
        for (unsigned long long i = a + lane; i < b; i += 32) {
            sum += contrib[graph_load<unsigned int>(g, GRAPH_IN_NEIGHBORS, i, &s)];
        }
        sum = warp_sum_f32(sum);
        if (lane == 0) {
            float next = base + damping * sum;
            change += fabs((double)(next - scores[v]));
            scores[v] = next;
        }
    }
    /* Only lane 0 holds a change; the block adds its warps'. */
    if (lane == 0) {
        warp_change[threadIdx.x >> 5] = change;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (unsigned int w = 0; w < (blockDim.x + 31) / 32; w++) {
            total += warp_change[w];
        }
        partial[blockIdx.x] = total;
    }
}

/* ---- Connected components ----------------------------------------------- */

extern "C" __global__ void graph_cc_init(unsigned int *comp, unsigned long long n) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        comp[v] = (unsigned int)v;
    }
}

/* Hooks the larger of two different labels onto the smaller, if it is
 * still a root (labels only ever decrease: no cycles). */
__device__ __forceinline__ void graph_cc_hook(unsigned int *comp, unsigned int u, unsigned int v,
                                              unsigned int *changed) {
    unsigned int cu = comp[u], cv = comp[v];
    if (cu == cv) {
        return;
    }
    unsigned int high = cu > cv ? cu : cv;
    unsigned int low = cu > cv ? cv : cu;
    if (atomicCAS(&comp[high], high, low) == high) {
        *changed = 1;
    }
}

/* One hooking round over every edge (both directions on directed graphs:
 * weak connectivity), one warp per vertex. */
extern "C" __global__ void graph_cc_hook_edges(graph_view g, unsigned int *comp,
                                               unsigned int directed, unsigned int *changed) {
    strata_sampler s = graph_sampler(g);
    unsigned long long lane = threadIdx.x & 31;
    for (unsigned long long u = graph_thread() >> 5; u < g.vertices; u += graph_threads() >> 5) {
        unsigned long long a, b;
        graph_range(g, GRAPH_OFFSETS, u, &s, &a, &b);
        for (unsigned long long i = a + lane; i < b; i += 32) {
            graph_cc_hook(comp, (unsigned int)u,
                          graph_load<unsigned int>(g, GRAPH_NEIGHBORS, i, &s), changed);
        }
        if (directed) {
            graph_range(g, GRAPH_IN_OFFSETS, u, &s, &a, &b);
            for (unsigned long long i = a + lane; i < b; i += 32) {
                graph_cc_hook(comp, (unsigned int)u,
                              graph_load<unsigned int>(g, GRAPH_IN_NEIGHBORS, i, &s), changed);
            }
        }
    }
}

/* Pointer jumping: every vertex to its root. No hooks run meanwhile, so
 * roots stay put; a stale read costs an extra step, never a cycle. */
extern "C" __global__ void graph_cc_compress(unsigned int *comp, unsigned long long n) {
    for (unsigned long long v = graph_thread(); v < n; v += graph_threads()) {
        for (;;) {
            unsigned int c = comp[v];
            unsigned int cc = comp[c];
            if (c == cc) {
                break;
            }
            comp[v] = cc;
        }
    }
}
