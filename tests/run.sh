#!/usr/bin/env bash
# The test suite, Rust and Python, on a fresh machine with Rust and Python 3:
#   tests/run.sh
# 1. cargo test --workspace (the library, the C ABI, the CLI and benches);
# 2. the Python package: a virtual environment in target/pyenv (git-ignored;
#    made once, $PYTHON or python3) with maturin, pytest, numpy and torch
#    (for strata.optim's tests: a 2.8 GB download the first time, about 80 s;
#    STRATA_NO_TORCH=1 leaves it out and those tests skip, saying so),
#    transformers and accelerate (strata.moe's tests; left out likewise),
#    `pip install ./python` (builds the extension with maturin), then
#    pytest python/tests;
# 3. with STRATA_TORCHREC=1, TorchRec's tests in an environment of their own
#    (target/recenv: TorchRec pins its torch, torch 2.14.1 with torchrec
#    1.9.2 and fbgemm-gpu-cpu 1.9.0; the CUDA fbgemm_gpu wheel torchrec
#    pulls in is removed, since it shadows the CPU one and needs
#    libnvidia-ml): pytest python/tests/test_torchrec.py there.
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
if [ "${STRATA_NO_TORCH:-0}" != 1 ]; then
    "$py" -c "import torch" 2>/dev/null || "${pip[@]}" install torch
    # strata.moe's tests build tiny transformers MoE models (nothing downloaded).
    "$py" -c "import transformers, accelerate" 2>/dev/null || "${pip[@]}" install transformers accelerate
elif [ "${STRATA_REQUIRE_TORCH:-0}" = 1 ]; then
    echo "STRATA_REQUIRE_TORCH=1 and STRATA_NO_TORCH=1 contradict each other" >&2
    exit 2
fi
# An extension module left in the source tree by `maturin develop` would be
# imported instead of the installed one, or packed into the wheel.
rm -f python/strata/_strata*.so
"${pip[@]}" install --no-build-isolation --force-reinstall --no-deps ./python

step "pytest python/tests"
# From the repository root: `import strata` finds the installed package.
"$py" -m pytest python/tests "$@"

if [ "${STRATA_TORCHREC:-0}" = 1 ]; then
    recenv=target/recenv
    rpy=$recenv/bin/python
    step "TorchRec's environment in $recenv (torch 2.14.1, torchrec 1.9.2, fbgemm-gpu-cpu 1.9.0)"
    [ -x "$rpy" ] || "${PYTHON:-python3}" -m venv "$recenv"
    rpip=("$rpy" -m pip --disable-pip-version-check -q)
    if ! "$rpy" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
        "${rpip[@]}" install 'maturin>=1.5,<2' pytest numpy torch==2.14.1 torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0
        # Both wheels install into fbgemm_gpu/: drop the CUDA one, then put
        # the CPU one's files back.
        "${rpip[@]}" uninstall -y fbgemm_gpu
        "${rpip[@]}" install --force-reinstall --no-deps fbgemm-gpu-cpu==1.9.0
    fi
    (export VIRTUAL_ENV=$PWD/$recenv PATH=$PWD/$recenv/bin:$PATH
        "${rpip[@]}" install --no-build-isolation --force-reinstall --no-deps ./python)
    step "pytest python/tests/test_torchrec.py (TorchRec's environment)"
    STRATA_REQUIRE_TORCHREC=1 "$rpy" -m pytest python/tests/test_torchrec.py "$@"
fi
