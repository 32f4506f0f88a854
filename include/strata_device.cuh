/*
 * strata_device.cuh: what CUDA kernels use to read tiered data and record
 * accesses. No includes, so it compiles under NVRTC as well as nvcc.
 *
 * The rules are the ones in src/hotness.rs (the simulated device runs that
 * code): a sampled access counts 1; an access numbered `seq` (the caller's
 * running count, e.g. per thread) to `page` is sampled iff
 * strata_mix(page ^ seq * STRATA_PHI) has its low `shift` bits zero.
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

#define STRATA_PHI 0x9E3779B97F4A7C15ull

/* splitmix64's finalizer. */
__device__ __forceinline__ unsigned long long strata_mix(unsigned long long x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Whether access number `seq` to `page` is one of the sampled 1 in 2^shift. */
__device__ __forceinline__ bool strata_sampled(unsigned long long page, unsigned long long seq,
                                               unsigned int shift) {
    return shift == 0 || (strata_mix(page ^ (seq * STRATA_PHI)) & ((1ull << shift) - 1ull)) == 0;
}

/* Records an access to `page` in the buffer's counters (one u32 per page). */
__device__ __forceinline__ void strata_touch(unsigned int *counters, unsigned long long page,
                                             unsigned long long seq, unsigned int shift) {
    if (counters != 0 && strata_sampled(page, seq, shift)) {
        atomicAdd(&counters[page], 1u);
    }
}

/* Element `index` of a tiered buffer seen as an array of T (sizeof(T) divides
 * the page size, 2^page_shift bytes), read through its device map, the access
 * recorded in `counters` (may be null). */
template <typename T>
__device__ __forceinline__ T strata_load(const unsigned long long *map, unsigned int *counters,
                                         unsigned long long index, unsigned int page_shift,
                                         unsigned long long seq, unsigned int shift) {
    unsigned long long offset = index * (unsigned long long)sizeof(T);
    unsigned long long page = offset >> page_shift;
    unsigned long long within = offset & ((1ull << page_shift) - 1ull);
    strata_touch(counters, page, seq, shift);
    const volatile unsigned long long *entry = map + page;
    return *(const T *)(*entry + within);
}

#endif /* STRATA_DEVICE_CUH */
