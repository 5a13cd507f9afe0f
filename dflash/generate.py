"""Kept for users of `dflash.generate.stream_generate`: the loop lives in `dflash.engine.loop`."""

from dflash.engine.loop import (
    GenerationError,
    GenerationResult,
    Step,
    dflash_generate,
    stream_generate,
)

__all__ = ["GenerationError", "GenerationResult", "Step", "dflash_generate", "stream_generate"]
