#!/usr/bin/env bash
# The committed CPU benchmark (docs/PERFORMANCE.md): the step profile and cost curve, then
# every method interleaved prompt by prompt on the four offline prompt sets. THREADS: torch
# threads (2 = both cores of this machine when nothing else runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu}
THREADS=${THREADS:-2}
$PY -m dflash.cli profile --threads "$THREADS" --clock wall --out "$OUT/profile"
$PY -m dflash.cli bench --datasets humaneval math mtbench sharegpt --limit "${LIMIT:-4}" --max-new-tokens 128 \
    --block-size 4 16 --draft-threshold 0.3 --threads "$THREADS" --time-budget "${BUDGET:-1500}" \
    --output "$OUT/results.json" --markdown "$OUT/results.md" --plots "$OUT" \
    --profile-json "$OUT/profile/profile.json"
