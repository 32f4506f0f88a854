"""What the Python binding adds to an optimizer step (the target:
at most 5% over calling the Rust optimizer directly, ~17 M parameters,
states in DRAM).

Interleaved over --trials, in one process per configuration where it
matters:
  rust      `strata bench optim --params N --tier host --steps S --json`:
            the Rust OffloadedAdam's own step time (its `step_seconds`),
            the aliased fp32 step (the weights are their own master);
  binding   strata._strata.OffloadedAdam.step(grads, weights,
            in_place=True, alias=True) called from Python, the same
            aliased step on the caller's array (what strata.optim.AdamW
            runs for a float32 parameter): wall time of the call, and the
            step's own time it reports;
  adamw     strata.optim.AdamW.step() on one float32 torch parameter of N
            elements (wall), where torch is installed.
Weights and gradients follow `strata bench optim`'s patterns, so every
configuration runs the same step on the same values.

Set-up: tests/run.sh builds target/pyenv with the package and torch, and
`cargo build --release` the CLI. Run from the repository root:
  target/pyenv/bin/python benches/peers/optim_binding.py [--params N] [--steps S] [--trials T]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import strata
import strata._strata


def patterns(n):
    i = np.arange(n, dtype=np.int64)
    w = ((i % 1000).astype(np.float32)) * np.float32(1e-3)
    g = ((((i * 7) % 13).astype(np.float32)) - np.float32(6.0)) * np.float32(1e-3)
    return w, g


def rust(cli, n, steps):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "optim.json")
        subprocess.run(
            [cli, "bench", "optim", "--params", str(n), "--tier", "host",
             "--steps", str(steps), "--quiet", "--json", out],
            check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["step_seconds"]


def binding(n, steps):
    w, g = patterns(n)
    adam = strata._strata.OffloadedAdam(w, tier="host")
    # Untimed, as the CLI's first step; aliased from the first step on.
    adam.step(g, w, in_place=True, alias=True)
    walls, own = [], []
    for _ in range(steps):
        t = time.perf_counter()
        st = adam.step(g, w, in_place=True, alias=True)
        walls.append(time.perf_counter() - t)
        own.append(st["seconds"])
    return statistics.mean(walls), statistics.mean(own)


def adamw(n, steps):
    import torch
    import strata.optim
    w, g = patterns(n)
    p = torch.nn.Parameter(torch.from_numpy(w.copy()))
    p.grad = torch.from_numpy(g.copy())
    opt = strata.optim.AdamW([p], lr=1e-3, weight_decay=0.0)
    opt.step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        walls.append(time.perf_counter() - t)
    return statistics.mean(walls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=16_777_216)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cli", default="target/release/strata")
    a = ap.parse_args()
    if not os.access(a.cli, os.X_OK):
        sys.exit(f"{a.cli} is not built: cargo build --release")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    rows = {k: [] for k in ["rust", "binding", "binding own", "adamw"]}
    for trial in range(a.trials):
        rows["rust"].append(rust(a.cli, a.params, a.steps))
        wall, own = binding(a.params, a.steps)
        rows["binding"].append(wall)
        rows["binding own"].append(own)
        if have_torch:
            rows["adamw"].append(adamw(a.params, a.steps))
        print(f"trial {trial + 1}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.2f} ms" for k, v in rows.items() if v), flush=True)
    base = statistics.median(rows["rust"])
    print(f"\n{a.params} parameters, states in host memory, {a.steps} timed steps x {a.trials} trials")
    print("| configuration | step (median of trials) | ÷ rust | every trial |")
    print("|---|---|---|---|")
    for k, v in rows.items():
        if not v:
            continue
        m = statistics.median(v)
        trials = ", ".join(f"{x * 1e3:.2f}" for x in v)
        print(f"| {k} | {m * 1e3:.2f} ms | {m / base:.3f}× | {trials} |")


if __name__ == "__main__":
    main()
