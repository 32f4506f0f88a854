#!/usr/bin/env bash
# The test suite, Rust and Python, on a fresh machine with Rust and Python 3:
#   tests/run.sh
# 1. cargo test --workspace (the library, the C ABI, the CLI and benches);
# 2. the Python package: a virtual environment in target/pyenv (git-ignored;
#    made once, $PYTHON or python3) with maturin, pytest, numpy and torch
#    (for strata.optim's tests: torch 2.14.1 from PyPI, a 2.8 GB download
#    the first time, about 80 s; STRATA_NO_TORCH=1 leaves it out and those
#    tests skip, saying so), transformers and accelerate (strata.moe's
#    tests; left out likewise), `pip install ./python` (builds the extension
#    with maturin), then pytest python/tests;
# 3. with STRATA_TORCHREC=1, TorchRec's tests too: torchrec 1.9.2 and
#    fbgemm-gpu-cpu 1.9.0 go into the same environment (they are built for
#    torch 2.14.1, so a different torch there is replaced by it; the CUDA
#    fbgemm_gpu wheel torchrec pulls in is removed, since it shadows the CPU
#    one and needs libnvidia-ml), and a missing TorchRec fails the run
#    instead of skipping its tests. One environment, one torch: a second
#    one would need another 5.5 GB of disk.
# Extra arguments go to pytest (e.g. tests/run.sh -k dlpack -x).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "cargo test --workspace"
cargo test --workspace

venv=target/pyenv
py=$venv/bin/python
if [ ! -x "$py" ]; then
    step "python virtual environment in $venv"
    if ! "${PYTHON:-python3}" -m venv "$venv"; then
        # Debian and Ubuntu ship venv (and pip) apart from python3.
        rm -rf "$venv"
        apt-get update -qq && apt-get install -y -qq python3-venv python3-pip
        "${PYTHON:-python3}" -m venv "$venv"
    fi
fi
step "pip install maturin pytest numpy torch, then ./python"
# As `activate` does: the build backend runs the venv's `maturin`.
export VIRTUAL_ENV=$PWD/$venv PATH=$PWD/$venv/bin:$PATH
pip=("$py" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade 'maturin>=1.5,<2' pytest numpy
# The torch TorchRec 1.9.2 and fbgemm-gpu-cpu 1.9.0 are built for; a fresh
# environment gets it, so that STRATA_TORCHREC=1 needs no second download.
torch_pin=2.14.1
if [ "${STRATA_NO_TORCH:-0}" != 1 ]; then
    if [ "${STRATA_TORCHREC:-0}" = 1 ]; then
        "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_pin')" 2>/dev/null ||
            "${pip[@]}" install "torch==$torch_pin"
    else
        "$py" -c "import torch" 2>/dev/null || "${pip[@]}" install "torch==$torch_pin"
    fi
    # strata.moe's tests build tiny transformers MoE models (nothing
    # downloaded), on the release they were written against: a later one may
    # add, rename or drop families.
    "$py" -c "import transformers, accelerate" 2>/dev/null ||
        "${pip[@]}" install transformers==5.25.0 accelerate==1.16.0
    if [ "${STRATA_TORCHREC:-0}" = 1 ]; then
        step "torchrec 1.9.2 and fbgemm-gpu-cpu 1.9.0 (TorchRec's tests)"
        if ! "$py" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
            "${pip[@]}" install "torch==$torch_pin" torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0
            # Both wheels install into fbgemm_gpu/: drop the CUDA one, then
            # put the CPU one's files back.
            "${pip[@]}" uninstall -y fbgemm_gpu
            "${pip[@]}" install --force-reinstall --no-deps fbgemm-gpu-cpu==1.9.0
        fi
        export STRATA_REQUIRE_TORCHREC=1
    fi
elif [ "${STRATA_REQUIRE_TORCH:-0}" = 1 ] || [ "${STRATA_TORCHREC:-0}" = 1 ]; then
    echo "STRATA_NO_TORCH=1 contradicts STRATA_REQUIRE_TORCH=1 and STRATA_TORCHREC=1" >&2
    exit 2
fi
# An extension module left in the source tree by `maturin develop` would be
# imported instead of the installed one, or packed into the wheel.
rm -f python/strata/_strata*.so
"${pip[@]}" install --no-build-isolation --force-reinstall --no-deps ./python

step "pytest python/tests"
# From the repository root: `import strata` finds the installed package.
"$py" -m pytest python/tests "$@"
