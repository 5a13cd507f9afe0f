"""The seed's public API: `from dflash.model import DFlashDraftModel, dflash_generate`."""

from .config import DFlashConfig, default_target_layer_ids
from .draft import CheckpointError, DFlashDraftModel
from .generate import GenerationError, GenerationResult, Step, dflash_generate, stream_generate
from .sampling import SamplingParams
from .target import IncompatibleDraftError, TargetModel, check_compatible

__all__ = [
    "CheckpointError", "DFlashConfig", "DFlashDraftModel", "GenerationError", "GenerationResult",
    "IncompatibleDraftError", "SamplingParams", "Step", "TargetModel", "check_compatible",
    "default_target_layer_ids", "dflash_generate", "stream_generate",
]
