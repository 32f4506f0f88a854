"""Pins and their DLPack export: NumPy wraps strata's memory in place, each
capsule is consumed once, and an exported tensor keeps its pages pinned
until it is gone."""

import ctypes
import gc
import os

import numpy as np
import pytest

import strata
from conftest import PAGE

_name = ctypes.pythonapi.PyCapsule_GetName
_name.restype = ctypes.c_char_p
_name.argtypes = [ctypes.py_object]


def pinned_pages(rt, tier):
    return next(t["pinned_pages"] for t in rt.stats()["tiers"] if t["tier"] == tier)


class Producer:
    """Hands NumPy the same capsule every time (to consume one twice)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def test_numpy_sees_strata_memory_without_a_copy(rt):
    buf = rt.alloc(4 * PAGE)
    buf.write(0, bytes(range(256)) * 16)
    with buf.pin((0, PAGE), "host") as pin:
        assert pin.tier == "host" and pin.range == (0, PAGE) and pin.nbytes == PAGE
        assert pin.pages == (0, 1) and len(pin.addresses) == 1 and pin.pinned
        assert pin.__dlpack_device__() == (1, 0)
        view = np.from_dlpack(pin)
        assert view.dtype == np.uint8 and view.shape == (PAGE,)
        # The same memory: the pin's address, not a copy.
        assert view.ctypes.data == pin.address == pin.addresses[0]
        assert not view.flags.owndata
        assert view[:4].tolist() == [0, 1, 2, 3]
        # A write through strata is seen in the view.
        buf.write(10, b"hello")
        assert view[10:15].tobytes() == b"hello"
        # NumPy marks arrays from unversioned ("dltensor") capsules
        # read-only; the memory is strata's all the same.
        assert not view.flags.writeable
        assert pinned_pages(rt, "host") == 1
    assert not pin.pinned
    # The view holds its own pin, released with the view.
    assert pinned_pages(rt, "host") == 1
    del view
    gc.collect()
    assert pinned_pages(rt, "host") == 0


def test_pin_moves_pages_and_exports_typed_views(rt):
    buf = rt.alloc(4 * PAGE)
    values = np.arange(4 * PAGE // 4, dtype=np.float32)
    buf.write(0, values)
    buf.evict(None, "nvme")
    assert buf.tier_of(1) == "nvme"
    # A range within one page, not at its start, as float32.
    pin = buf.pin((PAGE + 64, 2 * PAGE), "device", dtype="float32")
    assert buf.tier_of(1) == "device"
    assert pin.address == pin.addresses[0] + 64
    f = np.from_dlpack(pin)
    assert f.dtype == np.float32 and f.shape == ((PAGE - 64) // 4,)
    assert np.array_equal(f, values[(PAGE + 64) // 4 : 2 * PAGE // 4])
    assert pin.__dlpack_device__() == (1, 0)  # the simulated device is host memory
    pin.unpin()
    pin.unpin()  # released already: a no-op
    del f
    gc.collect()
    assert pinned_pages(rt, "device") == 0


def test_capsule_is_consumed_once(rt):
    buf = rt.alloc(PAGE)
    pin = buf.pin((0, PAGE), "host")
    capsule = pin.__dlpack__()
    assert _name(capsule) == b"dltensor"
    producer = Producer(capsule, pin.__dlpack_device__())
    view = np.from_dlpack(producer)
    assert _name(capsule) == b"used_dltensor"
    # A consumed capsule cannot be consumed again.
    with pytest.raises(ValueError, match="incorrect name"):  # renamed used_dltensor
        np.from_dlpack(producer)
    # The consumer owns the tensor now: dropping the capsule frees nothing.
    pin.unpin()
    del capsule, producer
    gc.collect()
    assert pinned_pages(rt, "host") == 1
    assert view[0] == 0
    del view
    gc.collect()
    assert pinned_pages(rt, "host") == 0


def test_unconsumed_capsule_frees_its_tensor(rt):
    buf = rt.alloc(PAGE)
    pin = buf.pin(None, "host")
    capsules = [pin.__dlpack__() for _ in range(3)]
    pin.unpin()
    assert pinned_pages(rt, "host") == 1
    del capsules
    gc.collect()
    assert pinned_pages(rt, "host") == 0


def test_tensor_outlives_buffer_and_runtime():
    rt = strata.Runtime(device=None, host_capacity=16 * PAGE, page_size=PAGE)
    buf = rt.alloc(PAGE)
    buf.write(0, b"kept alive")
    with buf.pin((0, 16), "host") as pin:
        view = np.from_dlpack(pin)
    del pin, buf, rt
    gc.collect()
    assert view.tobytes()[:10] == b"kept alive"


def test_dlpack_refusals(rt):
    buf = rt.alloc(4 * PAGE)
    pin = buf.pin((0, 2 * PAGE), "host")
    with pytest.raises(BufferError, match="copy=True is not supported"):
        pin.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"not \(2, 0\)"):
        pin.__dlpack__(dl_device=(2, 0))
    assert pin.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 0), stream=None)
    pin.unpin()
    with pytest.raises(strata.ClosedError, match="released"):
        pin.__dlpack__()
    # Whole elements, aligned.
    with pytest.raises(strata.InvalidArgumentError, match="elements"):
        buf.pin((0, 6), "host", dtype="float32")
    with pytest.raises(strata.InvalidArgumentError, match="aligned"):
        buf.pin((2, 10), "host", dtype="float32")
    with pytest.raises(strata.InvalidArgumentError, match="unknown dtype"):
        buf.pin((0, 8), "host", dtype="complex64")
    # NVMe pages have no address.
    with pytest.raises(strata.InvalidArgumentError, match="not addressable"):
        buf.pin((0, 8), "nvme")
    # A pin larger than its tier.
    with pytest.raises(strata.OutOfCapacityError):
        rt.alloc(32 * PAGE).pin(None, "device")


def test_torch_wraps_strata_memory_without_a_copy(rt):
    if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
        import torch  # must be there
    else:
        torch = pytest.importorskip("torch", reason="torch is not installed")
    buf = rt.alloc(2 * PAGE)
    buf.write(0, np.arange(PAGE // 4, dtype=np.float32))
    with buf.pin((0, PAGE), "host", dtype="float32") as pin:
        t = torch.from_dlpack(pin)
    assert t.dtype == torch.float32 and t.shape == (PAGE // 4,) and t.device.type == "cpu"
    assert t.data_ptr() == pin.address
    assert t[:3].tolist() == [0.0, 1.0, 2.0]
    # torch's tensor is writable: its writes are strata's bytes.
    t[1] = 42.0
    assert np.frombuffer(buf.read(4, 4), dtype=np.float32)[0] == 42.0
    buf.write(8, np.float32(7.0).tobytes())
    assert t[2].item() == 7.0
    assert pinned_pages(rt, "host") == 1
    del t
    gc.collect()
    assert pinned_pages(rt, "host") == 0


def test_strata_memory_lent_back_to_strata_goes_through_a_copy(rt):
    # A view of a pinned page as the source of a write into the same page,
    # and as the destination of a read from it: no aliasing, the bytes as a
    # copy would give them.
    buf = rt.alloc(2 * PAGE)
    buf.write(0, bytes(range(256)) * (PAGE // 256))
    with buf.pin((0, PAGE), "host") as pin:
        view = np.from_dlpack(pin)
        buf.write(4, view[:64])
        assert buf.read(4, 64) == bytes(range(64))
        if os.environ.get("STRATA_REQUIRE_TORCH") == "1" or _have_torch():
            import torch

            # A writable view of page 0 as the destination of a read of page 1.
            dst = torch.from_dlpack(pin).numpy()
            buf.write(PAGE, b"page one")
            buf.readinto(PAGE, dst[:8])
            assert bytes(dst[:8]) == b"page one"
            assert buf.read(0, 8) == b"page one"


def _have_torch():
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        return False


def test_optimizer_refuses_grads_aliasing_its_output():
    w = np.zeros(1000, dtype=np.float32)
    adam = strata._strata.OffloadedAdam(w, tier="host")
    with pytest.raises(strata.InvalidArgumentError, match="share memory"):
        adam.step(w, w)
    assert adam.steps == 0
