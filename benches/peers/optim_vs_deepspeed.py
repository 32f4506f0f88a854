"""strata.optim against DeepSpeed's offloaded optimizers on one machine.

Set-up (not run by CI; DeepSpeed and torch in their own virtual environment):
  python -m pip install torch deepspeed     # DeepSpeed 0.19.x; check torch is not replaced
  apt-get install -y libaio-dev            # for DeepSpeed's async I/O op (ZeRO-Infinity)
  python -m pip install --no-deps <strata wheel built by `maturin build --release` in python/>
  export DS_ACCELERATOR=cpu                # on a machine without a GPU
  export TORCH_EXTENSIONS_DIR=<a git-ignored folder, e.g. target/torch_extensions>
  export PATH=<venv>/bin:$PATH             # DeepSpeed's JIT build needs `ninja` on PATH
DeepSpeed builds its cpu_adam and async_io ops on first use (minutes).
Tune DeepSpeed's aio settings for the swap directory with its own tool and
pass the JSON it prints with --aio:
  ds_nvme_tune --nvme_dir SWAP --flush_page_cache      # prints {"aio": {...}}

Run (as root for --drop-caches):
  python benches/peers/optim_vs_deepspeed.py --size 17m --swap SWAP --aio aio.json \
      --trials 3 --drop-caches --json out.json

Configurations (each trial runs each in its own process, in an order
shuffled by --seed, a new one each trial):
  torch-adamw        torch.optim.AdamW (its default implementation: foreach), DRAM
  strata-host        strata.optim.AdamW(tier="host")
  ds-cpuadam         deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True) used as a
                     plain torch optimizer (the kernel ZeRO-Offload runs); with
                     --dtype bf16 on the bf16 parameters themselves (fp32 moments,
                     no fp32 master: less precise than the others)
  ds-cpuadam-master  --dtype bf16 only: DeepSpeedCPUAdam on fp32 master copies,
                     the gradients copied in and the masters copied back into the
                     bf16 parameters inside the timed step (what ZeRO-Offload does
                     with bf16; the like-for-like peer of strata-host)
  zero-offload       DeepSpeed engine, ZeRO-2, offload_optimizer {device: cpu}
  strata-nvme        strata.optim.AdamW(tier="nvme", nvme_path=SWAP)
  zero-infinity      DeepSpeed engine, ZeRO-3, offload_optimizer {device: nvme,
                     nvme_path: SWAP}, aio from --aio
  strata-importance  strata.optim.AdamW(tier="host", importance=(FRACTION, EVERY))
  zenflow            DeepSpeed engine, ZeRO-2, offload_optimizer cpu, zenflow
                     {topk_ratio: FRACTION, update_interval: EVERY, select_strategy:
                     step, select_interval: EVERY, overlap_step: --zenflow-overlap}

--dtype bf16: the model's parameters, inputs and gradients in bf16 (the
DeepSpeed engines with their "bf16" section; torch AdamW steps the bf16
parameters directly), strata's fp32 masters in its tier.

Every configuration trains the same model (a stack of bias-free Linear layers
with GELU between them, fp32 or --dtype, seeded) on the same batches (seeded per step)
with the same AdamW hyper-parameters; the first --warmup steps are not timed.
What each figure is:
  step       wall time of the optimizer step alone: opt.step() (torch, strata,
             ds-cpuadam) or engine.step() (DeepSpeed engines). DeepSpeed's engines
             do part of their optimizer work inside backward (ZeRO-2 copies each
             gradient into its fp32 CPU partition in backward hooks; ZenFlow
             selects columns and updates the important ones there), so
  iter       forward + backward + step, is also given; it is the figure to
             compare ZenFlow with (its step() does almost nothing between updates).
  read/written per step: /proc/self/io read_bytes / write_bytes deltas around
             the step (the whole process, all threads; storage I/O only, the page
             cache does not count); for strata also the bytes its optimizer reports.
  peak RSS   VmHWM of the process at its end (model, data, gradients and the
             optimizer's memory together); base RSS is VmRSS after building the
             model and before the optimizer, for scale.
  loss       training loss of each step; eval = loss on a fixed held-out batch
             after the last step.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import cgroups

SIZES = {
    # name: (width, layers) -> width*width*layers parameters
    "17m": (2048, 4),    # 16,777,216
    "130m": (4096, 8),   # 134,217,728
}
ALL = ["torch-adamw", "strata-host", "ds-cpuadam", "ds-cpuadam-master", "zero-offload",
       "strata-nvme", "zero-infinity", "strata-importance", "zenflow"]
DEEPSPEED = {"ds-cpuadam", "ds-cpuadam-master", "zero-offload", "zero-infinity", "zenflow"}
# Configurations that exist only for low-precision parameters.
LOW_PRECISION_ONLY = {"ds-cpuadam-master"}


# ---------------------------------------------------------------- child side

def proc_io():
    out = cgroups.proc_io()
    return out["read_bytes"], out["write_bytes"]


def proc_status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def build_model(torch, width, layers):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width, bias=False))
        if i + 1 < layers:
            mods.append(torch.nn.GELU())
    model = torch.nn.Sequential(*mods)
    with torch.no_grad():
        for m in model:
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, width ** -0.5)
    return model


def batch(torch, step, n, width):
    """Inputs and targets of one step: the target is a fixed nonlinear
    function of the input (tanh of each feature), which the model
    can learn; the same for every configuration."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, width, generator=g)
    return x, torch.tanh(x)


def descendants(pid):
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for c in f.read().split():
                    out.append(int(c))
                    out.extend(descendants(int(c)))
    except OSError:
        pass
    return out


def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemory:
    """Peak proportional set size of this process and its descendants,
    sampled every 0.2 s while any descendant lives (ZenFlow's overlap_step
    runs its CPU optimizer in a child process, whose memory VmHWM of this
    process does not see)."""

    def __init__(self):
        import threading
        self.peak = 0
        self.seen_children = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        me = os.getpid()
        while not self._stop.wait(0.2):
            kids = descendants(me)
            if kids:
                self.seen_children = True
                self.peak = max(self.peak, pss(me) + sum(pss(k) for k in kids))

    def stop(self):
        self._stop.set()
        self._t.join()


class Recorder:
    """Forwards to a strata._strata.OffloadedAdam and keeps the stats its
    step() returns (strata.optim.AdamW does not keep them)."""

    def __init__(self, inner, sink):
        self._inner = inner
        self._sink = sink

    def step(self, *a, **k):
        st = self._inner.step(*a, **k)
        self._sink.append(st)
        return st

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self):
        return len(self._inner)


def ds_config(a, name):
    hyper = {"lr": a.lr, "betas": [a.beta1, a.beta2], "eps": a.eps,
             "weight_decay": a.weight_decay}
    cfg = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": hyper},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if name == "zero-offload":
        cfg["zero_optimization"] = {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        }
    elif name == "zenflow":
        cfg["zero_optimization"] = {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": {
                "topk_ratio": a.fraction,
                "select_strategy": "step",
                "select_interval": a.every,
                "update_interval": a.every,
                "full_warm_up_rounds": 0,
                "overlap_step": a.zenflow_overlap,
            },
        }
    elif name == "zero-infinity":
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": a.swap,
                                  "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False},
            "sub_group_size": int(1e9),
        }
        if a.aio:
            with open(a.aio) as f:
                aio = json.load(f)
            aio = aio.get("aio", aio)
            # ds_nvme_tune prints num_threads; the aio section calls it
            # intra_op_parallelism.
            if "num_threads" in aio:
                aio["intra_op_parallelism"] = aio.pop("num_threads")
            for k in ("single_submit", "overlap_events"):
                if isinstance(aio.get(k), str):
                    aio[k] = aio[k].lower() == "true"
            cfg["aio"] = aio
    return cfg


def child(a):
    import resource
    import torch

    width, layers = SIZES[a.size]
    model = build_model(torch, width, layers)
    nparams = sum(p.numel() for p in model.parameters())
    name = a.child
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if name in LOW_PRECISION_ONLY and dtype == torch.float32:
        raise SystemExit(f"{name} is for --dtype bf16 (in fp32 it is ds-cpuadam)")
    if name not in DEEPSPEED - {"ds-cpuadam", "ds-cpuadam-master"}:
        # The engines convert the model themselves (their "bf16" section).
        model = model.to(dtype)
    masters = None
    hyper = dict(lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
    base_rss = proc_status("VmRSS")
    tree = TreeMemory()
    strata_stats = []
    engine = opt = None
    t_init = time.perf_counter()
    if name == "torch-adamw":
        opt = torch.optim.AdamW(model.parameters(), **hyper)
    elif name.startswith("strata-"):
        import strata.optim
        inner = strata.optim.OffloadedAdam
        strata.optim.OffloadedAdam = lambda *x, **k: Recorder(inner(*x, **k), strata_stats)
        kw = {}
        if name == "strata-host":
            kw["tier"] = "host"
        elif name == "strata-nvme":
            kw.update(tier="nvme", nvme_path=a.swap)
        elif name == "strata-importance":
            kw.update(tier="host", importance=(a.fraction, a.every))
        opt = strata.optim.AdamW(model.parameters(), **hyper, **kw)
    elif name == "ds-cpuadam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(model.parameters(), **hyper, adamw_mode=True)
    elif name == "ds-cpuadam-master":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        opt = DeepSpeedCPUAdam(masters, **hyper, adamw_mode=True)
    else:
        import deepspeed
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(a, name))
    init_s = time.perf_counter() - t_init

    rec = {"config": name, "size": a.size, "dtype": a.dtype, "params": nparams, "base_rss": base_rss,
           "init_seconds": init_s, "step": [], "iter": [], "fwd_bwd": [], "read": [],
           "written": [], "iter_read": [], "iter_written": [], "loss": [],
           "strata_read": [], "strata_written": [], "strata_io_wait": [],
           "strata_seconds": []}
    total = a.warmup + a.steps
    for i in range(total):
        x, y = batch(torch, i, a.batch, width)
        r0, w0 = proc_io()
        t0 = time.perf_counter()
        x = x.to(dtype)
        if engine is not None:
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
        else:
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
        t1 = time.perf_counter()
        r1, w1 = proc_io()
        del strata_stats[:]
        if engine is not None:
            engine.step()
        elif masters is not None:
            # ZeRO-Offload's bf16 step: gradients into the fp32 masters,
            # the kernel on them, the masters back into the parameters.
            with torch.no_grad():
                for p, w in zip(model.parameters(), masters):
                    w.grad = p.grad.float()
                opt.step()
                for p, w in zip(model.parameters(), masters):
                    p.copy_(w)
            model.zero_grad()
        else:
            opt.step()
        t2 = time.perf_counter()
        r2, w2 = proc_io()
        if opt is not None:
            opt.zero_grad()
        rec["loss"].append(float(loss.item()))
        if i < a.warmup:
            continue
        rec["step"].append(t2 - t1)
        rec["iter"].append(t2 - t0)
        rec["fwd_bwd"].append(t1 - t0)
        rec["read"].append(r2 - r1)
        rec["written"].append(w2 - w1)
        rec["iter_read"].append(r2 - r0)
        rec["iter_written"].append(w2 - w0)
        if strata_stats:
            rec["strata_read"].append(sum(s["bytes_read"] for s in strata_stats))
            rec["strata_written"].append(sum(s["bytes_written"] for s in strata_stats))
            rec["strata_io_wait"].append(sum(s["io_wait_seconds"] for s in strata_stats))
            rec["strata_seconds"].append(sum(s["seconds"] for s in strata_stats))
    with torch.no_grad():
        x, y = batch(torch, 10 ** 6, a.batch, width)
        x = x.to(dtype)
        out = engine(x) if engine is not None else model(x)
        rec["eval_loss"] = float(torch.nn.functional.mse_loss(out.float(), y).item())
    tree.stop()
    rec["peak_rss"] = proc_status("VmHWM")
    rec["tree_peak_pss"] = tree.peak if tree.seen_children else None
    rec["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec["versions"] = {"torch": torch.__version__}
    if name in DEEPSPEED:
        import deepspeed
        rec["versions"]["deepspeed"] = deepspeed.__version__
    return rec


# --------------------------------------------------------------- parent side

def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def clear_swap(swap):
    for entry in os.listdir(swap):
        path = os.path.join(swap, entry)
        subprocess.run(["rm", "-rf", "--", path], check=True)


def run_child(a, name, passthrough):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rec.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name,
               "--child-out", out] + passthrough
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = p.stdout.strip().splitlines()[-40:]
        return {"config": name, "size": a.size, "error": "\n".join(tail), "rc": p.returncode}


def med(v):
    return statistics.median(v) if v else float("nan")


def summarize(recs):
    """Per configuration: the median over trials of each trial's median."""
    out = {}
    for name in ALL:
        rs = [r for r in recs if r["config"] == name]
        if not rs:
            continue
        ok = [r for r in rs if "error" not in r]
        s = {"trials": len(rs), "failed": len(rs) - len(ok)}
        if not ok:
            s["error"] = rs[0]["error"]
            out[name] = s
            continue
        per = lambda k: [med(r[k]) for r in ok if r[k]]  # noqa: E731
        for k in ("step", "iter", "fwd_bwd"):
            v = per(k)
            s[k] = med(v)
            s[k + "_trials"] = v
            all_steps = [x for r in ok for x in r[k]]
            s[k + "_min"] = min(all_steps)
            s[k + "_max"] = max(all_steps)
            # Windowed configurations (importance, ZenFlow) do their work
            # on some steps only: the mean over whole windows is their cost.
            s[k + "_mean"] = med([statistics.mean(r[k]) for r in ok])
        for k in ("read", "written", "iter_read", "iter_written", "strata_read",
                  "strata_written", "strata_io_wait", "strata_seconds"):
            v = [med(r[k]) for r in ok if r.get(k)]
            if v:
                s[k] = med(v)
        s["peak_rss"] = max(r["peak_rss"] for r in ok)
        s["base_rss"] = med([r["base_rss"] for r in ok])
        tree = [r["tree_peak_pss"] for r in ok if r.get("tree_peak_pss")]
        if tree:
            s["tree_peak_pss"] = max(tree)
        s["eval_loss"] = med([r["eval_loss"] for r in ok])
        s["final_loss"] = med([r["loss"][-1] for r in ok])
        s["loss_curve"] = ok[0]["loss"]
        s["params"] = ok[0]["params"]
        s["versions"] = ok[0]["versions"]
        out[name] = s
    return out


def mb(x):
    return f"{x / 2 ** 20:.1f}"


def table(summary, a):
    lines = [f"model {a.size} ({next(iter(summary.values())).get('params', '?')} parameters, "
             f"{getattr(a, 'dtype', 'fp32')}), "
             f"batch {a.batch}, {a.warmup} warm-up + {a.steps} timed steps x {a.trials} trials; "
             "step and iter: median of the trials' medians [min-max over every timed step]"]
    lines.append("| configuration | step ms | step mean ms | iter ms | iter mean ms | read MiB/step | written MiB/step | "
                 "strata read/written MiB | peak RSS MiB (base) | final loss | eval loss |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        if "error" in s:
            err = s["error"].strip().splitlines()[-1] if s["error"].strip() else "?"
            lines.append(f"| {name} | failed: {err[:160]} | | | | | | | | | |")
            continue
        st = ""
        if "strata_read" in s:
            st = f"{mb(s['strata_read'])} / {mb(s['strata_written'])}"
        rss = f"{mb(s['peak_rss'])} ({mb(s['base_rss'])})"
        if s.get("tree_peak_pss", 0) > s["peak_rss"]:
            rss += f"; with child processes (PSS) {mb(s['tree_peak_pss'])}"
        lines.append(
            f"| {name} | {s['step'] * 1e3:.1f} [{s['step_min'] * 1e3:.1f}-{s['step_max'] * 1e3:.1f}] "
            f"| {s['step_mean'] * 1e3:.1f} "
            f"| {s['iter'] * 1e3:.1f} [{s['iter_min'] * 1e3:.1f}-{s['iter_max'] * 1e3:.1f}] "
            f"| {s['iter_mean'] * 1e3:.1f} "
            f"| {mb(s['read'])} | {mb(s['written'])} | {st} "
            f"| {rss} | {s['final_loss']:.5f} | {s['eval_loss']:.5f} |")
    return "\n".join(lines)


def targets(summary):
    def ratio(x, y, k="step"):
        if x in summary and y in summary and k in summary[x] and k in summary[y]:
            return summary[x][k] / summary[y][k]
        return None

    rows = []

    def row(what, r, limit):
        if r is None:
            rows.append(f"- {what}: not measured (a configuration failed or was not run)")
        else:
            rows.append(f"- {what}: {r:.3f}x (target <= {limit}x): "
                        + ("met" if r <= limit else "NOT met"))

    row("strata-nvme step / zero-infinity step", ratio("strata-nvme", "zero-infinity"), 0.6)
    row("strata-nvme peak RSS / zero-infinity peak RSS",
        ratio("strata-nvme", "zero-infinity", "peak_rss"), 0.5)
    row("strata-host step / zero-offload step (engine.step)", ratio("strata-host", "zero-offload"), 0.8)
    row("strata-host step / ds-cpuadam step (the kernel alone)", ratio("strata-host", "ds-cpuadam"), 1.0)
    if "ds-cpuadam-master" in summary:
        row("strata-host step / ds-cpuadam-master step (bf16 parameters, fp32 masters copied)",
            ratio("strata-host", "ds-cpuadam-master"), 1.0)
    row("strata-host step / torch-adamw step", ratio("strata-host", "torch-adamw"), 0.2)
    row("strata-importance iter mean / zenflow iter mean",
        ratio("strata-importance", "zenflow", "iter_mean"), 0.7)
    row("strata-importance step mean / zenflow step mean (step() only; ZenFlow works in backward)",
        ratio("strata-importance", "zenflow", "step_mean"), 0.7)
    for ref in ("zenflow", "torch-adamw", "strata-host"):
        if "strata-importance" in summary and ref in summary and "eval_loss" in summary[ref] \
                and "eval_loss" in summary["strata-importance"]:
            x = summary["strata-importance"]["eval_loss"]
            y = summary[ref]["eval_loss"]
            d = abs(x - y) / y
            rows.append(f"- strata-importance eval loss vs {ref}: {x:.5f} vs {y:.5f}, "
                        f"{d * 100:.2f}% apart (target <= 1%): " + ("met" if d <= 0.01 else "NOT met"))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="17m")
    ap.add_argument("--configs", default=",".join(ALL))
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the model's parameters (strata and DeepSpeed keep fp32 masters)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--fraction", type=float, default=0.1, help="importance / ZenFlow top-k share")
    ap.add_argument("--every", type=int, default=4, help="importance / ZenFlow update interval")
    ap.add_argument("--zenflow-overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="ZenFlow's overlap_step (its tutorial's setting: on)")
    ap.add_argument("--swap", default=None, help="swap directory for both NVMe configurations")
    ap.add_argument("--aio", default=None, help="JSON with DeepSpeed's aio section (ds_nvme_tune's output)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--json", default=None, help="write every record and the summary here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the configuration order")
    ap.add_argument("--summarize", default=None, help="print the tables of a saved --json file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        try:
            rec = child(a)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        with open(a.child_out, "w") as f:
            json.dump(rec, f)
        return

    if a.summarize:
        with open(a.summarize) as f:
            saved = json.load(f)
        for k in ("size", "batch", "warmup", "steps", "trials"):
            setattr(a, k, saved["args"][k])
        a.dtype = saved["args"].get("dtype", "fp32")
        summary = summarize(saved["records"])
        print(table(summary, a))
        print()
        print(targets(summary))
        return

    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        if c not in ALL:
            sys.exit(f"unknown configuration {c!r} (known: {', '.join(ALL)})")
    if any(c in ("strata-nvme", "zero-infinity") for c in configs):
        if not a.swap:
            sys.exit("--swap DIR is needed for strata-nvme and zero-infinity")
        os.makedirs(a.swap, exist_ok=True)
    if a.steps < 1:
        sys.exit("--steps must be at least 1")
    passthrough = []
    if a.dtype == "fp32" and any(c in LOW_PRECISION_ONLY for c in configs):
        sys.exit(f"{', '.join(sorted(LOW_PRECISION_ONLY))}: only with --dtype bf16")
    for k in ("size", "dtype", "warmup", "steps", "batch", "lr", "beta1", "beta2", "eps",
              "weight_decay", "fraction", "every"):
        passthrough += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    passthrough.append("--zenflow-overlap" if a.zenflow_overlap else "--no-zenflow-overlap")
    if a.swap:
        passthrough += ["--swap", a.swap]
    if a.aio:
        passthrough += ["--aio", os.path.abspath(a.aio)]

    rng = random.Random(a.seed)
    recs = []
    for trial in range(a.trials):
        order = configs[:]
        rng.shuffle(order)
        for name in order:
            if a.swap:
                clear_swap(a.swap)
            if a.drop_caches:
                drop_caches()
            load = os.getloadavg()[0]
            r = run_child(a, name, passthrough)
            r["trial"] = trial
            r["load_before"] = load
            recs.append(r)
            if "error" in r:
                msg = f"FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else r.get('rc')}"
            else:
                msg = (f"step {med(r['step']) * 1e3:.1f} ms, iter {med(r['iter']) * 1e3:.1f} ms, "
                       f"read {mb(med(r['read']))} MiB, written {mb(med(r['written']))} MiB, "
                       f"peak RSS {mb(r['peak_rss'])} MiB, eval loss {r['eval_loss']:.5f}")
            print(f"trial {trial + 1} {name} (load {load:.2f}): {msg}", flush=True)
    if a.swap:
        clear_swap(a.swap)
    summary = summarize(recs)
    print()
    print(table(summary, a))
    print()
    print(targets(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "records": recs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
