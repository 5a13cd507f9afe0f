"""The MLX backend: DFlash speculative decoding on an mlx-lm target (docs/MLX.md).

    from dflash.model_mlx import load, load_draft, stream_generate
    model, tokenizer = load("path/to/target")           # through mlx-lm
    draft = load_draft("path/to/draft")                  # the DFLASH.md §4 checkpoint
    for r in stream_generate(model, draft, tokenizer, "Hello", max_tokens=64):
        print(r.text, end="")

The loop is the PyTorch engine's (dflash/generate.py, DFLASH.md §2): greedy output equals
the target's own greedy output token for token; with temperature > 0 the target samples
its token at every block position and greedy proposals are accepted while they match it,
which is exactly the target's sampling distribution."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from dflash.backends.mlx.draft import DraftCache, MLXDraftModel, load_draft
from dflash.backends.mlx.target import (
    MLXTarget,
    TargetCache,
    UnsupportedTargetError,
    WindowKVCache,
    as_target,
)
from dflash.engine.errors import IncompatibleDraftError

__all__ = ["load", "load_draft", "stream_generate", "generate", "DFlashResponse", "MLXDraftModel",
           "MLXTarget", "DraftCache", "TargetCache", "WindowKVCache", "UnsupportedTargetError"]


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
    proposed: int  # draft proposals made this step (0 for the prefill token)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # generated so far
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop", "length" or None while running
    token: int = field(default=-1)  # the last of `tokens` (mlx-lm's field name)

    def __post_init__(self):
        if self.tokens:
            self.token = self.tokens[-1]


def _pick(logits: mx.array, temperature: float) -> mx.array:
    """(..., V) -> (...) token ids: argmax, or a sample at the given temperature."""
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits.astype(mx.float32) * (1.0 / temperature), axis=-1)


def _propose(draft: MLXDraftModel, target: MLXTarget, cache: DraftCache, ctx_hidden, last: int, pos: int,
             size: int, mask_id: int) -> list[int]:
    """One parallel draft pass over [last, mask x (size-1)] at positions pos..pos+size-1;
    returns the size-1 greedy proposals and crops the block's K/V off the draft cache."""
    block = mx.array([[last] + [mask_id] * (size - 1)])  # (1, S)
    noise = target.embed(block)  # (1, S, H)
    scale = draft.config.input_embedding_scale
    if scale != 1.0:
        noise = noise * scale
    hidden = draft(noise, ctx_hidden, cache)  # (1, S, H)
    proposals = mx.argmax(target.logits(hidden[:, 1:].astype(target.dtype)), axis=-1)  # (1, S-1)
    mx.eval(proposals)
    cache.crop_to(pos)  # keep the context, drop the block's K/V
    return proposals[0].tolist()


def _as_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


def _check(draft, target: MLXTarget, ids, block_size, max_tokens, temperature):
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if min(ids) < 0 or max(ids) >= target.vocab_size:
        raise ValueError(f"the prompt holds ids outside the target vocabulary of {target.vocab_size}")
    if len(ids) >= target.max_positions:
        raise ValueError(f"the prompt has {len(ids)} tokens but the target's context holds {target.max_positions}")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if block_size is None:
        block_size = draft.block_size if draft is not None else 1
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if block_size > 1:
        if draft is None:
            raise ValueError("block_size > 1 needs a draft model")
        c, problems = draft.config, []
        if c.hidden_size != target.hidden_size:
            problems.append(f"draft hidden_size {c.hidden_size} != target {target.hidden_size}")
        if c.vocab_size != target.vocab_size:
            problems.append(f"draft vocab_size {c.vocab_size} != target vocabulary {target.vocab_size}")
        if c.num_target_layers != target.num_layers or not all(0 <= i < target.num_layers for i in c.target_layer_ids):
            problems.append(f"draft built for a {c.num_target_layers}-layer target (layers {c.target_layer_ids}), "
                            f"this one has {target.num_layers}")
        if not 0 <= c.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {c.mask_token_id} outside the target vocabulary of {target.vocab_size}")
        if problems:

            raise IncompatibleDraftError("draft does not fit this target: " + "; ".join(problems))
    return block_size, min(max_tokens, target.max_positions - len(ids))


def _prefill(target: MLXTarget, ids: list[int], cache: TargetCache, layer_ids, step: int):
    """Run the prompt through the target in chunks; the last position's logits (1, 1, V)
    and the chosen layers' hidden states of the whole prompt (1, T, k*H) or None."""
    hidden = []
    for start in range(0, len(ids), step):
        logits, h = target(mx.array([ids[start: start + step]]), cache, layer_ids, last_only=True)
        mx.eval(logits, *([h] if h is not None else []))  # materialises the caches too
        if h is not None:
            hidden.append(h)
    return logits, (mx.concatenate(hidden, axis=1) if hidden else None)


def stream_tokens(model, draft: MLXDraftModel | None, ids: list[int], block_size: int | None = None,
                  max_tokens: int = 256, temperature: float = 0.0, stop_token_ids=(),
                  draft_window: int | None = None, prefill_step_size: int = 2048,
                  ) -> Iterator[tuple[list[int], int, int, str | None]]:
    """The loop on token ids: yields (new tokens, proposed, accepted, finish_reason) per step.
    The prompt is prefilled in chunks of prefill_step_size tokens, as mlx-lm does."""
    target = as_target(model)
    block_size, max_tokens = _check(draft, target, ids, block_size, max_tokens, temperature)
    if max_tokens == 0:
        return
    stop = frozenset(int(t) for t in stop_token_ids)
    layer_ids = draft.target_layer_ids if block_size > 1 else None
    mask_id = draft.mask_token_id if block_size > 1 else 0
    cache = target.new_cache()
    draft_cache = draft.new_cache(draft_window) if block_size > 1 else None

    logits, ctx_hidden = _prefill(target, ids, cache, layer_ids, prefill_step_size)  # (1, 1, V), (1, T, kH)
    last = int(_pick(logits[0, -1], temperature).item())
    generated, pos = 1, len(ids)  # pos: position of `last`, not yet in the target cache
    finish = "stop" if last in stop else ("length" if generated >= max_tokens else None)
    yield [last], 0, 0, finish

    while finish is None:
        size = min(block_size, max_tokens - generated)  # the block can yield up to `size` tokens
        proposals = _propose(draft, target, draft_cache, ctx_hidden, last, pos, size, mask_id) if size > 1 else []
        logits, hidden = target(mx.array([[last] + proposals]), cache, layer_ids)  # (1, S, V), (1, S, kH)
        picked = _pick(logits[0], temperature).tolist()  # (S,) the target's own token at each position
        n = 0
        while n < len(proposals) and proposals[n] == picked[n]:
            n += 1
        new = proposals[:n] + [picked[n]]
        for i, t in enumerate(new):  # stop tokens are looked for among the new tokens only
            if t in stop:
                new, finish = new[: i + 1], "stop"
                break
        cache.crop_to(pos + len(new))  # keep `last` and the accepted proposals
        if hidden is not None:
            ctx_hidden = hidden[:, : len(new)]  # (1, n, kH) the draft's next context
        last, pos, generated = new[-1], pos + len(new), generated + len(new)
        if finish is None and generated >= max_tokens:
            finish = "length"
        yield new, size - 1, n, finish


def stream_generate(model, draft: MLXDraftModel | None, tokenizer, prompt, block_size: int | None = None,
                    max_tokens: int = 256, temperature: float = 0.0, draft_window: int | None = None,
                    stop_token_ids=None, prefill_step_size: int = 2048) -> Iterator[DFlashResponse]:
    """Speculative generation on an mlx-lm target. prompt: text or token ids. One
    DFlashResponse per loop step. block_size 1 (or draft None) is plain target decoding.
    draft_window: keep at most this many context positions in the draft's cache (default:
    the draft's sliding_window_size). stop_token_ids: default the tokenizer's eos ids."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _as_ids(tokenizer, prompt)
    stop = set(tokenizer.eos_token_ids) if stop_token_ids is None else set(stop_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps, generated = 0.0, 0
    for i, (new, proposed, accepted, finish) in enumerate(
            stream_tokens(model, draft, ids, block_size, max_tokens, temperature, stop, draft_window,
                          prefill_step_size)):
        if i == 0:
            prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
        generated += len(new)
        for t in new:
            if t not in stop:
                detokenizer.add_token(t)
        if finish is not None:
            detokenizer.finalize()
        yield DFlashResponse(
            text=detokenizer.last_segment, tokens=new, accepted=accepted, proposed=proposed,
            prompt_tokens=len(ids), prompt_tps=prompt_tps, generation_tokens=generated,
            generation_tps=generated / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)


def generate(model, draft, tokenizer, prompt, **kwargs) -> str:
    """The whole text of stream_generate."""
    return "".join(r.text for r in stream_generate(model, draft, tokenizer, prompt, **kwargs))
