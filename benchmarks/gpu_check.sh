#!/usr/bin/env bash
# The GPU check: every CUDA-marked test, then benchmarks/gpu_check.py (PPO, FPO++ and FED-GRPO
# learner updates on the CPU and the GPU from one prepared batch, timed and compared; the 4-bit NF4
# Flow-GRPO update), on a machine that has torch, numpy, PyYAML, transformers and peft but not Ray,
# the envs' simulators or a package index. About 2 minutes on one H200-class GPU; <= 9 by design.
#
# Here, once (needs the package index; build/ is gitignored):
#   bash benchmarks/gpu_check.sh site      # or: make gpu-site
# unpacks the packages such a machine lacks into build/gpu-site (gymnasium for the env specs,
# bitsandbytes for NF4 with only its CPU and CUDA 13 libraries: about 11 MB). There, in a copy of
# the repository holding build/gpu-site:
#   OUT=folder bash benchmarks/gpu_check.sh [FLAGS for gpu_check.py]
# writes OUT/cuda_tests.txt (pytest's report), OUT/gpu_check.json and OUT/gpu_check.md; the exit
# status is not 0 when a test or a check failed. On a machine without a GPU the CUDA tests skip,
# the CPU halves run and the GPU halves say "skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-build/gpu-site}

# the packages, pinned to what the project's tests run with
PACKAGES=(bitsandbytes==0.50.2 gymnasium==1.2.2 farama-notifications==0.0.6)
# bitsandbytes loads libbitsandbytes_<backend>.so for torch's CUDA version; keep the CPU and CUDA 13 ones
KEEP_LIBS='libbitsandbytes_(cpu|cuda13[0-9])\.so'

if [ "${1:-}" = site ]; then
    set -e
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$wheels" "${PACKAGES[@]}"
    rm -rf "$SITE" && mkdir -p "$SITE"
    for w in "$wheels"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done      # a wheel is a zip
    find "$SITE/bitsandbytes" -name 'libbitsandbytes_*.so' | grep -Ev "/$KEEP_LIBS\$" | xargs -r rm -f
    echo "[gpu-check] $SITE: $(du -sb "$SITE" | cut -f1) bytes: ${PACKAGES[*]}"
    exit 0
fi

OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
[ -d "$SITE" ] || echo "[gpu-check] no $SITE: using the packages this Python has"
export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c 'import torch; print("[gpu-check] torch", torch.__version__, "CUDA", torch.version.cuda,
          "GPU:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'

mapfile -t files < <(grep -rlE --include='test_*.py' '^@pytest\.mark\.cuda\b' tests | sort)
"$PY" -m pytest -p no:cacheprovider -m cuda -rA "${files[@]}" 2>&1 | tee "$OUT/cuda_tests.txt"
tests=${PIPESTATUS[0]}
"$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
checks=$?
echo "[gpu-check] CUDA tests: exit $tests (${#files[@]} files); update checks: exit $checks"
[ "$tests" -eq 0 ] && [ "$checks" -eq 0 ]
