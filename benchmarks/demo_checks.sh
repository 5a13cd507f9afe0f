#!/usr/bin/env bash
# The `make demo` prompt through `dflash generate --json --compare`, three times each: the
# default (hybrid, shipped draft), the draft's chain, and an UNTRAINED draft at block 16
# (the fixed chain: what a verify step costs; the default: what a user with no trained draft
# gets) against block 1. One JSON object per line into $OUT/demo_checks.jsonl. Run it with
# nothing else on the machine (torch uses its default thread count).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/cpu}
PROMPT="Write a Python function that checks whether a number is prime."
mkdir -p "$OUT"
: > "$OUT/demo_checks.jsonl"
run() {  # name, then the flags
    local name=$1; shift
    $PY -m dflash.cli generate "$PROMPT" --max-new-tokens 128 --compare --json "$@" 2>/dev/null \
        | $PY -c "import json,sys; d=json.load(sys.stdin); d['check']='$name'; d['flags']='$*'; d.pop('text',None); print(json.dumps(d))" \
        >> "$OUT/demo_checks.jsonl"
}
for i in 1 2 3; do
    run default
    run draft-chain --proposer draft
    run random-b16-fixed --draft random --block-size 16 --proposer draft --policy fixed
    run random-default --draft random
    run random-b1 --draft random --block-size 1
done
