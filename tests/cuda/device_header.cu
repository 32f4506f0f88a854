/*
 * Not a runtime kernel: tests/kernels.rs compiles this with the runtime's
 * NVRTC options so that include/strata_device.cuh, which user kernels
 * include, is compiled in CI. It calls every function in the header.
 */
#include "strata_device.cuh"

extern "C" __global__ void strata_check_device_header(const unsigned long long *map,
                                                      unsigned int *counters,
                                                      unsigned long long n,
                                                      unsigned int page_shift,
                                                      unsigned int shift, float *out_f,
                                                      double *out_d, unsigned long long *out_u) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    strata_sampler s = strata_sampler_new(i);
    out_f[i] = strata_load<float>(map, counters, i, page_shift, &s, shift);
    out_d[i] = strata_load<double>(map, counters, i, page_shift, &s, shift);
    bool counted = strata_sample(&s, shift);
    strata_touch(counters, i >> 4, &s, shift);
    out_u[i] = strata_mix(i) ^ (counted ? 1ull : 0ull);
}
