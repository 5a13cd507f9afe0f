"""The speculative loop: prefill, then draft a block, verify it, keep the *accepted* tokens (the
leading proposals the target agreed with) and then the target's own next token: the *recovered*
token at the first rejected position, or the *bonus* token after a fully accepted block (vLLM's
words, engine/sampling.py); roll both caches back (docs/METHOD.md). `stream_generate` yields
the new tokens of each step; `dflash_generate` collects them.

Two seams keep the loop short: a *proposer* makes each step's proposals, a chain or a tree
(engine/proposers.py; the DFlash draft's `DraftProposer` by default) and a *policy* decides
whether to draft at all and how many of a chain's proposals to verify (`policy.ThresholdPolicy`
by default). Both see only the past, so output stays exact."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from dflash.engine.errors import GenerationError
from dflash.engine.policy import ThresholdPolicy, VerifyPolicy
from dflash.engine.proposers import DraftHead, DraftProposer, Proposal, Proposer, build_proposer
from dflash.engine.request import SamplingParams, check_request
from dflash.engine.sampling import next_token, probabilities, verify_greedy, verify_match, verify_rejection
from dflash.engine.stats import SpecStats
from dflash.engine.target import TargetModel, as_target
from dflash.engine.timing import NULL_TIMER, NullTimer
from dflash.engine.tree import TokenTree, path_rows, walk
from dflash.engine.tree_verify import commit_path, tree_forward

if TYPE_CHECKING:  # the loop drives any draft with this interface; draft.spec_generate calls the loop
    from dflash.engine.draft import DFlashDraftModel

__all__ = ["DraftHead", "DraftProposer", "GenerationError", "GenerationResult", "Proposal", "Proposer", "Step",
           "dflash_generate", "stream_generate"]


@dataclass
class Step:
    """What one loop step committed."""
    tokens: list[int]  # the new tokens, in order (the accepted ones, then the recovered or bonus token)
    proposed: int  # proposals verified this step (0 for the prefill token and plain steps)
    accepted: int  # of which accepted
    finish_reason: str | None = None  # "stop", "length" or None while running
    sources: tuple[str, ...] = ()  # per accepted token: the proposer source(s) it came from
    drafted: bool = False  # whether the draft model ran for this step's proposals


@dataclass
class GenerationResult:
    output_ids: torch.Tensor  # (1, num_input_tokens + num_output_tokens)
    num_input_tokens: int
    num_output_tokens: int
    time_to_first_token: float
    time_per_output_token: float
    acceptance_lengths: list[int]  # tokens committed by each verify step (the recovered or bonus token counts)
    stats: SpecStats = field(default_factory=SpecStats)  # the verify steps, folded (engine/stats.py)
    finish_reason: str = "length"
    total_time: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per verify step with proposals, the recovered or bonus token included (engine/stats.py)."""
        return self.stats.mean_acceptance_length

    @property
    def acceptance_counts(self) -> list[int]:
        """Per block position k = 1..B-1: the verify steps that accepted it."""
        return self.stats.num_accepted_tokens_per_pos

    @property
    def draft_steps(self) -> int:
        return self.stats.num_drafts


def _verdict(block: Proposal, logits: torch.Tensor, params: SamplingParams, generator):
    """logits: (1, K+1, V) -> (number of accepted proposals, the recovered or bonus token)."""
    if params.greedy:
        n, tok = verify_greedy(block.tokens, logits)
    elif block.probs is None:
        n, tok = verify_match(block.tokens, probabilities(logits, params), generator)
    else:
        n, tok = verify_rejection(block.tokens, block.probs, probabilities(logits, params), generator)
    return int(n[0]), tok


def _verify(block: Proposal, target: TargetModel, final: torch.Tensor, params: SamplingParams, generator,
            timer: NullTimer = NULL_TIMER):
    """final: (1, K+1, H) the target's last hidden states at [last, proposals].
    The lm_head runs on row 0 first, and on the other K rows only when the first proposal is
    accepted: on CPU one row of a large vocabulary costs far less than K+1 rows, and a weak
    draft's first proposal is rejected in most steps. Testing proposal 1, then the rest as a
    block of its own, is the same sequential test, so the output stays exact."""
    with timer.span("verify_head"):
        first = target.logits(final[:, :1])  # (1, 1, V)
    if block.size == 0:
        return _verdict(block, first, params, generator)
    # row 0 twice: the second row would only give the bonus token after an accepted proposal 1,
    # which is then dropped for the rest's own verdict
    n, tok = _verdict(block.slice(0, 1), first.expand(-1, 2, -1), params, generator)
    if n == 0:
        return 0, tok
    with timer.span("verify_head"):
        rest = target.logits(final[:, 1:])  # (1, K, V)
    n, tok = _verdict(block.slice(1, None), rest, params, generator)
    return 1 + n, tok


def _verify_chain(block: Proposal, target: TargetModel, cache, last, layer_ids, params, generator, timer):
    """One pass over [last, proposals] -> (accepted tokens, the recovered or bonus token (1,),
    hidden (1, 1+K, kH) | None)."""
    verify_ids = torch.cat([last[:, None], block.tokens], dim=1)  # (1, 1 + K)
    with timer.span("verify_forward"):
        final, hidden = target.forward_hidden(verify_ids, cache, layer_ids)  # (1, 1+K, H), (1, 1+K, kH)
    n, tok = _verify(block, target, final, params, generator, timer)
    return block.tokens[0, :n].tolist(), tok, hidden


def _verify_tree(tree: TokenTree, target: TargetModel, cache, last, layer_ids, params, generator, timer):
    """One pass over [last ; tree nodes], walked from the root (exact for any tree: the target's
    own token picks the child) -> (accepted node path, the recovered or bonus token (1,),
    hidden (1, 1+N, kH) | None)."""
    with timer.span("verify_forward"):
        final, hidden = tree_forward(target, cache, int(last), tree, layer_ids)  # (1, 1+N, H), (1, 1+N, kH)
    with timer.span("verify_head"):
        verdict = walk(tree, lambda rows: target.logits(final[:, rows])[0], params, generator)  # lazy head
    return verdict.path, torch.tensor([verdict.token], device=last.device), hidden


@torch.inference_mode()
def stream_generate(draft: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int,
                    stop_token_ids=None, params: SamplingParams = SamplingParams(), block_size: int | None = None,
                    mask_token_id: int | None = None, generator: torch.Generator | None = None,
                    draft_window: int | None = None, draft_threshold: float = 0.0,
                    timer: NullTimer = NULL_TIMER, proposer: Proposer | str | None = None,
                    policy: VerifyPolicy | None = None, cost_model=None) -> Iterator[Step]:
    """Yield one Step per loop iteration: first the prefill token, then each verified block.
    `draft_threshold` > 0: verify only the leading proposals the draft gives at least that
    probability (fewer target tokens per step when the draft is unsure; 0: the whole block).
    `proposer`: a Proposer, or a name of `proposers.PROPOSERS` ("draft", the default: the draft's
    chain; "tree", "suffix", "hybrid"); `policy` (default: `ThresholdPolicy`) cuts chains;
    `cost_model` (engine/costmodel.py) sizes trees; `timer` is the profiling seam."""
    target = as_target(target)  # a bare HF model: an adapter running its own modules
    checked = _check_args(draft, target, input_ids, max_new_tokens, block_size, mask_token_id, draft_threshold,
                          proposer)
    block_size, max_new_tokens = checked.block_size, checked.max_new_tokens
    if max_new_tokens == 0:
        return
    stop = frozenset(int(t) for t in (stop_token_ids or ()))
    if block_size <= 1:  # plain decoding: nothing to propose, whatever was asked
        proposer = None
    elif proposer is None or isinstance(proposer, str):
        proposer = build_proposer(proposer or "draft", draft, target, params, checked.mask_id, generator,
                                  draft_window, timer, cost_model, block_size)
    policy = policy or ThresholdPolicy(draft_threshold)
    layer_ids = getattr(proposer, "layer_ids", None) if block_size > 1 else None
    target_cache = target.new_cache()
    if proposer is not None:
        proposer.start(input_ids[0].tolist())

    logits, ctx_hidden = target.forward(input_ids, target_cache, layer_ids, logits_to_keep=1)  # (1, 1, V), (1, T, kH)
    last = next_token(logits[:, -1], params, generator)  # (1,)
    generated, pos = 1, input_ids.shape[1]  # pos: position of `last`, not yet in the target cache
    finish = "stop" if int(last) in stop else ("length" if generated >= max_new_tokens else None)
    if proposer is not None:
        proposer.commit([int(last)], None)
    yield Step([int(last)], 0, 0, finish)

    empty = Proposal(torch.empty(1, 0, dtype=torch.long, device=last.device))
    while finish is None:
        size = min(block_size, max_new_tokens - generated)  # the block can yield up to `size` tokens
        block, drafted = empty, False
        if size > 1 and policy.draft_now():
            block = proposer.propose(ctx_hidden, last, pos, size, policy.needs_confidence)
            drafted = proposer.drafted  # a tree proposer may skip the draft pass
            if isinstance(block, Proposal):
                block = block.slice(0, policy.verify_count(block.conf, block.size))
            ctx_hidden = None  # the draft pass consumed the context
        if isinstance(block, TokenTree):
            path, last, hidden = _verify_tree(block, target, target_cache, last, layer_ids, params, generator, timer)
            accepted = block.tokens[path].tolist()
        else:
            accepted, last, hidden = _verify_chain(block, target, target_cache, last, layer_ids, params, generator,
                                                   timer)
            path = None
        new = accepted + [int(last)]  # `last`: the recovered or bonus token
        for i, t in enumerate(new):  # stop tokens are looked for among the new tokens only
            if t in stop:
                new, finish = new[: i + 1], "stop"
                break
        kept = len(new) - 1  # accepted tokens committed (a stop token may cut them)
        if path is None:
            target_cache.crop_to(pos + len(new))  # keep `last` and the accepted proposals
            rows, sources = slice(0, len(new)), (block.source,) * kept
        else:
            commit_path(target_cache, pos, path[:kept])  # keep the root and the accepted path, compacted
            rows, sources = path_rows(path[:kept], last.device), tuple(block.sources[i] for i in path[:kept])
        if hidden is not None:  # the next context: what the draft has not seen yet
            seen = hidden[:, rows]  # (1, n, kH)
            ctx_hidden = seen if ctx_hidden is None else torch.cat([ctx_hidden, seen], dim=1)
        n_accepted = len(accepted)
        policy.observe(len(block), n_accepted)
        if proposer is not None:
            proposer.commit(new, path)
        pos, generated = pos + len(new), generated + len(new)
        if finish is None and generated >= max_new_tokens:
            finish = "length"
        yield Step(new, len(block), n_accepted, finish, sources, drafted)


def _check_args(draft, target: TargetModel, input_ids, max_new_tokens, block_size, mask_token_id,
                draft_threshold, proposer=None):
    """The torch side of `request.check_request`: the tensor's own checks, then the shared ones."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise GenerationError("input_ids must be a (1, T) LongTensor of token ids")
    if input_ids.shape[0] != 1:
        raise GenerationError(f"batch size {input_ids.shape[0]} is not supported yet: pass one prompt (1, T)")
    n_in = input_ids.shape[1]
    id_range = (int(input_ids.min()), int(input_ids.max())) if n_in else (0, 0)
    return check_request(draft.config if draft is not None else None, target.info, None, n_in, max_new_tokens,
                         block_size, mask_token_id, draft_threshold, id_range, proposer is not None)


def dflash_generate(model: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int,
                    stop_token_ids=None, temperature: float = 0.0, block_size: int | None = None,
                    mask_token_id: int | None = None, return_stats: bool = False, top_p: float = 1.0,
                    top_k: int = 0, generator: torch.Generator | None = None, rule: str = "rejection",
                    draft_window: int | None = None, draft_threshold: float = 0.0, proposer=None,
                    policy: VerifyPolicy | None = None, cost_model=None):
    """Speculative generation; the output equals the target's own decoding (greedy: token for
    token; sampled: in distribution). Returns output_ids (1, T+N), or a GenerationResult."""
    params = SamplingParams(temperature, top_p, top_k, rule)
    start = time.perf_counter()
    tokens, lengths, stats, ttft, finish = [], [], SpecStats(), 0.0, "length"
    for i, step in enumerate(stream_generate(model, target, input_ids, max_new_tokens, stop_token_ids, params,
                                             block_size, mask_token_id, generator, draft_window,
                                             draft_threshold, proposer=proposer, policy=policy,
                                             cost_model=cost_model)):
        tokens += step.tokens
        if i == 0:
            ttft = time.perf_counter() - start
        else:
            lengths.append(len(step.tokens))
            stats.add_step(step)
        finish = step.finish_reason or finish
    output_ids = torch.cat([input_ids, torch.tensor([tokens], dtype=torch.long, device=input_ids.device)], dim=1)
    if not return_stats:
        return output_ids
    total = time.perf_counter() - start
    return GenerationResult(output_ids, input_ids.shape[1], len(tokens), ttft,
                            (total - ttft) / max(len(tokens) - 1, 1), lengths, stats, finish, total)
