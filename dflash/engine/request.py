"""What a generation request may ask, checked once and torch-free, so the torch loop and the
MLX loop accept and refuse exactly the same things: `SamplingParams` (temperature, top-p,
top-k, the verification rule), `TargetInfo` (the few numbers of a target the checks need),
`check_pair` (does this draft fit this target) and `check_request` (prompt, lengths, block
size, mask id, draft threshold)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dflash.engine.errors import GenerationError, IncompatibleDraftError
from dflash.engine.params import effective_temperature

RULES = ("rejection", "match")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # "rejection": the draft samples from its own q, accept with min(1, p/q), recover from
    # norm(max(0, p - q)); "match": greedy draft, sample the target and accept while equal.
    rule: str = "rejection"

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", effective_temperature(self.temperature))  # below the floor: greedy
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.rule not in RULES:
            raise ValueError(f"unknown verification rule {self.rule!r}; use one of {RULES}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TargetInfo:
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the embedding table
    max_positions: int
    model_type: str = "?"


def check_pair(config, info: TargetInfo) -> None:
    """Raise IncompatibleDraftError naming every mismatch between a draft config and a target."""
    problems = pair_problems(config, info)
    if problems:
        raise IncompatibleDraftError("draft does not fit this target: " + "; ".join(problems))


def pair_problems(config, info: TargetInfo) -> list[str]:
    """Every mismatch between a draft config and a target, named (empty when they fit)."""
    problems = []
    if config.hidden_size != info.hidden_size:
        problems.append(f"draft hidden_size {config.hidden_size} != target hidden_size {info.hidden_size}")
    if config.vocab_size != info.vocab_size:
        problems.append(f"draft vocab_size {config.vocab_size} != target vocabulary {info.vocab_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < info.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {info.num_layers} layers")
    if not 0 <= config.mask_token_id < info.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} outside the target vocabulary of {info.vocab_size}")
    if config.num_target_layers != info.num_layers:
        problems.append(f"draft was built for a {config.num_target_layers}-layer target, this one has {info.num_layers}")
    return problems


@dataclass(frozen=True)
class Checked:
    block_size: int
    mask_id: int | None
    max_new_tokens: int  # cut to the room the target's context leaves


def check_request(draft_config, info: TargetInfo, ids: Sequence[int] | None, num_ids: int, max_new_tokens,
                  block_size=None, mask_token_id=None, draft_threshold=0.0, id_range=None,
                  other_proposer: bool = False) -> Checked:
    """Check one request against the draft config (None: no draft) and the target. `num_ids`
    is the prompt length; `id_range` the prompt's (min id, max id) when already known (a
    tensor's min/max), else taken from `ids`. `other_proposer`: proposals come from elsewhere
    (an n-gram index), so a block needs no draft. Raise GenerationError naming the problem."""
    if num_ids == 0:
        raise GenerationError("the prompt is empty: give at least one token")
    if num_ids >= info.max_positions:
        raise GenerationError(f"the prompt has {num_ids} tokens but the target's context holds {info.max_positions}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    lo, hi = id_range if id_range is not None else (min(ids), max(ids))
    if lo < 0 or hi >= info.vocab_size:
        raise GenerationError(f"the prompt holds ids outside the target vocabulary of {info.vocab_size}")
    if not (isinstance(draft_threshold, (int, float)) and 0.0 <= draft_threshold <= 1.0):
        raise GenerationError(f"draft_threshold must be a probability in [0, 1], got {draft_threshold!r}")
    if block_size is None:  # the draft's; 16 for another proposer alone; else plain decoding
        block_size = draft_config.block_size if draft_config is not None else (16 if other_proposer else 1)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise GenerationError(f"block_size must be an integer >= 1, got {block_size!r}")
    mask_id = draft_config.mask_token_id if mask_token_id is None and draft_config is not None else mask_token_id
    if block_size > 1 and draft_config is None and not other_proposer:
        raise GenerationError("block_size > 1 needs a draft model (or another proposer)")
    if block_size > 1 and draft_config is not None:
        check_pair(draft_config, info)
        if not 0 <= mask_id < info.vocab_size:
            raise GenerationError(f"mask_token_id {mask_id} is outside the target vocabulary of {info.vocab_size}")
    return Checked(block_size, mask_id, min(max_new_tokens, info.max_positions - num_ids))
