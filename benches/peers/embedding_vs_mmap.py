#!/usr/bin/env python3
"""strata.nn.EmbeddingBag against torch.nn.EmbeddingBag over a memory-mapped
table, under one memory limit that holds 20% of the tables.

Set-up (not run by CI; needs root for the cgroup and for dropping caches):

    # a Python with torch, numpy and strata (tests/run.sh makes target/pyenv;
    # or put a built wheel's package on PYTHONPATH)
    sudo target/pyenv/bin/python benches/peers/embedding_vs_mmap.py \
        --dir /var/tmp/strata-emb --trials 3 --json emb.json

Workload: 8 tables of --rows rows of --dim float32 (default 8 x 1 Mi x 64:
2 GiB), --batch bags per table per batch, pooling 32 (sum), indices drawn
from a Zipf(1.05) law over each table's rows (inverse CDF of the truncated
law, numpy's PCG64 with a seed per table and batch). Row id = Zipf rank - 1,
as in `strata bench recsys` (hot rows first); --scatter maps ranks to rows
through a fixed random permutation per table instead (hot rows spread
over pages, as after hashing).

Configurations, each in its own process, in its own cgroup v1 memory group
(/sys/fs/cgroup/memory/<name>/memory.limit_in_bytes; page cache counts
against it) with the same limit: 20% of the tables plus --allowance MiB
(default 1 GiB) for the process itself (torch and its libraries, strata's
page tables and I/O buffers, the indices). What of the allowance a
process does not use is page cache for the mmap peer (the end-of-run
anonymous and cache bytes of each group are reported), so the limit
favours the peer; strata's fast tier stays at 20%:

  strata  strata.nn.EmbeddingBagCollection: a fast tier of 20% of the
          tables in DRAM (the simulated device tier, a host arena), NVMe
          below in a private file under --dir, the balancer in the
          background at its defaults; fused SGD.
  strata-rows  the same collection with the fast tier given to row caches
          (row_cache=: each table an equal share of the fast tier's
          pages, rows kept at their own granularity under the default
          policy; the tables' pages on NVMe below).
  mmap    torch.nn.EmbeddingBag.from_pretrained(torch.from_file(path,
          shared=True, size=...), sparse=True) per table over fresh copies
          of the tables' files under --dir (its updates write them), torch.optim.SGD on its sparse gradients (torch's own
          recommended path for sparse embedding updates), torch's default
          threads.

Caches are dropped (echo 3 > /proc/sys/vm/drop_caches) before each child
and again after it has loaded its tables, so no run starts with the other's
page cache. Each child: --warmup training batches (not timed), then
--batches forward-only batches under torch.no_grad (lookups/s), then
--batches training batches: forward + backward + update (seconds per
batch; loss: the mean of the pooled outputs), each phase on its own batches of the same law. Configurations are
interleaved over --trials trials. strata's fast-tier hit rate is counted
over the forward-only batches; beside it the best fixed placement in
hindsight over the same lookups: the share of reads served by the
top-20%-of-table-bytes most-read rows (over all tables, since the fast
tier is shared) and the same for 4 KiB pages; and, since a short stream's
hindsight counts every row it read at all as a hit, the same placements'
expected share under the Zipf law (its probability mass: the long-run
optimum of a fixed placement under independent references). Nothing is tuned: every
setting is a default of strata or torch, or one of the workload's
stated above.

fbgemm-gpu-cpu (the DRAM ceiling for this workload) is not run: it pins
its own torch build, a separate venv with a multi-GiB download.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from cgroups import drop_caches

CGROUP = "/sys/fs/cgroup/memory"
TABLES = 8
POOLING = 32
ALPHA = 1.05


def zipf_cdf(rows, alpha):
    import numpy as np

    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    c = np.cumsum(w)
    return c / c[-1]


def batch_indices(args, cdf, perms, phase, b):
    """One batch: per table (indices int64 of batch*POOLING, offsets)."""
    import numpy as np

    out = []
    for t in range(TABLES):
        rng = np.random.Generator(np.random.PCG64([args.seed, phase, b, t]))
        ranks = np.searchsorted(cdf, rng.random(args.batch * POOLING), side="right")
        ranks = np.minimum(ranks, args.rows - 1)
        idx = perms[t][ranks] if perms is not None else ranks
        out.append(idx.astype(np.int64))
    return out


def permutations(args):
    import numpy as np

    if not args.scatter:
        return None
    return [np.random.Generator(np.random.PCG64([args.seed, 99, t])).permutation(args.rows) for t in range(TABLES)]


def table_path(args, t):
    return os.path.join(args.dir, f"table{t}.f32")


def work_path(args, t):
    """The mmap peer's copy of table t: its training writes the file."""
    return os.path.join(args.dir, f"work{t}.f32")


def make_tables(args):
    """The tables' values, once: N(0, 1) float32, one file per table."""
    import numpy as np

    os.makedirs(args.dir, exist_ok=True)
    size = args.rows * args.dim * 4
    for t in range(TABLES):
        p = table_path(args, t)
        if os.path.exists(p) and os.path.getsize(p) == size:
            continue
        rng = np.random.Generator(np.random.PCG64([args.seed, 7, t]))
        with open(p + ".tmp", "wb") as f:
            chunk = 1 << 18
            for start in range(0, args.rows, chunk):
                n = min(chunk, args.rows - start)
                f.write(rng.standard_normal((n, args.dim), dtype=np.float32).tobytes())
        os.replace(p + ".tmp", p)


# -- the child: one configuration ------------------------------------------


def enter_cgroup(cg):
    # Before anything is imported, so the group sees all of the process.
    if cg:
        with open(os.path.join(CGROUP, cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def child(args):
    cg = args.cgroup
    enter_cgroup(cg)
    import numpy as np
    import torch

    cdf = zipf_cdf(args.rows, ALPHA)
    perms = permutations(args)
    warm = [batch_indices(args, cdf, perms, 0, b) for b in range(args.warmup)]
    fwd = [batch_indices(args, cdf, perms, 1, b) for b in range(args.batches)]
    train = [batch_indices(args, cdf, perms, 2, b) for b in range(args.batches)]
    offsets = torch.arange(0, args.batch * POOLING, POOLING, dtype=torch.int64)
    to_t = lambda batch: [torch.from_numpy(x) for x in batch]  # noqa: E731
    lr = 0.01
    result = {"config": args.config}
    t0 = time.perf_counter()
    strata_config = args.config in ("strata", "strata-rows")
    if strata_config:
        import strata.nn

        table_bytes = TABLES * args.rows * args.dim * 4
        nvme = os.path.join(args.dir, "strata-nvme")
        os.makedirs(nvme, exist_ok=True)
        fast_bytes = int(table_bytes * args.fast_share)
        extra = {}
        if args.config == "strata-rows":
            # The fast tier's whole pages, shared equally by the tables.
            page = 4096
            extra["row_cache"] = (fast_bytes // page // TABLES) * (page // (args.dim * 4))
            result["row_cache_rows_per_table"] = extra["row_cache"]
        model = strata.nn.EmbeddingBagCollection(
            [(args.rows, args.dim)] * TABLES,
            mode="sum",
            fast_bytes=fast_bytes,
            nvme_path=nvme,
            optimizer="sgd",
            lr=lr,
            balance="manual",
            **extra,
        )
        for t, emb in enumerate(model.tables):
            chunk = 1 << 16
            with open(table_path(args, t), "rb") as f:
                for start in range(0, args.rows, chunk):
                    n = min(chunk, args.rows - start)
                    data = np.frombuffer(f.read(n * args.dim * 4), dtype=np.float32)
                    emb._table.write_rows(start, data)
        strata.nn.start_balancer(model.runtime)  # the defaults, from here on

        def forward(batch):
            return model(to_t(batch), [offsets] * TABLES)

        def step(batch):
            out = model(to_t(batch), [offsets] * TABLES)
            torch.stack(out).mean().backward()

    else:
        tables = []
        for t in range(TABLES):
            w = torch.from_file(work_path(args, t), shared=True, size=args.rows * args.dim, dtype=torch.float32)
            tables.append(
                torch.nn.EmbeddingBag.from_pretrained(w.view(args.rows, args.dim), freeze=False, mode="sum", sparse=True)
            )
        model = torch.nn.ModuleList(tables)
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def forward(batch):
            return [m(x, offsets) for m, x in zip(model, to_t(batch))]

        def step(batch):
            opt.zero_grad()
            out = [m(x, offsets) for m, x in zip(model, to_t(batch))]
            torch.stack(out).mean().backward()
            opt.step()

    result["load_seconds"] = time.perf_counter() - t0
    result["caches_dropped"] = drop_caches()
    # The first forward batch's checksum: the same tables in every config.
    with torch.no_grad():
        result["checksum_before"] = float(sum(o.double().sum() for o in forward(fwd[0])))
    t0 = time.perf_counter()
    for b in warm:
        step(b)
    result["warmup_seconds"] = time.perf_counter() - t0
    if strata_config:
        model.reset_stats()
    lookups = sum(x.size for b in fwd for x in b)
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in fwd:
            forward(b)
    result["forward_seconds"] = time.perf_counter() - t0
    result["lookups_per_sec"] = lookups / result["forward_seconds"]
    if strata_config:
        stats = model.stats()
        result["hit_rate"] = stats["hit_rate"]
        result["cache_hits"] = stats["cache_hits"]
        result["runtime_stats"] = {k: v for k, v in model.runtime.stats().items() if k in ("promotions", "demotions", "moves", "tiers")}
    times = []
    for b in train:
        t = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t)
    result["train_seconds_per_batch"] = sum(times) / len(times)
    result["train_batch_seconds"] = times
    if cg:
        with open(os.path.join(CGROUP, cg, "memory.max_usage_in_bytes")) as f:
            result["cgroup_max_usage_bytes"] = int(f.read())
        with open(os.path.join(CGROUP, cg, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
        # What the group held at the end: anonymous memory (strata's fast
        # tier is in it) and page cache (the mmap peer's cached table).
        result["cgroup_end"] = {k: int(stat[k]) for k in ("total_rss", "total_cache", "total_mapped_file") if k in stat}
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent -------------------------------------------------------------


def make_cgroup(name, limit):
    path = os.path.join(CGROUP, name)
    if os.path.isdir(path):
        remove_cgroup(name)
    os.mkdir(path)
    if limit is not None:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    return path


def remove_cgroup(name):
    path = os.path.join(CGROUP, name)
    try:
        with open(os.path.join(path, "memory.force_empty"), "w") as f:
            f.write("0")
    except OSError:
        pass
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


def run_child(args, mode, config, cgroup):
    cmd = [sys.executable, os.path.abspath(__file__), f"--{mode}", config] + args.forward
    if cgroup:
        cmd += ["--cgroup", cgroup]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{config} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def static_optimum(args):
    """The best fixed placement in hindsight over the forward-only batches:
    the share of lookups served by the most-read rows (and 4 KiB pages)
    that fit in the fast tier, over all tables."""
    import numpy as np

    cdf = zipf_cdf(args.rows, ALPHA)
    perms = permutations(args)
    row_bytes = args.dim * 4
    rows_per_page = max(1, 4096 // row_bytes)
    budget = int(TABLES * args.rows * row_bytes * args.fast_share)
    row_counts = np.zeros(TABLES * args.rows, dtype=np.int64)
    for b in range(args.batches):
        for t, idx in enumerate(batch_indices(args, cdf, perms, 1, b)):
            row_counts += np.bincount(idx + t * args.rows, minlength=TABLES * args.rows)
    total = row_counts.sum()
    out = {}
    for name, unit in (("rows", 1), ("pages", rows_per_page)):
        per_table = -(-args.rows // unit)
        c = np.zeros(TABLES * per_table, dtype=np.int64)
        for t in range(TABLES):
            rc = row_counts[t * args.rows : (t + 1) * args.rows]
            pad = np.zeros(per_table * unit, dtype=np.int64)
            pad[: args.rows] = rc
            c[t * per_table : (t + 1) * per_table] = pad.reshape(per_table, unit).sum(1)
        slots = budget // (unit * row_bytes)
        top = np.sort(c)[::-1][:slots]
        out[name] = float(top.sum() / total)
    # The same placement's long-run share under the Zipf law itself (the
    # probability mass of the rows or pages it holds: A0's optimum under
    # independent references), which a short stream's hindsight count
    # overstates (every row it touched once counts as a hit).
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    for name, unit in (("rows", 1), ("pages", rows_per_page)):
        per_table = -(-args.rows // unit)
        mass = []
        for t in range(TABLES):
            rows_of_rank = perms[t] if perms is not None else np.arange(args.rows)
            mass.append(np.bincount(rows_of_rank // unit, weights=pmf, minlength=per_table) / TABLES)
        m = np.sort(np.concatenate(mass))[::-1]
        out[f"expected_{name}"] = float(m[: budget // (unit * row_bytes)].sum())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/strata-emb", help="tables' files and strata's NVMe file")
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256, help="bags per table per batch")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--fast-share", type=float, default=0.2)
    ap.add_argument("--allowance", type=int, default=1024, help="MiB of the limit beyond the tables' share, for the process itself")
    ap.add_argument("--scatter", action="store_true")
    ap.add_argument("--configs", default="strata,mmap")
    ap.add_argument("--json", help="write every trial here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # What the children get, verbatim.
    args.forward = [
        "--dir", args.dir, "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
        "--warmup", str(args.warmup), "--batches", str(args.batches), "--seed", str(args.seed),
        "--fast-share", str(args.fast_share),
    ] + (["--scatter"] if args.scatter else [])
    if args.child:
        args.config = args.child
        return child(args)

    make_tables(args)
    table_bytes = TABLES * args.rows * args.dim * 4
    have_cgroup = os.path.isdir(CGROUP) and os.access(CGROUP, os.W_OK)
    report = {"params": {k: v for k, v in vars(args).items() if k not in ("forward", "child", "cgroup")},
              "table_bytes": table_bytes, "cgroup_v1": have_cgroup}
    if have_cgroup:
        limit = int(table_bytes * args.fast_share) + (args.allowance << 20)
        report.update(limit_bytes=limit)
        print(f"tables {table_bytes / 2**30:.2f} GiB; limit {limit / 2**20:.0f} MiB", flush=True)
    else:
        limit = None
        print(f"no writable cgroup v1 memory controller at {CGROUP}: running WITHOUT a memory limit", flush=True)
    report["static_optimum"] = static_optimum(args)
    print(f"static optimum (hindsight): {report['static_optimum']}", flush=True)
    trials = []
    configs = args.configs.split(",")
    for trial in range(args.trials):
        order = configs if trial % 2 == 0 else configs[::-1]
        for config in order:
            name = f"strata-emb-{config}" if have_cgroup else None
            if config == "mmap":
                for t in range(TABLES):
                    shutil.copyfile(table_path(args, t), work_path(args, t))
            if name:
                make_cgroup(name, limit)
            drop_caches()
            r = run_child(args, "child", config, name)
            if name:
                remove_cgroup(name)
            r["trial"] = trial
            trials.append(r)
            print(
                f"trial {trial} {config:11s} lookups/s {r['lookups_per_sec']:12.0f}  train s/batch "
                f"{r['train_seconds_per_batch']:.4f}  hit {r.get('hit_rate', float('nan')):.4f}  "
                f"peak {r.get('cgroup_max_usage_bytes', 0) / 2**20:.0f} MiB  checksum {r['checksum_before']:.3f}",
                flush=True,
            )
    report["trials"] = trials
    summary = {}
    for config in configs:
        rs = [r for r in trials if r["config"] == config]
        summary[config] = {
            "lookups_per_sec": [r["lookups_per_sec"] for r in rs],
            "train_seconds_per_batch": [r["train_seconds_per_batch"] for r in rs],
            "hit_rate": [r.get("hit_rate") for r in rs],
        }
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
