#!/usr/bin/env bash
# Train the forms SFT base further on one GPU for a fixed time, then score its copying offline, on a
# machine that has torch, transformers and PyYAML but not Ray, Playwright or matplotlib (the project
# need not be installed there). Issue: a base that copies (held-out-value copy and field accuracy
# >= 0.6); the committed bases reach 0.34-0.47 offline after 6,250 GPU steps of 64 pairs and 6,000
# CPU steps of 32, the loss still falling (docs/results.md, Forms).
#
# There, in a copy of the repository:
#   OUT=folder bash benchmarks/forms_sft_gpu.sh [MINUTES [FLAGS]]     # default 7; FLAGS override
# continues pretrained/forms_small_sft_cont (forms_small.yaml's architecture, so the RL config can
# start from the result) with batches of 256 pairs drawn from 8,000 new tasks per training form
# (168,000 pairs: four times all the earlier SFT data), lr 3e-4 with the warm-up and a cosine over
# 4,000 steps (about 6 passes), stopping at a checkpoint after MINUTES, and writes OUT/forms_sft_gpu/ (weights 5.3 MB, tokenizer, losses, the optimiser and data position:
# run the same command with the folder in place to continue an unfinished run), then OUT/forms_sft_gpu_copy.{json,md}:
# greedy copy and field accuracy on the 96 evaluation tasks whose values no SFT saw. Back here,
# in Chromium beside the base (the issue's metric):
#   .venv/bin/python benchmarks/forms_bases.py pretrained/forms_small_sft OUT/forms_sft_gpu --tasks 96 \
#       --greedy-only --output forms_bases_gpu
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-7}
OUT=${OUT:?set OUT to the folder the checkpoint goes to}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -m flowrl_ray.cli pretrain configs/flow_grpo/forms_small.yaml --init-from pretrained/forms_small_sft_cont \
    --out "$OUT/forms_sft_gpu" --batch-size 256 --tasks-per-form 8000 --lr 3e-4 --steps 4000 \
    --checkpoint-every 500 --max-minutes "$MINUTES" --resume "${@:2}"
"$PY" benchmarks/forms_sft_copy.py --checkpoint "$OUT/forms_sft_gpu" --tasks 96 --batch 96 \
    --results-dir "$OUT" --output forms_sft_gpu_copy ${COPY_FLAGS:-}      # COPY_FLAGS: e.g. a smaller check
