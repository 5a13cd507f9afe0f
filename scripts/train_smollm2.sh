#!/usr/bin/env bash
# Reproduce the shipped draft dflash/drafts/smollm2-135m-instruct on a CPU machine. Every step
# resumes: re-run after an interruption and it continues where it stopped.
#   DATA_SHARDS  shards of 64 prompts regenerated and trained on
#   STEPS        length of the cosine schedule (the shipped draft: 950 steps planned, cut to 800 at
#                step 425 by a resume with --max-steps 800; best held-out at step 750)
#   THREADS      torch threads per job (the machine's cores when nothing else runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2}
RUN=${RUN:-runs/fit/main2}
DATA_SHARDS=${DATA_SHARDS:-26}
STEPS=${STEPS:-800}
THREADS=${THREADS:-2}
$PY -m dflash.cli train data --out "$DATA" --num-prompts 3000 --batch-size 64 --threads "$THREADS" --max-shards "$DATA_SHARDS"
$PY -m dflash.cli train fit --data "$DATA" --data-shards "$DATA_SHARDS" --out "$RUN" --resume --init target \
    --num-layers 2 --loss-vocab draft --draft-vocab 8192 --lr 1e-3 --max-steps "$STEPS" --batch-size 8 \
    --anchors-per-seq 32 --heldout-frac 0.05 --eval-every 50 --tau-every 400 --eval-tau-prompts 2 \
    --eval-tau-tokens 64 --ckpt-every 25 --threads "$THREADS"
$PY -m dflash.cli train plot "$RUN" --out docs/training_curve.png
$PY -m dflash.cli train ship "$RUN" --dest dflash/drafts/smollm2-135m-instruct --extra '{"reproduce": "scripts/train_smollm2.sh"}'
