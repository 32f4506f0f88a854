"""Runtime construction, buffer I/O round trips, tier moves and stats."""

import array
import os

import numpy as np
import pytest

import strata
from conftest import PAGE


def pattern(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_runtime_properties(rt):
    assert rt.page_size == PAGE
    assert rt.tiers == ["device", "host", "nvme"]
    assert rt.backend == "simulated"
    assert "strata.Runtime(" in repr(rt)


def test_round_trip_across_page_boundaries(rt):
    buf = rt.alloc(10 * PAGE)
    assert buf.nbytes == len(buf) == 10 * PAGE
    assert buf.page_count == 10 and buf.page_size == PAGE
    data = pattern(3 * PAGE + 123)
    # Starts mid-page, spans three page boundaries, ends mid-page.
    buf.write(PAGE - 100, data)
    assert buf.read(PAGE - 100, len(data)) == data
    # Unwritten bytes read as zeros; read() without n reads to the end.
    assert buf.read(0, PAGE - 100) == bytes(PAGE - 100)
    whole = buf.read()
    assert len(whole) == 10 * PAGE
    assert whole[PAGE - 100 : PAGE - 100 + len(data)] == data


def test_write_accepts_any_contiguous_buffer(rt):
    buf = rt.alloc(8 * PAGE)
    values = np.arange(1000, dtype=np.float32)
    for i, src in enumerate(
        [
            b"bytes!",
            bytearray(b"bytearray"),
            memoryview(b"--memoryview--")[2:-2],
            array.array("i", [1, 2, 3]),
            values,
        ]
    ):
        at = 17 + 4001 * i
        buf.write(at, src)
        assert buf.read(at, memoryview(src).nbytes) == memoryview(src).tobytes()
    back = np.empty(1000, dtype=np.float32)
    buf.readinto(17 + 4001 * 4, back)
    assert np.array_equal(back, values)
    # A non-contiguous array is refused by its exporter, not copied silently.
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        buf.write(0, np.arange(10, dtype=np.uint8)[::2])


def test_readinto_fills_the_callers_memory(rt):
    buf = rt.alloc(3 * PAGE)
    data = pattern(2 * PAGE + 7, seed=1)
    buf.write(PAGE // 2, data)
    out = bytearray(len(data))
    assert buf.readinto(PAGE // 2, out) == len(data)
    assert bytes(out) == data
    # Into part of a larger array, through a memoryview slice.
    arr = np.zeros(PAGE, dtype=np.uint8)
    n = buf.readinto(PAGE // 2, memoryview(arr)[100:200])
    assert n == 100
    assert arr[100:200].tobytes() == data[:100] and not arr[:100].any()
    # Read-only targets are refused.
    with pytest.raises(BufferError):
        buf.readinto(0, b"immutable")


def test_prefetch_evict_tier_of_residency(rt):
    buf = rt.alloc(8 * PAGE, prefer="device")
    assert buf.tier_of(0) is None
    assert buf.residency() == {
        "device": 0, "host": 0, "cxl": 0, "nvme": 0, "unwritten": 8, "lost": 0,
    }
    data = pattern(8 * PAGE, seed=2)
    buf.write(0, data)
    assert [buf.tier_of(p) for p in range(8)] == ["device"] * 8

    buf.evict((0, 4 * PAGE), "nvme")
    assert [buf.tier_of(p) for p in range(8)] == ["nvme"] * 4 + ["device"] * 4
    assert buf.residency()["nvme"] == 4 and buf.residency()["device"] == 4

    ticket = buf.prefetch((0, 2 * PAGE), "host")
    assert ticket.wait() is True
    assert ticket.done()
    assert [buf.tier_of(p) for p in range(4)] == ["host", "host", "nvme", "nvme"]

    # Cancelling a finished request drops nothing; one cancelled while it
    # may still be queued ends (what it moved, moved), and nothing is lost.
    assert buf.cancel(ticket) == 0 and ticket.done()
    t = buf.prefetch((2 * PAGE, 8 * PAGE), "host")
    dropped = buf.cancel(t)
    assert t.wait(timeout=30) is True and 0 <= dropped <= 6
    assert sum(buf.tier_of(p) == "host" for p in range(2, 8)) == 6 - dropped
    assert buf.read(0, 8 * PAGE) == data
    with pytest.raises(TypeError):
        buf.cancel("ticket")

    # None is the whole buffer.
    buf.prefetch(None, "host").wait(timeout=30)
    assert buf.residency()["host"] == 8
    assert buf.read() == data
    stats = rt.stats()
    assert stats["moves"] == 12  # 4 evicted, 2 + 6 prefetched
    assert {l["from"] for l in stats["links"]} >= {"device", "nvme"}


def test_ticket_wait_timeout_and_repr(rt):
    buf = rt.alloc(PAGE)
    buf.write(0, b"x")
    t = buf.prefetch(None, "nvme")
    assert t.wait(timeout=60) is True
    assert "done" in repr(t)
    with pytest.raises(strata.InvalidArgumentError):
        t.wait(timeout=-1)


def test_stats_dict_keys(rt):
    buf = rt.alloc(2 * PAGE)
    buf.write(0, b"\x01" * PAGE)
    stats = rt.stats()
    assert {
        "backend", "page_size", "tiers", "reserved_pages", "moves", "failed_moves",
        "first_writes", "abandoned_moves", "faults", "reclaimed_pages",
        "in_flight_moves", "promotions", "demotions", "bypasses",
        "lost_count_readbacks", "lost_pages", "device_links", "links",
    } <= set(stats)
    assert stats["backend"] == "simulated"
    assert stats["page_size"] == PAGE
    assert [t["tier"] for t in stats["tiers"]] == ["device", "host", "nvme"]
    assert set(stats["tiers"][0]) >= {"tier", "used_pages", "free_pages", "pinned_pages", "emulated"}
    assert stats["reserved_pages"] == 2 and stats["first_writes"] == 1
    assert sum(t["used_pages"] for t in stats["tiers"]) == 1
    import json

    assert json.loads(rt.stats_json())["page_size"] == PAGE


def test_keyword_arguments(tmp_path):
    rt = strata.Runtime(device=None, host_capacity=1 << 20, page_size=8192)
    assert rt.tiers == ["host"] and rt.backend is None and rt.page_size == 8192
    rt = strata.Runtime(
        device="sim",
        device_capacity=0,
        host_capacity=1 << 20,
        cxl_capacity=1 << 20,
        cxl_mode="emulated",
        nvme_path=tmp_path / "swap",  # a new file name, as a PathLike
        nvme_capacity=1 << 20,
        nvme_engine="psync",
        watermarks=(0.5, 0.9),
        policy="lru",
    )
    assert rt.tiers == ["host", "cxl", "nvme"]
    assert rt.stats()["tiers"][1]["emulated"] is True
    # The swap file is private: created and unlinked.
    assert not (tmp_path / "swap").exists()


def test_from_toml(tmp_path):
    rt = strata.Runtime.from_toml(
        f"""
        page_size = "16k"
        device = "sim"
        device_capacity = "256k"
        [host]
        capacity = "1M"
        [nvme]
        path = "{tmp_path}"
        capacity = "1M"
        """
    )
    assert rt.page_size == 16384
    assert rt.tiers == ["device", "host", "nvme"]
    buf = rt.alloc(100_000)
    buf.write(99_990, b"0123456789")
    assert buf.read(99_990, 10) == b"0123456789"


def test_from_toml_use_env(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_PAGE_SIZE", "8k")
    text = f'device = "sim"\ndevice_capacity = "64k"\n[nvme]\npath = "{tmp_path}"\ncapacity = "1M"\n'
    assert strata.Runtime.from_toml(text).page_size == 64 << 10
    assert strata.Runtime.from_toml(text, use_env=True).page_size == 8 << 10


def test_buffer_outlives_runtime_reference(tmp_path):
    rt = strata.Runtime(device=None, host_capacity=1 << 20, page_size=PAGE)
    buf = rt.alloc(PAGE)
    del rt
    buf.write(0, b"still here")
    assert buf.read(0, 10) == b"still here"


def test_version():
    assert isinstance(strata.__version__, str) and strata.__version__.count(".") == 2


def test_check_and_shutdown(rt):
    buf = rt.alloc(8 * PAGE)
    buf.write(0, b"x" * (8 * PAGE))
    rt.check()  # nothing failed in the background
    assert rt.stats()["background_errors"] == 0
    # Moves still queued or running when the runtime shuts down: shutdown
    # finishes them (their tickets end) before it returns.
    t = buf.prefetch(None, "nvme")
    rt.shutdown()
    assert t.done()
    assert rt.stats()["in_flight_moves"] == 0
    assert buf.read(0, 8 * PAGE) == b"x" * (8 * PAGE)  # buffers go on working


def _every_setting(tmp_path, numa=True):
    """Every setting away from its default, as keywords and as TOML."""
    kw = dict(
        page_size=16 << 10,
        device="sim",
        device_capacity=256 << 10,
        host_capacity=1 << 20,
        huge_pages=False,
        cxl_mode="emulated",
        cxl_capacity=512 << 10,
        cxl_bandwidth=5 << 30,
        cxl_latency_ns=250,
        nvme_path=str(tmp_path),
        nvme_capacity=2 << 20,
        nvme_engine="psync",
        nvme_queue_depth=8,
        watermarks=(0.5, 0.75),
        policy="lru",
        background_eviction=False,
        sampling=3,
    )
    if numa:
        kw["numa_node"] = 0
    text = f"""
        page_size = "16k"
        device = "sim"
        device_capacity = "256k"
        watermark_low = 0.5
        watermark_high = 0.75
        policy = "lru"
        background_eviction = false
        sampling = 3
        [host]
        capacity = "1M"
        huge_pages = false
        {"numa_node = 0" if numa else ""}
        [cxl]
        mode = "emulated"
        capacity = "512k"
        bandwidth = "5G"
        latency_ns = 250
        [nvme]
        path = "{tmp_path}"
        capacity = "2M"
        engine = "psync"
        queue_depth = 8
        """
    return kw, text


def test_every_keyword_resolves_as_toml_does(tmp_path):
    kw, text = _every_setting(tmp_path, numa=False)
    rt = strata.Runtime(**kw)
    config = rt.config()
    assert config == strata.Runtime.from_toml(text).config()
    assert config == strata.resolve_config(**kw)
    assert rt.tiers == ["device", "host", "cxl", "nvme"]
    assert config["page_size"] == 16 << 10 and config["device"] == "sim"
    assert config["device_capacity"] == 256 << 10
    assert config["host"] == {"capacity": 1 << 20, "page_size": 16 << 10, "huge_pages": False, "numa_node": None}
    assert config["cxl"]["mode"] == "emulated" and config["cxl"]["capacity"] == 512 << 10
    assert config["cxl"]["bandwidth"] == float(5 << 30) and config["cxl"]["latency_ns"] == 250
    assert config["nvme"]["path"] == str(tmp_path) and config["nvme"]["capacity"] == 2 << 20
    assert config["nvme"]["engine"] == "psync" and config["nvme"]["queue_depth"] == 8
    assert config["watermarks"] == {"low": 0.5, "high": 0.75}
    assert config["policy"] == "lru" and config["background_eviction"] is False
    assert config["sampling"] == 3
    # The NUMA node too (resolved without opening the tiers: binding needs
    # mbind, which some sandboxes refuse).
    kw, _ = _every_setting(tmp_path)
    assert strata.resolve_config(**kw)["host"]["numa_node"] == 0
    assert strata.resolve_config(sampling="off")["sampling"] is None


def test_keywords_left_out_take_the_configurations_defaults():
    # A program asks for CXL and NVMe tiers; everything else is the default
    # of an empty config file (and of C's strata_config_init).
    program = strata.Runtime.from_toml('[cxl]\nmode = "off"\n[nvme]\ncapacity = 0\n')
    assert strata.resolve_config() == program.config()
    assert strata.Runtime().config() == program.config()
    defaults = program.config()
    assert defaults["page_size"] == 64 << 10 and defaults["device"] == "auto"
    assert defaults["host"]["huge_pages"] is True and defaults["host"]["numa_node"] is None
    assert defaults["watermarks"] == {"low": 0.85, "high": 0.95}
    assert defaults["policy"] == "default" and defaults["sampling"] == 0
    assert defaults["background_eviction"] is True
    # None for a device, and 0 for a capacity, turn a tier off.
    assert strata.resolve_config(device=None)["device_capacity"] == 0
    assert strata.resolve_config(cxl_mode="emulated", cxl_capacity=0)["cxl"] is None


@pytest.mark.parametrize(
    "kw, text",
    [
        ({"page_size": 3000}, "page_size = 3000"),
        ({"watermarks": (0.9, 0.5)}, "watermark_low = 0.9\nwatermark_high = 0.5"),
        ({"sampling": 17}, "sampling = 17"),
        ({"sampling": "often"}, 'sampling = "often"'),
        ({"host_capacity": 100}, "[host]\ncapacity = 100"),
        ({"cxl_mode": "emulated", "cxl_capacity": 100}, '[cxl]\nmode = "emulated"\ncapacity = 100'),
        ({"cxl_mode": "cxl2"}, '[cxl]\nmode = "cxl2"'),
        ({"nvme_path": "/tmp", "nvme_queue_depth": 0}, "[nvme]\nqueue_depth = 0"),
        ({"nvme_path": "/tmp", "nvme_capacity": 100_000}, "[nvme]\ncapacity = 100000"),
        ({"nvme_path": ""}, '[nvme]\npath = ""'),
        ({"nvme_path": "/tmp", "nvme_engine": "aio"}, '[nvme]\nengine = "aio"'),
        ({"policy": "mru"}, 'policy = "mru"'),
        ({"device": "tpu"}, 'device = "tpu"'),
    ],
)
def test_a_bad_keyword_value_raises_what_toml_raises(kw, text):
    with pytest.raises(strata.InvalidArgumentError) as from_toml:
        strata.Runtime.from_toml(text)
    with pytest.raises(strata.InvalidArgumentError) as from_keywords:
        strata.Runtime(**kw)
    assert str(from_keywords.value) == str(from_toml.value)
    with pytest.raises(strata.InvalidArgumentError) as resolved:
        strata.resolve_config(**kw)
    assert str(resolved.value) == str(from_toml.value)


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'host_capacty'"):
        strata.Runtime(host_capacty=1 << 20)
    with pytest.raises(TypeError):
        strata.Runtime(huge_pages="yes")


def test_none_leaves_a_keyword_to_its_default():
    assert strata.resolve_config(host_capacity=None, page_size=None, policy=None) == strata.resolve_config()
    # device=None alone means something: no device tier.
    assert strata.resolve_config(device=None, device_capacity=1 << 20)["device_capacity"] == 0


def test_a_keyword_of_the_wrong_type_is_named():
    for kw, exc, says in (
        (dict(huge_pages=1), TypeError, "huge_pages: "),
        (dict(device=5), TypeError, "device: "),
        (dict(page_size="64k"), TypeError, "page_size: "),
        (dict(host_capacity=2**70), OverflowError, "host_capacity: "),
        (dict(host_capacity=True), TypeError, "host_capacity takes an int, not a bool"),
        (dict(sampling=True), TypeError, "sampling takes an int, not a bool"),
        (dict(watermarks=(0.9,)), strata.InvalidArgumentError, "watermarks takes (low, high)"),
    ):
        with pytest.raises(exc) as e:
            strata.Runtime(**kw)
        assert str(e.value).startswith(says), (kw, str(e.value))


def test_balance_once_reports_a_round(rt):
    buf = rt.alloc(4 * PAGE, prefer="host")
    buf.write(0, pattern(4 * PAGE, seed=5))
    assert [buf.tier_of(p) for p in range(4)] == ["host"] * 4
    # The writes count as accesses: the pages, below the device, are
    # replayed into the policy and promoted.
    r = strata.balance_once(rt)
    assert set(r) == {
        "promotions", "demotions", "bypasses", "deferred", "promotions_below",
        "demotions_below", "marked", "held_back", "replayed",
    }
    assert r["replayed"] == 4 and r["promotions"] == 4
    assert [buf.tier_of(p) for p in range(4)] == ["device"] * 4
    for _ in range(10):
        buf.read(0, 4 * PAGE)
    # Every page on the device with room to spare: nothing to decide.
    r = strata.balance_once(rt)
    assert r["replayed"] == 0 and r["promotions"] == r["demotions"] == 0


def test_the_readmes_first_example_runs(tmp_path, capsys):
    """The README's first Python example, as a reader copies it (its NVMe
    file under tmp_path instead of /var/tmp), runs and prints where the
    first page is and the moves made."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if b.startswith("import numpy as np\nimport strata\n"))
    assert '"/var/tmp"' in example
    exec(compile(example.replace('"/var/tmp"', repr(str(tmp_path))), "README.md", "exec"), {})
    tier, moves = capsys.readouterr().out.split()
    assert tier == "host" and int(moves) > 0
