"""dflash: lossless block-diffusion speculative decoding (DFlash) for Hugging Face LLMs.

The public names (`DFlashDraftModel`, `dflash_generate`, `stream_generate`, ...) are importable
from here and from `dflash.model`; they load on first use, so `import dflash` stays light (the
MLX backend never imports torch). Packages: engine (the loop and its parts), text (tokenizer,
prompts, detokenizer, the text session), serve, bench, train, backends (mlx, vllm), cli."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "DFlashConfig": "dflash.engine.config", "default_target_layer_ids": "dflash.engine.config",
    "CheckpointError": "dflash.engine.errors", "GenerationError": "dflash.engine.errors",
    "IncompatibleDraftError": "dflash.engine.errors", "ConfigError": "dflash.engine.errors",
    "DFlashDraftModel": "dflash.engine.draft", "TargetModel": "dflash.engine.target",
    "check_compatible": "dflash.engine.target", "SamplingParams": "dflash.engine.request",
    "GenerationResult": "dflash.engine.loop", "Step": "dflash.engine.loop",
    "dflash_generate": "dflash.engine.loop", "stream_generate": "dflash.engine.loop",
    "SpecStats": "dflash.engine.stats",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'dflash' has no attribute {name!r}")
