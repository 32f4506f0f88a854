// A tiered tensor store for PyTorch over libstrata: tensors put by key live
// in strata buffers whose pages sit in GPU memory, host DRAM, CXL or NVMe;
// get() reads them back as tensors; prefetch() moves one toward a tier in
// the background; pinned() shares a pinned range zero-copy through DLPack.
//
// Build: see README.md (torch.utils.cpp_extension, linked with -lstrata).

// ATen's dlpack.h first: strata.h then uses its DLPack declarations.
#include <ATen/DLConvertor.h>
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata.hpp"

namespace {

strata_tier parse_tier(const std::string &name) {
    if (name == "device" || name == "cuda" || name == "gpu") return STRATA_TIER_DEVICE;
    if (name == "host" || name == "cpu") return STRATA_TIER_HOST;
    if (name == "cxl") return STRATA_TIER_CXL;
    if (name == "nvme") return STRATA_TIER_NVME;
    throw std::invalid_argument("unknown tier '" + name + "' (device, host, cxl or nvme)");
}

const char *tier_name(strata_tier t) {
    switch (t) {
        case STRATA_TIER_DEVICE: return "device";
        case STRATA_TIER_HOST: return "host";
        case STRATA_TIER_CXL: return "cxl";
        case STRATA_TIER_NVME: return "nvme";
        default: return "unwritten";
    }
}

// A moving request; wait() releases the GIL while it blocks.
class Ticket {
public:
    explicit Ticket(strata::Ticket t) : ticket_(std::move(t)) {}
    void wait() {
        pybind11::gil_scoped_release unlocked;
        ticket_.wait();
    }
    bool done() const { return ticket_.poll(); }

private:
    strata::Ticket ticket_;
};

struct Entry {
    strata::Buffer buffer;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    uint64_t bytes;
};

class TieredStore {
public:
    // `config` is strata's TOML config (see the strata README), e.g.
    // 'device = "cuda"\ndevice_capacity = "8G"\n[host]\ncapacity = "32G"\n[nvme]\npath = "/scratch"'.
    explicit TieredStore(const std::string &config) : rt_(strata::Runtime::from_toml(config)) {}

    // Stores a copy of `t` (any device; made contiguous, a conjugated or
    // negated view resolved to its values) under `key`, replacing what was
    // there. Dense tensors only: a quantized or sparse one is refused (its
    // bytes alone are not its value).
    void put(const std::string &key, const at::Tensor &t) {
        if (t.is_quantized() || t.layout() != at::kStrided)
            throw std::invalid_argument("put takes a dense tensor, not a quantized or sparse one");
        at::Tensor src = t.detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
        uint64_t bytes = src.numel() * src.element_size();
        Entry e{rt_.alloc(bytes == 0 ? 1 : bytes), src.sizes().vec(), src.scalar_type(), bytes};
        {
            pybind11::gil_scoped_release unlocked;
            e.buffer.write(0, src.data_ptr(), bytes);
        }
        std::lock_guard<std::mutex> g(mu_);
        entries_[key] = std::make_shared<Entry>(std::move(e));
    }

    // A new tensor holding the value stored under `key`, on `device`.
    at::Tensor get(const std::string &key, const std::string &device) {
        auto e = find(key);
        at::Tensor out = at::empty(e->shape, at::TensorOptions().dtype(e->dtype));
        {
            pybind11::gil_scoped_release unlocked;
            e->buffer.read(0, out.data_ptr(), e->bytes);
        }
        return device == "cpu" ? out : out.to(at::Device(device), /*non_blocking=*/false);
    }

    // Starts moving the tensor's pages toward `tier` ("device" to stage it
    // in GPU memory ahead of use).
    std::unique_ptr<Ticket> prefetch(const std::string &key, const std::string &tier) {
        auto e = find(key);
        return std::make_unique<Ticket>(e->buffer.prefetch(0, e->bytes, parse_tier(tier)));
    }

    void evict(const std::string &key, const std::string &tier) {
        auto e = find(key);
        pybind11::gil_scoped_release unlocked;
        e->buffer.evict(0, e->bytes, parse_tier(tier));
    }

    // Where each page of the tensor lives now.
    std::vector<std::string> tiers(const std::string &key) {
        auto e = find(key);
        std::vector<std::string> out;
        for (size_t p = 0; p < e->buffer.page_count(); p++) out.push_back(tier_name(e->buffer.tier_of(p)));
        return out;
    }

    // Elements [start, start + count) of the flattened tensor, pinned in
    // `tier` and shared without a copy: a 1-D tensor over strata's memory
    // (CUDA for the device tier on a GPU, CPU otherwise), pinned until the
    // tensor is freed. The range must lie on adjacent pages (within one page
    // always does).
    at::Tensor pinned(const std::string &key, int64_t start, int64_t count, const std::string &tier) {
        auto e = find(key);
        int64_t size = at::elementSize(e->dtype);
        // In elements first: start * size could overflow past the check
        // strata makes in bytes.
        int64_t numel = static_cast<int64_t>(e->bytes) / size;
        if (start < 0 || count <= 0 || start > numel || count > numel - start)
            throw std::invalid_argument("elements [start, start + count) must lie within the tensor's " +
                                        std::to_string(numel) + " elements");
        at::Tensor probe = at::empty({0}, at::TensorOptions().dtype(e->dtype));
        DLDataType dtype = at::getDLDataType(probe);
        DLManagedTensor *dl = nullptr;
        strata::check(strata_dlpack_export(e->buffer.get(), static_cast<uint64_t>(start * size),
                                           static_cast<uint64_t>(count * size), parse_tier(tier), dtype.code,
                                           dtype.bits, dtype.lanes, &dl));
        // ATen owns it from here and calls the deleter (ending the pin)
        // when the tensor's storage dies.
        return at::fromDLPack(dl);
    }

    void remove(const std::string &key) {
        std::lock_guard<std::mutex> g(mu_);
        entries_.erase(key);
    }

    std::vector<std::string> keys() {
        std::lock_guard<std::mutex> g(mu_);
        std::vector<std::string> out;
        for (auto &kv : entries_) out.push_back(kv.first);
        return out;
    }

    std::string stats() const { return rt_.stats_json(); }

private:
    std::shared_ptr<Entry> find(const std::string &key) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = entries_.find(key);
        if (it == entries_.end()) throw pybind11::key_error(key);
        return it->second;
    }

    strata::Runtime rt_;
    std::mutex mu_;
    std::unordered_map<std::string, std::shared_ptr<Entry>> entries_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "A tiered tensor store over libstrata (GPU memory, host DRAM, CXL, NVMe)";
    static pybind11::exception<strata::Error> error(m, "StrataError", PyExc_RuntimeError);
    pybind11::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const strata::Error &e) {
            std::string message = std::string(strata_status_string(e.status())) + ": " + e.what();
            PyErr_SetString(error.ptr(), message.c_str());
        }
    });
    pybind11::class_<Ticket>(m, "Ticket")
        .def("wait", &Ticket::wait, "Blocks until the move is done (raises its error).")
        .def("done", &Ticket::done, "True once the move is done (raises its error).");
    pybind11::class_<TieredStore>(m, "TieredStore")
        .def(pybind11::init<const std::string &>(), pybind11::arg("config") = "")
        .def("put", &TieredStore::put, pybind11::arg("key"), pybind11::arg("tensor"))
        .def("get", &TieredStore::get, pybind11::arg("key"), pybind11::arg("device") = "cpu")
        .def("prefetch", &TieredStore::prefetch, pybind11::arg("key"), pybind11::arg("tier") = "device")
        .def("evict", &TieredStore::evict, pybind11::arg("key"), pybind11::arg("tier") = "nvme")
        .def("tiers", &TieredStore::tiers, pybind11::arg("key"))
        .def("pinned", &TieredStore::pinned, pybind11::arg("key"), pybind11::arg("start"), pybind11::arg("count"),
             pybind11::arg("tier") = "host")
        .def("remove", &TieredStore::remove, pybind11::arg("key"))
        .def("keys", &TieredStore::keys)
        .def("stats", &TieredStore::stats, "The runtime's stats as a JSON string.");
    m.def("version", [] { return std::string(strata_version()); });
}
