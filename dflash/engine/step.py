"""The loop as a step: one sequence's state in the speculative loop (`Row`) and `step(rows)`,
which proposes for each row, verifies every row's proposals in one target pass, and commits each
row's *accepted* tokens plus the target's own next token (the *recovered* token at the first
rejected position, or the *bonus* token after a fully accepted proposal). One row is the
single-request loop (`loop.stream_generate` is a thin wrapper); several rows are continuous
batching: rows join (`open_row` + `prefill`) and leave between steps.

A pass over several rows runs them together where the target's layers allow it (the native
low-bit layers: every row's numbers are those of its sequence alone, `static_decoder.forward_rows`),
else one row after another; either way each row's output equals its request run alone.
Each row's proposals are sized for the batch: a tree proposer weighs its nodes against its
share of the batched pass (`costmodel.BatchCost`), so at large batches rows propose less and
stop drafting, down to plain steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache
from dflash.engine.context import DraftContext
from dflash.engine.policy import StepPlan, ThresholdPolicy, VerifyPolicy
from dflash.engine.prompt_cache import PromptCache, Transcript
from dflash.engine.proposers import Proposal, Proposer
from dflash.engine.request import SamplingParams
from dflash.engine.sampling import next_token, probabilities, verify_greedy, verify_match, verify_rejection
from dflash.engine.target import TargetModel
from dflash.engine.timing import NULL_TIMER, NullTimer
from dflash.engine.tree import TokenTree, path_rows, walk
from dflash.engine.tree_verify import commit_path, tree_forward, tree_inputs

Head = Callable[[object], torch.Tensor]  # rows (a slice or an index tensor) -> (1, R, V) logits


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
class Row:
    """One sequence in the loop: its request (`params`, `generator`, stop tokens, budget), its
    proposer and policy, its target cache, and where it stands. `last` is the last committed
    token, at position `pos`, not yet in the target cache; `context` the target's hidden
    states of committed tokens the draft has not read yet."""
    target: TargetModel
    cache: object
    params: SamplingParams
    generator: torch.Generator | None
    stop: frozenset[int]
    max_new_tokens: int
    block_size: int
    proposer: Proposer | None = None
    policy: VerifyPolicy = field(default_factory=ThresholdPolicy)
    layer_ids: list[int] | None = None
    timer: NullTimer = NULL_TIMER
    last: torch.Tensor | None = None  # (1,)
    pos: int = 0
    generated: int = 0
    finish: str | None = None
    context: DraftContext = field(default_factory=DraftContext)
    plan: StepPlan = field(default_factory=lambda: StepPlan(False))  # the policy's plan for the step under way
    prompts: PromptCache | None = None  # recent prompts' K/V, where the prefill may start from
    cached: int = 0  # prompt tokens whose K/V came from `prompts`
    transcript: Transcript | None = None  # what the cache holds, for `prompts` when the row ends

    def _propose(self, speculate: bool = True) -> tuple[Proposal | TokenTree, bool]:
        """This step's proposals (a chain or a tree; empty: a plain step) and whether the draft ran."""
        size = min(self.block_size, self.max_new_tokens - self.generated)  # the step may commit `size` tokens
        asked = self.proposer is not None and size > 1 and speculate
        self.plan = self.policy.plan() if asked else StepPlan(False)  # not asked: a plain step
        if not self.plan.draft:
            return Proposal(torch.empty(1, 0, dtype=torch.long, device=self.last.device)), False
        block = self.proposer.propose(self.context, self.last, self.pos, size, self.policy.needs_confidence)
        if isinstance(block, Proposal):
            block = block.slice(0, self.policy.verify_count(self.plan, block.conf, block.size))
        return block, self.proposer.drafted  # a tree proposer may skip the draft pass

    def _remember(self) -> None:
        """A finished row's prompt and reply into its prompt cache, for a next turn's prefill."""
        if self.transcript is not None:
            self.prompts.store(self, *self.transcript.whole())
            self.transcript = None

    def _inputs(self, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The verify pass's tokens (1+N,) [last ; proposals], their positions and mask (None: causal)."""
        if isinstance(block, TokenTree):
            return tree_inputs(block, int(self.last), self.pos, self.last.device)
        ids = torch.cat([self.last, block.tokens[0]])
        return ids, torch.arange(self.pos, self.pos + len(ids), device=ids.device), None

    def _commit(self, block, path: list[int] | None, accepted: list[int], token: torch.Tensor, hidden,
                drafted: bool) -> Step:
        """Keep the accepted tokens and `token` (the recovered or bonus one) in the cache, the
        proposer, the policy and the draft's next context."""
        previous, self.last = self.last, token
        new, finish = accepted + [int(token)], None
        for i, t in enumerate(new):  # stop tokens are looked for among the new tokens only
            if t in self.stop:
                new, finish = new[: i + 1], "stop"
                break
        kept = len(new) - 1  # accepted tokens committed (a stop token may cut them)
        if path is None:
            self.cache.crop_to(self.pos + len(new))  # keep `last` and the accepted proposals
            rows, sources = slice(0, len(new)), (block.source,) * kept
        else:
            commit_path(self.cache, self.pos, path[:kept])  # keep the root and the accepted path, compacted
            rows, sources = path_rows(path[:kept], token.device), tuple(block.sources[i] for i in path[:kept])
        seen = hidden[:, rows] if hidden is not None and self.layer_ids else None  # (1, n, kH): the positions kept
        self.context.add(seen)  # the draft's next context
        if self.transcript is not None:
            self.transcript.add([int(previous)] + new[:-1], seen)
        self.policy.observe(self.plan, len(block), len(accepted))
        if self.proposer is not None:
            self.proposer.commit(new, path)
        self.pos, self.generated = self.pos + len(new), self.generated + len(new)
        if finish is None and self.generated >= self.max_new_tokens:
            finish = "length"
        self.finish = finish
        return Step(new, len(block), len(accepted), finish, sources, drafted)


@torch.inference_mode()
def prefill(row: Row, input_ids: torch.Tensor) -> Step:
    """The prompt's pass: fills the row's cache (from its prompt cache as far as that holds the
    prompt's start, the rest computed) and commits the target's first token."""
    if row.prompts is not None:
        row.cached, known = row.prompts.restore(row, input_ids)  # known: (1, cached, kH) | None
    logits, hidden = row.target.forward(input_ids[:, row.cached:], row.cache, row.layer_ids,
                                        logits_to_keep=1)  # (1, 1, V), (1, T - cached, kH) | None
    if hidden is not None:  # the draft's first context: the whole prompt
        row.context.add(known if row.cached else None)
        row.context.add(hidden)
    if row.prompts is not None and row.prompts.serves(row):
        row.prompts.store(row, input_ids, row.context.peek())
        row.transcript = Transcript(input_ids, row.context.peek())
    row.last = next_token(logits[:, -1], row.params, row.generator)  # (1,)
    row.pos, row.generated = input_ids.shape[1], 1
    if row.proposer is not None:
        row.proposer.start(input_ids[0].tolist())
        row.proposer.commit([int(row.last)], None)
    token = int(row.last)
    row.finish = "stop" if token in row.stop else ("length" if row.generated >= row.max_new_tokens else None)
    return Step([token], 0, 0, row.finish)


@torch.inference_mode()
def step(rows: list[Row], batch_cost=None) -> list[Step]:
    """One step of every row (none finished): propose, verify all in one pass, commit each.
    `batch_cost` (costmodel.BatchCost, the one the rows' proposers were built with): told the
    number of rows first, so each row sizes its proposals by its share of this pass; its gate
    says whether the rows propose at all (measured whole steps, costmodel.SpeculationGate)."""
    if any(r.finish is not None for r in rows):
        raise ValueError("a finished row cannot take another step")
    start = time.perf_counter()
    speculate = True
    if batch_cost is not None:
        batch_cost.rows = len(rows)
        speculate = batch_cost.gate.speculate(len(rows))
    host = HostClock(len(rows))
    proposed = [host.time(i, r._propose, speculate) for i, r in enumerate(rows)]  # [(block, drafted)]
    if len(rows) == 1 or not _together(rows):
        verdicts = [_verify_alone(r, block) for r, (block, _) in zip(rows, proposed)]
    else:
        verdicts = _verify_together(rows, [block for block, _ in proposed])
    steps = [host.time(i, r._commit, block, path, accepted, token, hidden, drafted)
             for i, (r, (block, drafted), (path, accepted, token, hidden)) in enumerate(zip(rows, proposed, verdicts))]
    for r, ms, (block, drafted) in zip(rows, host.ms, proposed):  # what proposals cost a row on the host
        # (a drafted step's time is mostly its draft pass; a step the gate kept plain built nothing)
        if r.proposer is not None and speculate and not drafted:
            r.proposer.observe_host(len(block) > 0, ms)
    if batch_cost is not None and len(rows) > 1:
        batch_cost.gate.observe(len(rows), speculate, sum(len(s.tokens) for s in steps),
                                (time.perf_counter() - start) * 1e3)
    for r in rows:  # outside the timed parts: a copy of the row's K/V
        if r.finish is not None:
            r._remember()
    return steps


class HostClock:
    """Each row's host time in a step (its proposals and commit), in ms."""

    def __init__(self, rows: int):
        self.ms = [0.0] * rows

    def time(self, i: int, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.ms[i] += (time.perf_counter() - start) * 1e3
        return out


def _together(rows: list[Row]) -> bool:
    """The rows can share one target pass: the same adapter, static caches, native layers."""
    target = rows[0].target
    return (all(r.target is target and isinstance(r.cache, StaticTargetCache) for r in rows)
            and len({tuple(r.layer_ids) for r in rows if r.layer_ids}) <= 1  # one draft's context layers
            and static_decoder.supports_rows(target.linears))


# ---- verification ----------------------------------------------------------------------------
def _verdict(block: Proposal, logits: torch.Tensor, params: SamplingParams, generator):
    """logits: (1, K+1, V) -> (number of accepted proposals, the recovered or bonus token)."""
    if params.greedy:
        n, tok = verify_greedy(block.tokens, logits)
    elif block.probs is None:
        n, tok = verify_match(block.tokens, probabilities(logits, params), generator)
    else:
        n, tok = verify_rejection(block.tokens, block.probs, probabilities(logits, params), generator)
    return int(n[0]), tok


def _chain_verdict(block: Proposal, head: Head, params: SamplingParams, generator):
    """The verdict on [last, proposals] from `head` (its rows' logits, computed on demand).
    Row 0 first, the other K rows only when the first proposal is accepted: on a CPU one row of
    a large vocabulary costs far less than K+1 rows, and a weak draft's first proposal is
    rejected in most steps. Testing proposal 1, then the rest as a block of its own, is the same
    sequential test, so the output stays exact."""
    first = head(slice(0, 1))  # (1, 1, V)
    if block.size == 0:
        return _verdict(block, first, params, generator)
    # row 0 twice: the second row would only give the bonus token after an accepted proposal 1,
    # which is then dropped for the rest's own verdict
    n, tok = _verdict(block.slice(0, 1), first.expand(-1, 2, -1), params, generator)
    if n == 0:
        return 0, tok
    n, tok = _verdict(block.slice(1, None), head(slice(1, None)), params, generator)  # (1, K, V)
    return 1 + n, tok


def _judge(row: Row, block, head: Head):
    """-> (accepted node path or None for a chain, accepted tokens, the recovered or bonus token (1,))."""
    if isinstance(block, TokenTree):
        verdict = walk(block, lambda rows: head(rows)[0], row.params, row.generator)
        return verdict.path, block.tokens[verdict.path].tolist(), torch.tensor([verdict.token], device=row.last.device)
    n, tok = _chain_verdict(block, head, row.params, row.generator)
    return None, block.tokens[0, :n].tolist(), tok


def _verify_alone(row: Row, block):
    """One row's own pass -> (path, accepted, token, hidden (1, 1+N, kH) | None); its lm_head lazy."""
    target, timer = row.target, row.timer
    with timer.span("verify_forward"):
        if isinstance(block, TokenTree):
            final, hidden = tree_forward(target, row.cache, int(row.last), block, row.layer_ids)  # (1, 1+N, H)
        else:
            ids = torch.cat([row.last[:, None], block.tokens], dim=1)  # (1, 1 + K)
            final, hidden = target.forward_hidden(ids, row.cache, row.layer_ids)  # (1, 1+K, H), (1, 1+K, kH)

    def head(rows):
        with timer.span("verify_head"):
            return target.logits(final[:, rows])

    return (*_judge(row, block, head), hidden)


def _verify_together(rows: list[Row], blocks: list) -> list:
    """All rows in one pass of the native layers, their lm_head rows in two products: every
    row's row 0, then the other rows of those that need them (greedy rows whose first proposal
    was accepted; all sampled ones). The head's rows do not depend on each other either."""
    target = rows[0].target
    layer_ids = next((r.layer_ids for r in rows if r.layer_ids), None)  # plain rows ignore them
    inputs = [r._inputs(block) for r, block in zip(rows, blocks)]  # [(ids, positions, mask)]
    for r, (ids, _, _) in zip(rows, inputs):
        r.cache.kv.reserve(r.cache.length + len(ids))
    with rows[0].timer.span("verify_forward"):
        outs = static_decoder.forward_rows(target.model, [i for i, _, _ in inputs], [p for _, p, _ in inputs],
                                           [r.cache.kv for r in rows], [m for _, _, m in inputs], layer_ids,
                                           target.linears)  # [(final (1, n, H), hidden (1, n, kH) | None)]
    with rows[0].timer.span("verify_head"):
        first = target.logits(torch.cat([final[:, :1] for final, _ in outs], dim=1))  # (1, B, V)
        top = first[0].argmax(-1)  # (B,) each row's greedy token after its `last`, in one call
        tops = top.tolist()
        more = [i for i, (r, block) in enumerate(zip(rows, blocks)) if _needs_more(r, block, tops[i])]
        rest = {}
        if more:
            logits = target.logits(torch.cat([outs[i][0][:, 1:] for i in more], dim=1))  # (1, sum n_i - 1, V)
            for i, part in zip(more, logits.split([outs[i][0].shape[1] - 1 for i in more], dim=1)):
                rest[i] = part
    verdicts = []
    for i, (r, block) in enumerate(zip(rows, blocks)):
        if isinstance(block, Proposal) and len(block) == 0 and r.params.greedy:  # a plain greedy step: its argmax
            verdicts.append((None, [], top[i:i + 1], outs[i][1]))
            continue
        full = first[:, i:i + 1] if i not in rest else torch.cat([first[:, i:i + 1], rest[i]], dim=1)  # (1, n, V)
        verdicts.append((*_judge(r, block, lambda sel, full=full: full[:, sel]), outs[i][1]))
    return verdicts


def _needs_more(row: Row, block, token: int) -> bool:
    """Whether the verdict will read rows past row 0: a greedy row whose target token after
    `last` (`token`, the argmax of its row 0) is its first proposal (a chain) or one of the
    root's children (a tree); any sampled row with proposals (its draw happens in the verdict)."""
    if len(block) == 0:
        return False
    if not row.params.greedy:
        return True
    if isinstance(block, TokenTree):
        return (-1, token) in block.children
    return token == int(block.tokens[0, 0])
