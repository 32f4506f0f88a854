#!/usr/bin/env bash
# The checks only a GPU can run, prepared on a machine without one.
#
#   benches/gpu-check.sh            # here: builds into gpu-carry/ (git-ignored)
#   gpu-carry/run.sh                # on the GPU machine (no Rust toolchain needed)
#   gpu-carry/moe-gpu.sh            # there too, in a call of its own: strata.moe
#                                   # on a Mixtral-shaped bf16 model (about 8 min)
#
# A task lent a GPU has 15 minutes of device time, the machine's start
# included: enough for one of the two scripts, not both. Each writes its
# whole output to $OUT (run.log, moe-gpu.log) as well as to the terminal,
# whose last 12 KB alone come back.
#
# gpu-carry/ gets the CUDA-enabled CLI and the device (strata's CUDA layer,
# src/device/cuda/, on its own and as the device tier), hotness,
# graph and offload test binaries (the layer loads libcuda and libnvrtc at
# run time; the GPU machine must have libnvrtc for the kernels to compile).
# STRATA_REQUIRE_GPU=1 turns the tests' "no GPU" skips into failures.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-carry
mkdir -p gpu-carry
cargo build --release -p strata-bench --features strata-bench/cuda
cp target/release/strata gpu-carry/
for t in device hotness graph offload; do
    # graph's tests live beside the graph kernels in strata-bench.
    pkg=strata; [ "$t" = graph ] && pkg=strata-bench
    exe=$(cargo test --release -p "$pkg" --features "$pkg/cuda" --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -1)
    cp "$exe" "gpu-carry/test-$t"
done
# The Python package as a wheel (abi3: the GPU machine's python3 takes it),
# installed there into gpu-carry/site by moe-gpu.sh.
PY=${PYTHON:-$( [ -x target/pyenv/bin/python ] && echo target/pyenv/bin/python || echo python3 )}
"$PY" -m pip wheel -q --no-deps -w gpu-carry ./python
# Without debug info the folder is about 12 MiB (with it, about 170 MiB:
# over the device tool's 64 MiB carry limit).
strip gpu-carry/strata gpu-carry/test-*
# The hotness test reads tests/vectors/hotness.json from the working
# directory when the build's source path is absent: run.sh runs from the
# repository root, where the working tree has it.
cat > gpu-carry/run.sh <<'SH'
#!/usr/bin/env bash
# Run on the GPU machine from the repository root.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export STRATA_REQUIRE_GPU=1
exec > >(tee "${OUT:-/tmp}/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
# NVRTC: cudarc opens libnvrtc.so or libnvrtc.so.12 (.11, ...), not .so.13.
# Where the loader finds neither, look in the CUDA toolkit, then in Python's
# NVIDIA wheels, and put the first folder with a libnvrtc.so.N first on the
# library path, under the name cudarc opens (a link in gpu-carry/lib).
if ! ldconfig -p 2>/dev/null | grep -Eq 'libnvrtc\.so(\.12)? '; then
    wheels=$(python3 -c 'import glob, site
for d in site.getsitepackages():
    print(" ".join(glob.glob(d + "/nvidia/*/lib") + glob.glob(d + "/nvidia/cu*/lib")))' 2>/dev/null || true)
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib $wheels; do
        lib=$(ls "$d"/libnvrtc.so.[0-9]* 2>/dev/null | sort | head -1)
        if [ -n "$lib" ]; then
            mkdir -p "$here/lib"
            ln -sf "$lib" "$here/lib/libnvrtc.so"
            export LD_LIBRARY_PATH="$here/lib:$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "nvrtc: using $lib"
            break
        fi
    done
fi
"$here/strata" info
status=0
# offload: the CUDA Adam update bitwise against the CPU update. (The
# runtime tests run on the simulated device only: not here.)
for t in device hotness graph offload; do
    echo "== $t"
    (cd "$here/.." && "$here/test-$t" --test-threads 2) || status=1
done
echo "== migration, cuda"
"$here/strata" bench migrate --device cuda --path /tmp --size 256M --json "${OUT:-/tmp}/migrate-cuda.json" || status=1
# The graph kernels of kernels/graph.cu on a graph 2.5x the device budget
# (kron:23, about 1 GiB read by BFS and PageRank), beside zero-copy and
# all-device, every trial verified; Unified Memory at the end, on its own
# and under a timeout (oversubscribed managed memory can stall a GPU).
echo "== graph, cuda"
"$here/strata" bench graph --device cuda --graph kron:23 --algo bfs,pr --device-budget 40% \
    --configs strata,zero-copy,all-device --verify --trials 2 --quiet \
    --json "${OUT:-/tmp}/graph-cuda.json" || status=1
echo "== MoE expert cache with real device slots (stall measured), beside lru and no-cache"
"$here/strata" bench moe --device cuda --baselines --quiet --json "${OUT:-/tmp}/moe-cuda.json" || status=1
echo "== offloaded Adam, update on the GPU and, as the peer, on the CPU"
for u in cuda cpu; do
    "$here/strata" bench optim --update "$u" --tier host --quiet --json "${OUT:-/tmp}/optim-$u.json" || status=1
done
echo "== graph, cuda: Unified Memory (last, at most 150 s)"
timeout 150 "$here/strata" bench graph --device cuda --graph kron:23 --algo bfs,pr --device-budget 40% \
    --configs uvm --verify --trials 1 --quiet --json "${OUT:-/tmp}/graph-cuda-uvm.json" || status=1
exit $status
SH
chmod +x gpu-carry/run.sh
cat > gpu-carry/moe-gpu.sh <<'SH'
#!/usr/bin/env bash
# Run on the GPU machine from the repository root, in a call of its own:
# strata.moe on a random Mixtral-shaped bf16 model (8 layers x 8 experts of
# 336 MiB) with 25% and 50% of its experts in device slots, beside the
# model wholly on the GPU and accelerate's CPU offload of the experts
# (benches/peers/moe_gpu.py; transformers and accelerate are the image's).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$here/site" "$here"/strata-*.whl || exit 1
export PYTHONPATH="$here/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "${OUT:-/tmp}/moe-gpu.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 benches/peers/moe_gpu.py --device cuda --trials 2 --json "${OUT:-/tmp}/moe-gpu.json"
SH
chmod +x gpu-carry/moe-gpu.sh
echo "gpu-carry/ ($(du -sh gpu-carry | cut -f1)) is ready: pass it in the device tool's carry list and run gpu-carry/run.sh"
