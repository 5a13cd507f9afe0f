#!/usr/bin/env bash
# The session-5 recipe comparison (docs/TRAINING.md, "Session 5"): hard-label CE against
# distillation of the target's top-k distributions, at equal data, steps and CPU, both warm-started
# from the shipped draft (main4) on data it never saw (data/smollm2-c, its first SHARDS shards).
# Every step resumes: re-run after an interruption and it continues where it stopped.
#   1. rebuild the kept responses' features and soft labels by one target prefill each (--topk 32)
#   2. two fits, same schedule and seed: --distill-weight 0 (hard CE) and $DISTILL
#   3. tau of each best draft on evaluation prompts (scripts/train_measure_tau.py)
#   THREADS  torch threads per job; PARALLEL=1 runs the two fits side by side
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2-c}
SHARDS=${SHARDS:-8}
STEPS=${STEPS:-250}
DISTILL=${DISTILL:-0.5}
LR=${LR:-2e-4}
WARMUP=${WARMUP:-0.1}
THREADS=${THREADS:-1}
PARALLEL=${PARALLEL:-1}
START=${START:-dflash/drafts/smollm2-135m-instruct}
$PY -m dflash.cli train data --out "$DATA" --num-prompts 9000 --first-shard 94 --max-shards $((94 + SHARDS)) \
    --responses data/smollm2-c --threads "$THREADS"
COMMON="--data $DATA --data-shards $SHARDS --resume --init-from $START --num-layers 2 --loss-vocab draft
    --draft-vocab 8192 --batch-size 8 --anchors-per-seq 32 --lr "$LR" --warmup-frac "$WARMUP" --max-steps $STEPS
    --heldout-frac 0.1 --eval-every 25 --eval-tau-prompts 0 --ckpt-every 25 --threads $THREADS"
fit() {  # $1 run name, $2 distill weight
    # shellcheck disable=SC2086
    $PY -m dflash.cli train fit --out "runs/fit/$1" --distill-weight "$2" $COMMON > "runs/fit/$1.log" 2>&1
}
mkdir -p runs/fit runs/tau
if [ "$PARALLEL" = 1 ]; then
    fit hard 0 & fit distill "$DISTILL" & wait
else
    fit hard 0
    fit distill "$DISTILL"
fi
for run in hard distill; do
    $PY scripts/train_measure_tau.py "runs/fit/$run/best" --n 5 --tokens 128 --threads "$THREADS" \
        --json "runs/tau/$run.json"
done
$PY -m dflash.cli train plot runs/fit/hard runs/fit/distill --labels "hard CE" "distill $DISTILL" \
    --out docs/training_distill.png
