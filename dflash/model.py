"""The seed's public API: `from dflash.model import DFlashDraftModel, dflash_generate`."""

from dflash.engine.config import DFlashConfig, default_target_layer_ids
from dflash.engine.draft import CheckpointError, DFlashDraftModel
from dflash.engine.loop import (
    GenerationError,
    GenerationResult,
    Step,
    dflash_generate,
    stream_generate,
)
from dflash.engine.sampling import SamplingParams
from dflash.engine.target import IncompatibleDraftError, TargetModel, check_compatible

__all__ = [
    "CheckpointError", "DFlashConfig", "DFlashDraftModel", "GenerationError", "GenerationResult",
    "IncompatibleDraftError", "SamplingParams", "Step", "TargetModel", "check_compatible",
    "default_target_layer_ids", "dflash_generate", "stream_generate",
]
