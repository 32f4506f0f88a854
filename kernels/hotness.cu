/*
 * Access-counter harvest on the GPU (src/device/cuda_hotness.rs launches
 * these; src/hotness.rs is the reference they must match):
 *
 * 1. strata_fold: score = fmaf(score, decay, count * scale), count = 0, and
 *    two 64-bit keys per page, larger = earlier in its list, 0 = not a
 *    candidate. Hot (pages not resident, score > 0): score bits, then the
 *    page inverted (ties by page ascending). Cold (resident): inverted
 *    score bits (low scores first), then the page inverted. Scores are
 *    never negative, so their bits order like the floats. Every nonzero
 *    key is unique, so the K largest are exactly defined.
 * 2. strata_histogram: a radix select, 8 bits per pass from the top, over
 *    keys matching the digits chosen so far; the host reads 256 counts per
 *    pass (1 KiB) and picks the next digit. After 8 passes it knows the
 *    K-th largest key exactly.
 * 3. strata_collect: the pages whose key is at least that threshold (and
 *    nonzero): exactly the list, unordered; the host sorts its K keys.
 *
 * Only the histograms and the two lists cross PCIe.
 */

extern "C" __global__ void strata_fold(unsigned int *counts, float *scores,
                                       const unsigned char *resident, unsigned long long n,
                                       float decay, float scale, unsigned long long *hot_keys,
                                       unsigned long long *cold_keys) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned int c = atomicExch(&counts[i], 0u);
    float s = fmaf(scores[i], decay, (float)c * scale);
    scores[i] = s;
    unsigned long long bits = (unsigned long long)__float_as_uint(s);
    unsigned long long page_key = 0xFFFFFFFFull - (i & 0xFFFFFFFFull);
    if (resident[i]) {
        cold_keys[i] = ((~bits & 0xFFFFFFFFull) << 32) | page_key;
        hot_keys[i] = 0;
    } else {
        hot_keys[i] = s > 0.0f ? ((bits << 32) | page_key) : 0;
        cold_keys[i] = 0;
    }
}

extern "C" __global__ void strata_histogram(const unsigned long long *keys, unsigned long long n,
                                            unsigned long long prefix,
                                            unsigned long long prefix_mask,
                                            unsigned int digit_shift, unsigned int *hist) {
    __shared__ unsigned int local[256];
    for (unsigned int t = threadIdx.x; t < 256; t += blockDim.x) {
        local[t] = 0;
    }
    __syncthreads();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned long long k = keys[i];
        if (k != 0 && (k & prefix_mask) == prefix) {
            atomicAdd(&local[(k >> digit_shift) & 255ull], 1u);
        }
    }
    __syncthreads();
    for (unsigned int t = threadIdx.x; t < 256; t += blockDim.x) {
        if (local[t] != 0) {
            atomicAdd(&hist[t], local[t]);
        }
    }
}

extern "C" __global__ void strata_collect(const unsigned long long *keys, unsigned long long n,
                                          unsigned long long threshold, unsigned long long *out,
                                          unsigned int capacity, unsigned int *count) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned long long k = keys[i];
    if (k != 0 && k >= threshold) {
        unsigned int at = atomicAdd(count, 1u);
        if (at < capacity) {
            out[at] = k;
        }
    }
}
