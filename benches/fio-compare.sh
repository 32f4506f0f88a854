#!/usr/bin/env bash
# The NVMe store against fio, back to back on the same filesystem, size,
# block size and queue depth (fio: --direct=1 --ioengine=io_uring).
# Each case alternates fio, strata/uring and strata/psync ROUNDS times and
# reports medians and ratios as a markdown table on stdout.
#
# usage: benches/fio-compare.sh DIR [SIZE] [SECONDS] [ROUNDS]
set -euo pipefail
dir=${1:?usage: benches/fio-compare.sh DIR [SIZE] [SECONDS] [ROUNDS]}
size=${2:-1G}
secs=${3:-5}
rounds=${4:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
strata=${STRATA:-$here/target/release/strata}
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
[ -x "$strata" ] || { echo "build strata first: cargo build --release" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; rm -f "$dir/strata-fio-compare.dat"' EXIT

fio_run() { # pattern bs qd [verify] -> iops bytes_per_sec
  local rw=$1 bs=$2 qd=$3 verify=${4:-} f="$dir/strata-fio-compare.dat"
  local extra=()
  if [ -n "$verify" ]; then
    # Lay the file out with fio's verify headers, then check every read
    # against them: the same work strata's per-page checksum does.
    fio --name=l --filename="$f" --size="$size" --direct=1 --ioengine=io_uring \
        --rw=write --bs="$bs" --iodepth=64 --verify="$verify" --do_verify=0 \
        --verify_state_save=0 --output-format=terse >/dev/null 2>&1
    extra=(--verify="$verify")
  elif [ "$rw" = write ] || [ "$rw" = randwrite ]; then
    # Laid out before the timed writes (fio's default writes a fresh,
    # fallocated file, paying the filesystem's extent conversion; strata's
    # bench writes every block before it times, as a store overwrites).
    extra=(--overwrite=1)
  fi
  fio --name=c --filename="$f" --size="$size" --direct=1 --ioengine=io_uring \
      --rw="$rw" --bs="$bs" --iodepth="$qd" --runtime="$secs" --time_based \
      "${extra[@]}" --verify_state_save=0 --output-format=json >"$tmp/fio.json" 2>/dev/null
  rm -f "$f"
  python3 - "$tmp/fio.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
print(side["iops"], side["bw_bytes"])
PY
}

strata_run() { # engine pattern bs qd -> iops bytes_per_sec
  "$strata" bench io --path "$dir" --size "$size" --engine "$1" --pattern "$2" \
      --bs "$3" --qd "$4" --seconds "$secs" --json "$tmp/s.json" >/dev/null
  python3 -c "import json; j=json.load(open('$tmp/s.json')); print(j['iops'], j['bytes_per_sec'])"
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "| case | fio io_uring | strata uring | ratio | strata psync | ratio | fio + verify=xxhash | strata uring / it |"
echo "|---|---|---|---|---|---|---|---|"
for case in "randread 4k 1" "randread 4k 32" "randread 4k 128" "read 1M 8" "write 1M 8"; do
  set -- $case
  : >"$tmp/f"; : >"$tmp/u"; : >"$tmp/p"; : >"$tmp/v"
  for _ in $(seq "$rounds"); do
    fio_run "$1" "$2" "$3" >>"$tmp/f"
    if [ "$1" = randread ]; then fio_run "$1" "$2" "$3" xxhash >>"$tmp/v"; fi
    strata_run uring "$1" "$2" "$3" >>"$tmp/u"
    strata_run psync "$1" "$2" "$3" >>"$tmp/p"
  done
  if [ "$2" = 4k ]; then col=1; unit=IOPS; else col=2; unit=B/s; fi
  f=$(cut -d' ' -f$col "$tmp/f" | median)
  u=$(cut -d' ' -f$col "$tmp/u" | median)
  p=$(cut -d' ' -f$col "$tmp/p" | median)
  v=$(cut -d' ' -f$col "$tmp/v" | median)
  python3 -c "
f,u,p,v=$f,$u,$p,${v:-0}
fmt=(lambda v: f'{v:,.0f} IOPS') if '$unit'=='IOPS' else (lambda v: f'{v/1e9:.2f} GB/s')
ver=f'{fmt(v)} | {u/v:.2f}' if v else '– | –'
print(f'| $1 bs=$2 qd=$3 | {fmt(f)} | {fmt(u)} | {u/f:.2f} | {fmt(p)} | {p/f:.2f} | {ver} |')"
done
