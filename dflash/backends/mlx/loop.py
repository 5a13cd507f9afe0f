"""The speculative loop in MLX, the torch engine's loop (dflash/engine/loop.py) step for step:
prefill, then a *proposer* drafts a block (`DraftProposer`, over the draft vocabulary if the
draft has one), the *policy* cuts it (`engine.policy.ThresholdPolicy`: the draft threshold),
the target verifies it with the lazy head (row 0 first) and a *verdict* (greedy, sample-and-
match or rejection sampling), and both caches roll back to the committed tokens.

Shared with the torch engine, not copied: the argument checks (`engine.request.check_request`
on the target's `TargetInfo`), the sampling parameters and temperature floor (`SamplingParams`),
the verify policies (`engine.policy`) and the statistics (`engine.stats.SpecStats`, folded by
the caller). The sampling arithmetic is MLX (`sampling.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from dflash.backends.mlx.draft import MLXDraftModel
from dflash.backends.mlx.sampling import (
    Keys,
    next_token,
    probabilities,
    sample,
    verify_greedy,
    verify_match,
    verify_rejection,
)
from dflash.backends.mlx.target import MLXTarget, TargetCache, as_target
from dflash.engine.policy import StepPlan, ThresholdPolicy, VerifyPolicy
from dflash.engine.request import SamplingParams, check_request


class Step(NamedTuple):
    """What one loop step committed (the torch loop's `Step`, as a tuple)."""
    tokens: list[int]  # the new tokens, in order (the accepted ones, then the recovered or bonus token)
    proposed: int  # proposals verified this step (0 for the prefill token and plain steps)
    accepted: int  # of which accepted
    finish_reason: str | None  # "stop", "length" or None while running
    drafted: bool = False  # whether the draft ran for this step's proposals


@dataclass
class Proposal:
    """One step's proposals: the tokens to verify, and what the verdict and the policy need."""
    tokens: mx.array  # (K,) vocabulary ids
    probs: mx.array | None = None  # (K, V) the proposer's q, for rejection sampling; None: deterministic
    conf: mx.array | None = None  # (K,) the proposer's top probability at each slot, for the policy

    def slice(self, start: int, stop: int | None) -> Proposal:
        probs = None if self.probs is None else self.probs[start:stop]
        conf = None if self.conf is None else self.conf[start:stop]
        return Proposal(self.tokens[start:stop], probs, conf)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


@dataclass
class DraftHead:
    """The head the draft proposes with: the target's whole output projection, or only the
    rows of the draft vocabulary (`dflash_config.draft_vocab`), plus the rows of the ids the
    text brought in that the vocabulary lacks (`widened`, as the torch engine's head)."""
    ids: mx.array | None = None  # (Kv,) vocabulary ids of the rows, None = the full head
    rows: mx.array | None = None  # (Kv, H)
    extra_ids: mx.array | None = None  # (E,) ids the text brought in, none of them in `ids`
    extra_rows: mx.array | None = None  # (E, H)
    known: frozenset[int] = frozenset()  # ids and extra_ids
    columns: mx.array | None = None  # (Kv + E,) ids then extra_ids, built once per widening

    @classmethod
    def build(cls, draft: MLXDraftModel, target: MLXTarget) -> DraftHead:
        if draft.config.draft_vocab is None:
            return cls()
        ids = mx.array(draft.config.draft_vocab, dtype=mx.int32)  # (Kv,)
        return cls(ids, target.head_rows(ids), known=frozenset(draft.config.draft_vocab), columns=ids)

    @property
    def vocab(self) -> mx.array | None:
        """(Kv + E,) the ids of the logits' columns, None = the whole vocabulary."""
        return self.columns

    def widened(self, tokens, target: MLXTarget) -> DraftHead:
        """This head with the rows of `tokens`' ids it lacks (itself when it lacks none)."""
        new = sorted({int(t) for t in tokens} - self.known) if self.ids is not None else []
        if not new:
            return self
        ids = mx.array(new, dtype=mx.int32)  # (E',)
        rows = target.head_rows(ids)  # (E', H)
        if self.extra_ids is not None:
            ids, rows = mx.concatenate([self.extra_ids, ids]), mx.concatenate([self.extra_rows, rows])
        return DraftHead(self.ids, self.rows, ids, rows, self.known | frozenset(new), mx.concatenate([self.ids, ids]))

    def logits(self, target: MLXTarget, hidden: mx.array) -> mx.array:
        """hidden: (S, H) -> (S, V or Kv + E) the draft's logits."""
        logits = target.logits(hidden, self.rows)  # (S, V or Kv)
        if self.extra_ids is None:
            return logits
        return mx.concatenate([logits, target.logits(hidden, self.extra_rows)], axis=-1)  # (S, Kv + E)

    def to_vocab(self, idx: mx.array) -> mx.array:
        """Row indices (K,) -> vocabulary ids (K,)."""
        vocab = self.vocab
        return idx if vocab is None else vocab[idx]

    def full_probs(self, q: mx.array, vocab_size: int) -> mx.array:
        """q: (K, Kv + E) over the draft's columns -> (K, V) over the whole vocabulary."""
        vocab = self.vocab
        if vocab is None:
            return q
        full = mx.zeros((q.shape[0], vocab_size), dtype=q.dtype)  # (K, V)
        full[:, vocab] = q
        return full


class DraftProposer:
    """The DFlash draft as a proposer: one parallel pass over [last, mask x (size-1)] reading
    the target's hidden states of the committed tokens it has not seen yet; with a draft
    vocabulary and `context_vocab`, its head also proposes the prompt's and the committed
    text's ids the vocabulary lacks."""

    def __init__(self, draft: MLXDraftModel, target: MLXTarget, params: SamplingParams, mask_id: int,
                 keys: Keys, window: int | None = None, context_vocab: bool = True):
        self.draft, self.target, self.params, self.mask_id, self.keys = draft, target, params, mask_id, keys
        self.layer_ids = draft.config.target_layer_ids  # the target layers whose outputs are the context
        self.cache = draft.new_cache(window)
        self.head = DraftHead.build(draft, target)
        self.context_vocab = context_vocab

    def start(self, prompt) -> None:
        if self.context_vocab:
            self.head = self.head.widened(prompt, self.target)

    def commit(self, tokens) -> None:
        if self.context_vocab:
            self.head = self.head.widened(tokens, self.target)

    def propose(self, ctx_hidden: mx.array, last: int, pos: int, size: int, want_conf: bool = False) -> Proposal:
        """ctx_hidden: (1, C, kH) the context not yet in the draft cache; last: the last
        committed token, at position `pos`; -> size-1 proposals."""
        block = mx.array([[last] + [self.mask_id] * (size - 1)])  # (1, S)
        noise = self.target.embed(block, self.draft.config.input_embedding_scale)  # (1, S, H)
        hidden = self.draft(noise, ctx_hidden, self.cache)  # (1, S, H)
        logits = self.head.logits(self.target, hidden[0, 1:].astype(self.target.dtype))  # (S-1, V or Kv + E)
        if self.params.greedy or self.params.rule == "match":
            idx = mx.argmax(logits, axis=-1)  # (S-1,)
            conf = mx.softmax(logits.astype(mx.float32), axis=-1).max(axis=-1) if want_conf else None  # (S-1,)
            proposal = Proposal(self.head.to_vocab(idx), None, conf)
        else:
            q = probabilities(logits, self.params)  # (S-1, V or Kv)
            idx = sample(q, self.keys.next())  # (S-1,)
            # the policy sees the draft's top probability at each slot, not the sample's own: a cut
            # that depended on the sample would bias rejection sampling (tests/test_mlx_sampling.py)
            conf = q.max(axis=-1)  # (S-1,)
            proposal = Proposal(self.head.to_vocab(idx), self.head.full_probs(q, self.target.info.vocab_size), conf)
        mx.eval(proposal.tokens)
        self.cache.crop_to(pos)  # keep the context, drop the block's K/V
        return proposal


def _verdict(block: Proposal, logits: mx.array, params: SamplingParams, keys: Keys) -> tuple[int, int]:
    """logits: (K+1, V) -> (number of accepted proposals, the recovered or bonus token)."""
    if params.greedy:
        return verify_greedy(block.tokens, logits)
    if block.probs is None:
        return verify_match(block.tokens, probabilities(logits, params), keys)
    return verify_rejection(block.tokens, block.probs, probabilities(logits, params), keys)


def _verify(block: Proposal, target: MLXTarget, final: mx.array, params: SamplingParams,
            keys: Keys) -> tuple[int, int]:
    """final: (K+1, H) the target's last hidden states at [last, proposals]. The head runs on
    row 0 first and on the other K rows only when proposal 1 is accepted (the torch loop's
    lazy head): testing proposal 1, then the rest as a block of its own, is the same
    sequential test, so the output stays exact."""
    first = target.logits(final[:1])  # (1, V)
    if block.size == 0:
        return _verdict(block, first, params, keys)
    # proposal 1 alone: row 0 twice, the second standing in for the bonus row that an
    # accepted proposal 1 never uses (the rest's own verdict gives the next token)
    n_first, tok = _verdict(block.slice(0, 1), mx.concatenate([first, first]), params, keys)
    if n_first == 1:
        n_rest, tok = _verdict(block.slice(1, None), target.logits(final[1:]), params, keys)  # rest: (K, V)
        return 1 + n_rest, tok
    return 0, tok


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


def _cut_at_stop(new: list[int], stop: frozenset) -> tuple[list[int], str | None]:
    """The new tokens up to and including the first stop token among them, and "stop" if any."""
    for i, t in enumerate(new):
        if t in stop:
            return new[: i + 1], "stop"
    return new, None


def stream_tokens(model, draft: MLXDraftModel | None, ids: list[int], *, max_tokens: int = 256, stop_token_ids=(),
                  params: SamplingParams | None = None, block_size: int | None = None,
                  mask_token_id: int | None = None, seed: int | None = None, draft_window: int | None = None,
                  draft_threshold: float = 0.0, prefill_step_size: int = 2048, proposer=None,
                  policy: VerifyPolicy | None = None) -> Iterator[Step]:
    """The loop on token ids: one Step per iteration, the prefill token first, then each
    verified block. The prompt is prefilled in chunks of prefill_step_size tokens, as mlx-lm
    does. `seed`: explicit mx.random keys (None: mx.random's global state). `draft_threshold`,
    `proposer` and `policy` as in the torch loop. params: default greedy."""
    target, params = as_target(model), params or SamplingParams()
    checked = check_request(draft.config if draft is not None else None, target.info, ids, len(ids), max_tokens,
                            block_size, mask_token_id, draft_threshold)
    block_size, max_tokens = checked.block_size, checked.max_new_tokens
    if max_tokens == 0:
        return
    stop, keys = frozenset(int(t) for t in stop_token_ids), Keys(seed)
    if proposer is None and block_size > 1:
        proposer = DraftProposer(draft, target, params, checked.mask_id, keys, draft_window)
    policy = policy or ThresholdPolicy(draft_threshold)
    layer_ids = getattr(proposer, "layer_ids", None) if block_size > 1 else None
    cache = target.new_cache()
    if proposer is not None:
        proposer.start(ids)

    logits, ctx_hidden = _prefill(target, ids, cache, layer_ids, prefill_step_size)  # (1, 1, V), (1, T, kH)
    last = next_token(logits[0, -1], params, keys)
    generated, pos = 1, len(ids)  # pos: position of `last`, not yet in the target cache
    finish = "stop" if last in stop else ("length" if generated >= max_tokens else None)
    if proposer is not None:
        proposer.commit([last])
    yield Step([last], 0, 0, finish)

    empty = Proposal(mx.zeros((0,), dtype=mx.int32))
    while finish is None:
        size, block = min(block_size, max_tokens - generated), empty  # the block yields up to `size` tokens
        plan = policy.plan() if size > 1 else StepPlan(False)
        if plan.draft:
            block = proposer.propose(ctx_hidden, last, pos, size, policy.needs_confidence)
            block, ctx_hidden = block.slice(0, policy.verify_count(plan, block.conf, block.size)), None
        verify_ids = mx.concatenate([mx.array([last], dtype=mx.int32), block.tokens.astype(mx.int32)])[None]  # (1, 1+K)
        final, hidden = target.forward_hidden(verify_ids, cache, layer_ids)  # (1, 1+K, H), (1, 1+K, kH)
        n_accepted, last = _verify(block, target, final[0], params, keys)
        new, finish = _cut_at_stop(block.tokens[:n_accepted].tolist() + [last], stop)
        cache.crop_to(pos + len(new))  # keep `last` and the accepted proposals
        if proposer is not None:
            proposer.commit(new)
        if hidden is not None:  # the next context: what the draft has not seen yet
            seen = hidden[:, : len(new)]  # (1, n, kH)
            ctx_hidden = seen if ctx_hidden is None else mx.concatenate([ctx_hidden, seen], axis=1)
        policy.observe(plan, block.size, n_accepted)
        pos, generated = pos + len(new), generated + len(new)
        if finish is None and generated >= max_tokens:
            finish = "length"
        yield Step(new, block.size, n_accepted, finish, plan.draft)
