#!/usr/bin/env bash
# Trace replay: generates the traces of docs/perf-log.md's trace-replay
# entry (2026-11-30) with `strata trace gen`, replays each through every
# policy with `strata trace replay --policy all` at 1/2, 1/4 and 1/8 of its
# footprint (distinct pages), and prints markdown tables: misses per policy
# beside Belady, the default policy against its targets (the reference LRU,
# perfect LFU and perfect LFU with admission of
# benches/strata-bench/tests/policy.rs), and replay speed.
#
# usage: benches/trace-replay.sh DIR
set -euo pipefail
dir=${1:?usage: benches/trace-replay.sh DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
strata=${STRATA:-$here/target/release/strata}
[ -x "$strata" ] || { echo "build strata first: cargo build --release" >&2; exit 2; }
mkdir -p "$dir"

gen() { # name args...
  local name=$1; shift
  "$strata" trace gen --out "$dir/$name.trace" "$@" >/dev/null
}
gen zipf-0.8 --kind zipf --alpha 0.8 --pages 65536 --accesses 2000000 --seed 1
gen zipf-1.0 --kind zipf --alpha 1.0 --pages 65536 --accesses 2000000 --seed 1
gen zipf-1.2 --kind zipf --alpha 1.2 --pages 65536 --accesses 2000000 --seed 1
gen loop --kind loop --pages 32768 --accesses 1000000
gen mix --kind mix --alpha 1.0 --pages 32768 --accesses 2000000 \
    --scan-fraction 0.2 --scan-length 16384 --seed 1
gen bfs --kind bfs --graph kron --scale 15 --edge-factor 16 --page-size 1k --roots 2 --seed 1
gen pr --kind pr --graph kron --scale 15 --edge-factor 16 --page-size 1k --iterations 2 --seed 1

traces=(zipf-0.8 zipf-1.0 zipf-1.2 loop mix bfs pr)
echo "| trace | accesses | footprint | capacity | lru | lfu | gmt | lookahead | default | belady |"
echo "|---|---|---|---|---|---|---|---|---|---|"
speed=$(mktemp)
trap 'rm -f "$speed"' EXIT
for t in "${traces[@]}"; do
  f="$dir/$t.trace"
  pages=$(grep -v '^#' "$f" | sort -u | wc -l)
  accesses=$(grep -vc '^#' "$f")
  for div in 2 4 8; do
    cap=$((pages / div))
    "$strata" trace replay --trace "$f" --capacity-pages "$cap" --policy all \
        --json "$dir/$t-$div.json" >/dev/null
    # One row: misses per policy in the JSON's order (lru lfu gmt lookahead
    # default belady), and accesses/s per policy for the speed table.
    misses=$(grep '"misses"' "$dir/$t-$div.json" | tr -dc '0-9\n' | paste -sd'|')
    echo "| $t | $accesses | $pages | 1/$div ($cap) | ${misses//|/ | } |"
    paste <(grep '"policy"' "$dir/$t-$div.json" | cut -d'"' -f4) \
          <(grep '"accesses"' "$dir/$t-$div.json" | tr -dc '0-9\n') \
          <(grep '"seconds"' "$dir/$t-$div.json" | sed 's/.*: *//; s/,//') >>"$speed"
  done
done

echo
echo "Replay speed, million accesses/s (all traces and capacities: min, median, max):"
echo
echo "| policy | min | median | max |"
echo "|---|---|---|---|"
for p in lru lfu gmt lookahead default belady; do
  awk -v p="$p" '$1 == p { printf "%.3f\n", $2 / $3 / 1e6 }' "$speed" | sort -n |
    awk -v p="$p" '{ v[NR] = $1 } END { printf "| %s | %.1f | %.1f | %.1f |\n", p, v[1], v[int((NR + 1) / 2)], v[NR] }'
done

echo
STRATA_TRACES=$(for t in "${traces[@]}"; do printf '%s ' "$dir/$t.trace"; done) \
  cargo test --release --quiet --manifest-path "$here/Cargo.toml" --test policy \
  targets_on_trace_files -- --ignored --nocapture 2>/dev/null | grep '^|'
