#!/usr/bin/env bash
# Continue the imported EDM base (pretrained/edm_qm9_small.pt: EDM's own 5 x 128 run with charges, 200
# steps, 341 epochs) with EDM's loss on one GPU for a fixed time, on a machine that has torch, numpy and
# PyYAML but not Ray, RDKit, qm9pack or matplotlib (the project need not be installed there).
#
# Here, once (the other machine has no qm9pack; 10.3 MB, gitignored):
#   flowrl-ray qm9-pack --out pretrained/qm9_train.npz
# There, in a copy of the repository with the pack beside it:
#   OUT=folder bash benchmarks/edm_continue_gpu.sh [MINUTES [FLAGS]]     # default 7; FLAGS override
# writes $OUT/edm_qm9_small_cont.pt (EMA weights and the whole training state, about 15 MB; run the
# same command with the file in place to continue it) and $OUT/edm_qm9_small_cont.metrics.jsonl (the
# loss every 100 steps). Batch 256 as in EDM's run; lr 1e-4 (EDM's paper value; the run itself used
# 2e-3, too large a first step for AdamW's fresh moments on trained weights). No samples are scored
# there (no RDKit): back here the base and the continued model sample the same 512 molecules:
#   .venv/bin/python benchmarks/fed_grpo_qm9.py --bases OUT/edm_qm9_small_cont.pt pretrained/edm_qm9_small.pt \
#       --eval-molecules 512 --output edm_bases_gpu
set -euo pipefail
MINUTES=${1:-7}
OUT=${OUT:?set OUT to the folder the checkpoint goes to}
mkdir -p "$OUT"
PYTHONPATH=. "${PYTHON:-python3}" -m flowrl_ray.cli pretrain configs/fed_grpo/qm9_edm_small.yaml \
    --init-from pretrained/edm_qm9_small.pt --qm9 pretrained/qm9_train.npz --out "$OUT/edm_qm9_small_cont.pt" \
    --batch-size 256 --lr 1e-4 --steps 1000000 --checkpoint-every 1000 --max-minutes "$MINUTES" \
    --eval-samples 0 --device auto --resume "${@:2}"
