/*
 * strata_device.cuh: what CUDA kernels use to read tiered data and record
 * accesses. No includes, so it compiles under NVRTC as well as nvcc.
 *
 * The rules are the ones in src/hotness.rs (the simulated device runs that
 * code): each kernel thread keeps a strata_sampler in registers; it counts
 * one access in 2^shift on average, skipping a random number of accesses
 * (uniform in 0..2^(shift+1)-2) after each counted one, the first gap the
 * smaller of two such draws (the rest of a gap met at a random point), so
 * every page is sampled at the same rate however few accesses a thread
 * makes, and an uncounted access costs a decrement.
 *
 * Device maps (strata_device_map / DeviceMap::prepare in Rust) hold one
 * 64-bit address per page: device memory for pages in HBM, the mapped
 * address of registered host memory for pages in DRAM or CXL. They are
 * valid from prepare() until the launch guard drops; entries may be
 * swapped (one 64-bit store) while a read-only launch runs, and both the
 * old and the new address stay readable until the launch ends.
 */
#ifndef STRATA_DEVICE_CUH
#define STRATA_DEVICE_CUH

/* A splitmix64 step (src/hotness.rs: mix). */
__device__ __forceinline__ unsigned long long strata_mix(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* One kernel thread's sampling state (src/hotness.rs: Sampler). */
struct strata_sampler {
    unsigned int left;
    unsigned long long state;
};

/* A sampler seeded with `seed`: different for every thread and every
 * launch (e.g. the global thread index mixed with a launch counter; the
 * same seed at every launch samples the same accesses every time). */
__device__ __forceinline__ strata_sampler strata_sampler_new(unsigned long long seed) {
    strata_sampler s;
    s.left = 0; /* the first gap is drawn on first use */
    s.state = strata_mix(seed);
    return s;
}

/* Whether this access counts, sampling 1 in 2^shift (a shift above 31
 * samples as 31 does: a gap is 32 bits). */
__device__ __forceinline__ bool strata_sample(strata_sampler *s, unsigned int shift) {
    if (shift == 0) {
        return true;
    }
    unsigned long long span = (2ull << (shift < 31u ? shift : 31u)) - 1ull;
    if (s->left == 0) {
        s->state = strata_mix(s->state);
        unsigned long long a = 1ull + s->state % span;
        s->state = strata_mix(s->state);
        unsigned long long b = 1ull + s->state % span;
        s->left = (unsigned int)(a < b ? a : b);
    }
    if (--s->left != 0) {
        return false;
    }
    s->state = strata_mix(s->state);
    s->left = 1u + (unsigned int)(s->state % span);
    return true;
}

/* Counters stop counting here and never wrap (2^32 - 2^20: concurrent
 * increments may pass it by their number); hotness::COUNT_CEILING in Rust. */
#define STRATA_COUNT_CEILING 0xFFF00000u

/* Records an access to `page` in the buffer's counters (one u32 per page;
 * null: not counting). The counters of a launch are at
 * strata_launch_counters_address (Launch::counters_address in Rust): device
 * memory on a GPU, added to the buffer's counts, which the balancer
 * harvests, when the buffer's last launch ends; null while the runtime's
 * sampling is off. `shift` must be the launch's strata_launch_sample_shift
 * (Launch::sample_shift; the runtime's sampling): the balancer scales the
 * counts back up by 2^shift, so another shift skews it by the difference. */
__device__ __forceinline__ void strata_touch(unsigned int *counters, unsigned long long page,
                                             strata_sampler *s, unsigned int shift) {
    /* The ceiling check costs a load from L2 (__ldcg: the counters change
     * under other threads; L1 could serve a stale value) before the
     * fire-and-forget atomic; a stale value only lets a few more increments
     * past the ceiling. */
    if (counters != 0 && strata_sample(s, shift) &&
        __ldcg(&counters[page]) < STRATA_COUNT_CEILING) {
        atomicAdd(&counters[page], 1u);
    }
}

/* Element `index` of a tiered buffer seen as an array of T (sizeof(T) divides
 * the page size, 2^page_shift bytes), read through its device map, the access
 * recorded in `counters` (may be null). */
template <typename T>
__device__ __forceinline__ T strata_load(const unsigned long long *map, unsigned int *counters,
                                         unsigned long long index, unsigned int page_shift,
                                         strata_sampler *s, unsigned int shift) {
    unsigned long long offset = index * (unsigned long long)sizeof(T);
    unsigned long long page = offset >> page_shift;
    unsigned long long within = offset & ((1ull << page_shift) - 1ull);
    strata_touch(counters, page, s, shift);
    const volatile unsigned long long *entry = map + page;
    return *(const T *)(*entry + within);
}

#endif /* STRATA_DEVICE_CUH */
