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
#    pytest python/tests.
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
