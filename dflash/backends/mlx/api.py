"""The MLX backend's public entry: DFlash speculative decoding on an mlx-lm target (docs/MLX.md).

    from dflash.model_mlx import load, load_draft, stream_generate
    model, tokenizer = load("path/to/target")           # through mlx-lm
    draft = load_draft("path/to/draft")                  # a DFlash checkpoint folder
    for r in stream_generate(model, draft, tokenizer, "Hello", max_tokens=64):
        print(r.text, end="")

The loop is the torch engine's (loop.py here mirrors dflash/engine/loop.py): greedy output is
the target's own greedy output token for token; sampled output (rejection sampling, or
sample-and-match) follows the target's own sampling distribution, with the same temperature,
top-k and top-p. Each response carries the engine's `SpecStats` of the steps so far."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from dflash.backends.mlx.draft import DraftCache, MLXDraftModel, load_draft
from dflash.backends.mlx.loop import Step, stream_tokens
from dflash.backends.mlx.target import MLXTarget, TargetCache, UnsupportedTargetError, WindowKVCache
from dflash.engine.request import SamplingParams
from dflash.engine.stats import SpecStats

__all__ = [
    "DFlashResponse",
    "DraftCache",
    "MLXDraftModel",
    "MLXTarget",
    "Step",
    "TargetCache",
    "UnsupportedTargetError",
    "WindowKVCache",
    "generate",
    "load",
    "load_draft",
    "stream_generate",
    "stream_tokens",
]


def _rope_overrides(config: dict) -> dict:
    """transformers 5 writes RoPE settings only as `rope_parameters` (per layer type for
    gemma3), which mlx-lm's llama and gemma3_text read as their defaults: translate them."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config:
        return {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention")
    out = {"rope_theta": full["rope_theta"]} if "rope_theta" in full else {}
    if full.get("rope_type") not in (None, "default"):
        out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if isinstance(local, dict) and "rope_theta" in local:
        out["rope_local_base_freq"] = local["rope_theta"]
    return out


def load(target_path, model_config: dict | None = None, **kwargs):
    """(model, tokenizer) through `mlx_lm.load`; the model is mlx-lm's own (usable with
    mlx-lm's generate too); stream_generate wraps it in an MLXTarget."""
    from mlx_lm import load as mlx_load

    path = Path(target_path)
    overrides = {}
    if (path / "config.json").is_file():
        overrides = _rope_overrides(json.loads((path / "config.json").read_text()))
    return mlx_load(str(target_path), model_config={**overrides, **(model_config or {})}, **kwargs)


@dataclass
class DFlashResponse:
    """One loop step: the prefill token first, then each verified block."""
    text: str  # the next segment of decoded text (stop tokens are not decoded)
    tokens: list[int]  # the new tokens of this step, in order
    accepted: int  # draft proposals accepted this step
    proposed: int  # draft proposals verified this step (0 for the prefill token and plain steps)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # generated so far
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop", "length" or None while running
    stats: SpecStats = field(default_factory=SpecStats)  # the verify steps so far (engine/stats.py)
    token: int = field(default=-1)  # the last of `tokens` (mlx-lm's field name)

    def __post_init__(self):
        if self.tokens:
            self.token = self.tokens[-1]

    @property
    def mean_acceptance_length(self) -> float:
        """tau so far: tokens per verify step with proposals, the recovered or bonus token included."""
        return self.stats.mean_acceptance_length


def _as_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


def stream_generate(model, draft: MLXDraftModel | None, tokenizer, prompt, block_size: int | None = None,
                    max_tokens: int = 256, temperature: float = 0.0, draft_window: int | None = None,
                    stop_token_ids=None, prefill_step_size: int = 2048, *, top_p: float = 1.0, top_k: int = 0,
                    rule: str = "rejection", seed: int | None = None, draft_threshold: float = 0.0
                    ) -> Iterator[DFlashResponse]:
    """Speculative generation on an mlx-lm target. prompt: text or token ids. One
    DFlashResponse per loop step. block_size 1 (or draft None) is plain target decoding.
    temperature / top_p / top_k / rule: the engine's `SamplingParams` (below 1e-5 is greedy).
    seed: explicit mx.random keys (None: mx.random's global state). draft_window: keep at most
    this many context positions in the draft's cache (default: the draft's
    sliding_window_size). draft_threshold: verify only the leading proposals the draft gives
    at least that probability. stop_token_ids: default the tokenizer's eos ids."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    params = SamplingParams(temperature, top_p, top_k, rule)
    ids = _as_ids(tokenizer, prompt)
    stop = set(tokenizer.eos_token_ids) if stop_token_ids is None else set(stop_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps, generated, stats = 0.0, 0, SpecStats()
    steps = stream_tokens(model, draft, ids, max_tokens=max_tokens, stop_token_ids=stop, params=params,
                          block_size=block_size, seed=seed, draft_window=draft_window,
                          draft_threshold=draft_threshold, prefill_step_size=prefill_step_size)
    for i, step in enumerate(steps):
        if i == 0:
            prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
        else:  # the prefill token is no verify step
            stats.add_step(step)
        generated += len(step.tokens)
        for t in step.tokens:
            if t not in stop:
                detokenizer.add_token(t)
        if step.finish_reason is not None:
            detokenizer.finalize()
        yield DFlashResponse(
            text=detokenizer.last_segment, tokens=step.tokens, accepted=step.accepted, proposed=step.proposed,
            prompt_tokens=len(ids), prompt_tps=prompt_tps, generation_tokens=generated,
            generation_tps=generated / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=step.finish_reason,
            stats=stats.merge(SpecStats()))


def generate(model, draft, tokenizer, prompt, **kwargs) -> str:
    """The whole text of stream_generate."""
    return "".join(r.text for r in stream_generate(model, draft, tokenizer, prompt, **kwargs))
