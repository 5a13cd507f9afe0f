#!/usr/bin/env bash
# The committed CPU benchmark (docs/PERFORMANCE.md): the step profile and cost curve (both
# kernel settings side by side), then every method interleaved prompt by prompt on the four
# offline prompt sets. Run it with nothing else on the machine. THREADS: torch threads (2 =
# both cores of a 2-core machine); LIMIT prompts per set; TOKENS new tokens per prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu}
THREADS=${THREADS:-2}
$PY -m dflash.cli profile --threads "$THREADS" --clock wall --out "$OUT/profile"
$PY -m dflash.cli bench --datasets humaneval math mtbench sharegpt --limit "${LIMIT:-5}" \
    --max-new-tokens "${TOKENS:-256}" --block-size 16 --proposers tree suffix hybrid --adaptive \
    --threads "$THREADS" --time-budget "${BUDGET:-3600}" \
    --output "$OUT/results.json" --markdown "$OUT/results.md" --plots "$OUT" \
    --profile-json "$OUT/profile/profile.json"
