"""What the peer scripts share for running a configuration under a cgroup v1
memory limit: its own group, the limit set once it has loaded, the group's
counters, and the page cache dropped between runs. Linux, as root, with the
memory controller at /sys/fs/cgroup/memory; where it is not writable the
scripts run without a limit and say so."""

import ctypes
import gc
import os
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/memory")


def writable() -> bool:
    return CGROUP.is_dir() and os.access(CGROUP, os.W_OK)


def own_cgroup() -> Path:
    """The memory cgroup of this process."""
    with open("/proc/self/cgroup") as f:
        path = next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line)
    return CGROUP / path.lstrip("/")


def cgroup_stat() -> dict:
    """This process's group's memory.stat ({} where it cannot be read)."""
    try:
        with open(own_cgroup() / "memory.stat") as f:
            return {k: int(v) for k, v in (line.split() for line in f)}
    except (OSError, StopIteration):
        return {}


def memory_counters() -> dict:
    """This process's group's major faults and file refaults so far ({}
    where the group cannot be read)."""
    st = cgroup_stat()
    if not st:
        return {}
    return {
        "major_faults": st.get("total_pgmajfault", st.get("pgmajfault", 0)),
        "refaults": st.get("total_workingset_refault_file", st.get("total_workingset_refault", 0)),
    }


def proc_io() -> dict:
    """This process's /proc/self/io counters (read_bytes, write_bytes, ...)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def apply_limit(limit: int) -> dict:
    """Limits this process's group to `limit` bytes from now on (after
    loading, whose transient peak is not what is measured) and restarts
    its peak. The kernel reclaims page cache down to the limit; anonymous
    memory above it fails. Returns the usage before the limit."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    cg = own_cgroup()
    before = int((cg / "memory.usage_in_bytes").read_text())
    for _ in range(20):
        try:
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            break
        except OSError:
            time.sleep(0.2)
    else:
        raise SystemExit(f"cannot limit to {limit} bytes: {before} in use after loading")
    (cg / "memory.max_usage_in_bytes").write_text("0")
    return {"usage_before_limit": before}


def drop_caches() -> bool:
    """Writes dirty pages back and drops the page cache (root); whether it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Group:
    """A memory cgroup of its own for one run's processes: `wrap(cmd)`
    starts a command in it; after the `with` block, `peak` and `failcnt`
    hold its counters (None without a writable controller)."""

    def __init__(self, name: str):
        self.path = CGROUP / name if writable() else None
        self.peak = self.failcnt = None

    def __enter__(self):
        if self.path is not None:
            self.path.mkdir()
        return self

    def wrap(self, cmd):
        if self.path is None:
            return list(cmd)
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"] + list(cmd)

    def __exit__(self, *exc):
        if self.path is None:
            return False
        self.peak = int((self.path / "memory.max_usage_in_bytes").read_text())
        self.failcnt = int((self.path / "memory.failcnt").read_text())
        for _ in range(50):
            try:
                self.path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        return False
