"""Puts tensors worth 4x a (simulated or real) GPU's tier into strata, reads
them back, prefetches one to the device, and shares a pinned range through
DLPack. Exits non-zero on any mismatch.

    python example.py            # simulated device (any machine)
    python example.py --cuda     # the CUDA backend (libstrata built with --features cuda)
"""
import json
import sys
import tempfile

import torch

import strata_torch

cuda = "--cuda" in sys.argv
nvme = tempfile.mkdtemp(prefix="strata-torch-")
store = strata_torch.TieredStore(
    f"""
page_size = "64k"
device = "{'cuda' if cuda else 'sim'}"
device_capacity = "16M"
[host]
capacity = "32M"
[nvme]
path = "{nvme}"
capacity = "128M"
"""
)

# 64 MiB of float32 over a 16 MiB device tier: 4x oversubscribed.
tensors = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}
for k, t in tensors.items():
    store.put(k, t)
for k, t in tensors.items():
    assert torch.equal(store.get(k), t), k
tiers = {}
for k in tensors:
    for t in store.tiers(k):
        tiers[t] = tiers.get(t, 0) + 1
print("pages per tier:", tiers)

# Stage one tensor in device memory ahead of use (with room made first).
for k in tensors:
    store.evict(k, "nvme")
ticket = store.prefetch("w3", "device")
ticket.wait()
assert set(store.tiers("w3")) == {"device"}, store.tiers("w3")
device = "cuda" if cuda else "cpu"
assert torch.equal(store.get("w3", device).cpu(), tensors["w3"])

# Zero-copy: 1000 elements of w5 pinned in host memory (within one page).
view = store.pinned("w5", 100, 1000, "host")
assert view.device.type == "cpu" and torch.equal(view, tensors["w5"].flatten()[100:1100])
view.mul_(2)  # writes go to strata's memory
assert torch.equal(store.get("w5").flatten()[100:1100], tensors["w5"].flatten()[100:1100] * 2)
del view  # the pin ends with the tensor

if cuda:
    # The device tier of a real GPU exports CUDA tensors.
    v = store.pinned("w3", 0, 1000, "device")
    assert v.device.type == "cuda" and torch.equal(v.cpu(), tensors["w3"].flatten()[:1000])
    del v

# A lazily conjugated view is stored as its values; what the store cannot
# hold as bytes (a sparse tensor), or a range past the tensor's end, is
# refused with ValueError.
z = torch.tensor([1 + 2j, 3 - 4j])
store.put("z", z.conj())
assert torch.equal(store.get("z"), torch.tensor([1 - 2j, 3 + 4j]))
refused = [
    lambda: store.put("s", torch.eye(3).to_sparse()),
    lambda: store.pinned("w5", 2**62, 5, "host"),
    lambda: store.pinned("w5", 1024 * 1024 - 2, 3, "host"),
]
for call in refused:
    try:
        call()
    except ValueError:
        continue
    raise SystemExit("bad input was not refused")

stats = json.loads(store.stats())
print("backend:", stats["backend"], "moves:", stats["moves"], "faults:", stats["faults"])
print("strata", strata_torch.version(), "torch", torch.__version__, "ok")
