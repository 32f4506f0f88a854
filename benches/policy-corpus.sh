#!/usr/bin/env bash
# The policy evaluation corpus (docs/perf.md, placement policies): regenerates every trace with
# `strata trace gen` (deterministic: fixed parameters and seeds), replays
# each at several capacities through `strata trace replay --json`, and
# prints markdown tables: per trace and capacity the default policy's misses
# over the best of the six references (LRU, perfect LFU, perfect LFU with
# admission, ARC, S3-FIFO, SIEVE) and over Belady's; the worst case and the
# median of each part; and the default's replay speed per capacity.
#
# usage: benches/policy-corpus.sh DIR [train|heldout|all]   (default: all)
#
# The split (fixed; a held-out trace is never a re-seed of a training one):
# every family has training members and held-out members, and a held-out
# member differs from every training member of its family in a parameter
# setting, not only in its seed:
#   - graph kernels (bfs, sssp, pr, cc): training on kron scale 16 in 4 KiB
#     pages and urand scale 15 in 1 KiB pages; held out: kron scale 15 in
#     2 KiB pages and urand scale 16 (edge factor 8) in 8 KiB pages;
#   - zipf: training α 0.7, 1.0, 1.3; held out α 0.85, 1.15;
#   - loop: training 30000 pages; held out 77000;
#   - scan + hot set (mix), working-set shifts (shift), embedding lookups
#     (emb), MoE experts (moe): the held-out member has its own skew, sizes,
#     phase length, tables or model shape (see the list below);
#   - seeds: training members use seeds below 100, held-out ones 100 and up.
# Tune only on `train`; `heldout` is for the report.
#
# Capacities: 1/2, 1/8 and 1/32 of the trace's distinct pages, and 256
# pages where that is below half of them (capacities under 4 are skipped).
#
# Environment: STRATA (the binary; default: built here with
# `cargo build --release -p strata-bench`), SPEED_RUNS (CLI speed runs per
# capacity, best kept; default 3).
set -euo pipefail
dir=${1:?usage: benches/policy-corpus.sh DIR [train|heldout|all]}
which=${2:-all}
case $which in train | heldout | all) ;; *) echo "part: train, heldout or all" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet --manifest-path "$here/Cargo.toml" -p strata-bench >&2
  strata=$here/target/release/strata
else
  strata=$STRATA
fi
mkdir -p "$dir/train" "$dir/heldout" "$dir/json"

# split name generator arguments...
corpus() {
  local m=1500000
  # Synthetic families.
  echo "train zipf-0.7 --kind zipf --alpha 0.7 --pages 200000 --accesses $m --seed 1"
  echo "train zipf-1.0 --kind zipf --alpha 1.0 --pages 100000 --accesses $m --seed 2"
  echo "train zipf-1.3 --kind zipf --alpha 1.3 --pages 400000 --accesses $m --seed 3"
  echo "heldout zipf-0.85 --kind zipf --alpha 0.85 --pages 300000 --accesses $m --seed 101"
  echo "heldout zipf-1.15 --kind zipf --alpha 1.15 --pages 150000 --accesses $m --seed 102"
  echo "train loop-30k --kind loop --pages 30000 --accesses 1200000"
  echo "heldout loop-77k --kind loop --pages 77000 --accesses $m"
  echo "train mix-a --kind mix --alpha 1.0 --pages 65536 --accesses $m --scan-fraction 0.2 --scan-length 16384 --seed 1"
  echo "train mix-b --kind mix --alpha 0.8 --pages 20000 --accesses $m --scan-fraction 0.4 --scan-length 4096 --seed 2"
  echo "heldout mix-c --kind mix --alpha 1.2 --pages 30000 --accesses $m --scan-fraction 0.3 --scan-length 8192 --seed 101"
  echo "train shift-a --kind shift --alpha 1.0 --pages 20000 --phase 200000 --overlap 0 --accesses $m --seed 1"
  echo "train shift-b --kind shift --alpha 0.8 --pages 5000 --phase 50000 --overlap 0.5 --accesses $m --seed 2"
  echo "heldout shift-c --kind shift --alpha 1.2 --pages 10000 --phase 100000 --overlap 0.25 --accesses $m --seed 101"
  # The graph kernels' page traces.
  for k in bfs sssp pr cc; do
    echo "train $k-kron16-4k --kind $k --graph kron --scale 16 --edge-factor 16 --page-size 4k --roots 2 --iterations 2 --accesses $m --seed 1"
    echo "train $k-urand15-1k --kind $k --graph uniform --scale 15 --edge-factor 16 --page-size 1k --roots 2 --iterations 2 --accesses $m --seed 2"
    echo "heldout $k-kron15-2k --kind $k --graph kron --scale 15 --edge-factor 16 --page-size 2k --roots 2 --iterations 2 --accesses $m --seed 101"
    echo "heldout $k-urand16-8k --kind $k --graph uniform --scale 16 --edge-factor 8 --page-size 8k --roots 2 --iterations 2 --accesses $m --seed 102"
  done
  # Embedding lookups (recommender) and MoE experts (layer order, drift).
  echo "train emb-a --kind emb --alphas 1.1,0.9,0.7,0.5 --rows 200000 --row-bytes 128 --page-size 4k --batch 512 --pooling 16 --batches 48 --seed 1"
  echo "train emb-b --kind emb --alphas 1.2,1.0,0.8,0.6,0.4,0.2,0,0 --rows 50000 --row-bytes 256 --page-size 4k --batch 256 --pooling 16 --batches 48 --seed 2"
  echo "heldout emb-c --kind emb --alphas 1.05,0.95,0.8,0.6,0.3,0 --rows 100000 --row-bytes 64 --page-size 16k --batch 256 --pooling 20 --batches 50 --seed 101"
  echo "train moe-a --kind moe --layers 32 --experts 64 --top-k 2 --alpha 1.0 --drift 0.05 --tokens 20000 --seed 1"
  echo "train moe-b --kind moe --layers 24 --experts 128 --top-k 4 --alpha 1.2 --drift 0.2 --tokens 12000 --seed 2"
  echo "heldout moe-c --kind moe --layers 48 --experts 32 --top-k 2 --alpha 0.8 --drift 0.1 --tokens 14000 --seed 101"
}

policies=lru,lfu,perfect-lfu,lfu-admission,arc,s3fifo,sieve,default,belady
results=$dir/results-$which.tsv
: >"$results"
while read -r split name args; do
  [ "$which" = all ] || [ "$which" = "$split" ] || continue
  f=$dir/$split/$name.trace
  # shellcheck disable=SC2086
  line=$("$strata" trace gen --out "$f" $args)
  # "wrote N accesses to D distinct pages to FILE"
  accesses=$(echo "$line" | awk '{ print $2 }')
  pages=$(echo "$line" | awk '{ print $5 }')
  caps=""
  for div in 2 8 32; do
    c=$((pages / div))
    [ "$c" -ge 4 ] && caps="$caps 1/$div:$c"
  done
  # 256 pages where it is below half the pages and not one of the above.
  if [ $((pages / 2)) -gt 256 ] && [ $((pages / 8)) -ne 256 ] && [ $((pages / 32)) -ne 256 ]; then
    caps="$caps 256:256"
  fi
  for cc in $caps; do
    class=${cc%%:*} cap=${cc##*:}
    j=$dir/json/$name-${class//\//_}.json
    "$strata" trace replay --trace "$f" --capacity-pages "$cap" --policy "$policies" \
      --json "$j" >/dev/null
    # Misses in the order of $policies, then the default's seconds.
    misses=$(grep '"misses"' "$j" | tr -dc '0-9\n' | paste -sd' ')
    secs=$(grep -A9 '"policy": "default"' "$j" | grep -m1 '"seconds"' | sed 's/.*: *//; s/,//')
    echo "$split $name $accesses $pages $class $cap $misses $secs" >>"$results"
  done
done < <(corpus)

# Columns of $results: 1 split, 2 name, 3 accesses, 4 pages, 5 class, 6 cap,
# 7 lru, 8 lfu (decayed), 9 perfect-lfu, 10 lfu-admission, 11 arc,
# 12 s3fifo, 13 sieve, 14 default, 15 belady, 16 default's seconds.
report() { # split
  local s=$1
  echo
  echo "### Part: $s"
  echo
  echo "| trace | accesses | pages | capacity | default | lru | lfu (decayed) | perfect lfu | lfu + admission | arc | s3fifo | sieve | belady | best of six | default / best | ≤ 1.05 | default / belady |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  awk -v s="$s" '$1 == s {
    split("lru perfect-lfu lfu-admission arc s3fifo sieve", names, " ")
    col[1] = 7; col[2] = 9; col[3] = 10; col[4] = 11; col[5] = 12; col[6] = 13
    best = -1
    for (i = 1; i <= 6; i++) if (best < 0 || $(col[i]) < best) { best = $(col[i]); who = names[i] }
    r = best > 0 ? $14 / best : ($14 == 0 ? 1 : 99)
    b = $15 > 0 ? $14 / $15 : 1
    printf "| %s | %s | %s | %s (%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.3f | %s | %.3f |\n",
      $2, $3, $4, $5, $6, $14, $7, $8, $9, $10, $11, $12, $13, $15, who, r, r <= 1.05 ? "met" : "**not met**", b
  }' "$results"
  echo
  awk -v s="$s" '$1 == s {
    best = $7; for (i = 9; i <= 13; i++) if ($i < best) best = $i
    r = best > 0 ? $14 / best : ($14 == 0 ? 1 : 99)
    n++; if (r <= 1.05) met++
    if (r > worst) { worst = r; wt = $2 " at " $5 " (" $6 " pages)" }
  } END {
    if (n) printf "%s: default ≤ 1.05 × best of six on %d of %d cases; worst %.3f: %s\n", s, met, n, worst, wt
  }' "$results"
  awk -v s="$s" '$1 == s { print ($15 > 0 ? $14 / $15 : 1) }' "$results" | sort -g |
    awk -v s="$s" '{ v[NR] = $1 } END { if (NR) printf "%s: median default / belady %.3f (%d cases, min %.3f, max %.3f)\n", s, NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2, NR, v[1], v[NR] }'
}

parts=()
[ "$which" = all ] && parts=(train heldout) || parts=("$which")
for p in "${parts[@]}"; do report "$p"; done
if [ "$which" = all ]; then
  awk '{ print ($15 > 0 ? $14 / $15 : 1) }' "$results" | sort -g |
    awk '{ v[NR] = $1 } END { printf "\ncorpus: median default / belady %.3f over %d cases (target ≤ 1.25)\n", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2, NR }'
fi

echo
echo "Replay speed of the default through the CLI, million accesses/s, over the replays above (the default's own timing in each):"
echo
echo "| capacity | replays | min | median | max |"
echo "|---|---|---|---|---|"
for class in 1/2 1/8 1/32 256; do
  awk -v c="$class" '$5 == c { printf "%.3f\n", $3 / $16 / 1e6 }' "$results" | sort -g |
    awk -v c="$class" '{ v[NR] = $1 } END { if (NR) printf "| %s | %d | %.1f | %.1f | %.1f |\n", c, NR, v[1], v[int((NR + 1) / 2)], v[NR] }'
done

# A dedicated speed run: the default alone on one trace at fixed
# capacities, best of SPEED_RUNS.
f=$dir/speed-zipf.trace
"$strata" trace gen --kind zipf --alpha 1.0 --pages 1048576 --accesses 2000000 --seed 7 --out "$f" >/dev/null
echo
echo "Default alone, Zipf(1.0) over 1 M pages, 2 M accesses, best of ${SPEED_RUNS:-3} CLI runs:"
echo
echo "| capacity (pages) | M accesses/s |"
echo "|---|---|"
for cap in 16 64 256 1024 4096 16384 131072; do
  best=0
  for _ in $(seq "${SPEED_RUNS:-3}"); do
    "$strata" trace replay --trace "$f" --capacity-pages "$cap" --json "$dir/json/speed.json" >/dev/null
    v=$(awk -F': *' '/"accesses"/ { a = $2 + 0 } /"seconds"/ { s = $2 + 0 } END { printf "%.2f", a / s / 1e6 }' "$dir/json/speed.json")
    best=$(awk -v a="$best" -v b="$v" 'BEGIN { print (b > a ? b : a) }')
  done
  echo "| $cap | $best |"
done
