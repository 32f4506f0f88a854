#!/usr/bin/env python3
"""TorchRec's DLRM trained end to end with its tables in TorchRec's fused
CPU kernels or in strata's tiers, on synthetic Criteo-shaped data.

Set-up (not run by CI; root for the cgroup and for dropping caches). TorchRec
pins its own torch, and FBGEMM's CUDA wheel that torchrec pulls in shadows
the CPU one, so in a virtual environment of its own:

    python3 -m venv V
    V/bin/pip install torch==2.14.1 torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0 maturin numpy
    V/bin/pip uninstall -y fbgemm_gpu        # the CUDA wheel (needs libnvidia-ml)
    V/bin/pip install --force-reinstall --no-deps fbgemm-gpu-cpu==1.9.0   # its files back
    VIRTUAL_ENV=$PWD/V PATH=$PWD/V/bin:$PATH V/bin/pip install --no-build-isolation --no-deps ./python
    sudo V/bin/python benches/peers/dlrm_vs_torchrec.py --dir /var/tmp/dlrm --trials 3 --json dlrm.json

The model: torchrec.models.dlrm.DLRM (dense arch 13 -> 512 -> 256 -> D, the
dot interaction, over arch -> 512 -> 256 -> 1), binary cross-entropy,
dense parameters by torch.optim.Adagrad (lr 0.01), tables by row-wise
Adagrad fused into backward (lr 0.01, eps 1e-8) in every configuration.
The data: 13 dense features N(0, 1) and 26 sparse features of one id each
(Criteo's shape), ids Zipf(--alpha) over each table's --rows rows (the
inverse CDF of the truncated law; ranks mapped to rows by a fixed
multiplicative permutation per table, so hot rows are spread over pages);
labels Bernoulli(sigmoid(dense . w + the sum of a fixed pseudo-random
effect of each id)), so there is something to learn. Batches are seeded by
their step: every configuration trains on the same batches and is
evaluated on the same --eval-batches held-out batches. Every table starts
with the same rows: U(-sqrt(1/rows), sqrt(1/rows)), TorchRec's default
range, drawn by strata.nn.initial_rows for --seed (checked).

Configurations, each trial in its own process, interleaved:
  torchrec        torchrec.modules.fused_embedding_modules.FusedEmbeddingBagCollection
                  (FBGEMM's table-batched CPU kernels, EXACT_ROWWISE_ADAGRAD
                  fused into backward: TorchRec's fused path), tables in DRAM
  strata-dram     strata.nn.EmbeddingBagCollection, tables in host DRAM
  strata-nvme     strata.nn.EmbeddingBagCollection with the tables 4x the
                  memory limit: a fast tier (the DRAM the limit leaves after
                  the process's own footprint and --slack) and the rest in a
                  private NVMe file under --dir, the balancer in the
                  background; the process in a cgroup v1 memory group whose
                  limit is table bytes / 4, set once the model is built
  strata-nvme-rows  the same, the fast tier given to row caches instead
                  (row_cache=: each table an equal share of its whole
                  pages, the default policy; the tables' pages below it,
                  updates of cached rows held in the caches)
  torchrec-nvme   not run: TorchRec has no tier below DRAM on a CPU (its
                  caches need a GPU); reported as such
  strata-dram-2p  strata.nn sharded over 2 processes (gloo, --sharding
                  table or row), the dense part under DDP, each rank half
                  of every global batch

--mode lookups instead times the pooled forward alone (no_grad) of
torchrec.EmbeddingBagCollection (torch's CPU EmbeddingBag, FBGEMM's
kernels) against strata.nn in DRAM, for sum and mean, with and without
per-sample weights, on --lookup-pooling ids per bag.

What each figure is: samples/s over --steps timed steps after --warmup;
the evaluation loss and AUC on the held-out batches after training; peak
RSS (VmHWM); for strata its fast-tier hit rate over the timed steps and,
beside it, the best fixed placement in hindsight for the same capacity
(the most-read rows, and the most-read 4 KiB pages, of the same id
stream); for the cgroup run its failcnt, major faults and file refaults.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cgroups import Group, apply_limit, cgroup_stat, drop_caches

SPARSE = 26
DENSE = 13
PAGE = 4096
CONFIGS = ["torchrec", "strata-dram", "strata-nvme", "strata-nvme-rows", "torchrec-nvme", "strata-dram-2p"]
# The configurations under the memory limit, with a fast tier and NVMe.
LIMITED = ("strata-nvme", "strata-nvme-rows")


# -- data --------------------------------------------------------------------


class Data:
    """The synthetic Criteo-shaped stream: batch k is a function of k."""

    def __init__(self, args):
        import torch

        self.args = args
        rows = args.rows
        ranks = torch.arange(1, rows + 1, dtype=torch.float64)
        p = ranks.pow(-args.alpha)
        self.cdf = (p.cumsum(0) / p.sum()).to(torch.float64)
        # A multiplier coprime with rows per table: rank -> row.
        self.mult = []
        m = 2654435761
        for t in range(SPARSE):
            k = m + 2 * t
            while math.gcd(k, rows) != 1:
                k += 1
            self.mult.append(k % rows or 1)
        g = torch.Generator().manual_seed(12345)
        self.w_dense = torch.randn(DENSE, generator=g) * 0.5

    def ids(self, step, batch):
        """(26, batch) row ids of batch `step`."""
        import torch

        g = torch.Generator().manual_seed(1_000_003 * step + 7)
        u = torch.rand(SPARSE, batch, generator=g, dtype=torch.float64)
        rank = torch.searchsorted(self.cdf, u).clamp(max=self.args.rows - 1)
        mult = torch.tensor(self.mult, dtype=torch.int64).unsqueeze(1)
        return (rank * mult) % self.args.rows

    def batch(self, step, batch, lo=0, hi=None):
        """Dense features, the sparse KJT and labels of batch `step`,
        samples [lo, hi)."""
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        hi = batch if hi is None else hi
        ids = self.ids(step, batch)
        g = torch.Generator().manual_seed(2_000_029 * step + 11)
        dense = torch.randn(batch, DENSE, generator=g)
        t = torch.arange(SPARSE, dtype=torch.int64).unsqueeze(1)
        effect = (((ids * 40503 + t * 2654435761) % 1000).to(torch.float32) / 1000 - 0.5).sum(0)
        logit = dense @ self.w_dense + effect * 0.4
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        ids = ids[:, lo:hi]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(SPARSE)],
            values=ids.reshape(-1),
            lengths=torch.ones(SPARSE * (hi - lo), dtype=torch.int64),
        )
        return dense[lo:hi], kjt, labels[lo:hi].unsqueeze(1)


def configs(args):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{t}", feature_names=[f"f{t}"])
        for t in range(SPARSE)
    ]


def init_chunks(args, tables=range(SPARSE), first=None):
    """Tables' initial rows, (table, first row, rows), as strata.nn draws
    them for seed --seed (strata.nn.initial_rows, TorchRec's range)."""
    import strata.nn

    bound = math.sqrt(1.0 / args.rows)
    chunk = 1 << 16
    for t in tables:
        for start in range(0, args.rows if first is None else first, chunk):
            stop = min(args.rows, start + chunk)
            yield t, start, strata.nn.initial_rows(args.seed, t, args.dim, start, stop, -bound, bound)


# -- one configuration (its own process) -------------------------------------


def vm(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def auc(scores, labels):
    """Area under the ROC curve (ties averaged), by ranks."""
    import torch

    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=scores.dtype)
    # Average ranks over ties.
    uniq, inv, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    sums = torch.zeros(uniq.numel(), dtype=scores.dtype).index_add_(0, inv, ranks)
    ranks = (sums / counts)[inv]
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def build(args, name, rank=0, world=1):
    """The model and its tables' collection for configuration `name`."""
    import torch
    import torchrec
    from torchrec.models.dlrm import DLRM

    cfgs = configs(args)
    if name == "torchrec":
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        ebc = FusedEmbeddingBagCollection(
            tables=cfgs,
            optimizer_type=torchrec.optim.RowWiseAdagrad,
            optimizer_kwargs={"lr": args.lr, "eps": 1e-8},
            device=torch.device("cpu"),
        )
        weights = {c.name: ebc.embedding_bags[c.name].weight for c in cfgs}
        with torch.no_grad():
            for t, start, rows in init_chunks(args):
                weights[f"t{t}"][start : start + rows.shape[0]].copy_(rows)
    else:
        import strata.nn

        kw = dict(optimizer="rowwise_adagrad", lr=args.lr, eps=1e-8, seed=args.seed)
        if name in LIMITED:
            kw.update(fast_bytes=args.fast_bytes, nvme_path=args.dir)
        if name == "strata-nvme-rows":
            # The fast tier's whole pages, shared equally by the tables.
            kw.update(row_cache=(args.fast_bytes // PAGE // SPARSE) * (PAGE // (args.dim * 4)),
                      row_cache_policy=args.row_cache_policy)
        if name == "strata-dram-2p":
            kw.update(sharding=args.sharding)
        ebc = strata.nn.EmbeddingBagCollection(cfgs, **kw)
    torch.manual_seed(args.seed)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[512, 256, args.dim],
        over_arch_layer_sizes=[512, 256, 1],
    )
    return model, ebc


def check_rows(args, name, ebc):
    """A few rows of the first and last tables against their initial draw."""
    import torch

    if name == "strata-dram-2p":
        return  # a rank holds shards: the sharding tests check their rows
    for t, _, rows in init_chunks(args, (0, SPARSE - 1), first=1):
        rows = rows[:4]
        if name == "torchrec":
            got = ebc.embedding_bags[f"t{t}"].weight[:4].detach()
        else:
            got = ebc.tables[t].read_rows(torch.arange(4))
        if not torch.equal(got, rows):
            raise SystemExit(f"{name}: table t{t} does not start with the shared initial rows")


def worker(args):
    import torch

    name, rank, world = args.worker, args.rank, args.world
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    data = Data(args)
    t0 = time.perf_counter()
    model, ebc = build(args, name, rank, world)
    check_rows(args, name, ebc)
    built = time.perf_counter() - t0
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # The dense arches under DDP; the tables are sharded, not replicated.
        model.dense_arch = DistributedDataParallel(model.dense_arch)
        model.over_arch = DistributedDataParallel(model.over_arch)
    dense = [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]
    opt = torch.optim.Adagrad(dense, lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    if args.limit:
        apply_limit(args.limit)
    per = args.batch // world
    lo, hi = rank * per, (rank + 1) * per
    io0 = cgroup_stat()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and hasattr(ebc, "reset_stats"):
            ebc.reset_stats()
        dense_x, kjt, labels = data.batch(step, args.batch, lo, hi)
        t = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(dense_x, kjt), labels)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t
        if step >= args.warmup:
            times.append(dt)
            losses.append(loss.item())
    stats = ebc.stats() if hasattr(ebc, "stats") else {}
    # Evaluation: the held-out batches, whole, on every rank.
    scores, labels_all, eval_losses = [], [], []
    with torch.no_grad():
        for k in range(args.eval_batches):
            step = 10_000_000 + k
            if world > 1:
                dense_x, kjt, labels = data.batch(step, args.batch, lo, hi)
            else:
                dense_x, kjt, labels = data.batch(step, args.batch)
            out = model(dense_x, kjt)
            eval_losses.append(loss_fn(out, labels).item() * labels.numel())
            scores.append(out.reshape(-1))
            labels_all.append(labels.reshape(-1))
    s, y = torch.cat(scores), torch.cat(labels_all)
    if world > 1:
        import torch.distributed as dist

        gs = [torch.empty_like(s) for _ in range(world)]
        gy = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(gs, s)
        dist.all_gather(gy, y)
        s, y = torch.cat(gs), torch.cat(gy)
    eval_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(s, y))
    io1 = cgroup_stat()
    res = {
        "config": name,
        "rank": rank,
        "world": world,
        "build_seconds": built,
        "step_seconds": statistics.median(times),
        "samples_per_second": args.batch / statistics.median(times),
        "train_loss_last": statistics.mean(losses[-5:]),
        "eval_loss": eval_loss,
        "auc": auc(s, y),
        "peak_rss_bytes": vm("VmHWM"),
        "hit_rate": stats.get("hit_rate"),
        "cgroup_end": {k: io1.get(k) for k in ("total_rss", "total_cache", "total_mapped_file")},
        "major_faults": io1.get("total_pgmajfault", 0) - io0.get("total_pgmajfault", 0),
        "refaults": io1.get("total_workingset_refault_file", io1.get("total_workingset_refault", 0))
        - io0.get("total_workingset_refault_file", io0.get("total_workingset_refault", 0)),
    }
    print("RESULT " + json.dumps(res), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def lookups_worker(args):
    """Pooled forward alone: torchrec.EmbeddingBagCollection against strata.nn."""
    import torch
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import strata.nn

    out = []
    data = Data(args)
    for pooling in ("sum", "mean"):
        for weighted in (False, True):
            if weighted and pooling == "mean":
                continue  # per-sample weights pool sums (torch and TorchRec alike)
            cfgs = [
                EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{t}",
                                   feature_names=[f"f{t}"], pooling=PoolingType[pooling.upper()])
                for t in range(SPARSE)
            ]
            if args.worker == "torchrec":
                ebc = torchrec.EmbeddingBagCollection(tables=cfgs, is_weighted=weighted, device=torch.device("cpu"))
            else:
                ebc = strata.nn.EmbeddingBagCollection(cfgs, is_weighted=weighted)
            times = []
            n = args.lookup_pooling
            for step in range(args.warmup + args.steps):
                ids = torch.cat([data.ids(step * n + j, args.batch) for j in range(n)], dim=1)
                g = torch.Generator().manual_seed(step)
                kjt = KeyedJaggedTensor.from_lengths_sync(
                    keys=[f"f{t}" for t in range(SPARSE)],
                    values=ids.reshape(-1),
                    lengths=torch.full((SPARSE * args.batch,), n, dtype=torch.int64),
                    weights=torch.rand(ids.numel(), generator=g) if weighted else None,
                )
                t0 = time.perf_counter()
                with torch.no_grad():
                    ebc(kjt).values()
                if step >= args.warmup:
                    times.append(time.perf_counter() - t0)
            out.append({"pooling": pooling, "weighted": weighted,
                        "lookups_per_second": SPARSE * args.batch * n / statistics.median(times)})
            del ebc
    print("RESULT " + json.dumps({"config": args.worker, "lookups": out}), flush=True)
    os._exit(0)


# -- the parent ----------------------------------------------------------------


def child_args(args, name):
    keep = ["rows", "dim", "alpha", "batch", "steps", "warmup", "eval_batches", "lr", "seed",
            "dir", "sharding", "mode", "lookup_pooling", "fast_bytes", "row_cache_policy"]
    out = []
    for k in keep:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out + ["--worker", name]


def run_one(args, name, trial):
    """One trial of one configuration: its processes, in a cgroup of their own."""
    world = 2 if name == "strata-dram-2p" else 1
    limit = args.limit if name in LIMITED else 0
    rendezvous = Path(args.dir) / f"rendezvous-{os.getpid()}-{trial}"
    rendezvous.unlink(missing_ok=True)
    drop_caches()
    results = []
    with Group(f"strata-dlrm-{os.getpid()}-{name}-{trial}") as group:
        procs = []
        for r in range(world):
            cmd = [sys.executable, __file__] + child_args(args, name) + [
                "--rank", str(r), "--world", str(world), "--rendezvous", str(rendezvous), "--limit", str(limit)]
            procs.append(subprocess.Popen(group.wrap(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            so, se = p.communicate()
            res = None
            for line in so.splitlines():
                if line.startswith("RESULT "):
                    res = json.loads(line[7:])
            if res is None:
                res = {"config": name, "error": f"rc {p.returncode}: {se.strip()[-600:]}"}
            results.append(res)
    rendezvous.unlink(missing_ok=True)
    res = dict(results[0])
    res.update(trial=trial, limit_bytes=limit or None, cgroup_failcnt=group.failcnt, cgroup_peak_bytes=group.peak)
    if world > 1 and all("error" not in r for r in results):
        res["peak_rss_bytes_per_rank"] = [r["peak_rss_bytes"] for r in results]
        res["hit_rate"] = None
    return res


def static_optimum(args):
    """The best fixed placement for the strata-nvme fast tier: the share of
    lookups the most-read rows (and the most-read 4 KiB pages) fitting in
    it serve, in hindsight over the timed steps' own ids and, since a
    short stream's hindsight counts every row it read at all, under the
    Zipf law itself (the placement's probability mass: the long-run
    optimum of a fixed placement under independent references)."""
    import torch

    data = Data(args)
    row_bytes = args.dim * 4
    per_page = max(1, PAGE // row_bytes)
    law = {}
    mass = torch.diff(data.cdf, prepend=torch.zeros(1, dtype=torch.float64)) / SPARSE
    # Rows: the same law in every table, so the top ranks of each alike.
    cap = args.fast_bytes // row_bytes
    law["rows"] = float(torch.sort(mass.repeat(SPARSE), descending=True).values[:cap].sum())
    # Pages: each page holds the rows its table's permutation puts there.
    ranks = torch.arange(args.rows, dtype=torch.int64)
    pages = []
    for t in range(SPARSE):
        row = (ranks * data.mult[t]) % args.rows
        pages.append(torch.zeros(-(-args.rows // per_page), dtype=torch.float64).index_add_(0, row // per_page, mass))
    cap = args.fast_bytes // PAGE
    law["pages"] = float(torch.sort(torch.cat(pages), descending=True).values[:cap].sum())
    keys = []
    for step in range(args.warmup, args.warmup + args.steps):
        ids = data.ids(step, args.batch)
        keys.append(ids + torch.arange(SPARSE).unsqueeze(1) * args.rows)
    keys = torch.cat(keys, dim=1).reshape(-1)
    total = keys.numel()
    out = {"law": law}
    for what, unit in (("rows", 1), ("pages", per_page)):
        k = keys // unit if unit > 1 else keys
        _, counts = torch.unique(k, return_counts=True)
        cap = args.fast_bytes // (row_bytes * unit)
        out[what] = float(torch.sort(counts, descending=True).values[:cap].sum()) / total
    return out


def summarize(args, records):
    by = {}
    for r in records:
        by.setdefault(r["config"], []).append(r)
    print(f"\nDLRM, 26 tables x {args.rows} rows x {args.dim} f32 ({table_bytes(args) / 2**30:.2f} GiB), "
          f"batch {args.batch}, Zipf {args.alpha}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.eval_batches} held-out batches; medians over trials [range]")
    print("| configuration | samples/s | eval loss | AUC | peak RSS MiB | hit rate | failcnt | major faults | refaults |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {}
    for name in args.configs:
        rs = [r for r in by.get(name, []) if "error" not in r]
        if name == "torchrec-nvme":
            print("| torchrec-nvme | not run: TorchRec on a CPU has no tier below DRAM (its UVM caches need a GPU) | | | | | | | |")
            continue
        if not rs:
            errs = [r.get("error") for r in by.get(name, [])]
            print(f"| {name} | failed: {errs[:1]} | | | | | | | |")
            continue
        sps = [r["samples_per_second"] for r in rs]
        med[name] = statistics.median(sps)
        rss = statistics.median(r["peak_rss_bytes"] for r in rs) / 2**20
        if "peak_rss_bytes_per_rank" in rs[0]:
            rss_txt = " / ".join(f"{statistics.median(r['peak_rss_bytes_per_rank'][k] for r in rs) / 2**20:.0f}"
                                 for k in range(len(rs[0]["peak_rss_bytes_per_rank"]))) + " (per rank)"
        else:
            rss_txt = f"{rss:.0f}"
        hits = [r["hit_rate"] for r in rs if r.get("hit_rate") is not None]
        hit = f"{statistics.median(hits):.4f}" if hits else ""
        limited = name in LIMITED
        failcnt = max(r["cgroup_failcnt"] or 0 for r in rs) if limited else ""
        majors = statistics.median(r["major_faults"] for r in rs) if limited else ""
        refaults = statistics.median(r["refaults"] for r in rs) if limited else ""
        print(f"| {name} | {med[name]:.0f} [{min(sps):.0f}-{max(sps):.0f}] | "
              f"{statistics.median(r['eval_loss'] for r in rs):.5f} | {statistics.median(r['auc'] for r in rs):.4f} | "
              f"{rss_txt} | {hit} | {failcnt} | {majors} | {refaults} |")
    if "torchrec" in med and "strata-dram" in med:
        print(f"- strata-dram / torchrec samples/s: {med['strata-dram'] / med['torchrec']:.3f}x (target >= 0.9x)")
    for name in LIMITED:
        if name in med and "strata-dram" in med:
            print(f"- {name} / strata-dram samples/s: {med[name] / med['strata-dram']:.3f}x (target >= 0.5x)")
    if "strata-dram-2p" in med and "strata-dram" in med:
        print(f"- 2 processes / 1 process samples/s (this machine's 2 cores): "
              f"{med['strata-dram-2p'] / med['strata-dram']:.3f}x")
    for a, b in (("strata-dram", "torchrec"), ("strata-nvme", "strata-dram"), ("strata-nvme-rows", "strata-dram"),
                 ("strata-dram-2p", "strata-dram")):
        ra = [r for r in by.get(a, []) if "error" not in r]
        rb = [r for r in by.get(b, []) if "error" not in r]
        if ra and rb:
            la = statistics.median(r["eval_loss"] for r in ra)
            lb = statistics.median(r["eval_loss"] for r in rb)
            print(f"- eval loss {a} vs {b}: {100 * (la - lb) / lb:+.2f}% (target within 0.5%)")
    if any(name in args.configs for name in LIMITED):
        opt = static_optimum(args)
        print(f"- strata-nvme's fast tier ({args.fast_bytes / 2**20:.0f} MiB): the best fixed placement serves, "
              f"in hindsight over the timed steps, {opt['rows']:.4f} of the lookups by rows and {opt['pages']:.4f} "
              f"by 4 KiB pages; under the Zipf law {opt['law']['rows']:.4f} by rows and {opt['law']['pages']:.4f} by pages")
        rs = [r for name in LIMITED for r in by.get(name, []) if "error" not in r]
        if rs:
            peak = max(r["cgroup_peak_bytes"] or 0 for r in rs)
            print(f"- strata-nvme's limit {args.limit / 2**20:.0f} MiB (a quarter of the tables), its cgroup's peak "
                  f"{peak / 2**20:.0f} MiB; a failcnt above 0 means the limit reclaimed the process's own pages: "
                  f"raise --footprint")
        return {"static_optimum": opt}
    return {}


def table_bytes(args):
    return SPARSE * args.rows * args.dim * 4


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="torchrec,strata-dram,strata-nvme,torchrec-nvme,strata-dram-2p")
    ap.add_argument("--mode", choices=["train", "lookups"], default="train")
    ap.add_argument("--rows", type=int, default=600_000, help="rows per table (26 tables)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp/strata-dlrm", help="NVMe directory (and rendezvous files)")
    ap.add_argument("--sharding", choices=["table", "row"], default="table")
    ap.add_argument("--slack", type=int, default=256, help="MiB of the limit left to the process beyond its footprint")
    ap.add_argument("--footprint", type=int, default=1200,
                    help="MiB the process holds without its tables (torch, the model, strata's runtime)")
    ap.add_argument("--lookup-pooling", type=int, default=8, help="ids per bag in --mode lookups")
    ap.add_argument("--row-cache-policy", default=None,
                    help="strata-nvme-rows: the row caches' policy (a strata policy name; default: strata's default)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fast-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rows < 1 or args.dim < 1 or args.batch < 2 or args.steps < 1 or args.trials < 1:
        ap.error("--rows, --dim, --steps and --trials must be positive, --batch at least 2")
    if args.worker:
        (lookups_worker if args.mode == "lookups" else worker)(args)
        return
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r} (one of {', '.join(CONFIGS)})")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    # The limit: a quarter of the tables' bytes; the fast tier is what it
    # leaves after the process's own footprint and the slack.
    args.limit = table_bytes(args) // 4
    args.fast_bytes = args.limit - (args.footprint + args.slack) * 2**20
    if args.mode == "train" and any(n in args.configs for n in LIMITED) and args.fast_bytes < 16 * PAGE:
        ap.error(f"a limit of {args.limit >> 20} MiB (a quarter of the tables) leaves no fast tier "
                 f"after {args.footprint} + {args.slack} MiB: use more --rows")
    records = []
    run = [c for c in args.configs if c != "torchrec-nvme"]
    if args.mode == "lookups":
        run = [c for c in ("torchrec", "strata-dram") if c in run]
    for trial in range(args.trials):
        order = run[trial % len(run):] + run[: trial % len(run)]
        for name in order:
            if args.mode == "lookups":
                r = run_lookups(args, name, trial)
            else:
                r = run_one(args, name, trial)
            records.append(r)
            brief = r.get("error") or (
                f"{r['samples_per_second']:.0f} samples/s, eval loss {r['eval_loss']:.5f}, AUC {r['auc']:.4f}, "
                f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
                + (f", hit rate {r['hit_rate']:.4f}" if r.get("hit_rate") is not None else "")
                if args.mode == "train" else json.dumps(r.get("lookups")))
            print(f"trial {trial + 1} {name}: {brief}", flush=True)
    extra = summarize_lookups(records) if args.mode == "lookups" else summarize(args, records)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "records": records, **(extra or {})}, indent=1))


def run_lookups(args, name, trial):
    cmd = [sys.executable, __file__] + child_args(args, name)
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["trial"] = trial
            return r
    return {"config": name, "trial": trial, "error": f"rc {p.returncode}: {p.stderr.strip()[-600:]}"}


def summarize_lookups(records):
    print("\n| pooling | weighted | torchrec.EmbeddingBagCollection lookups/s | strata.nn lookups/s | strata / torchrec |")
    print("|---|---|---|---|---|")
    cell = {}
    for r in records:
        for x in r.get("lookups", []):
            cell.setdefault((x["pooling"], x["weighted"], r["config"]), []).append(x["lookups_per_second"])
    for pooling, weighted in (("sum", False), ("sum", True), ("mean", False)):
        a = cell.get((pooling, weighted, "torchrec"))
        b = cell.get((pooling, weighted, "strata-dram"))
        if a and b:
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"| {pooling} | {weighted} | {ma:.3e} [{min(a):.3e}-{max(a):.3e}] | "
                  f"{mb:.3e} [{min(b):.3e}-{max(b):.3e}] | {mb / ma:.3f}x (target >= 1.0x) |")
    return {}


if __name__ == "__main__":
    main()
