#!/usr/bin/env bash
# Reproduce the shipped draft dflash/drafts/smollm2-135m-instruct on a CPU machine.
# Every step is resumable: re-run this script after an interruption and it continues.
#   DATA_SHARDS   shards of 64 prompts to regenerate (each ~10K response tokens)
#   STEPS         optimizer steps
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2}
RUN=${RUN:-runs/fit/smollm2}
DATA_SHARDS=${DATA_SHARDS:-8}
STEPS=${STEPS:-1500}
$PY -m dflash.cli train data --out "$DATA" --num-prompts 3000 --max-shards "$DATA_SHARDS"
$PY -m dflash.cli train fit --data "$DATA" --out "$RUN" --resume --init target --num-layers 1 \
    --max-steps "$STEPS" --batch-size 4 --anchors-per-seq 32 --eval-every 50 --tau-every 200 --ckpt-every 25
$PY -m dflash.cli train plot "$RUN" --out docs/training_curve.png
$PY -m dflash.cli train ship "$RUN" --dest dflash/drafts/smollm2-135m-instruct
