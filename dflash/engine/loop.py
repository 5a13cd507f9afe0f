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
from dflash.engine.prompt_cache import PromptCache
from dflash.engine.proposers import DraftHead, DraftProposer, Proposal, Proposer, build_proposer
from dflash.engine.request import SamplingParams, check_request
from dflash.engine.stats import SpecStats
from dflash.engine.step import Row, Step, prefill, step
from dflash.engine.target import TargetModel, as_target
from dflash.engine.timing import NULL_TIMER, NullTimer

if TYPE_CHECKING:  # the loop drives any draft with this interface; draft.spec_generate calls the loop
    from dflash.engine.draft import DFlashDraftModel

__all__ = ["DraftHead", "DraftProposer", "GenerationError", "GenerationResult", "Proposal", "Proposer", "Row", "Step",
           "dflash_generate", "open_row", "run_row", "stream_generate"]


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


def open_row(draft: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int, *,
             stop_token_ids=None, params: SamplingParams = SamplingParams(), block_size: int | None = None,
             mask_token_id: int | None = None, generator: torch.Generator | None = None,
             draft_window: int | None = None, draft_threshold: float = 0.0, timer: NullTimer = NULL_TIMER,
             proposer: Proposer | str | None = None, policy: VerifyPolicy | None = None, cost_model=None,
             prompt_cache: PromptCache | None = None) -> Row:
    """A sequence's `Row` (engine/step.py), its arguments checked, its proposer and policy built,
    before its prefill (`step.prefill`); arguments as `stream_generate`'s, and `prompt_cache`
    (engine/prompt_cache.py), which its prefill reads and adds to."""
    target = as_target(target)  # a bare HF model: an adapter running its own modules
    checked = _check_args(draft, target, input_ids, max_new_tokens, block_size, mask_token_id, draft_threshold,
                          proposer)
    block_size = checked.block_size
    if block_size <= 1:  # plain decoding: nothing to propose, whatever was asked
        proposer = None
    elif proposer is None or isinstance(proposer, str):
        proposer = build_proposer(proposer or "draft", draft, target, params, checked.mask_id, generator,
                                  draft_window, timer, cost_model, block_size)
    stop = frozenset(int(t) for t in (stop_token_ids or ()))
    room = input_ids.shape[1] + checked.max_new_tokens + block_size  # the longest the sequence gets, a block's slack
    return Row(target, target.new_cache(room), params, generator, stop, checked.max_new_tokens, block_size, proposer,
               policy or ThresholdPolicy(draft_threshold), getattr(proposer, "layer_ids", None), timer,
               prompts=prompt_cache)


@torch.inference_mode()
def stream_generate(draft: DFlashDraftModel | None, target, input_ids: torch.Tensor, max_new_tokens: int, *,
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
    `cost_model` (engine/costmodel.py) sizes trees; `timer` is the profiling seam. A thin wrapper:
    one `Row` (engine/step.py), its prefill, then `step([row])` until it ends."""
    row = open_row(draft, target, input_ids, max_new_tokens, stop_token_ids=stop_token_ids, params=params,
                   block_size=block_size, mask_token_id=mask_token_id, generator=generator, draft_window=draft_window,
                   draft_threshold=draft_threshold, timer=timer, proposer=proposer, policy=policy,
                   cost_model=cost_model)
    yield from run_row(row, input_ids)


def run_row(row: Row, input_ids: torch.Tensor) -> Iterator[Step]:
    """A row alone, from its prefill to its end: one Step each."""
    if row.max_new_tokens == 0:
        return
    yield prefill(row, input_ids)
    while row.finish is None:
        yield step([row])[0]


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
    for i, step in enumerate(stream_generate(model, target, input_ids, max_new_tokens, stop_token_ids=stop_token_ids,
                                             params=params, block_size=block_size, mask_token_id=mask_token_id,
                                             generator=generator, draft_window=draft_window,
                                             draft_threshold=draft_threshold, proposer=proposer, policy=policy,
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
