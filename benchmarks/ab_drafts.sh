#!/usr/bin/env bash
# Two drafts of the same shape in ONE benchmark run: `dflash bench --draft A --compare-draft B`
# loads the target once and runs the draft's chain and the default (hybrid) with each draft,
# beside the target alone, on the same prompts, the method order rotating prompt by prompt, so
# a drift of this machine's speed during the run falls on both drafts alike (two runs one after
# the other have seen the target run 10% slower in the second half). Both drafts share the
# machine's cost model (engine/costmodel.py: measured once per target and draft shape, then
# cached). Run it with nothing else on the machine. A, B: the two draft folders; OUT: where
# results.json and results.md go (B's methods are named METHOD@B).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu/ab}
A=${A:?A=the first draft folder}
B=${B:?B=the second draft folder}
mkdir -p "$OUT"
$PY -m dflash.cli bench --datasets humaneval math mtbench sharegpt --limit "${LIMIT:-5}" \
    --max-new-tokens "${TOKENS:-256}" --block-size 16 --proposers hybrid --prompt-lookup 0 \
    --no-loop-baseline --threads "${THREADS:-2}" --draft "$A" --compare-draft "$B" \
    --output "$OUT/results.json" --markdown "$OUT/results.md"
