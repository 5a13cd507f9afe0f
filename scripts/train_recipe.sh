#!/usr/bin/env bash
# The recipe comparisons of docs/TRAINING.md: arms that differ in one setting, at equal data,
# steps and seed, all warm-started from START (default: the shipped draft; the published
# comparisons started from main4, which stage 3 of scripts/train_smollm2.sh rebuilds:
# START=runs/fit/main4/best) on data it never saw (data/smollm2-c, its first SHARDS shards; the
# shipped lineage has trained on all of smollm2-c since its gamma-4 stage, so a comparison that
# starts from the shipped draft needs other data: DATA_FLAGS). Every step resumes: re-run after
# an interruption and it continues where it stopped.
#   1. rebuild the kept responses' features and soft labels by one target prefill each (--topk 32)
#   2. one fit per arm, two at a time (PARALLEL=1), each with THREADS torch threads
#   3. tau of each arm's best draft on evaluation prompts (scripts/train_measure_tau.py)
#   4. the held-out curves of all arms in one plot ($PLOT)
# ARMS: ";"-separated "name=flags", the flags added to the common ones. The default compares
# hard-label CE against distillation of the target's top-k:
#   ARMS="hard=--distill-weight 0;distill=--distill-weight 0.5"
# the optimizer and the position weights, against the same hard arm:
#   ARMS="radam=--optimizer radam;gamma4=--gamma 4"
# DATA_FLAGS: other data than smollm2-c's first SHARDS shards (nothing is rebuilt then; the
# folders must hold their features already), e.g. the depth and warm-up comparison on d + e:
#   DATA_FLAGS="--data runs/data/smollm2-d --more-data [\"runs/data/smollm2-e\"]" START=runs/fit/d5/best
# INIT: how every arm starts (default: warm from START); to compare the target layers the
# draft reads, from scratch, each arm naming its own features (a later --data wins):
#   INIT="--init target" LR=1e-3 STEPS=600 WARMUP=0.04 GAMMA=4 TAU_N=10 DATA_FLAGS="--data runs/data/smollm2-e" \
#   ARMS="l27=;l29=--data runs/data/smollm2-e29" PLOT=docs/training_layers.png scripts/train_recipe.sh
# TAU_N: evaluation prompts per domain for step 3 (default 5)
set -euo pipefail
set -f  # no globbing: DATA_FLAGS may hold a JSON list, which a glob could expand
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2-c}
SHARDS=${SHARDS:-8}
STEPS=${STEPS:-250}
LR=${LR:-2e-4}
WARMUP=${WARMUP:-0.1}
THREADS=${THREADS:-1}
PARALLEL=${PARALLEL:-1}
START=${START:-dflash/drafts/smollm2-135m-instruct}
ARMS=${ARMS:-"hard=--distill-weight 0;distill=--distill-weight 0.5"}
PLOT=${PLOT:-docs/training_distill.png}
GAMMA=${GAMMA:-7}
INIT=${INIT:-"--init-from $START"}
TAU_N=${TAU_N:-5}
if [ -z "${DATA_FLAGS:-}" ]; then
    $PY -m dflash.cli train data --out "$DATA" --num-prompts 9000 --first-shard 94 --max-shards $((94 + SHARDS)) \
        --responses data/smollm2-c --threads "$THREADS"
    DATA_FLAGS="--data $DATA --data-shards $SHARDS"
fi
COMMON="$DATA_FLAGS --resume $INIT --num-layers 2 --loss-vocab draft
    --draft-vocab 8192 --batch-size 8 --anchors-per-seq 32 --lr $LR --warmup-frac $WARMUP --max-steps $STEPS
    --heldout-frac 0.1 --eval-every 25 --eval-tau-prompts 0 --ckpt-every 25 --gamma $GAMMA --threads $THREADS"
fit() {  # $1 arm name, $2 its flags
    # shellcheck disable=SC2086
    $PY -m dflash.cli train fit --out "runs/fit/$1" $COMMON $2 > "runs/fit/$1.log" 2>&1
}
tau() {  # $1 arm name
    $PY scripts/train_measure_tau.py "runs/fit/$1/best" --n "$TAU_N" --tokens 128 --threads "$THREADS" \
        --json "runs/tau/$1.json" > "runs/tau/$1.log" 2>&1
}
mkdir -p runs/fit runs/tau
IFS=';' read -r -a arms <<< "$ARMS"
names=("${arms[@]%%=*}")
for job in fit tau; do  # each arm, two at a time with PARALLEL=1
    for i in "${!arms[@]}"; do
        if [ $job = fit ]; then fit "${names[$i]}" "${arms[$i]#*=}" & else tau "${names[$i]}" & fi
        if [ "$PARALLEL" != 1 ] || [ $((i % 2)) = 1 ]; then wait; fi
    done
    wait
done
$PY -m dflash.cli train plot "${names[@]/#/runs/fit/}" --labels "${names[@]}" --out "$PLOT"
