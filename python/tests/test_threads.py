"""Threads: concurrent I/O from Python threads, and the GIL released while
strata works or waits."""

import sys
import threading
import time

import numpy as np
import pytest

import strata
from conftest import PAGE


def test_two_threads_doing_io_concurrently(rt):
    bufs = [rt.alloc(16 * PAGE) for _ in range(2)]
    errors = []

    def worker(i):
        try:
            rng = np.random.default_rng(i)
            buf = bufs[i]
            for round in range(20):
                data = rng.integers(0, 256, 5 * PAGE + 11, dtype=np.uint8)
                at = int(rng.integers(0, 16 * PAGE - data.size))
                buf.write(at, data)
                # Move pages around while the other thread does the same.
                tier = ("nvme", "host", "device")[round % 3]
                buf.prefetch((at, at + data.size), tier).wait()
                back = np.empty_like(data)
                buf.readinto(at, back)
                assert np.array_equal(back, data), f"thread {i} round {round}"
                assert buf.read(at, data.size) == data.tobytes()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


@pytest.fixture
def spinner():
    """A thread that counts in pure Python and gives the GIL up after each
    count, with the switch interval so long that no thread is ever made to
    give it up: the count rises while the main thread runs only if the main
    thread releases the GIL (between counts the spinner waits for it)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e6)
    state = {"count": 0, "stop": False}

    def spin():
        while not state["stop"]:
            state["count"] += 1
            time.sleep(0)  # releases the GIL

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    yield state
    state["stop"] = True
    t.join()
    sys.setswitchinterval(old)


def progress_during(state, call):
    """Whether the spinner counted while `call` ran (several tries: a call
    that releases the GIL briefly may end before the spinner is
    scheduled)."""
    for _ in range(20):
        time.sleep(0.001)  # the spinner takes the GIL; we get it back fresh
        before = state["count"]
        call()
        if state["count"] > before:
            return True
    return False


def test_the_spinner_counts_only_while_the_gil_is_released(spinner):
    """The control for the test below: Python work that holds the GIL lets
    the spinner make no progress, a sleep that releases it does."""
    assert not progress_during(spinner, lambda: sum(range(200_000)))
    assert progress_during(spinner, lambda: time.sleep(0.01))


def test_gil_released_during_io_and_waits(tmp_path, spinner):
    rt = strata.Runtime(
        device=None,
        host_capacity=64 << 20,
        nvme_path=tmp_path,
        nvme_capacity=64 << 20,
        page_size=64 << 10,
        background_eviction=False,
    )
    buf = rt.alloc(32 << 20)
    data = np.ones(32 << 20, dtype=np.uint8)
    assert progress_during(spinner, lambda: buf.write(0, data))
    assert progress_during(spinner, lambda: buf.read())
    out = np.empty_like(data)
    assert progress_during(spinner, lambda: buf.readinto(0, out))

    def round_trip():
        buf.evict(None, "nvme")
        buf.prefetch(None, "host").wait()

    assert progress_during(spinner, round_trip)
    assert np.array_equal(out, data)


def test_wait_in_one_thread_does_not_block_another(tmp_path):
    rt = strata.Runtime(
        device=None,
        host_capacity=64 << 20,
        nvme_path=tmp_path,
        nvme_capacity=64 << 20,
        page_size=64 << 10,
    )
    buf = rt.alloc(32 << 20)
    buf.write(0, np.ones(32 << 20, dtype=np.uint8))
    other = rt.alloc(PAGE)
    started = threading.Event()
    finish = threading.Event()
    done = []

    def waiter():
        started.set()
        # Moves and waits until told to stop: the I/O below runs while this
        # thread is inside strata's waits, not after it.
        while not finish.is_set():
            buf.evict(None, "nvme")
            buf.prefetch(None, "host").wait()
        done.append(True)

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    try:
        # Small I/O from this thread proceeds meanwhile.
        for i in range(100):
            other.write(0, i.to_bytes(4, "little"))
            assert other.read(0, 4) == i.to_bytes(4, "little")
        assert t.is_alive() and done == [], "the waiter ended before the I/O beside it did"
    finally:
        finish.set()
        t.join(timeout=120)
    assert done == [True]
    assert buf.read(0, 1 << 20) == b"\x01" * (1 << 20)
