#!/usr/bin/env bash
# The committed CPU benchmark (docs/PERFORMANCE.md): the step profile and cost curve, then
# every method interleaved prompt by prompt on the four offline prompt sets. One torch
# thread: on this shared 2-core machine two threads lose 3-4x to the other jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu}
$PY -m dflash.bench profile --threads 1 --clock cpu --out "$OUT/profile"
$PY -m dflash.bench bench --datasets humaneval math mtbench sharegpt --limit "${LIMIT:-4}" --max-new-tokens 128 \
    --block-size 16 --draft-vocab 8192 --threads 1 --time-budget "${BUDGET:-2200}" \
    --output "$OUT/results.json" --markdown "$OUT/results.md" --plots "$OUT" \
    --profile-json "$OUT/profile/profile.json"
