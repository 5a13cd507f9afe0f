"""The seed's public API: `from dflash.model import DFlashDraftModel, dflash_generate`."""

from dflash.engine.config import DFlashConfig, default_target_layer_ids
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.errors import CheckpointError, GenerationError, IncompatibleDraftError
from dflash.engine.loop import GenerationResult, Step, dflash_generate, stream_generate
from dflash.engine.request import SamplingParams
from dflash.engine.stats import SpecStats
from dflash.engine.target import TargetModel, check_compatible

__all__ = [
    "CheckpointError", "DFlashConfig", "DFlashDraftModel", "GenerationError", "GenerationResult",
    "IncompatibleDraftError", "SamplingParams", "SpecStats", "Step", "TargetModel", "check_compatible",
    "default_target_layer_ids", "dflash_generate", "stream_generate",
]
