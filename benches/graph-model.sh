#!/usr/bin/env bash
# The device model's runs: `strata bench graph` on the simulated
# device (modelled GPU time, platform presets of
# benches/strata-bench/src/workloads/graph/model.rs), and markdown tables of
# what they say.
#
# usage: benches/graph-model.sh DIR [train|heldout|calibration|all] [TRIALS]
#   (default: all, 3 trials; JSON reports are written to DIR, tables to
#   stdout; an existing report in DIR is reused, not rerun)
#
# The split (fixed): strata's graph-bench settings (the promotion threshold,
# the policy's repeats, the balancer's CPU share) were chosen on `train`;
# `heldout` is for the report and is never tuned on.
#   train:       kron:19 at 25% and 50%, every kernel, strata beside
#                zero-copy and the static optimum;
#   heldout:     kron:22 at 25% and 50%, every kernel, every configuration;
#                PageRank and CC at 100% (the cold-start target);
#   calibration: the closest configurations to published figures
#                (v100-pcie3: EMOGI's zero-copy against optimized UVM at a
#                budget of half the graph; Unified Memory at 110% and 125%
#                oversubscription against none, as UVMBench measures).
#
# Environment: STRATA (the binary; default: built here with
# `cargo build --release -p strata-bench`).
set -euo pipefail
dir=${1:?usage: benches/graph-model.sh DIR [train|heldout|calibration|all] [TRIALS]}
which=${2:-all}
trials=${3:-3}
case $which in train | heldout | calibration | all) ;; *) echo "part: train, heldout, calibration or all" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet --manifest-path "$here/Cargo.toml" -p strata-bench >&2
  strata=$here/target/release/strata
else
  strata=$STRATA
fi
mkdir -p "$dir"

run() { # name, then the bench's arguments
  local name=$1
  shift
  if [ ! -s "$dir/$name.json" ]; then
    echo "running $name: strata bench graph $*" >&2
    "$strata" bench graph --quiet --json "$dir/$name.json.tmp" "$@" >/dev/null
    mv "$dir/$name.json.tmp" "$dir/$name.json"
  fi
}

all="bfs,sssp,pr,cc"
if [ "$which" = train ] || [ "$which" = all ]; then
  for b in 25 50; do
    run "train_kron19_$b" --algo $all --graph kron:19 --device-budget $b% \
      --configs strata,zero-copy,static-optimum --trials "$trials"
  done
fi
if [ "$which" = heldout ] || [ "$which" = all ]; then
  for b in 25 50; do
    run "heldout_kron22_$b" --algo $all --graph kron:22 --device-budget $b% --baselines --trials "$trials"
  done
  run heldout_kron22_100 --algo pr,cc --graph kron:22 --device-budget 100% \
    --configs strata,all-device,zero-copy,uvm-advised --trials "$trials"
fi
if [ "$which" = calibration ] || [ "$which" = all ]; then
  run calib_emogi --algo $all --graph kron:19 --device-budget 50% \
    --configs zero-copy,uvm-advised,uvm --platform v100-pcie3 --trials 1
  for b in 100 91 80; do
    run "calib_uvmbench_$b" --algo pr,cc --graph kron:19 --device-budget $b% \
      --configs uvm --platform v100-pcie3 --trials 1
  done
fi

python3 - "$dir" "$which" <<'PY'
import json, os, statistics, sys

d, which = sys.argv[1], sys.argv[2]

def load(name):
    p = os.path.join(d, name + ".json")
    if not os.path.exists(p):
        return None
    r = json.load(open(p))
    return r.get("reports", [r])

def by_config(rep):
    return {c["config"]: c for c in rep["results"]}

def cost(c):
    """Median trial's cost breakdown (by modelled seconds)."""
    ts = sorted(c["trials"], key=lambda t: t["seconds"])
    return ts[len(ts) // 2].get("cost") or {}

def ms(x):
    return f"{x * 1e3:.3g}"

def graph_table(name, title):
    reps = load(name)
    if not reps:
        return
    r0 = reps[0]
    print(f"\n#### {title}\n")
    g = r0["params"]["graph"]
    gname = f"{g['kind']}:{g['scale']}" if "scale" in g else str(g)
    print(f"{gname}, platform {r0['model']['name']}, budget "
          f"{r0['budget_bytes'] / 2**20:.1f} MiB of {r0['graph_bytes'] / 2**20:.1f} MiB "
          f"(BFS/PR/CC; SSSP adds its weights), {len(r0['results'][0]['trials'])} trial(s), medians, modelled ms\n")
    configs = [c["config"] for c in r0["results"]]
    print("| algo | " + " | ".join(configs) + " | strata / best of the uvm, uvm-advised and zero-copy run | strata / static-optimum | zero-copy / static-optimum | strata: kernels, migrations, balancer, device maps |")
    print("|---" * (len(configs) + 5) + "|")
    for rep in reps:
        c = by_config(rep)
        row = [ms(c[k]["seconds"]) for k in configs]
        s = c.get("strata")
        base = [c[k]["seconds"] for k in ("uvm", "uvm-advised", "zero-copy") if k in c]
        so = c.get("static-optimum")
        zc = c.get("zero-copy")
        ratio_best = f"{s['seconds'] / min(base):.2f}" if s and base else "-"
        ratio_so = f"{s['seconds'] / so['seconds']:.2f}" if s and so else "-"
        headroom = f"{zc['seconds'] / so['seconds']:.2f}" if zc and so else "-"
        parts = "-"
        if s:
            k = cost(s)
            parts = f"{ms(k.get('kernels', 0))}, {ms(k.get('migrations', 0))}, {ms(k.get('balancer', 0))}, {ms(k.get('maps', 0))}"
        print(f"| {rep['params']['algo']} | " + " | ".join(row) + f" | {ratio_best} | {ratio_so} | {headroom} | {parts} |")

if which in ("train", "all"):
    for b in (25, 50):
        graph_table(f"train_kron19_{b}", f"Training: kron:19 at {b}%")
if which in ("heldout", "all"):
    for b in (25, 50):
        graph_table(f"heldout_kron22_{b}", f"Held out: kron:22 at {b}%")
    reps = load("heldout_kron22_100")
    if reps:
        print("\n#### Held out: kron:22 at 100% (cold start)\n")
        print("| algo | strata ms | all-device ms | strata / all-device | zero-copy ms | uvm-advised ms |")
        print("|---|---|---|---|---|---|")
        for rep in reps:
            c = by_config(rep)
            print(f"| {rep['params']['algo']} | {ms(c['strata']['seconds'])} | {ms(c['all-device']['seconds'])} | "
                  f"{c['strata']['seconds'] / c['all-device']['seconds']:.2f} | {ms(c['zero-copy']['seconds'])} | "
                  f"{ms(c['uvm-advised']['seconds'])} |")
if which in ("calibration", "all"):
    reps = load("calib_emogi")
    if reps:
        print("\n#### Calibration: zero-copy against optimized UVM (v100-pcie3, kron:19, budget 50%)\n")
        print("| algo | zero-copy ms | uvm-advised ms | uvm ms | uvm-advised / zero-copy |")
        print("|---|---|---|---|---|")
        ratios = []
        for rep in reps:
            c = by_config(rep)
            x = c["uvm-advised"]["seconds"] / c["zero-copy"]["seconds"]
            ratios.append(x)
            print(f"| {rep['params']['algo']} | {ms(c['zero-copy']['seconds'])} | {ms(c['uvm-advised']['seconds'])} | {ms(c['uvm']['seconds'])} | {x:.2f} |")
        print(f"\ngeometric mean {statistics.geometric_mean(ratios):.2f}, arithmetic mean {statistics.mean(ratios):.2f}")
    fits = load("calib_uvmbench_100")
    if fits:
        print("\n#### Calibration: Unified Memory oversubscribed (v100-pcie3, kron:19)\n")
        print("| algo | fits (ms) | 110% (ms) | slowdown | 125% (ms) | slowdown |")
        print("|---|---|---|---|---|---|")
        over = {b: load(f"calib_uvmbench_{b}") for b in (91, 80)}
        for i, rep in enumerate(fits):
            base = rep["results"][0]["seconds"]
            cells = []
            for b in (91, 80):
                s = over[b][i]["results"][0]["seconds"] if over[b] else float("nan")
                cells += [ms(s), f"{s / base:.2f}"]
            print(f"| {rep['params']['algo']} | {ms(base)} | " + " | ".join(cells) + " |")
PY
