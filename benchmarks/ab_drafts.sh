#!/usr/bin/env bash
# Two drafts of the same shape, one after the other, under ONE cost model: the engine's verify
# and draft cost curves are measured once per machine, target and draft shape and cached
# (engine/costmodel.py), so the second run reuses what the first measured (run run_cpu.sh
# first, or let the first run here measure it). Speedups across separate run_cpu.sh runs also
# move with that start-up measurement; within this script only the draft differs. Each run has
# its own target-alone baseline, interleaved prompt by prompt. Run it with nothing else on the
# machine.  A, B: the two draft folders; OUT: where results-a.* and results-b.* go.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu/ab}
A=${A:?A=the first draft folder}
B=${B:?B=the second draft folder}
mkdir -p "$OUT"
for side in a b; do
    draft=$A; [ "$side" = b ] && draft=$B
    $PY -m dflash.cli bench --datasets humaneval math mtbench sharegpt --limit "${LIMIT:-5}" \
        --max-new-tokens "${TOKENS:-256}" --block-size 16 --proposers hybrid --prompt-lookup 0 \
        --no-loop-baseline --threads "${THREADS:-2}" --draft "$draft" \
        --output "$OUT/results-$side.json" --markdown "$OUT/results-$side.md"
done
