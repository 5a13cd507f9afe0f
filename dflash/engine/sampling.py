"""Sampling and lossless verification of a drafted block (docs/METHOD.md §2).

Words as in vLLM's rejection sampler: the draft's *accepted* tokens (those the target agreed
with), the *recovered* token the target gives at the first rejected position, and the *bonus*
token it gives after a fully accepted block. The engine uses these words throughout. Every
function works on a batch, with shape comments on each argument."""

from __future__ import annotations

import torch

from dflash.engine.params import TEMPERATURE_FLOOR
from dflash.engine.request import RULES, SamplingParams  # noqa: F401  (defined torch-free, used here)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: (..., V) -> float32 probabilities after temperature, top-k, then top-p.
    The logits are shifted so their maximum is 0 before the division: every score is then <= 0
    and the largest exactly 0, so no temperature (>= the floor) can overflow to inf or nan."""
    scores = logits.float()
    scores = (scores - scores.amax(-1, keepdim=True)) / max(params.temperature, TEMPERATURE_FLOOR)  # (..., V)
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # keep the smallest head reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs: (..., V) -> tokens (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator=None) -> torch.Tensor:
    """logits: (B, V) -> (B,) the target's own token."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, params), generator)


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """ok: (B, K) bool per draft position -> (B,) length of the all-True prefix."""
    return ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    """draft_tokens: (B, K); target_logits: (B, K+1, V).
    Returns (num_accepted (B,), recovered-or-bonus token (B,)): the target's argmax at the first
    rejected position, or after the block when all K are accepted."""
    target_tokens = target_logits.argmax(-1)  # (B, K+1)
    num_accepted = accepted_prefix(draft_tokens == target_tokens[:, :-1])  # (B,)
    return num_accepted, target_tokens.gather(1, num_accepted[:, None])[:, 0]


def verify_match(draft_tokens: torch.Tensor, target_probs: torch.Tensor, generator=None):
    """Greedy draft, sample-and-match. draft_tokens: (B, K); target_probs: (B, K+1, V).
    The target samples at every position; proposals are accepted while they equal its sample.
    Returns (num_accepted (B,), recovered-or-bonus token (B,)): its sample after them."""
    target_tokens = sample(target_probs, generator)  # (B, K+1)
    num_accepted = accepted_prefix(draft_tokens == target_tokens[:, :-1])  # (B,)
    return num_accepted, target_tokens.gather(1, num_accepted[:, None])[:, 0]


def verify_rejection(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator=None):
    """Speculative rejection sampling. draft_tokens: (B, K) sampled from draft_probs (B, K, V);
    target_probs: (B, K+1, V). Returns (num_accepted (B,), recovered-or-bonus token (B,))."""
    b, k = draft_tokens.shape
    p = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # (B, K)
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # (B, K)
    u = torch.rand(p.shape, generator=generator, device=p.device)  # (B, K)
    num_accepted = accepted_prefix(u * q < p)  # accept with probability min(1, p/q)
    rows = torch.arange(b, device=p.device)
    p_next = target_probs[rows, num_accepted]  # (B, V) target's distribution at the first rejection
    q_next = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, draft_probs.shape[-1])], 1)[rows, num_accepted]  # (B, V)
    residual = (p_next - q_next).clamp_min(0)  # all-accepted rows: q_next = 0, so this is p (bonus)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)
    return num_accepted, sample(residual, generator)
