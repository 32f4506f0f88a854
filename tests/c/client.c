/*
 * A C11 client of libstrata: a simulated device oversubscribed 4x (a buffer
 * four times its size, spilling into host memory and an NVMe file in a
 * temporary directory), written and read back whole, moved with tickets,
 * pinned, mapped, and described by the stats; then bad input, each call
 * answered with its status and a message; then one configuration given as
 * the struct and as TOML, resolved alike; then an embedding table.
 *
 * Usage: client [--psync]   (--psync: the NVMe tier on the psync engine,
 * for valgrind, which does not follow io_uring)
 */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata.h"

static int passed, failed;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) {                                                             \
            passed++;                                                           \
        } else {                                                                \
            failed++;                                                           \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                     \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, " (last error: %s)\n", strata_last_error());        \
        }                                                                       \
    } while (0)

#define OK(call) CHECK((call) == STRATA_OK, "%s", #call)

/* A call that must fail with `want` and a message containing `says`. */
#define FAILS(call, want, says)                                                 \
    do {                                                                        \
        int got_ = (call);                                                      \
        CHECK(got_ == (want) && strstr(strata_last_error(), (says)) != NULL,    \
              "%s: status %d (%s), want %d, message should mention \"%s\"",     \
              #call, got_, strata_status_string(got_), (want), (says));         \
    } while (0)

enum { PAGE = 64 * 1024, DEVICE_PAGES = 8, HOST_PAGES = 16, NVME_PAGES = 64 };

static uint8_t pattern(uint64_t i) {
    return (uint8_t)((i * 2654435761u) >> 11);
}

/* An embedding table of 3000 rows of 16 floats (three pages) on a runtime
 * with one page of device, host and NVMe each: bags pooled against a sum
 * computed here, an SGD and a row-wise Adagrad step checked row by row,
 * then bad input. */
static void embedding(const char *dir, int psync) {
    enum { ROWS = 3000, DIM = 16, N = 12, BAGS = 4 };
    strata_config config;
    OK(strata_config_init(&config));
    config.device = STRATA_DEVICE_SIM;
    config.page_size = PAGE;
    config.device_capacity = PAGE;
    config.host_capacity = PAGE;
    config.nvme_path = dir;
    config.nvme_capacity = 8ull * PAGE;
    config.nvme_engine = psync ? STRATA_IO_PSYNC : STRATA_IO_AUTO;
    config.background_eviction = 0;
    strata_runtime *rt = NULL;
    OK(strata_runtime_create(&config, &rt));
    strata_embedding *emb = NULL;
    OK(strata_embedding_create(rt, ROWS, DIM, 4, &emb));
    if (emb == NULL) {
        OK(strata_runtime_destroy(rt));
        return;
    }
    float *w = malloc(sizeof(float) * ROWS * DIM);
    for (size_t i = 0; i < (size_t)ROWS * DIM; i++) w[i] = (float)(i % 97) / 97.0f - 0.5f;
    OK(strata_embedding_write_rows(emb, 0, w, (size_t)ROWS * DIM));
    /* The three pages were written at once (one per worker thread), each
     * taking the fastest tier with room: one page in each tier. */
    int in_tier[4] = {0, 0, 0, 0};
    for (int64_t r = 0; r < ROWS; r += 1024) {
        strata_tier t = STRATA_TIER_NONE;
        OK(strata_embedding_tier_of_row(emb, r, &t));
        if (t >= 0 && t < 4) in_tier[t]++;
    }
    CHECK(in_tier[STRATA_TIER_DEVICE] == 1 && in_tier[STRATA_TIER_HOST] == 1 &&
              in_tier[STRATA_TIER_NVME] == 1,
          "pages in tiers: device %d host %d nvme %d", in_tier[0], in_tier[1], in_tier[3]);

    /* Bags {0 1500 2999} {} {7 7 2048 5 2999} {11 22 33 44}. */
    const int64_t idx[N] = {0, 1500, 2999, 7, 7, 2048, 5, 2999, 11, 22, 33, 44};
    const int64_t off[BAGS + 1] = {0, 3, 3, 8, N};
    float out[BAGS * DIM], want[BAGS * DIM];
    memset(want, 0, sizeof want);
    for (int b = 0; b < BAGS; b++)
        for (int64_t i = off[b]; i < off[b + 1]; i++)
            for (int d = 0; d < DIM; d++) want[b * DIM + d] += w[idx[i] * DIM + d];
    uint64_t on_device = 0;
    for (int i = 0; i < N; i++) {
        strata_tier t = STRATA_TIER_NONE;
        OK(strata_embedding_tier_of_row(emb, idx[i], &t));
        on_device += t == STRATA_TIER_DEVICE;
    }
    strata_bags bags = {idx, N, off, BAGS + 1, NULL, STRATA_POOLING_SUM, -1};
    strata_embedding_stats st = {0, 0, 0, 0};
    OK(strata_embedding_forward(emb, &bags, out, BAGS * DIM, &st));
    CHECK(memcmp(out, want, sizeof out) == 0, "pooled sums");
    CHECK(st.lookups == N && st.fast_hits == on_device && on_device > 0, "%llu lookups, %llu fast",
          (unsigned long long)st.lookups, (unsigned long long)st.fast_hits);

    /* One SGD step on three rows (one per tier), then one of Adagrad. */
    const int64_t rows[3] = {2999, 0, 1500};
    float g[3 * DIM], got[3 * DIM];
    for (int i = 0; i < 3 * DIM; i++) g[i] = 0.25f * (float)(i % 5);
    OK(strata_embedding_sgd(emb, rows, 3, g, 3 * DIM, 0.5f));
    OK(strata_embedding_read_rows(emb, rows, 3, got, 3 * DIM));
    int same = 1;
    for (int k = 0; k < 3; k++)
        for (int d = 0; d < DIM; d++)
            same &= got[k * DIM + d] == w[rows[k] * DIM + d] - 0.5f * g[k * DIM + d];
    CHECK(same, "rows after SGD");
    float *state = calloc(ROWS, sizeof(float));
    OK(strata_embedding_rowwise_adagrad(emb, rows, 3, g, 3 * DIM, state, ROWS, 0.1f, 1e-8f));
    float mean_sq = 0;
    for (int d = 0; d < DIM; d++) mean_sq += g[d] * g[d];
    mean_sq /= DIM;
    CHECK(state[2999] == mean_sq && state[1] == 0.0f, "accumulators %g %g", state[2999], state[1]);

    /* Bad input: a status and a message, nothing read or written. */
    const int64_t bad_idx[2] = {1, ROWS};
    strata_bags bad = {bad_idx, 2, off, 2, NULL, STRATA_POOLING_SUM, -1};
    const int64_t bad_off[2] = {0, 3};
    FAILS(strata_embedding_forward(emb, &bad, out, DIM, NULL), STRATA_ERR_INVALID_ARGUMENT,
          "index 3000 is out of range");
    bad.indices = idx;
    bad.offsets = bad_off;
    FAILS(strata_embedding_forward(emb, &bad, out, DIM, NULL), STRATA_ERR_INVALID_ARGUMENT,
          "last offset 3");
    bad.pooling = 9;
    FAILS(strata_embedding_forward(emb, &bad, out, DIM, NULL), STRATA_ERR_INVALID_ARGUMENT,
          "unknown pooling");
    FAILS(strata_embedding_forward(emb, NULL, out, DIM, NULL), STRATA_ERR_NULL_POINTER,
          "bags is NULL");
    const int64_t twice[2] = {4, 4};
    FAILS(strata_embedding_sgd(emb, twice, 2, g, 2 * DIM, 0.1f), STRATA_ERR_INVALID_ARGUMENT,
          "rows repeat");
    FAILS(strata_embedding_rowwise_adagrad(emb, rows, 3, g, 3 * DIM, state, 10, 0.1f, 1e-8f),
          STRATA_ERR_INVALID_ARGUMENT, "state holds 10");
    FAILS(strata_embedding_create(rt, ROWS, DIM, 0, &emb), STRATA_ERR_INVALID_ARGUMENT, "threads");
    FAILS(strata_embedding_shape((strata_embedding *)(uintptr_t)0x1234, NULL, NULL),
          STRATA_ERR_INVALID_HANDLE, "embedding table");
    OK(strata_embedding_get_stats(emb, &st));
    CHECK(st.lookups == N, "refused calls count nothing: %llu", (unsigned long long)st.lookups);
    OK(strata_embedding_free(NULL));

    /* A table with a row cache of 100 rows: its slots take the device's
     * page (the first table's page there moves down), its pages go to
     * NVMe; it pools what the first table pools, bit for bit. */
    strata_embedding *cached = NULL;
    FAILS(strata_embedding_create_cached(rt, ROWS, DIM, STRATA_TIER_NVME, 4, 0,
                                         STRATA_POLICY_DEFAULT, &cached),
          STRATA_ERR_INVALID_ARGUMENT, "row cache");
    CHECK(cached == NULL, "no handle on failure");
    OK(strata_embedding_create_cached(rt, ROWS, DIM, STRATA_TIER_NVME, 4, 100, STRATA_POLICY_LRU,
                                      &cached));
    if (cached != NULL) {
        int64_t *all = malloc(sizeof(int64_t) * ROWS);
        float *now = malloc(sizeof(float) * ROWS * DIM);
        for (int64_t r = 0; r < ROWS; r++) all[r] = r;
        OK(strata_embedding_read_rows(emb, all, ROWS, now, (size_t)ROWS * DIM));
        OK(strata_embedding_write_rows(cached, 0, now, (size_t)ROWS * DIM));
        float from_cache[BAGS * DIM];
        strata_embedding_stats cs = {0, 0, 0, 0};
        for (int round = 0; round < 2; round++) {
            OK(strata_embedding_forward(emb, &bags, out, BAGS * DIM, NULL));
            OK(strata_embedding_forward(cached, &bags, from_cache, BAGS * DIM, &cs));
            CHECK(memcmp(out, from_cache, sizeof out) == 0, "pooled through the row cache");
        }
        /* LRU admits every miss: the second round's lookups all hit. */
        CHECK(cs.lookups == N && cs.cache_hits == N && cs.cache_fills == 0,
              "%llu lookups, %llu cached, %llu filled", (unsigned long long)cs.lookups,
              (unsigned long long)cs.cache_hits, (unsigned long long)cs.cache_fills);
        OK(strata_embedding_free(cached));
        free(now);
        free(all);
    }

    /* The table outlives its runtime's handle; freeing it ends both. */
    OK(strata_runtime_destroy(rt));
    uint64_t n_rows = 0;
    size_t dim = 0;
    OK(strata_embedding_shape(emb, &n_rows, &dim));
    CHECK(n_rows == ROWS && dim == DIM, "shape %llu x %zu", (unsigned long long)n_rows, dim);
    OK(strata_embedding_free(emb));
    FAILS(strata_embedding_free(emb), STRATA_ERR_INVALID_HANDLE, "was freed");
    free(state);
    free(w);
}

int main(int argc, char **argv) {
    int psync = argc > 1 && strcmp(argv[1], "--psync") == 0;
    char dir[] = "/tmp/strata-c-XXXXXX";
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 2;
    }

    strata_config config;
    OK(strata_config_init(&config));
    config.device = STRATA_DEVICE_SIM;
    config.page_size = PAGE;
    config.device_capacity = (uint64_t)DEVICE_PAGES * PAGE;
    config.host_capacity = (uint64_t)HOST_PAGES * PAGE;
    config.nvme_path = dir;
    config.nvme_capacity = (uint64_t)NVME_PAGES * PAGE;
    config.nvme_engine = psync ? STRATA_IO_PSYNC : STRATA_IO_AUTO;
    strata_runtime *rt = NULL;
    OK(strata_runtime_create(&config, &rt));
    if (rt == NULL) {
        fprintf(stderr, "no runtime: %s\n", strata_last_error());
        return 1;
    }

    /* 4x the device: every byte written, then read back. */
    const uint64_t len = 4ull * DEVICE_PAGES * PAGE;
    strata_buffer *buf = NULL;
    OK(strata_alloc(rt, len, &buf));
    uint8_t *data = malloc(len), *back = malloc(len);
    for (uint64_t i = 0; i < len; i++) data[i] = pattern(i);
    for (uint64_t off = 0; off < len; off += 100000) {
        size_t n = (size_t)(len - off < 100000 ? len - off : 100000);
        OK(strata_write(buf, off, data + off, n));
    }
    memset(back, 0, len);
    for (uint64_t off = 0; off < len; off += 77777) {
        size_t n = (size_t)(len - off < 77777 ? len - off : 77777);
        OK(strata_read(buf, off, back + off, n));
    }
    CHECK(memcmp(data, back, len) == 0, "read back what was written");

    size_t pages = 0;
    OK(strata_buffer_page_count(buf, &pages));
    CHECK(pages == 4 * DEVICE_PAGES, "%zu pages", pages);
    int per_tier[4] = {0, 0, 0, 0};
    for (size_t p = 0; p < pages; p++) {
        strata_tier t = STRATA_TIER_NONE;
        OK(strata_buffer_tier_of(buf, p, &t));
        if (t >= 0 && t < 4) per_tier[t]++;
    }
    CHECK(per_tier[STRATA_TIER_DEVICE] <= DEVICE_PAGES && per_tier[STRATA_TIER_HOST] > 0,
          "pages spread: device %d host %d nvme %d", per_tier[0], per_tier[1], per_tier[3]);

    /* Everything to NVMe, then a quarter back up to the device with a ticket. */
    OK(strata_evict(buf, 0, len, STRATA_TIER_NVME));
    strata_tier t = STRATA_TIER_NONE;
    OK(strata_buffer_tier_of(buf, 0, &t));
    CHECK(t == STRATA_TIER_NVME, "page 0 in tier %d after evict", t);
    strata_ticket *ticket = NULL;
    OK(strata_prefetch(buf, 0, 4 * PAGE, STRATA_TIER_DEVICE, &ticket));
    int s = strata_ticket_poll(ticket);
    CHECK(s == STRATA_OK || s == STRATA_PENDING, "poll: %d", s);
    s = strata_ticket_wait_timeout(ticket, 10ull * 1000 * 1000 * 1000);
    CHECK(s == STRATA_OK, "wait_timeout: %d", s);
    OK(strata_ticket_wait(ticket));
    size_t declined = 1;
    OK(strata_ticket_declined(ticket, &declined));
    CHECK(declined == 0, "%zu pages declined with the device empty", declined);
    OK(strata_ticket_free(ticket));
    OK(strata_buffer_tier_of(buf, 3, &t));
    CHECK(t == STRATA_TIER_DEVICE, "page 3 in tier %d after prefetch", t);
    memset(back, 0, len);
    OK(strata_read(buf, 0, back, (size_t)len));
    CHECK(memcmp(data, back, len) == 0, "read back after the moves");

    /* A pin: host addresses of pages 5 and 6, holding the bytes. */
    strata_pin *pin = NULL;
    OK(strata_buffer_pin(buf, 5 * PAGE, 2 * PAGE, STRATA_TIER_HOST, &pin));
    uint64_t addresses[2] = {0, 0};
    size_t count = 0;
    OK(strata_pin_addresses(pin, addresses, 2, &count));
    CHECK(count == 2, "%zu addresses", count);
    for (size_t i = 0; i < 2 && i < count; i++) {
        const uint8_t *page = (const uint8_t *)(uintptr_t)addresses[i];
        CHECK(memcmp(page, data + (5 + i) * PAGE, PAGE) == 0, "pinned page %zu", 5 + i);
    }
    OK(strata_unpin(pin));

    /* A device map and a read-only launch: of a buffer the memory tiers can
     * hold whole (the big one cannot be mapped, and says so). */
    strata_map *map = NULL;
    strata_launch *launch = NULL;
    OK(strata_device_map(buf, &map));
    size_t map_pages = 0;
    OK(strata_map_pages(map, &map_pages));
    CHECK(map_pages == pages, "map of %zu pages", map_pages);
    FAILS(strata_map_prepare(map, STRATA_ACCESS_READ_ONLY, &launch), STRATA_ERR_OUT_OF_CAPACITY,
          "cannot be staged");
    OK(strata_map_free(map));
    strata_buffer *small_buf = NULL;
    OK(strata_alloc(rt, 8 * PAGE, &small_buf));
    OK(strata_write(small_buf, 0, data, 8 * PAGE));
    OK(strata_evict(small_buf, 0, 8 * PAGE, STRATA_TIER_NVME));
    OK(strata_device_map(small_buf, &map));
    OK(strata_map_prepare(map, STRATA_ACCESS_READ_ONLY, &launch));
    uint64_t table = 0, entry = 0;
    OK(strata_launch_map_address(launch, &table));
    OK(strata_launch_entry(launch, 7, &entry));
    CHECK(entry != 0 && table != 0 && entry == ((const uint64_t *)(uintptr_t)table)[7], "map entry 7");
    if (entry != 0) {
        /* On the simulated device every entry is a host address. */
        CHECK(memcmp((const void *)(uintptr_t)entry, data + 7 * PAGE, PAGE) == 0, "mapped page 7");
    }
    FAILS(strata_write(small_buf, 0, "x", 1), STRATA_ERR_INVALID_ARGUMENT, "read-only");
    FAILS(strata_launch_entry(launch, 8, &entry), STRATA_ERR_INVALID_ARGUMENT, "beyond");
    /* A "kernel" counts its accesses where the launch says (one uint32_t
     * per page; on the simulated device the buffer's counters in host
     * memory, updated atomically): page 5 read 40 times. */
    uint64_t counters = 0;
    OK(strata_launch_counters_address(launch, &counters));
    CHECK(counters != 0, "counters address");
    if (counters != 0) {
        _Atomic uint32_t *count = (_Atomic uint32_t *)(uintptr_t)counters;
        for (int i = 0; i < 40; i++) {
            atomic_fetch_add_explicit(&count[5], 1u, memory_order_relaxed);
        }
    }
    OK(strata_launch_end(launch));
    /* Every page's score: hot lists the pages outside device memory,
     * cold those in it, and background eviction decides which list page 5
     * is in; either way its 40 counts make it the hottest. */
    uint64_t hot_pages[8] = {0}, cold_pages[8] = {0};
    float hot_scores[8] = {0}, cold_scores[8] = {0};
    size_t hot_len = 0, cold_len = 0;
    OK(strata_buffer_harvest(small_buf, 1.0f, 8, hot_pages, hot_scores, &hot_len, cold_pages,
                             cold_scores, &cold_len));
    uint64_t hot_page = UINT64_MAX;
    float hot_score = -1.0f;
    for (size_t i = 0; i < hot_len + cold_len && i < 16; i++) {
        uint64_t page = i < hot_len ? hot_pages[i] : cold_pages[i - hot_len];
        float score = i < hot_len ? hot_scores[i] : cold_scores[i - hot_len];
        if (score > hot_score) {
            hot_page = page;
            hot_score = score;
        }
    }
    CHECK(hot_len + cold_len == 8 && hot_page == 5 && hot_score >= 40.0f,
          "hottest page %llu (%g) of %zu scored", (unsigned long long)hot_page, hot_score,
          hot_len + cold_len);
    OK(strata_write(small_buf, 0, "x", 1));
    OK(strata_map_free(map));
    OK(strata_buffer_free(small_buf));

    /* Stats, both ways. */
    char *json = NULL;
    size_t json_len = 0;
    OK(strata_stats_json(rt, &json, &json_len));
    CHECK(json != NULL && strstr(json, "\"backend\":\"simulated\"") != NULL, "stats: %s", json);
    CHECK(json != NULL && strlen(json) == json_len, "stats length");
    CHECK(json != NULL && strstr(json, "\"moves\":0,") == NULL, "pages moved");
    OK(strata_string_free(json));
    char small[16];
    size_t need = 0;
    FAILS(strata_stats_json_copy(rt, small, sizeof small, &need), STRATA_ERR_BUFFER_TOO_SMALL, "bytes");
    /* The stats may have changed since (moves run in the background), so
     * the length is only roughly the one above. */
    CHECK(need > sizeof small && small[15] == '\0', "needed %zu", need);

    /* Bad input: each fails with its status and a message. */
    uint8_t byte;
    FAILS(strata_read(buf, len, &byte, 1), STRATA_ERR_INVALID_ARGUMENT, "exceeds");
    FAILS(strata_read(buf, 0, NULL, 1), STRATA_ERR_NULL_POINTER, "dst is NULL");
    FAILS(strata_evict(buf, UINT64_MAX, 2, STRATA_TIER_HOST), STRATA_ERR_INVALID_ARGUMENT, "overflows");
    FAILS(strata_evict(buf, 0, 1, 42), STRATA_ERR_INVALID_ARGUMENT, "unknown tier");
    FAILS(strata_alloc(rt, 1, NULL), STRATA_ERR_NULL_POINTER, "out is NULL");
    strata_buffer *forged = (strata_buffer *)(uintptr_t)0x1234;
    FAILS(strata_read(forged, 0, &byte, 1), STRATA_ERR_INVALID_HANDLE, "not a live buffer handle");
    FAILS(strata_ticket_wait((strata_ticket *)buf), STRATA_ERR_INVALID_HANDLE, "ticket");
    const char bad_toml[] = "page_size = \"64k\"\n\xff";
    strata_runtime *other = NULL;
    FAILS(strata_runtime_from_toml(bad_toml, sizeof bad_toml - 1, 0, &other), STRATA_ERR_INVALID_ARGUMENT,
          "not UTF-8");
    CHECK(other == NULL, "no runtime from bad TOML");
    char message[8];
    size_t message_len = 0;
    CHECK(strata_last_error_copy(message, sizeof message, &message_len) == STRATA_ERR_BUFFER_TOO_SMALL &&
              message[7] == '\0' && message_len == strlen(strata_last_error()),
          "last error copy");
    CHECK(strcmp(strata_status_string(STRATA_ERR_INVALID_HANDLE), "invalid handle") == 0, "status string");
    OK(strata_buffer_free(NULL));

    /* A freed buffer's handle is dead; the runtime's destruction closes the rest. */
    strata_buffer *second = NULL;
    OK(strata_alloc(rt, PAGE, &second));
    OK(strata_buffer_free(second));
    FAILS(strata_write(second, 0, "x", 1), STRATA_ERR_INVALID_HANDLE, "was freed");
    OK(strata_runtime_destroy(rt));
    FAILS(strata_read(buf, 0, &byte, 1), STRATA_ERR_CLOSED, "runtime was destroyed");

    /* The same kind of runtime from TOML text. */
    char toml[512];
    snprintf(toml, sizeof toml,
             "page_size = \"64k\"\ndevice = \"sim\"\ndevice_capacity = \"512k\"\n"
             "[host]\ncapacity = \"1M\"\n[nvme]\npath = \"%s\"\ncapacity = \"4M\"\nengine = \"%s\"\n",
             dir, psync ? "psync" : "auto");
    OK(strata_runtime_from_toml(toml, strlen(toml), 0, &rt));
    OK(strata_alloc(rt, 4 * 512 * 1024, &buf));
    OK(strata_write(buf, 1000000, data, 1000000));
    memset(back, 0, 1000000);
    OK(strata_read(buf, 1000000, back, 1000000));
    CHECK(memcmp(data, back, 1000000) == 0, "TOML runtime round trip");
    OK(strata_runtime_destroy(rt));

    /* Every setting, from the struct and from TOML: the same resolved
     * configuration, and for a bad value the same message. */
    strata_config every;
    OK(strata_config_init(&every));
    every.page_size = 16384;
    every.device = STRATA_DEVICE_SIM;
    every.device_capacity = 256 * 1024;
    every.host_capacity = 1 << 20;
    every.huge_pages = 0;
    every.numa_node = STRATA_NUMA_NONE;
    every.cxl_mode = STRATA_CXL_EMULATED;
    every.cxl_capacity = 512 * 1024;
    every.cxl_bandwidth = 5ull << 30;
    every.cxl_latency_ns = 250;
    every.nvme_path = dir;
    every.nvme_capacity = 2 << 20;
    every.nvme_engine = psync ? STRATA_IO_PSYNC : STRATA_IO_AUTO;
    every.nvme_queue_depth = 8;
    every.watermark_low = 0.5;
    every.watermark_high = 0.75;
    every.policy = STRATA_POLICY_LRU;
    every.background_eviction = 0;
    every.sampling = 3;
    char every_toml[1024];
    snprintf(every_toml, sizeof every_toml,
             "page_size = \"16k\"\ndevice = \"sim\"\ndevice_capacity = \"256k\"\n"
             "watermark_low = 0.5\nwatermark_high = 0.75\npolicy = \"lru\"\n"
             "background_eviction = false\nsampling = 3\n"
             "[host]\ncapacity = \"1M\"\nhuge_pages = false\n"
             "[cxl]\nmode = \"emulated\"\ncapacity = \"512k\"\nbandwidth = \"5G\"\nlatency_ns = 250\n"
             "[nvme]\npath = \"%s\"\ncapacity = \"2M\"\nengine = \"%s\"\nqueue_depth = 8\n",
             dir, psync ? "psync" : "auto");
    strata_runtime *from_struct = NULL, *from_text = NULL;
    OK(strata_runtime_create(&every, &from_struct));
    OK(strata_runtime_from_toml(every_toml, strlen(every_toml), 0, &from_text));
    char *struct_json = NULL, *text_json = NULL, *resolved_json = NULL;
    size_t struct_len = 0;
    OK(strata_runtime_config_json(from_struct, &struct_json, &struct_len));
    OK(strata_runtime_config_json(from_text, &text_json, NULL));
    OK(strata_config_json(&every, &resolved_json, NULL));
    CHECK(struct_json != NULL && text_json != NULL && resolved_json != NULL &&
              strcmp(struct_json, text_json) == 0 && strcmp(struct_json, resolved_json) == 0 &&
              strlen(struct_json) == struct_len,
          "one configuration: %s, %s, %s", struct_json, text_json, resolved_json);
    CHECK(struct_json != NULL && strstr(struct_json, "\"policy\":\"lru\"") != NULL &&
              strstr(struct_json, "\"sampling\":3") != NULL &&
              strstr(struct_json, "\"huge_pages\":false") != NULL,
          "the settings arrived: %s", struct_json);
    uint32_t mask = 0;
    OK(strata_runtime_tiers(from_struct, &mask));
    CHECK(mask == 0xf, "tiers 0x%x", mask);
    OK(strata_string_free(struct_json));
    OK(strata_string_free(text_json));
    OK(strata_string_free(resolved_json));
    OK(strata_runtime_destroy(from_struct));
    OK(strata_runtime_destroy(from_text));
    every.sampling = 17;
    char *no_json = NULL;
    FAILS(strata_config_json(&every, &no_json, NULL), STRATA_ERR_INVALID_ARGUMENT,
          "strata_config_json: sampling 1 in 2^17 accesses: at most 2^16");
    FAILS(strata_runtime_create(&every, &rt), STRATA_ERR_INVALID_ARGUMENT,
          "strata_runtime_create: sampling 1 in 2^17 accesses: at most 2^16");
    FAILS(strata_runtime_from_toml("sampling = 17", 13, 0, &rt), STRATA_ERR_INVALID_ARGUMENT,
          "strata_runtime_from_toml: sampling 1 in 2^17 accesses: at most 2^16");
    CHECK(no_json == NULL, "no JSON for a bad config");

    embedding(dir, psync);

    free(data);
    free(back);
    if (rmdir(dir) != 0) perror("rmdir");
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
