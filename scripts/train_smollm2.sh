#!/usr/bin/env bash
# Reproduce the shipped draft dflash/drafts/smollm2-135m-instruct on a CPU machine (one torch
# thread per job). Every step resumes: re-run after an interruption and it continues.
#   DATA_SHARDS  shards of 64 prompts regenerated and trained on (the shipped draft: 2)
#   STEPS        length of the cosine schedule (the shipped draft: best held-out at step 75 of 300)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2}
RUN=${RUN:-runs/fit/main1}
DATA_SHARDS=${DATA_SHARDS:-2}
STEPS=${STEPS:-300}
$PY -m dflash.cli train data --out "$DATA" --num-prompts 3000 --max-shards "$DATA_SHARDS"
$PY -m dflash.cli train fit --data "$DATA" --data-shards "$DATA_SHARDS" --out "$RUN" --resume --init target \
    --lr 1e-3 --max-steps "$STEPS" --batch-size 4 --anchors-per-seq 32 --heldout-frac 0.1 \
    --eval-every 25 --tau-every 100 --eval-tau-prompts 2 --eval-tau-tokens 64 --ckpt-every 10
$PY -m dflash.cli train plot "$RUN" --out docs/training_curve.png
$PY -m dflash.cli train ship "$RUN" --dest dflash/drafts/smollm2-135m-instruct
