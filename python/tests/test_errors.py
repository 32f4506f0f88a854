"""Errors: one class per ErrorKind under StrataError, with strata's message."""

import pytest

import strata
from conftest import PAGE

KINDS = [
    ("InvalidArgumentError", "invalid argument", 1, ValueError),
    ("NoDeviceError", "no device", 2, None),
    ("OutOfCapacityError", "out of capacity", 3, None),
    ("IoError", "i/o error", 4, OSError),
    ("NoSpaceError", "no space left", 5, OSError),
    ("CorruptedError", "corrupted", 6, None),
    ("UnsupportedError", "unsupported", 7, None),
    ("ClosedError", "closed", 8, None),
    ("NotFoundError", "not found", 9, FileNotFoundError),
    ("PermissionDeniedError", "permission denied", 10, PermissionError),
]


@pytest.mark.parametrize("name,kind,code,builtin", KINDS)
def test_one_class_per_kind(name, kind, code, builtin):
    cls = getattr(strata, name)
    assert issubclass(cls, strata.StrataError) and cls is not strata.StrataError
    assert cls.__module__ == "strata" and cls.__doc__
    assert (cls.kind, cls.code) == (kind, code)
    if builtin is not None:
        assert issubclass(cls, builtin)
    e = cls("a message")
    assert str(e) == "a message" and e.kind == kind


def test_base_class():
    assert issubclass(strata.StrataError, Exception)
    assert strata.StrataError.kind is None and strata.StrataError.code is None
    assert len({getattr(strata, n) for n, *_ in KINDS}) == len(KINDS)


def test_message_text(rt):
    with pytest.raises(strata.InvalidArgumentError) as e:
        rt.alloc(0)
    assert str(e.value) == "allocation of zero bytes"
    assert e.value.kind == "invalid argument" and e.value.code == 1


def test_bad_tier(rt):
    buf = rt.alloc(PAGE)
    for call in (
        lambda: buf.prefetch(None, "disk"),
        lambda: buf.evict(None, "disk"),
        lambda: buf.pin(None, "disk"),
        lambda: rt.alloc(PAGE, prefer="disk"),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert isinstance(e.value, strata.InvalidArgumentError)
        assert str(e.value) == 'unknown tier "disk" (use device, host, cxl or nvme)'
        assert "\n" not in str(e.value)
    # A known tier the runtime lacks.
    with pytest.raises(strata.InvalidArgumentError, match="cxl tier is not configured"):
        buf.evict(None, "cxl")
    with pytest.raises(strata.InvalidArgumentError, match="not configured"):
        buf.prefetch(None, "cxl").wait()


def test_out_of_range(rt):
    buf = rt.alloc(2 * PAGE)
    with pytest.raises(strata.InvalidArgumentError, match="exceeds the buffer's 8192 bytes"):
        buf.read(2 * PAGE - 1, 2)
    with pytest.raises(strata.InvalidArgumentError, match="exceeds the buffer's"):
        buf.write(2 * PAGE - 1, b"ab")
    with pytest.raises(strata.InvalidArgumentError, match="exceeds the buffer's"):
        buf.readinto(2 * PAGE, bytearray(1))
    with pytest.raises(strata.InvalidArgumentError, match="beyond the buffer's 2 pages"):
        buf.tier_of(2)
    with pytest.raises(strata.InvalidArgumentError):
        buf.evict((0, 3 * PAGE), "nvme")
    with pytest.raises(strata.InvalidArgumentError, match="negative"):
        buf.read(-1, 1)
    with pytest.raises(strata.InvalidArgumentError, match="negative"):
        buf.prefetch((-5, 10), "host")
    with pytest.raises(strata.InvalidArgumentError, match="ends before it starts"):
        buf.evict((10, 5), "nvme")
    # A range past the end is refused by the call, not by the ticket.
    with pytest.raises(strata.InvalidArgumentError, match="outside the buffer's"):
        buf.prefetch((0, 3 * PAGE), "host")
    assert buf.prefetch((0, 2 * PAGE), "host").declined == 0
    with pytest.raises(TypeError):
        buf.prefetch("all", "host")
    with pytest.raises(strata.OutOfCapacityError, match="cannot allocate"):
        rt.alloc(1 << 40)


def test_nvme_path_that_cannot_be_opened(tmp_path):
    with pytest.raises(strata.NotFoundError) as e:
        strata.Runtime(device=None, nvme_path=tmp_path / "no" / "such" / "dir", nvme_capacity=1 << 20)
    assert isinstance(e.value, FileNotFoundError)
    assert "does not exist" in str(e.value)
    existing = tmp_path / "file"
    existing.write_bytes(b"precious")
    with pytest.raises(strata.InvalidArgumentError, match="will not overwrite"):
        strata.Runtime(device=None, nvme_path=existing, nvme_capacity=1 << 20)
    assert existing.read_bytes() == b"precious"
    with pytest.raises(strata.InvalidArgumentError, match="empty"):
        strata.Runtime(device=None, nvme_path="", nvme_capacity=1 << 20)


def test_bad_keyword_values():
    with pytest.raises(strata.InvalidArgumentError, match="unknown device"):
        strata.Runtime(device="tpu")
    with pytest.raises(strata.InvalidArgumentError, match="page"):
        strata.Runtime(device=None, page_size=3000)
    with pytest.raises(strata.InvalidArgumentError, match="unknown policy"):
        strata.Runtime(device=None, policy="random")
    with pytest.raises(strata.InvalidArgumentError, match="unknown io engine"):
        strata.Runtime(device=None, nvme_path="/tmp", nvme_engine="aio")
    with pytest.raises(strata.InvalidArgumentError, match="watermark"):
        strata.Runtime(device=None, watermarks=(0.9, 0.5))
    # A value of the wrong type is a TypeError, as for every key; a list is
    # a sequence of two as a tuple is; a policy name in capitals is a name.
    for bad in (0.9, "ab", ("a", "b")):
        with pytest.raises(TypeError, match="watermarks takes"):
            strata.Runtime(device=None, watermarks=bad)
    for bad in ([0.5], (0.5, 0.9, 1.0)):
        with pytest.raises(strata.InvalidArgumentError, match="watermarks takes"):
            strata.Runtime(device=None, watermarks=bad)
    assert strata.resolve_config(device=None, watermarks=[0.5, 0.9])["watermarks"] == {"low": 0.5, "high": 0.9}
    assert strata.resolve_config(device=None, policy="LRU")["policy"] == "lru"
    with pytest.raises(TypeError):
        strata.Runtime("sim")  # keyword arguments only


def test_bad_toml():
    with pytest.raises(strata.InvalidArgumentError, match="^config: unknown field `bogus`"):
        strata.Runtime.from_toml("bogus = 1")
    with pytest.raises(strata.InvalidArgumentError, match="^config:"):
        strata.Runtime.from_toml("page_size = [")


def test_cuda_without_a_gpu():
    try:
        rt = strata.Runtime(device="cuda", device_capacity=1 << 20, host_capacity=1 << 20)
    except strata.NoDeviceError as e:
        assert str(e) and e.code == 2
    else:
        assert rt.backend == "cuda"  # a machine with a GPU
