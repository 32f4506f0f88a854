/*
 * The offloaded Adam/AdamW update on the GPU (src/device/cuda_adam.rs
 * launches these; adam_update and the importance-aware step in
 * src/offload/optim.rs are the CPU reference they must match bit for bit).
 *
 * Per element, in this order, every operation rounded to fp32 on its own
 * (the __f*_rn intrinsics are never contracted into an FMA; the runtime
 * also compiles with --fmad=false, IEEE division and square root, no
 * flush to zero):
 *
 *   m = b1*m + (1-b1)*g
 *   v = b2*v + (1-b2)*(g*g)
 *   w = w - (step*(m / (sqrt(v)*rs + eps)) + decay*w)
 *
 * with the step's scalars from the host (src/adam.rs, StepScalars):
 * step = lr/(1-b1^t), rs = 1/sqrt(1-b2^t), decay = lr*wd.
 *
 * strata_adam: every element of the arrays it is given. Importance-aware
 * mode needs nothing more: between flushes it updates the compact arrays
 * of the resident elements, and on a flush every element of a chunk with
 * the gradient the host chose for it (src/offload/optim.rs).
 */

struct strata_adam_scalars {
    float beta1, beta2, eps, step, rs, decay;
};

__device__ __forceinline__ void strata_adam_element(float *w, float *m, float *v, float g,
                                                    const strata_adam_scalars &s) {
    float c1 = __fsub_rn(1.0f, s.beta1);
    float c2 = __fsub_rn(1.0f, s.beta2);
    float mi = __fadd_rn(__fmul_rn(s.beta1, *m), __fmul_rn(c1, g));
    float vi = __fadd_rn(__fmul_rn(s.beta2, *v), __fmul_rn(c2, __fmul_rn(g, g)));
    *m = mi;
    *v = vi;
    float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), s.rs), s.eps);
    float update = __fadd_rn(__fmul_rn(s.step, __fdiv_rn(mi, denom)), __fmul_rn(s.decay, *w));
    *w = __fsub_rn(*w, update);
}

extern "C" __global__ void strata_adam(float *w, float *m, float *v, const float *g,
                                       unsigned int n, float beta1, float beta2, float eps,
                                       float step, float rs, float decay) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    strata_adam_scalars s = {beta1, beta2, eps, step, rs, decay};
    strata_adam_element(&w[i], &m[i], &v[i], g[i], s);
}
