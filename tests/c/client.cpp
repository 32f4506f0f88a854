// A C++17 client of libstrata through the RAII wrapper include/strata.hpp:
// a simulated device oversubscribed 4x, typed reads and writes, tickets from
// several threads, pins, a launch, and errors as exceptions. Every handle is
// freed by a destructor, also when an exception unwinds.
//
// Usage: client_cpp [--psync]
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "strata.hpp"

namespace {

// Counted from several threads.
std::atomic<int> passed{0}, failed{0};

void check(bool ok, const char *what, int line) {
    if (ok) {
        passed++;
    } else {
        failed++;
        std::fprintf(stderr, "client.cpp:%d: %s\n", line, what);
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

// Runs `f`, which must throw strata::Error with `status`.
template <class F>
void expect_error(F f, int status, const char *says, int line) {
    try {
        f();
        check(false, "no exception", line);
    } catch (const strata::Error &e) {
        bool ok = e.status() == status && std::strstr(e.what(), says) != nullptr;
        if (!ok) std::fprintf(stderr, "client.cpp:%d: got %d: %s\n", line, e.status(), e.what());
        check(ok, "the expected error", line);
    }
}
#define EXPECT_ERROR(expr, status, says) expect_error([&] { expr; }, status, says, __LINE__)

constexpr uint64_t kPage = 64 * 1024;

}  // namespace

int main(int argc, char **argv) {
    bool psync = argc > 1 && std::string(argv[1]) == "--psync";
    char dir[] = "/tmp/strata-cpp-XXXXXX";
    if (!mkdtemp(dir)) {
        std::perror("mkdtemp");
        return 2;
    }
    try {
        strata_config config = strata::Runtime::defaults();
        config.device = STRATA_DEVICE_SIM;
        config.page_size = kPage;
        config.device_capacity = 8 * kPage;
        config.host_capacity = 16 * kPage;
        config.nvme_path = dir;
        config.nvme_capacity = 64 * kPage;
        config.nvme_engine = psync ? STRATA_IO_PSYNC : STRATA_IO_AUTO;
        strata::Runtime rt(config);
        CHECK(rt.page_size() == kPage);

        // 4x the device, as doubles.
        const size_t n = 4 * 8 * kPage / sizeof(double);
        strata::Buffer buf = rt.alloc(n * sizeof(double));
        std::vector<double> values(n);
        for (size_t i = 0; i < n; i++) values[i] = 0.5 * static_cast<double>(i);
        buf.write(0, values);
        CHECK(buf.read<double>(0, n) == values);

        // Four threads move quarters around with tickets and check them.
        std::atomic<int> bad{0};
        std::vector<std::thread> threads;
        for (int t = 0; t < 4; t++) {
            threads.emplace_back([&, t] {
                try {
                    uint64_t quarter = n * sizeof(double) / 4;
                    for (strata_tier to : {STRATA_TIER_NVME, STRATA_TIER_HOST, STRATA_TIER_DEVICE}) {
                        strata::Ticket ticket = buf.prefetch(t * quarter, quarter, to);
                        while (!ticket.wait_for(std::chrono::milliseconds(1))) {
                        }
                        CHECK(ticket.poll());
                        CHECK(ticket.declined() <= quarter);
                        CHECK(buf.cancel(ticket) == 0);  // finished: nothing to drop
                    }
                    auto back = buf.read<double>(t * quarter, quarter / sizeof(double));
                    if (std::memcmp(back.data(), values.data() + t * quarter / sizeof(double), quarter) != 0) bad++;
                } catch (const strata::Error &e) {
                    // A full tier is a fair outcome when four movers compete.
                    if (e.status() != STRATA_ERR_OUT_OF_CAPACITY) {
                        std::fprintf(stderr, "thread %d: %s\n", t, e.what());
                        bad++;
                    }
                }
            });
        }
        for (auto &th : threads) th.join();
        CHECK(bad == 0);
        CHECK(buf.read<double>(0, n) == values);

        // A pin's addresses hold the bytes (host memory).
        {
            strata::Pin pin = buf.pin(3 * kPage, kPage, STRATA_TIER_HOST);
            CHECK(pin.tier() == STRATA_TIER_HOST && pin.first_page() == 3);
            std::vector<uint64_t> a = pin.addresses();
            CHECK(a.size() == 1);
            const double *page = reinterpret_cast<const double *>(static_cast<uintptr_t>(a[0]));
            CHECK(std::memcmp(page, values.data() + 3 * kPage / sizeof(double), kPage) == 0);
        }  // unpinned here

        // A launch over a buffer the memory tiers hold whole.
        {
            strata::Buffer small = rt.alloc(4 * kPage);
            small.write(0, values.data(), 4 * kPage);
            strata::Map map = small.device_map();
            strata::Launch launch = map.prepare(STRATA_ACCESS_READ_WRITE);
            CHECK(launch.map_address() != 0 && launch.entry(3) != 0 && launch.counters_address() != 0);
            CHECK(launch.sample_shift() == 0);  // the default sampling: every access
            CHECK(map.counts().size() == 4);
            EXPECT_ERROR(launch.entry(4), STRATA_ERR_INVALID_ARGUMENT, "beyond");
        }

        // The offload objects on the same runtime: experts and optimizer
        // states share its tiers with the buffers above.
        {
            strata_moe_config mc = strata::ExpertCache::defaults();
            mc.device_slots = 2;
            mc.slot_bytes = kPage;
            strata::ExpertCache cache(rt, mc);
            std::vector<unsigned char> w(kPage, 7);
            for (uint32_t e = 0; e < 3; e++) cache.add(0, e, w.data(), w.size());
            {
                strata::ExpertPin pin = cache.fetch(0, 1);
                CHECK(pin.addresses().size() == 1 && pin.addresses()[0] != 0);
                // The addresses go with the handle: moved, then released.
                strata::ExpertPin other = std::move(pin);
                CHECK(!pin && pin.addresses().empty() && other && other.addresses().size() == 1);
                other.reset();
                CHECK(!other && other.addresses().empty());
            }
            CHECK(cache.is_ready(0, 1) && !cache.is_ready(0, 2));
            CHECK(cache.prefetch(0, {2}) <= 1);
            cache.cancel_prefetches(0, {1});
            cache.cancel_prefetches(0);
            strata_moe_stats ms = cache.stats();
            CHECK(ms.fetches == 1);
            EXPECT_ERROR(cache.fetch(1, 0), STRATA_ERR_NOT_FOUND, "not registered");

            strata_optim_config oc = strata::Optimizer::defaults();
            oc.tier = STRATA_TIER_HOST;
            oc.chunk_bytes = kPage;
            std::vector<float> w0(1000, 1.0f), g(1000);
            for (size_t i = 0; i < g.size(); i++) g[i] = i % 2 ? 0.5f : -0.25f;
            strata::Optimizer opt(rt, w0, oc);
            opt.step(g);
            std::vector<float> w1 = opt.weights(w0.size());
            // Adam's first step moves each weight by about lr against its
            // gradient's sign.
            bool moved = true;
            for (size_t i = 0; i < w1.size(); i++) {
                float want = g[i] > 0 ? 1.0f - oc.lr : 1.0f + oc.lr;
                if (std::abs(w1[i] - want) > 1e-5f) moved = false;
            }
            CHECK(moved);
            EXPECT_ERROR(opt.step(std::vector<float>(3)), STRATA_ERR_INVALID_ARGUMENT, "3");
        }

        std::string stats = rt.stats_json();
        CHECK(stats.find("\"backend\":\"simulated\"") != std::string::npos);

        // Errors are exceptions with the status and the message; handles made
        // before the throw are freed by their destructors.
        EXPECT_ERROR(buf.read<double>(n * sizeof(double), 1), STRATA_ERR_INVALID_ARGUMENT, "exceeds");
        EXPECT_ERROR(buf.evict(0, 1, 17), STRATA_ERR_INVALID_ARGUMENT, "unknown tier");
        EXPECT_ERROR(rt.alloc(0), STRATA_ERR_INVALID_ARGUMENT, "zero bytes");
        EXPECT_ERROR(strata::Runtime::from_toml("page_size = \"3k\""), STRATA_ERR_INVALID_ARGUMENT, "power of two");
        static const char not_utf8[] = "[host]\ncapacity = \"1M\"\n\xc3\x28";
        EXPECT_ERROR(strata::Runtime::from_toml(std::string_view(not_utf8, sizeof not_utf8 - 1)),
                     STRATA_ERR_INVALID_ARGUMENT, "not UTF-8");
        strata::Buffer moved = std::move(buf);
        CHECK(!buf && moved);

        // An embedding table on the same runtime: rows written and read
        // back, bags pooled (weighted sum) as the rows say, SGD and
        // row-wise Adagrad on distinct rows, stats, and bad input refused.
        {
            const size_t dim = 4;
            strata::EmbeddingTable emb(rt, 1000, dim);
            CHECK(emb.rows() == 1000 && emb.dim() == dim);
            std::vector<float> rows(1000 * dim);
            for (size_t i = 0; i < rows.size(); i++) rows[i] = static_cast<float>(i % 97) * 0.25f;
            emb.write_rows(0, rows);
            CHECK(emb.read_rows({7, 3}) == std::vector<float>({rows[28], rows[29], rows[30], rows[31], rows[12],
                                                              rows[13], rows[14], rows[15]}));
            strata_embedding_stats st{};
            std::vector<float> out = emb.forward({1, 2, 5}, {0, 2, 3}, STRATA_POOLING_SUM, {1.0f, 2.0f, 0.5f}, -1, &st);
            bool pooled = out.size() == 2 * dim;
            for (size_t j = 0; pooled && j < dim; j++) {
                pooled = out[j] == rows[4 + j] + 2.0f * rows[8 + j] && out[dim + j] == 0.5f * rows[20 + j];
            }
            CHECK(pooled && st.lookups == 3 && emb.stats().lookups == 3);
            emb.sgd({2}, std::vector<float>(dim, 1.0f), 0.5f);
            CHECK(emb.read_rows({2})[0] == rows[8] - 0.5f);
            std::vector<float> state(1000, 0.0f);
            emb.rowwise_adagrad({9}, std::vector<float>(dim, 2.0f), state, 0.1f);
            CHECK(state[9] == 4.0f && std::abs(emb.read_rows({9})[0] - (rows[36] - 0.1f)) < 1e-5f);
            CHECK(emb.tier_of_row(0) != STRATA_TIER_NONE);
            // An int thread count is a thread count (not a tier).
            strata::EmbeddingTable three(rt, 100, dim, 3);
            three.write_rows(0, std::vector<float>(dim, 1.0f));
            CHECK(three.tier_of_row(0) != STRATA_TIER_NVME);
            strata::EmbeddingTable on_host = strata::EmbeddingTable::in_tier(rt, 100, dim, STRATA_TIER_HOST, 2);
            on_host.write_rows(0, std::vector<float>(dim, 1.0f));
            CHECK(on_host.tier_of_row(0) == STRATA_TIER_HOST);
            emb.reset_stats();
            CHECK(emb.stats().lookups == 0);
            EXPECT_ERROR(emb.read_rows({1000}), STRATA_ERR_INVALID_ARGUMENT, "");
            EXPECT_ERROR(emb.forward({1, 2}, {0, 2}, STRATA_POOLING_SUM, {1.0f}), STRATA_ERR_INVALID_ARGUMENT,
                         "one weight per index");
            EXPECT_ERROR(emb.sgd({1, 1}, std::vector<float>(2 * dim), 0.1f), STRATA_ERR_INVALID_ARGUMENT, "");
        }

        // The balancer through the runtime, and a DLPack view of a page.
        {
            rt.balance_once();  // a round runs (what it moves depends on the counts)
            rt.balancer_start(STRATA_POLICY_LRU, std::chrono::milliseconds(5));
            rt.balancer_stop();
            rt.check_background();
            strata::DLPackTensor t = moved.dlpack(2 * kPage, kPage, STRATA_TIER_HOST, kDLFloat, 64);
            CHECK(t && t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == static_cast<int64_t>(kPage / 8));
            const char *bytes = static_cast<const char *>(t->dl_tensor.data) + t->dl_tensor.byte_offset;
            CHECK(std::memcmp(bytes, values.data() + 2 * kPage / sizeof(double), kPage) == 0);
        }  // the tensor is deleted here

        // "Wait for good" waits: a duration too long for nanoseconds (it
        // overflowed to a poll) and a huge floating one.
        {
            strata::Ticket t = moved.prefetch(0, n * sizeof(double), STRATA_TIER_NVME);
            CHECK(t.wait_for(std::chrono::seconds::max()));
            CHECK(t.wait_for(std::chrono::duration<double>(1e300)));
            CHECK(t.wait_for(std::chrono::seconds(-1)));  // done: a poll says so
        }

        // close() reports what the destructor cannot: a handle freed behind
        // the wrapper's back.
        {
            strata::Buffer b = rt.alloc(kPage);
            CHECK(strata_buffer_free(b.get()) == STRATA_OK);
            EXPECT_ERROR(b.close(), STRATA_ERR_INVALID_HANDLE, "");
            CHECK(!b);
            b.close();  // empty: nothing to free
        }

        // Objects made through a runtime keep it alive: a pin outlives its
        // Runtime and its buffer, and its addresses still hold the bytes.
        {
            strata_config c2 = config;
            c2.nvme_path = nullptr;
            c2.nvme_capacity = 0;
            std::optional<strata::Runtime> own(std::in_place, c2);
            strata::Buffer b = own->alloc(2 * kPage);
            b.write(0, values.data(), 2 * kPage);
            strata::Pin pin = b.pin(kPage, kPage, STRATA_TIER_HOST);
            strata::Ticket t = b.prefetch(0, kPage, STRATA_TIER_HOST);
            own.reset();
            b.reset();
            std::vector<uint64_t> a = pin.addresses();
            CHECK(a.size() == 1 && pin.tier() == STRATA_TIER_HOST);
            const void *page = reinterpret_cast<const void *>(static_cast<uintptr_t>(a[0]));
            CHECK(std::memcmp(page, values.data() + kPage / sizeof(double), kPage) == 0);
            t.wait();
        }  // the runtime is destroyed with the last of them
        EXPECT_ERROR(strata::Buffer(reinterpret_cast<strata_buffer *>(rt.get())).size(),
                     STRATA_ERR_INVALID_HANDLE, "not a live buffer handle");
    } catch (const strata::Error &e) {
        std::fprintf(stderr, "unexpected: %d %s\n", e.status(), e.what());
        failed++;
    }
    if (rmdir(dir) != 0) std::perror("rmdir");
    std::printf("%d passed, %d failed\n", passed.load(), failed.load());
    return failed != 0;
}
