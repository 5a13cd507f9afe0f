"""The torch engine's sampling rules (dflash/engine/sampling.py), written in MLX for one sequence.

The parameters, the temperature floor and their checks are the engine's (`SamplingParams`,
engine/params.py); only the arithmetic is MLX. Same words as there: the draft's *accepted*
tokens, the *recovered* token sampled where a proposal is rejected, the *bonus* token sampled
after a fully accepted block. Randomness comes from `Keys`: explicit mx.random keys, so a
seeded generation repeats exactly."""

from __future__ import annotations

import mlx.core as mx

from dflash.engine.params import TEMPERATURE_FLOOR
from dflash.engine.request import SamplingParams


class Keys:
    """The random keys of one generation, one fresh key per draw: `seed` given, split from
    `mx.random.key(seed)`; None, mx.random's global state (seed it with `mx.random.seed`)."""

    def __init__(self, seed: int | None = None):
        self.key = None if seed is None else mx.random.key(seed)

    def next(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """logits: (..., V) -> float32 probabilities after temperature, top-k, then top-p: the
    engine's definition (scores shifted to a maximum of 0, ties with the k-th score kept,
    the smallest head of the sorted distribution whose mass reaches top_p)."""
    scores = logits.astype(mx.float32)
    scores = (scores - scores.max(axis=-1, keepdims=True)) / max(params.temperature, TEMPERATURE_FLOOR)  # (..., V)
    if 0 < params.top_k < scores.shape[-1]:
        kth = mx.topk(scores, params.top_k, axis=-1).min(axis=-1, keepdims=True)  # (..., 1)
        scores = mx.where(scores < kth, float("-inf"), scores)
    probs = mx.softmax(scores, axis=-1)  # (..., V)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)  # (..., V) most probable first
        ranked = mx.take_along_axis(probs, order, axis=-1)  # (..., V)
        ranked = mx.where(mx.cumsum(ranked, axis=-1) - ranked >= params.top_p, 0.0, ranked)
        probs = mx.put_along_axis(mx.zeros_like(probs), order, ranked, axis=-1)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array, key: mx.array | None) -> mx.array:
    """probs: (..., V) -> token ids (...)."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


def next_token(logits: mx.array, params: SamplingParams, keys: Keys) -> int:
    """logits: (V,) -> the target's own token."""
    if params.greedy:
        return int(mx.argmax(logits, axis=-1).item())
    return int(sample(probabilities(logits, params), keys.next()).item())


def accepted_prefix(ok: mx.array) -> int:
    """ok: (K,) bool per proposal -> length of the all-True prefix."""
    return int(mx.cumprod(ok.astype(mx.int32)).sum().item()) if ok.size else 0


def verify_greedy(tokens: mx.array, logits: mx.array) -> tuple[int, int]:
    """tokens: (K,) proposals; logits: (K+1, V) the target's. Returns (accepted, the target's
    token after them: the recovered token, or the bonus)."""
    own = mx.argmax(logits, axis=-1)  # (K+1,)
    n = accepted_prefix(tokens == own[:-1])
    return n, int(own[n].item())


def verify_match(tokens: mx.array, target_probs: mx.array, keys: Keys) -> tuple[int, int]:
    """Greedy draft, sample-and-match: the target samples at every position (K+1, V) and the
    proposals (K,) are accepted while they equal its samples."""
    own = sample(target_probs, keys.next())  # (K+1,)
    n = accepted_prefix(tokens == own[:-1])
    return n, int(own[n].item())


def verify_rejection(tokens: mx.array, draft_probs: mx.array, target_probs: mx.array,
                     keys: Keys) -> tuple[int, int]:
    """Speculative rejection sampling. tokens: (K,) sampled from draft_probs (K, V);
    target_probs: (K+1, V). Accept proposal i with probability min(1, p/q); at the first
    rejection recover from norm(max(0, p - q)); all accepted: the bonus from p."""
    k = tokens.shape[0]
    p = mx.take_along_axis(target_probs[:k], tokens[:, None], axis=-1)[:, 0]  # (K,)
    q = mx.take_along_axis(draft_probs, tokens[:, None], axis=-1)[:, 0]  # (K,)
    u = mx.random.uniform(shape=(k,), key=keys.next())  # (K,)
    n = accepted_prefix(u * q < p)
    p_next = target_probs[n]  # (V,) the target's distribution at the first rejection
    residual = mx.maximum(p_next - draft_probs[n], 0.0) if n < k else p_next  # (V,)
    total = float(residual.sum().item())
    residual = residual / total if total > 0 else p_next
    return n, int(sample(residual, keys.next()).item())
