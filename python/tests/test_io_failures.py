"""I/O failures of the NVMe tier through Python: a corrupted page raises
CorruptedError, a failing read or write IoError, a failed background move
is raised once by Runtime.check(); the caller never gets the wrong bytes,
and what was written before reads back afterwards.

The faults are real ones made from outside the library (Python has no
fault-injecting engine): a bit flipped in the private swap file (reached
through this process's descriptor of it: the file has no name), the swap
file truncated under the runtime (its reads hit end of file), and
RLIMIT_FSIZE at 0 (every write to a file fails with EFBIG)."""

import contextlib
import os
import resource
import signal
import tempfile

import numpy as np
import pytest

import strata

# Four 4 KiB sectors a page: small reads are served (and checksummed) by
# sector, whole ones by page.
PAGE = 16 << 10


@pytest.fixture
def nvme_dir():
    # A filesystem with O_DIRECT (tmpfs, which /tmp may be, has none).
    with tempfile.TemporaryDirectory(prefix="strata-py-io-failures", dir="/var/tmp") as d:
        yield os.path.realpath(d)


def runtime(nvme_dir, host_pages=4):
    """No device tier, `host_pages` of host, 32 NVMe pages; pages stay
    where they are put (no background eviction)."""
    return strata.Runtime(
        device=None,
        host_capacity=host_pages * PAGE,
        nvme_path=nvme_dir,
        nvme_capacity=32 * PAGE,
        nvme_engine="psync",
        page_size=PAGE,
        background_eviction=False,
    )


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def written_in(rt, tier, data):
    buf = rt.alloc(len(data), prefer=tier)
    buf.write(0, data)
    assert [buf.tier_of(p) for p in range(buf.page_count)] == [tier] * buf.page_count
    return buf


def swap_fd(nvme_dir):
    """The path of this process's descriptor of the swap file in nvme_dir."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(nvme_dir + "/"):
            found.append(f"/proc/self/fd/{fd}")
    assert len(found) == 1, f"one swap file open in {nvme_dir}: {found}"
    return found[0]


def corrupt_on_disk(nvme_dir, page, at):
    """Flips a bit of byte `at` of the one slot of the swap file holding `page`."""
    with open(swap_fd(nvme_dir), "r+b", buffering=0) as f:
        whole = f.read()
        slots = [s for s in range(len(whole) // PAGE) if whole[s * PAGE : (s + 1) * PAGE] == page]
        assert len(slots) == 1, "the page is in exactly one slot on disk"
        f.seek(slots[0] * PAGE + at)
        f.write(bytes([whole[slots[0] * PAGE + at] ^ 0x08]))
        os.fsync(f.fileno())


@contextlib.contextmanager
def writes_refused():
    """Every write to a file fails with EFBIG while inside (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_page_corrupted_on_disk_raises_corrupted_error(nvme_dir):
    rt = runtime(nvme_dir)
    data = pattern(3 * PAGE, 1)
    buf = written_in(rt, "nvme", data)
    # Byte 5000 of page 1: its second sector.
    corrupt_on_disk(nvme_dir, data[PAGE : 2 * PAGE], 5000)
    bad = bytearray(data[PAGE : 2 * PAGE])
    bad[5000] ^= 0x08

    with pytest.raises(strata.CorruptedError, match="checksum"):
        buf.read()
    out = bytearray(PAGE)
    with pytest.raises(strata.CorruptedError, match="checksum"):
        buf.readinto(PAGE, out)
    assert out != bad, "the flipped bytes came out"
    with pytest.raises(strata.CorruptedError):
        buf.read(PAGE + 4990, 20)

    # Intact: the other pages, and page 1's first sector alone.
    assert buf.read(0, PAGE) == data[:PAGE]
    assert buf.read(2 * PAGE, PAGE) == data[2 * PAGE :]
    assert buf.read(PAGE + 10, 100) == data[PAGE + 10 : PAGE + 110]

    with pytest.raises(strata.CorruptedError, match="checksum"):
        buf.prefetch((PAGE, 2 * PAGE), "host").wait()
    assert buf.tier_of(1) == "nvme"
    # A partial write cannot merge into bytes that fail their checksum.
    with pytest.raises(strata.CorruptedError):
        buf.write(PAGE + 7, b"x")
    rt.check()  # the caller's own errors are not background failures

    fresh = pattern(PAGE, 2)
    buf.write(PAGE, fresh)
    assert buf.read() == data[:PAGE] + fresh + data[2 * PAGE :]
    assert rt.stats()["lost_pages"] == 0


def test_a_failing_nvme_read_raises_io_error_and_the_data_survives(nvme_dir):
    rt = runtime(nvme_dir)
    data = pattern(2 * PAGE, 3)
    buf = written_in(rt, "nvme", data)
    with open(swap_fd(nvme_dir), "r+b", buffering=0) as f:
        saved = f.read()
        os.ftruncate(f.fileno(), 0)
        try:
            with pytest.raises(strata.IoError, match="end of file") as e:
                buf.read()
            assert isinstance(e.value, OSError)
            with pytest.raises(strata.IoError):
                buf.read(PAGE + 10, 10)
            with pytest.raises(strata.IoError, match="end of file"):
                buf.prefetch(None, "host").wait()
            assert [buf.tier_of(0), buf.tier_of(1)] == ["nvme", "nvme"]
        finally:
            f.seek(0)
            f.write(saved)
            os.fsync(f.fileno())
    assert buf.read() == data, "acknowledged data lost"
    assert buf.prefetch(None, "host").wait()
    assert buf.read() == data
    rt.check()
    assert rt.stats()["lost_pages"] == 0


def test_a_refused_write_raises_io_error_and_keeps_the_old_content(nvme_dir):
    rt = runtime(nvme_dir)
    data = pattern(2 * PAGE, 4)
    buf = written_in(rt, "nvme", data)
    nxt = pattern(2 * PAGE, 5)
    with writes_refused():
        with pytest.raises(strata.IoError, match="too large"):
            buf.write(0, nxt[:PAGE])
        with pytest.raises(strata.IoError):
            buf.write(PAGE + 3, nxt[:100])
        with pytest.raises(strata.IoError):
            buf.write(0, nxt)
        assert buf.read() == data, "acknowledged data lost"
    assert buf.read() == data
    assert [buf.tier_of(0), buf.tier_of(1)] == ["nvme", "nvme"]
    buf.write(0, nxt)
    assert buf.read() == nxt
    rt.check()


def test_check_raises_a_background_failure_once(nvme_dir):
    rt = runtime(nvme_dir)
    host_data = pattern(4 * PAGE, 6)
    full = written_in(rt, "host", host_data)
    data = pattern(PAGE, 7)
    buf = written_in(rt, "nvme", data)
    rt.check()
    errors = rt.stats()["background_errors"]
    # The host tier is full: pinning buf there demotes a page of `full`,
    # and that write is refused.
    with writes_refused():
        with pytest.raises(strata.StrataError):
            buf.pin(None, "host")
    assert rt.stats()["background_errors"] > errors
    with pytest.raises(strata.IoError, match="making room"):
        rt.check()
    rt.check()  # raised once, then cleared
    assert full.read() == host_data and buf.read() == data
    assert full.residency()["host"] == 4 and rt.stats()["lost_pages"] == 0
    with buf.pin(None, "host") as pin:
        assert pin.tier == "host"
    assert full.read() == host_data and buf.read() == data
    rt.check()
