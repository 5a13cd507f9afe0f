"""The speculative loop: prefill, then draft a block, verify it, keep the accepted prefix plus
the target's own token, roll both caches back (DFLASH.md §2). `stream_generate` yields the
new tokens of each step; `dflash_generate` collects them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from dflash.engine.errors import GenerationError
from dflash.engine.timing import NULL_TIMER, NullTimer
from dflash.engine.sampling import (
    SamplingParams,
    accepted_prefix,
    next_token,
    probabilities,
    sample,
    verify_greedy,
    verify_match,
    verify_rejection,
)
from dflash.engine.target import TargetModel, as_target, check_compatible

if TYPE_CHECKING:  # the loop drives any draft with this interface; draft.spec_generate calls the loop
    from dflash.engine.draft import DFlashDraftModel


@dataclass
class Step:
    """What one loop step committed."""
    tokens: list[int]  # the new tokens, in order (accepted drafts, then the target's own)
    proposed: int  # draft tokens proposed this step (0 for the prefill token and block_size 1)
    accepted: int  # of which accepted
    finish_reason: str | None = None  # "stop", "length" or None while running


@dataclass
class GenerationResult:
    output_ids: torch.Tensor  # (1, num_input_tokens + num_output_tokens)
    num_input_tokens: int
    num_output_tokens: int
    time_to_first_token: float
    time_per_output_token: float
    acceptance_lengths: list[int]  # one per verify step: accepted + 1 (the bonus counts)
    acceptance_counts: list[int]  # per block position k=1..B-1: steps that accepted it
    finish_reason: str = "length"
    draft_steps: int = 0  # verify steps that had proposals
    total_time: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


@dataclass
class _Block:
    tokens: torch.Tensor  # (1, K) proposals
    probs: torch.Tensor | None = None  # (1, K, V) the draft's q, for rejection sampling

    def slice(self, start: int, stop: int | None) -> "_Block":
        probs = None if self.probs is None else self.probs[:, start:stop]
        return _Block(self.tokens[:, start:stop], probs)


@dataclass
class DraftHead:
    """The lm_head the draft proposes with: all rows, or only its draft vocabulary's."""
    ids: torch.Tensor | None = None  # (K,) vocabulary ids of the rows, None = the full head
    rows: torch.Tensor | None = None  # (K, H)

    @classmethod
    def build(cls, draft: DFlashDraftModel, target: TargetModel) -> "DraftHead":
        if draft is None or draft.config.draft_vocab is None:
            return cls()
        ids = torch.tensor(draft.config.draft_vocab, dtype=torch.long, device=target.device)
        return cls(ids, target.head_rows(ids))

    def logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (1, S, H) -> (1, S, V or K) the draft's logits."""
        return target.logits(hidden, self.rows)

    def to_vocab(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.ids is None else self.ids[idx]

    def full_probs(self, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """q: (1, K', Kv) over the draft vocabulary -> (1, K', V) over the whole vocabulary."""
        if self.ids is None:
            return q
        return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, self.ids, q)


def _draft(draft: DFlashDraftModel, target: TargetModel, cache, ctx_hidden, last, pos, size,
           mask_id, params: SamplingParams, generator, head: DraftHead = DraftHead(),
           threshold: float = 0.0, timer: NullTimer = NULL_TIMER) -> _Block:
    """One parallel draft pass over [last, mask x (size-1)] at positions pos..pos+size-1. With
    `threshold` > 0 the proposals end before the first one the draft gives a probability
    below it: the target then verifies fewer tokens. The cut uses the draft's numbers only,
    so verification stays exact (greedy and sampled)."""
    block = torch.full((1, size), mask_id, dtype=torch.long, device=last.device)  # (1, S)
    block[:, 0] = last
    noise = target.embed(block, draft.config.input_embedding_scale)  # (1, S, H)
    positions = torch.arange(cache.length, pos + size, device=last.device)[None]  # (1, C+S)
    with timer.span("draft_forward"):
        hidden = draft(positions, noise_embedding=noise, target_hidden=ctx_hidden, past_key_values=cache,
                       use_cache=True)  # (1, S, H)
    cache.crop_to(pos)  # keep the context, drop the block's K/V
    with timer.span("draft_head"):
        logits = head.logits(target, hidden[:, 1:])  # (1, S-1, V or draft vocabulary)
    if params.greedy or params.rule == "match":
        idx = logits.argmax(-1)  # (1, S-1)
        if threshold > 0:
            conf = torch.softmax(logits.float(), dim=-1).amax(-1)  # (1, S-1) the draft's probability of each proposal
            idx = idx[:, :int(accepted_prefix(conf >= threshold)[0])]
        return _Block(head.to_vocab(idx))
    q = probabilities(logits, params)  # (1, S-1, V or draft vocabulary)
    idx = sample(q, generator)  # (1, S-1)
    if threshold > 0:
        keep = int(accepted_prefix(q.gather(-1, idx[..., None])[..., 0] >= threshold)[0])
        idx, q = idx[:, :keep], q[:, :keep]
    return _Block(head.to_vocab(idx), head.full_probs(q, target.info.vocab_size))


def _check(block: _Block, logits, params: SamplingParams, generator):
    """logits: (1, K+1, V) -> (num accepted, the target's token after them)."""
    if params.greedy:
        n, tok = verify_greedy(block.tokens, logits)
    elif block.probs is None:
        n, tok = verify_match(block.tokens, probabilities(logits, params), generator)
    else:
        n, tok = verify_rejection(block.tokens, block.probs, probabilities(logits, params), generator)
    return int(n[0]), tok


def _verify(block: _Block, target: TargetModel, final: torch.Tensor, params: SamplingParams, generator,
            timer: NullTimer = NULL_TIMER):
    """final: (1, K+1, H) the target's last hidden states at [last, proposals].
    The lm_head runs on row 0 first, and on the other K rows only when the first proposal is
    accepted: on CPU one row of a large vocabulary costs far less than K+1 rows, and a weak
    draft's first proposal is rejected in most steps. Testing proposal 1, then the rest as a
    block of its own, is the same sequential test, so the output stays exact."""
    if block.tokens.shape[1] == 0:
        with timer.span("verify_head"):
            logits = target.logits(final)  # (1, 1, V)
        return _check(block, logits, params, generator)
    with timer.span("verify_head"):
        first = target.logits(final[:, :1])  # (1, 1, V)
    # row 0 twice: the second row would only give the token after an accepted proposal 1,
    # which is then dropped for the rest's own verdict
    n, tok = _check(block.slice(0, 1), first.expand(-1, 2, -1), params, generator)
    if n == 0:
        return 0, tok
    with timer.span("verify_head"):
        rest = target.logits(final[:, 1:])  # (1, K, V)
    n, tok = _check(block.slice(1, None), rest, params, generator)
    return 1 + n, tok


@torch.inference_mode()
def stream_generate(draft: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int,
                    stop_token_ids=None, params: SamplingParams = SamplingParams(), block_size: int | None = None,
                    mask_token_id: int | None = None, generator: torch.Generator | None = None,
                    draft_window: int | None = None, draft_threshold: float = 0.0,
                    timer: NullTimer = NULL_TIMER) -> Iterator[Step]:
    """Yield one Step per loop iteration: first the prefill token, then each verified block.
    `draft_threshold` > 0: verify only the leading proposals the draft gives at least that
    probability (fewer target tokens per step when the draft is unsure; 0: the whole block).
    `timer`: the profiling seam (`engine.timing.PartTimer`); the default times nothing."""
    target = as_target(target)
    block_size, mask_id, max_new_tokens = _check_args(draft, target, input_ids, max_new_tokens, block_size, mask_token_id)
    if not (isinstance(draft_threshold, (int, float)) and 0.0 <= draft_threshold <= 1.0):
        raise GenerationError(f"draft_threshold must be a probability in [0, 1], got {draft_threshold!r}")
    if max_new_tokens == 0:
        return
    stop = frozenset(int(t) for t in (stop_token_ids or ()))
    layer_ids = draft.config.target_layer_ids if block_size > 1 else None
    target_cache = target.new_cache()
    draft_cache = draft.new_cache(draft_window) if block_size > 1 else None
    head = DraftHead.build(draft, target) if block_size > 1 else None

    logits, ctx_hidden = target.forward(input_ids, target_cache, layer_ids, logits_to_keep=1)  # (1, 1, V), (1, T, kH)
    last = next_token(logits[:, -1], params, generator)  # (1,)
    generated, pos = 1, input_ids.shape[1]  # pos: position of `last`, not yet in the target cache
    finish = "stop" if int(last) in stop else ("length" if generated >= max_new_tokens else None)
    yield Step([int(last)], 0, 0, finish)

    while finish is None:
        size = min(block_size, max_new_tokens - generated)  # the block can yield up to `size` tokens
        if size > 1:
            block = _draft(draft, target, draft_cache, ctx_hidden, last, pos, size, mask_id, params, generator, head,
                           draft_threshold, timer)
        else:
            block = _Block(torch.empty(1, 0, dtype=torch.long, device=last.device))
        proposed = block.tokens.shape[1]
        verify_ids = torch.cat([last[:, None], block.tokens], dim=1)  # (1, 1 + proposed)
        with timer.span("verify_forward"):
            final, hidden = target.forward_hidden(verify_ids, target_cache, layer_ids)  # (1, 1+K, H), (1, 1+K, kH)
        n_accepted, last = _verify(block, target, final, params, generator, timer)
        new = block.tokens[0, :n_accepted].tolist() + [int(last)]
        for i, t in enumerate(new):  # stop tokens are looked for among the new tokens only
            if t in stop:
                new, finish = new[: i + 1], "stop"
                break
        target_cache.crop_to(pos + len(new))  # keep `last` and the accepted proposals
        if hidden is not None:
            ctx_hidden = hidden[:, : len(new)]  # (1, n, kH) next context for the draft
        pos, generated = pos + len(new), generated + len(new)
        if finish is None and generated >= max_new_tokens:
            finish = "length"
        yield Step(new, proposed, n_accepted, finish)


def _check_args(draft, target: TargetModel, input_ids, max_new_tokens, block_size, mask_token_id):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise GenerationError("input_ids must be a (1, T) LongTensor of token ids")
    if input_ids.shape[0] != 1:
        raise GenerationError(f"batch size {input_ids.shape[0]} is not supported yet: pass one prompt (1, T)")
    n_in = input_ids.shape[1]
    if n_in == 0:
        raise GenerationError("the prompt is empty: give at least one token")
    if n_in >= target.info.max_positions:
        raise GenerationError(f"the prompt has {n_in} tokens but the target's context holds {target.info.max_positions}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= target.info.vocab_size:
        raise GenerationError(f"input_ids hold ids outside the target vocabulary of {target.info.vocab_size}")
    if block_size is None:
        block_size = draft.config.block_size if draft is not None else 1
    if not isinstance(block_size, int) or block_size < 1:
        raise GenerationError(f"block_size must be an integer >= 1, got {block_size!r}")
    if block_size > 1:
        if draft is None:
            raise GenerationError("block_size > 1 needs a draft model")
        check_compatible(draft.config, target)
    mask_id = draft.config.mask_token_id if mask_token_id is None and draft is not None else mask_token_id
    if block_size > 1 and not 0 <= mask_id < target.info.vocab_size:
        raise GenerationError(f"mask_token_id {mask_id} is outside the target vocabulary of {target.info.vocab_size}")
    return block_size, mask_id, min(max_new_tokens, target.info.max_positions - n_in)


def dflash_generate(model: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int,
                    stop_token_ids=None, temperature: float = 0.0, block_size: int | None = None,
                    mask_token_id: int | None = None, return_stats: bool = False, top_p: float = 1.0,
                    top_k: int = 0, generator: torch.Generator | None = None, rule: str = "rejection",
                    draft_window: int | None = None, draft_threshold: float = 0.0):
    """Speculative generation; the output equals the target's own decoding (greedy: token for
    token; sampled: in distribution). Returns output_ids (1, T+N), or a GenerationResult."""
    params = SamplingParams(temperature, top_p, top_k, rule)
    start = time.perf_counter()
    tokens, lengths, counts, ttft, finish, steps = [], [], [], 0.0, "length", 0
    for i, step in enumerate(stream_generate(model, target, input_ids, max_new_tokens, stop_token_ids, params,
                                             block_size, mask_token_id, generator, draft_window,
                                             draft_threshold)):
        tokens += step.tokens
        if i == 0:
            ttft = time.perf_counter() - start
        else:
            lengths.append(len(step.tokens))
            steps += step.proposed > 0
            counts += [0] * (step.proposed - len(counts))  # one counter per block position
            for k in range(step.accepted):
                counts[k] += 1
        finish = step.finish_reason or finish
    output_ids = torch.cat([input_ids, torch.tensor([tokens], dtype=torch.long, device=input_ids.device)], dim=1)
    if not return_stats:
        return output_ids
    total = time.perf_counter() - start
    return GenerationResult(output_ids, input_ids.shape[1], len(tokens), ttft,
                            (total - ttft) / max(len(tokens) - 1, 1), lengths, counts, finish, steps, total)
