/*
 * The offloading modules from C, through libstrata and include/strata.h:
 *
 * 1. an MoE expert cache: 2 layers of 8 experts in host memory, 4 device
 *    slots; each token fetches its top-2 experts per layer (blocking only
 *    on a miss), prefetches the next layer's predicted experts while the
 *    current one "runs", and cancels what the layer did not use;
 * 2. an offloaded AdamW: 100,000 parameters whose weights and moments live
 *    in host DRAM (STRATA_TIER_NVME with a directory puts them on a disk),
 *    fitting w to a target; the loss must fall.
 *
 * On the simulated device (this example's default) a device address is
 * host memory, so the fetched expert's bytes can be checked here; on a
 * GPU they would be read by a kernel.
 *
 *   cargo build --release -p libstrata
 *   gcc -std=c11 -Wall -Wextra -Iinclude examples/c/offload.c \
 *       -Ltarget/release -lstrata -Wl,-rpath,$PWD/target/release -o offload
 *   ./offload
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

#define TRY(call)                                                                 \
    do {                                                                          \
        int status_ = (call);                                                     \
        if (status_ != STRATA_OK) {                                               \
            fprintf(stderr, "%s: %s (%s)\n", #call, strata_status_string(status_), \
                    strata_last_error());                                         \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

enum { LAYERS = 2, EXPERTS = 8, EXPERT_BYTES = 64 << 10, TOKENS = 32 };

static int moe_example(void) {
    strata_moe_config config;
    TRY(strata_moe_config_init(&config));
    config.device = STRATA_DEVICE_SIM;
    config.device_slots = 4;
    config.slot_bytes = EXPERT_BYTES;
    config.host_bytes = 4 << 20;
    strata_moe *moe = NULL;
    TRY(strata_moe_create(&config, &moe));

    /* Expert (l, e) is EXPERT_BYTES of the byte 16 * l + e. */
    unsigned char *weights = malloc(EXPERT_BYTES);
    if (weights == NULL) {
        return 1;
    }
    for (uint32_t l = 0; l < LAYERS; l++) {
        for (uint32_t e = 0; e < EXPERTS; e++) {
            memset(weights, (int)(16 * l + e), EXPERT_BYTES);
            TRY(strata_moe_register(moe, l, e, weights, EXPERT_BYTES));
        }
    }
    free(weights);

    int wrong = 0;
    for (uint32_t t = 0; t < TOKENS; t++) {
        for (uint32_t l = 0; l < LAYERS; l++) {
            /* A skewed router: experts 0 and 1 most of the time. */
            uint32_t top[2] = {t % 3 == 0 ? 2u + t % 6 : 0u, 1u};
            if (l + 1 < LAYERS) {
                /* The next layer will likely want the same two. */
                TRY(strata_moe_prefetch(moe, l + 1, top, 2, NULL));
            }
            for (int k = 0; k < 2; k++) {
                uint64_t pages[EXPERT_BYTES / 4096];
                size_t n = 0;
                strata_expert_pin *pin = NULL;
                TRY(strata_moe_fetch(moe, l, top[k], pages, sizeof pages / sizeof pages[0], &n,
                                     &pin));
                /* Simulated device: the page addresses are host memory. */
                const unsigned char *first = (const unsigned char *)(uintptr_t)pages[0];
                if (n == 0 || first[0] != 16 * l + top[k]) {
                    wrong++;
                }
                TRY(strata_moe_release(pin));
            }
            /* The layer ran: its unfinished prefetches can only be late. */
            TRY(strata_moe_cancel_prefetches(moe, l, NULL));
        }
    }
    strata_moe_stats s;
    TRY(strata_moe_get_stats(moe, &s));
    printf("moe: %llu fetches, hit rate %.1f%%, %llu prefetches (%llu used, %llu cancelled), "
           "stall %.3f ms%s\n",
           (unsigned long long)s.fetches, 100.0 * (double)s.hits / (double)s.fetches,
           (unsigned long long)s.prefetches, (unsigned long long)s.prefetches_used,
           (unsigned long long)s.prefetches_cancelled, 1e3 * s.stall_seconds,
           s.stall_modelled ? " (modelled)" : "");
    TRY(strata_moe_free(moe));
    if (wrong != 0) {
        fprintf(stderr, "moe: %d fetches returned the wrong expert\n", wrong);
        return 1;
    }
    return 0;
}

static double loss(const float *w, size_t n) {
    double l = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)w[i] - 0.25 * (double)(i % 8);
        l += d * d;
    }
    return l / (double)n;
}

static int optim_example(void) {
    enum { N = 100000, STEPS = 40 };
    float *w = calloc(N, sizeof *w);
    float *g = calloc(N, sizeof *g);
    if (w == NULL || g == NULL) {
        return 1;
    }
    strata_optim_config config;
    TRY(strata_optim_config_init(&config));
    config.tier = STRATA_TIER_HOST;
    config.chunk_bytes = 64 << 10;
    config.lr = 0.05f;
    config.weight_decay = 0.0f;
    strata_optim *opt = NULL;
    TRY(strata_optim_create(w, N, &config, &opt));
    double first = loss(w, N);
    for (int step = 0; step < STEPS; step++) {
        TRY(strata_optim_weights(opt, w, N));
        for (size_t i = 0; i < N; i++) {
            g[i] = 2.0f * (w[i] - 0.25f * (float)(i % 8)) / (float)N;
        }
        strata_step_stats st;
        TRY(strata_optim_step(opt, g, N, &st));
    }
    TRY(strata_optim_weights(opt, w, N));
    double last = loss(w, N);
    printf("optim: loss %.4f -> %.6f after %d AdamW steps, states in host memory\n", first, last,
           STEPS);
    TRY(strata_optim_free(opt));
    free(w);
    free(g);
    if (!(last < first * 0.1)) {
        fprintf(stderr, "optim: the loss did not fall enough\n");
        return 1;
    }
    return 0;
}

int main(void) {
    int failed = moe_example();
    failed |= optim_example();
    return failed;
}
