#!/usr/bin/env bash
# The committed CPU benchmark (docs/PERFORMANCE.md): the step profile and cost curve, then
# every method interleaved prompt by prompt on the four offline prompt sets.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu}
LIMIT=${LIMIT:-6}
$PY -m dflash.bench profile --out "$OUT/profile" ${PROFILE_ARGS:-}
$PY -m dflash.bench bench --datasets humaneval math mtbench sharegpt --limit "$LIMIT" --max-new-tokens 128 \
    --block-size 8 16 --output "$OUT/results.json" --markdown "$OUT/results.md" --plots "$OUT" \
    --profile-json "$OUT/profile/profile.json" ${BENCH_ARGS:-}
