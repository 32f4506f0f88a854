// strata.hpp: a small C++17 RAII wrapper over the C ABI in strata.h.
//
// Each handle type owns its C handle and frees it in its destructor; they
// are movable, not copyable. An object made through a Runtime (a buffer and
// its pins, tickets, device maps and launches) keeps that runtime alive: the
// runtime is destroyed when its Runtime and the last such object are gone, so
// a pin's addresses stay valid for as long as the pin lives, whatever the
// order of destruction. A failing call throws strata::Error carrying the
// status and the message from strata_last_error(). Threads: distinct objects
// may be used from any thread at once, and so may one object's calls, except
// that an object must not be reset, closed, moved from or assigned to while
// another thread uses it (the C ABI allows a call beside the free of its
// handle; a C++ object's own member is not synchronized).
//
// Written by hand (not generated): it only calls functions of strata.h.
#ifndef STRATA_HPP
#define STRATA_HPP

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "strata.h"

namespace strata {

// A failed call: its STRATA_ERR_* status and the library's message.
class Error : public std::runtime_error {
public:
    Error(int status, const char *message) : std::runtime_error(message), status_(status) {}
    int status() const noexcept { return status_; }

private:
    int status_;
};

// Throws on a negative status; returns the status otherwise (STRATA_OK or
// STRATA_PENDING).
inline int check(int status) {
    if (status < 0) throw Error(status, strata_last_error());
    return status;
}

// A runtime, shared by its Runtime and the objects made through it.
using RuntimeRef = std::shared_ptr<strata_runtime>;

// Owns one C handle; `Free` ends it (and accepts NULL). `owner`, if set, is
// the runtime the handle was made through, released after the handle.
template <class T, int (*Free)(T *)>
class Owned {
public:
    Owned() noexcept = default;
    explicit Owned(T *p, RuntimeRef owner = nullptr) noexcept : p_(p), owner_(std::move(owner)) {}
    Owned(Owned &&o) noexcept : p_(std::exchange(o.p_, nullptr)), owner_(std::move(o.owner_)) {}
    Owned &operator=(Owned &&o) noexcept {
        if (this != &o) {
            reset();
            p_ = std::exchange(o.p_, nullptr);
            owner_ = std::move(o.owner_);
        }
        return *this;
    }
    Owned(const Owned &) = delete;
    Owned &operator=(const Owned &) = delete;
    ~Owned() { reset(); }

    T *get() const noexcept { return p_; }
    explicit operator bool() const noexcept { return p_ != nullptr; }
    // Frees now and ignores a failure, as the destructor does.
    void reset() noexcept {
        if (p_) Free(std::exchange(p_, nullptr));
        owner_.reset();
    }
    // Frees now and throws strata::Error if the library refuses (a handle
    // already freed by other means, which C allows: STRATA_ERR_CLOSED or
    // STRATA_ERR_INVALID_HANDLE). The object is empty either way.
    void close() {
        int status = p_ ? Free(std::exchange(p_, nullptr)) : STRATA_OK;
        if (status < 0) {
            Error e(status, strata_last_error());
            owner_.reset();
            throw e;
        }
        owner_.reset();
    }

protected:
    // The runtime this object was made through (empty for an object made
    // otherwise); objects made through this one share it.
    const RuntimeRef &owner() const noexcept { return owner_; }

private:
    T *p_ = nullptr;
    RuntimeRef owner_;
};

class Ticket : public Owned<strata_ticket, strata_ticket_free> {
public:
    using Owned::Owned;
    void wait() const { check(strata_ticket_wait(get())); }
    // True when the request is done (throws its error, if any).
    bool poll() const { return check(strata_ticket_poll(get())) == STRATA_OK; }
    // True when the request finished within `d` (throws its error, if
    // any); a negative or NaN `d` polls, one beyond 2^64 ns waits for good.
    template <class Rep, class Period>
    bool wait_for(std::chrono::duration<Rep, Period> d) const {
        // Through double: an integer duration such as seconds::max() would
        // overflow on its way to nanoseconds.
        const double wanted = std::chrono::duration<double, std::nano>(d).count();
        uint64_t ns = 0;
        if (wanted >= 18446744073709551616.0) {
            ns = UINT64_MAX;
        } else if (wanted > 0) {
            ns = static_cast<uint64_t>(wanted);
        }
        return check(strata_ticket_wait_timeout(get(), ns)) == STRATA_OK;
    }
    // Pages of a prefetch declined so far (its room would have demoted
    // pages valued more); they stay readable where they are.
    size_t declined() const {
        size_t n = 0;
        check(strata_ticket_declined(get(), &n));
        return n;
    }
};

class Pin : public Owned<strata_pin, strata_unpin> {
public:
    using Owned::Owned;
    strata_tier tier() const {
        strata_tier t = STRATA_TIER_NONE;
        check(strata_pin_info(get(), &t, nullptr, nullptr));
        return t;
    }
    size_t first_page() const {
        size_t first = 0;
        check(strata_pin_info(get(), nullptr, &first, nullptr));
        return first;
    }
    // Each pinned page's address (device or host), valid while the pin lives.
    std::vector<uint64_t> addresses() const {
        size_t n = 0;
        int s = strata_pin_addresses(get(), nullptr, 0, &n);
        if (s != STRATA_ERR_BUFFER_TOO_SMALL) check(s);
        std::vector<uint64_t> out(n);
        check(strata_pin_addresses(get(), out.data(), out.size(), &n));
        return out;
    }
};

class Launch : public Owned<strata_launch, strata_launch_end> {
public:
    using Owned::Owned;
    uint64_t map_address() const {
        uint64_t a = 0;
        check(strata_launch_map_address(get(), &a));
        return a;
    }
    uint64_t entry(size_t page) const {
        uint64_t e = 0;
        check(strata_launch_entry(get(), page, &e));
        return e;
    }
    /* Where kernels count their accesses (one uint32_t per page; 0 while
       the runtime's sampling is off). */
    uint64_t counters_address() const {
        uint64_t a = 0;
        check(strata_launch_counters_address(get(), &a));
        return a;
    }
    /* The shift kernels sample at (strata_touch's `shift`; the runtime's
       sampling, STRATA_SAMPLING_OFF while it is off). */
    uint32_t sample_shift() const {
        uint32_t s = 0;
        check(strata_launch_sample_shift(get(), &s));
        return s;
    }
};

class Map : public Owned<strata_map, strata_map_free> {
public:
    using Owned::Owned;
    size_t pages() const {
        size_t n = 0;
        check(strata_map_pages(get(), &n));
        return n;
    }
    Launch prepare(strata_access access) const {
        strata_launch *l = nullptr;
        check(strata_map_prepare(get(), access, &l));
        return Launch(l, owner());
    }
    std::vector<uint32_t> counts() const {
        std::vector<uint32_t> out(pages());
        size_t n = 0;
        check(strata_map_counts(get(), out.data(), out.size(), &n));
        return out;
    }
};

// A DLPack tensor strata exported, deleted (strata_dlpack_free) when it
// drops unless release() handed it to a consumer. It keeps its pages and
// their runtime alive on its own.
struct DLPackFree {
    void operator()(DLManagedTensor *t) const noexcept { strata_dlpack_free(t); }
};
using DLPackTensor = std::unique_ptr<DLManagedTensor, DLPackFree>;

class Buffer : public Owned<strata_buffer, strata_buffer_free> {
public:
    using Owned::Owned;
    uint64_t size() const {
        uint64_t n = 0;
        check(strata_buffer_len(get(), &n));
        return n;
    }
    size_t page_count() const {
        size_t n = 0;
        check(strata_buffer_page_count(get(), &n));
        return n;
    }
    strata_tier tier_of(size_t page) const {
        strata_tier t = STRATA_TIER_NONE;
        check(strata_buffer_tier_of(get(), page, &t));
        return t;
    }
    void write(uint64_t offset, const void *src, size_t len) const {
        check(strata_write(get(), offset, src, len));
    }
    void read(uint64_t offset, void *dst, size_t len) const { check(strata_read(get(), offset, dst, len)); }
    // The vector's bytes; `T` is copied as bytes, so it must be trivially
    // copyable (no pointers to memory of its own, as std::string has).
    template <class T>
    void write(uint64_t offset, const std::vector<T> &v) const {
        static_assert(std::is_trivially_copyable_v<T>, "strata::Buffer::write copies T as bytes");
        write(offset, v.data(), v.size() * sizeof(T));
    }
    template <class T>
    std::vector<T> read(uint64_t offset, size_t n) const {
        static_assert(std::is_trivially_copyable_v<T>, "strata::Buffer::read copies T as bytes");
        std::vector<T> v(n);
        read(offset, v.data(), n * sizeof(T));
        return v;
    }
    void evict(uint64_t offset, uint64_t len, strata_tier to) const {
        check(strata_evict(get(), offset, len, to));
    }
    Ticket prefetch(uint64_t offset, uint64_t len, strata_tier to) const {
        strata_ticket *t = nullptr;
        check(strata_prefetch(get(), offset, len, to, &t));
        return Ticket(t, owner());
    }
    // Cancels `ticket`'s request: its queued batches are dropped (their
    // pages stay where they are); returns the pages dropped.
    size_t cancel(const Ticket &ticket) const {
        size_t dropped = 0;
        check(strata_ticket_cancel(get(), ticket.get(), &dropped));
        return dropped;
    }
    Pin pin(uint64_t offset, uint64_t len, strata_tier in) const {
        strata_pin *p = nullptr;
        check(strata_buffer_pin(get(), offset, len, in, &p));
        return Pin(p, owner());
    }
    Map device_map() const {
        strata_map *m = nullptr;
        check(strata_device_map(get(), &m));
        return Map(m, owner());
    }
    // Pins [offset, offset + len) in `tier_in` and exports it as a DLPack
    // tensor of `bits`-bit elements of `code` (kDLFloat, kDLInt, ...),
    // deleted with the result unless released to a consumer (which then
    // calls its deleter: at::fromDLPack does).
    DLPackTensor dlpack(uint64_t offset, uint64_t len, strata_tier tier_in, uint8_t code, uint8_t bits,
                        uint16_t lanes = 1) const {
        DLManagedTensor *t = nullptr;
        check(strata_dlpack_export(get(), offset, len, tier_in, code, bits, lanes, &t));
        return DLPackTensor(t);
    }
};

// A runtime. The objects made through it keep it alive: reset() (or the
// destructor) drops this reference, and strata_runtime_destroy runs once the
// last of them is gone too.
class Runtime {
public:
    Runtime() noexcept = default;
    // Adopts `rt` (destroyed with strata_runtime_destroy).
    explicit Runtime(strata_runtime *rt) : rt_(adopt(rt)) {}
    Runtime(Runtime &&) noexcept = default;
    Runtime &operator=(Runtime &&) noexcept = default;
    Runtime(const Runtime &) = delete;
    Runtime &operator=(const Runtime &) = delete;

    static strata_config defaults() {
        strata_config c;
        check(strata_config_init(&c));
        return c;
    }
    explicit Runtime(const strata_config &config) {
        strata_runtime *rt = nullptr;
        check(strata_runtime_create(&config, &rt));
        rt_ = adopt(rt);
    }
    static Runtime from_toml(std::string_view text, uint32_t flags = 0) {
        strata_runtime *rt = nullptr;
        check(strata_runtime_from_toml(text.data(), text.size(), flags, &rt));
        return Runtime(rt);
    }

    strata_runtime *get() const noexcept { return rt_.get(); }
    explicit operator bool() const noexcept { return rt_ != nullptr; }
    // Drops this reference (see the class comment).
    void reset() noexcept { rt_.reset(); }

    Buffer alloc(uint64_t bytes) const {
        strata_buffer *b = nullptr;
        check(strata_alloc(get(), bytes, &b));
        return Buffer(b, rt_);
    }
    Buffer alloc_in(uint64_t bytes, strata_tier preferred) const {
        strata_buffer *b = nullptr;
        check(strata_alloc_in(get(), bytes, preferred, &b));
        return Buffer(b, rt_);
    }
    size_t page_size() const {
        size_t n = 0;
        check(strata_runtime_page_size(get(), &n));
        return n;
    }
    // The background balancer: every `interval` it places pages by
    // `policy` (STRATA_POLICY_*), at most `rate_limit` bytes a second (0:
    // no limit); start again to change them.
    void balancer_start(strata_policy policy = STRATA_POLICY_DEFAULT,
                        std::chrono::microseconds interval = std::chrono::milliseconds(10),
                        uint64_t rate_limit = 0) const {
        check(strata_balancer_start(get(), policy, static_cast<uint64_t>(interval.count()), rate_limit));
    }
    void balancer_stop() const { check(strata_balancer_stop(get())); }
    // One balancer round now.
    strata_balance_report balance_once() const {
        strata_balance_report r{};
        check(strata_balance_once(get(), &r));
        return r;
    }
    // Throws the first failure of background work (balancer, eviction)
    // since the last call, if any.
    void check_background() const { check(strata_runtime_check(get())); }
    std::string stats_json() const {
        char *s = nullptr;
        size_t n = 0;
        check(strata_stats_json(get(), &s, &n));
        // Freed also when the copy below throws.
        std::unique_ptr<char, int (*)(char *)> held(s, strata_string_free);
        return std::string(held.get(), n);
    }

private:
    static RuntimeRef adopt(strata_runtime *rt) {
        // If the control block cannot be allocated, shared_ptr runs the
        // deleter before it throws: the runtime is not leaked.
        return RuntimeRef(rt, [](strata_runtime *r) { strata_runtime_destroy(r); });
    }

    RuntimeRef rt_;
};

// An expert pinned in device memory until it drops (strata_moe_release).
// Its addresses stay valid while it lives, also after its cache is freed.
class ExpertPin : public Owned<strata_expert_pin, strata_moe_release> {
public:
    ExpertPin(strata_expert_pin *p, std::vector<uint64_t> addresses) noexcept
        : Owned(p), addresses_(std::move(addresses)) {}
    ExpertPin(ExpertPin &&o) noexcept : Owned(std::move(o)), addresses_(std::exchange(o.addresses_, {})) {}
    ExpertPin &operator=(ExpertPin &&o) noexcept {
        if (this != &o) {
            Owned::operator=(std::move(o));
            addresses_ = std::exchange(o.addresses_, {});
        }
        return *this;
    }
    // The expert's page addresses in device memory, in order (none once
    // released).
    const std::vector<uint64_t> &addresses() const noexcept { return addresses_; }
    // Releases now, as Owned's reset() and close() do; the addresses go too.
    void reset() noexcept {
        addresses_.clear();
        Owned::reset();
    }
    void close() {
        addresses_.clear();
        Owned::close();
    }

private:
    std::vector<uint64_t> addresses_;
};

// The MoE expert cache (strata_moe_*).
class ExpertCache : public Owned<strata_moe, strata_moe_free> {
public:
    using Owned::Owned;
    static strata_moe_config defaults() {
        strata_moe_config c;
        check(strata_moe_config_init(&c));
        return c;
    }
    // On its own runtime (strata_moe_create).
    explicit ExpertCache(const strata_moe_config &config) {
        strata_moe *m = nullptr;
        check(strata_moe_create(&config, &m));
        *this = ExpertCache(m);
    }
    // On `rt`, sharing its tiers' budgets with the caller's buffers
    // (strata_moe_create_on); the cache keeps the runtime alive.
    ExpertCache(const Runtime &rt, const strata_moe_config &config) {
        strata_moe *m = nullptr;
        check(strata_moe_create_on(rt.get(), &config, &m));
        *this = ExpertCache(m);
    }
    // Registers expert `expert` of `layer` (strata_moe_register).
    void add(uint32_t layer, uint32_t expert, const void *weights, size_t len) const {
        check(strata_moe_register(get(), layer, expert, weights, len));
    }
    // The expert in device memory, pinned until the result drops; an expert
    // of more than `max_pages` pages is refused (and released).
    ExpertPin fetch(uint32_t layer, uint32_t expert, size_t max_pages = 1024) const {
        std::vector<uint64_t> a(max_pages);
        size_t n = 0;
        strata_expert_pin *p = nullptr;
        check(strata_moe_fetch(get(), layer, expert, a.data(), a.size(), &n, &p));
        bool fits = n <= a.size();
        a.resize(fits ? n : a.size());
        ExpertPin pin(p, std::move(a));
        if (!fits) throw Error(STRATA_ERR_INVALID_ARGUMENT, "the expert has more pages than max_pages");
        return pin;
    }
    // Whether a fetch of the expert needs no read of its own (in device
    // memory or on its way, or read in place from host memory).
    bool is_ready(uint32_t layer, uint32_t expert) const {
        uint32_t ready = 0;
        check(strata_moe_is_ready(get(), layer, expert, &ready));
        return ready != 0;
    }
    // Starts moving a router's predictions for `layer`; how many started.
    size_t prefetch(uint32_t layer, const std::vector<uint32_t> &experts) const {
        size_t started = 0;
        check(strata_moe_prefetch(get(), layer, experts.data(), experts.size(), &started));
        return started;
    }
    // Drops `layer`'s unfinished prefetches; how many.
    size_t cancel_prefetches(uint32_t layer) const {
        size_t cancelled = 0;
        check(strata_moe_cancel_prefetches(get(), layer, &cancelled));
        return cancelled;
    }
    // The same, but for the experts of `keep` (the layer's router's picks).
    size_t cancel_prefetches(uint32_t layer, const std::vector<uint32_t> &keep) const {
        size_t cancelled = 0;
        check(strata_moe_cancel_prefetches_except(get(), layer, keep.data(), keep.size(), &cancelled));
        return cancelled;
    }
    strata_moe_stats stats() const {
        strata_moe_stats s;
        check(strata_moe_get_stats(get(), &s));
        return s;
    }
};

// An embedding table in a runtime's tiers (strata_embedding_*): rows of
// `dim` floats, gathered and pooled in torch.nn.EmbeddingBag's form. It
// keeps its runtime alive on its own.
class EmbeddingTable : public Owned<strata_embedding, strata_embedding_free> {
public:
    using Owned::Owned;
    EmbeddingTable(const Runtime &rt, uint64_t rows, size_t dim, size_t threads = 4) {
        strata_embedding *e = nullptr;
        check(strata_embedding_create(rt.get(), rows, dim, threads, &e));
        *this = EmbeddingTable(e);
    }
    // Its pages in `preferred` while it has room (a named maker: strata_tier
    // is an int, which a constructor would confuse with `threads`).
    static EmbeddingTable in_tier(const Runtime &rt, uint64_t rows, size_t dim, strata_tier preferred,
                                  size_t threads = 4) {
        strata_embedding *e = nullptr;
        check(strata_embedding_create_in(rt.get(), rows, dim, preferred, threads, &e));
        return EmbeddingTable(e);
    }
    // With a row cache of `cache_rows` rows under `policy` (see
    // strata_embedding_create_cached).
    static EmbeddingTable cached(const Runtime &rt, uint64_t rows, size_t dim, strata_tier preferred,
                                 size_t cache_rows, strata_policy policy = STRATA_POLICY_DEFAULT,
                                 size_t threads = 4) {
        strata_embedding *e = nullptr;
        check(strata_embedding_create_cached(rt.get(), rows, dim, preferred, threads, cache_rows, policy, &e));
        return EmbeddingTable(e);
    }
    uint64_t rows() const {
        uint64_t r = 0;
        check(strata_embedding_shape(get(), &r, nullptr));
        return r;
    }
    size_t dim() const {
        size_t d = 0;
        check(strata_embedding_shape(get(), nullptr, &d));
        return d;
    }
    // Rows `start`, `start + 1`, ... from `data` (a whole number of rows).
    void write_rows(int64_t start, const std::vector<float> &data) const {
        check(strata_embedding_write_rows(get(), start, data.data(), data.size()));
    }
    // The rows of `indices`, one after another.
    std::vector<float> read_rows(const std::vector<int64_t> &indices) const {
        std::vector<float> out(indices.size() * dim());
        check(strata_embedding_read_rows(get(), indices.data(), indices.size(), out.data(), out.size()));
        return out;
    }
    // The bags (`offsets`: one entry more than the bags, from 0 to the
    // indices' count) pooled by `pooling`, one row of dim() per bag;
    // `weights` empty or one per index; indices equal to `padding_idx`
    // (when not negative) left out.
    std::vector<float> forward(const std::vector<int64_t> &indices, const std::vector<int64_t> &offsets,
                               strata_pooling pooling = STRATA_POOLING_SUM,
                               const std::vector<float> &weights = {}, int64_t padding_idx = -1,
                               strata_embedding_stats *stats = nullptr) const {
        strata_bags bags{};
        bags.indices = indices.data();
        bags.num_indices = indices.size();
        bags.offsets = offsets.data();
        bags.num_offsets = offsets.size();
        bags.weights = weights.empty() ? nullptr : weights.data();
        bags.pooling = pooling;
        bags.padding_idx = padding_idx;
        if (!weights.empty() && weights.size() != indices.size())
            throw Error(STRATA_ERR_INVALID_ARGUMENT, "strata::EmbeddingTable::forward: one weight per index");
        std::vector<float> out((offsets.empty() ? 0 : offsets.size() - 1) * dim());
        check(strata_embedding_forward(get(), &bags, out.data(), out.size(), stats));
        return out;
    }
    // w -= lr * g on the distinct `rows`, `grads` row by row.
    void sgd(const std::vector<int64_t> &rows, const std::vector<float> &grads, float lr) const {
        check(strata_embedding_sgd(get(), rows.data(), rows.size(), grads.data(), grads.size(), lr));
    }
    // Row-wise Adagrad; `state` holds one accumulator per table row.
    void rowwise_adagrad(const std::vector<int64_t> &rows, const std::vector<float> &grads,
                         std::vector<float> &state, float lr, float eps = 1e-8f) const {
        check(strata_embedding_rowwise_adagrad(get(), rows.data(), rows.size(), grads.data(), grads.size(),
                                               state.data(), state.size(), lr, eps));
    }
    strata_tier tier_of_row(int64_t row) const {
        strata_tier t = STRATA_TIER_NONE;
        check(strata_embedding_tier_of_row(get(), row, &t));
        return t;
    }
    strata_embedding_stats stats() const {
        strata_embedding_stats s{};
        check(strata_embedding_get_stats(get(), &s));
        return s;
    }
    void reset_stats() const { check(strata_embedding_reset_stats(get())); }
};

// Adam/AdamW with its states in a tier (strata_optim_*).
class Optimizer : public Owned<strata_optim, strata_optim_free> {
public:
    using Owned::Owned;
    static strata_optim_config defaults() {
        strata_optim_config c;
        check(strata_optim_config_init(&c));
        return c;
    }
    // Its own stores (strata_optim_create).
    Optimizer(const std::vector<float> &weights, const strata_optim_config &config) {
        strata_optim *o = nullptr;
        check(strata_optim_create(weights.data(), weights.size(), &config, &o));
        *this = Optimizer(o);
    }
    // States in a buffer of `rt` (strata_optim_create_on); the optimizer
    // keeps the runtime alive.
    Optimizer(const Runtime &rt, const std::vector<float> &weights, const strata_optim_config &config) {
        strata_optim *o = nullptr;
        check(strata_optim_create_on(rt.get(), weights.data(), weights.size(), &config, &o));
        *this = Optimizer(o);
    }
    // One step with one gradient per weight.
    strata_step_stats step(const std::vector<float> &grads) const {
        strata_step_stats s;
        check(strata_optim_step(get(), grads.data(), grads.size(), &s));
        return s;
    }
    // The current fp32 master weights (`n` of them).
    std::vector<float> weights(size_t n) const {
        std::vector<float> w(n);
        check(strata_optim_weights(get(), w.data(), w.size()));
        return w;
    }
};

}  // namespace strata

#endif  // STRATA_HPP
