"""Proposers: what a verify step checks. A proposer turns the committed text (and, for the DFlash
draft, the target's hidden states) into a *chain* (`Proposal`: tokens in order) or a *tree*
(`tree.TokenTree`: several continuations, shared prefixes once) for the target to verify.

- `DraftProposer`: the DFlash draft, one parallel pass per step (docs/METHOD.md §1).
- `TreeProposer`: a token tree from the draft's top-k per position (best-first, path score =
  product of the draft's probabilities, as DDTree) and/or n-gram matches of the prompt and the
  text so far (`suffix.SuffixIndex`), each source's scores calibrated by its own running
  acceptance, cut per step to the node budget that maximises expected tokens per second.

A proposer sees only the past, so the verdict keeps output exact whatever it proposes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from dflash.engine.probes import ProbeWait
from dflash.engine.request import SamplingParams
from dflash.engine.sampling import probabilities, sample
from dflash.engine.suffix import GlobalSuffixIndex, SuffixIndex
from dflash.engine.target import HeadRows, TargetModel
from dflash.engine.timing import NULL_TIMER, NullTimer
from dflash.engine.tree import Candidate, TokenTree, TreeBuilder

if TYPE_CHECKING:
    from dflash.engine.context import DraftContext
    from dflash.engine.draft import DFlashDraftModel


@dataclass
class Proposal:
    """One step's chain of proposals: the tokens to verify, and what the verdict and the policy need."""
    tokens: torch.Tensor  # (1, K)
    probs: torch.Tensor | None = None  # (1, K, V) the proposer's q, for rejection sampling; None: deterministic
    conf: torch.Tensor | None = None  # (K,) the proposer's probability of each proposal, for the policy
    source: str = "draft"

    def slice(self, start: int, stop: int | None) -> "Proposal":
        probs = None if self.probs is None else self.probs[:, start:stop]
        conf = None if self.conf is None else self.conf[start:stop]
        return Proposal(self.tokens[:, start:stop], probs, conf, self.source)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def __len__(self) -> int:
        return self.tokens.shape[1]


class Proposer:
    """The interface the loop drives; `start` and `commit` do nothing unless a proposer keeps text."""
    layer_ids: list[int] | None = None  # target layers whose hidden states it reads (None: none)
    drafted: bool = False  # whether the last `propose` ran the draft model

    def start(self, prompt: Sequence[int]) -> None:
        """The prompt's token ids, before the first step."""

    def propose(self, context: "DraftContext", last: torch.Tensor, pos: int, size: int,
                want_conf: bool = False) -> Proposal | TokenTree:
        """Proposals for the positions after `last` (the last committed token, at `pos`), at
        most size - 1 of them; a draft pass takes `context` (what the draft has not read yet)."""
        raise NotImplementedError

    def commit(self, tokens: Sequence[int], path: Sequence[int] | None) -> None:
        """The tokens the step committed: the accepted ones, then the recovered or bonus token
        (the new `last`); `path`: the accepted tree nodes of the last proposal when it was a tree."""

    def observe_host(self, proposed: bool, ms: float) -> None:
        """The host time of the step just committed (its proposals and commit, no draft pass);
        `proposed`: whether it verified proposals (the loop measures it)."""


@dataclass
class DraftHead:
    """The lm_head the draft proposes with: all rows, or only its draft vocabulary's, plus the
    rows of the ids the text brought in (`widened`: the prompt's and the output's ids outside
    the vocabulary, so a name the prompt spells or the answer repeats can be proposed)."""
    ids: torch.Tensor | None = None  # (K,) vocabulary ids of the rows, None = the full head
    rows: HeadRows | None = None  # their K rows of the lm_head, in the adapter's layout
    extra_ids: torch.Tensor | None = None  # (E,) ids the text brought in, none of them in `ids`
    extra_rows: HeadRows | None = None  # their E rows
    known: frozenset[int] = frozenset()  # ids and extra_ids, for `widened`'s membership test
    columns: torch.Tensor | None = None  # (K + E,) ids then extra_ids, built once per widening

    @classmethod
    def build(cls, draft: DFlashDraftModel, target: TargetModel) -> "DraftHead":
        """The head of the draft's own `draft_vocab` (the full head without one)."""
        return cls.of(None if draft is None else draft.config.draft_vocab, target)

    @classmethod
    def of(cls, vocab: list[int] | None, target: TargetModel) -> "DraftHead":
        """The head over the vocabulary ids `vocab` (None: the full head)."""
        if vocab is None:
            return cls()
        ids = torch.tensor(vocab, dtype=torch.long, device=target.device)
        return cls(ids, target.head_rows(ids), known=frozenset(vocab), columns=ids)

    @property
    def vocab(self) -> torch.Tensor | None:
        """(K + E,) the ids of the logits' columns, None = the whole vocabulary."""
        return self.columns

    def widened(self, tokens: Sequence[int], target: TargetModel) -> "DraftHead":
        """This head with the rows of `tokens`' ids it lacks (itself when it lacks none; a new
        head otherwise: the shared vocabulary's rows are never copied or changed)."""
        new = sorted({int(t) for t in tokens} - self.known) if self.ids is not None else []
        if not new:
            return self
        ids = torch.tensor(new, dtype=torch.long, device=self.ids.device)  # (E',)
        if self.extra_ids is not None:
            ids = torch.cat([self.extra_ids, ids])
        rows = target.head_rows(ids, measured=False)  # (E, H): a request's own, F.linear
        return DraftHead(self.ids, self.rows, ids, rows, self.known | frozenset(new), torch.cat([self.ids, ids]))

    def logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (1, S, H) -> (1, S, V or K + E) the draft's logits."""
        logits = target.logits(hidden, self.rows)  # (1, S, V or K)
        if self.extra_ids is None:
            return logits
        return torch.cat([logits, target.logits(hidden, self.extra_rows)], dim=-1)  # (1, S, K + E)

    def to_vocab(self, idx: torch.Tensor) -> torch.Tensor:
        vocab = self.vocab
        return idx if vocab is None else vocab[idx]

    def full_probs(self, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """q: (1, K', K + E) over the draft's columns -> (1, K', V) over the whole vocabulary."""
        vocab = self.vocab
        if vocab is None:
            return q
        return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, vocab, q)


class DraftProposer(Proposer):
    """The DFlash draft as a proposer: one parallel pass over [last, mask x (size-1)] reading
    the target's hidden states of the committed tokens it has not seen yet. With a draft
    vocabulary and `context_vocab` (the default), the head also proposes the ids of the prompt
    and of the committed text that the vocabulary lacks (`DraftHead.widened`)."""
    drafted = True  # every proposal is the draft's pass

    def __init__(self, draft: DFlashDraftModel, target: TargetModel, params: SamplingParams, mask_id: int,
                 generator: torch.Generator | None = None, window: int | None = None, timer: NullTimer = NULL_TIMER,
                 head: DraftHead | None = None, context_vocab: bool = True, layout=None):
        """`head`: the rows the draft proposes from (default: its own draft vocabulary's);
        `layout`: the draft's linears in the target's layout (`TargetModel.draft_layout`, kept by
        the caller; None: built now)."""
        self.draft, self.target, self.params, self.mask_id = draft, target, params, mask_id
        self.generator, self.timer = generator, timer
        self.layer_ids = draft.config.target_layer_ids  # the target layers whose outputs are the context
        self.cache = draft.new_cache(window)
        self.head = head if head is not None else DraftHead.build(draft, target)
        self.context_vocab = context_vocab
        self.layout = layout if layout is not None else target.draft_layout(draft)  # None: the draft's modules

    def start(self, prompt: Sequence[int]) -> None:
        if self.context_vocab:
            self.head = self.head.widened(prompt, self.target)

    def commit(self, tokens: Sequence[int], path: Sequence[int] | None) -> None:
        if self.context_vocab:
            self.head = self.head.widened(tokens, self.target)

    def logits(self, ctx_hidden: torch.Tensor, last: torch.Tensor, pos: int, size: int) -> torch.Tensor:
        """ctx_hidden: (1, C, kH) the context not yet in the draft cache; last: (1,) the last
        committed token, at position `pos` -> (1, size-1, V or draft vocabulary) the draft's logits."""
        block = torch.full((1, size), self.mask_id, dtype=torch.long, device=last.device)  # (1, S)
        block[:, 0] = last
        noise = self.target.embed(block, self.draft.config.input_embedding_scale)  # (1, S, H)
        positions = torch.arange(self.cache.length, pos + size, device=last.device)[None]  # (1, C+S)
        with self.timer.span("draft_forward"):
            hidden = self.draft(positions, noise_embedding=noise, target_hidden=ctx_hidden,
                                past_key_values=self.cache, use_cache=True, layout=self.layout)  # (1, S, H)
        self.cache.crop_to(pos)  # keep the context, drop the block's K/V
        with self.timer.span("draft_head"):
            return self.head.logits(self.target, hidden[:, 1:])  # (1, S-1, V or draft vocabulary)

    def propose(self, context, last, pos, size, want_conf=False) -> Proposal:
        logits = self.logits(context.take(), last, pos, size)  # (1, S-1, Kv)
        if self.params.greedy or self.params.rule == "match":
            idx = logits.argmax(-1)  # (1, S-1)
            conf = torch.softmax(logits.float(), dim=-1).amax(-1)[0] if want_conf else None  # (S-1,)
            return Proposal(self.head.to_vocab(idx), None, conf)
        q = probabilities(logits, self.params)  # (1, S-1, Kv)
        idx = sample(q, self.generator)  # (1, S-1)
        # what a policy may cut on: the draft's top probability per position, never the sampled
        # token's (a cut that depends on the sample would bias the kept proposals away from q)
        conf = q.amax(-1)[0]  # (S-1,)
        return Proposal(self.head.to_vocab(idx), self.head.full_probs(q, self.target.info.vocab_size), conf)


class Calibration:
    """Per source: accepted nodes over the scores it claimed for them, with a prior of one
    accepted node per unit of score, so a source that over-promises is weighted down."""

    def __init__(self, prior: float = 1.0):
        self.accepted: dict[str, float] = {}
        self.claimed: dict[str, float] = {}
        self.prior = prior

    def fade(self, keep: float) -> None:
        """Scale what was observed by `keep`: older evidence counts less than new."""
        self.accepted = {s: keep * v for s, v in self.accepted.items()}
        self.claimed = {s: keep * v for s, v in self.claimed.items()}

    def weight(self, source: str) -> float:
        return (self.accepted.get(source, 0.0) + self.prior) / (self.claimed.get(source, 0.0) + self.prior)

    def observe(self, tree: TokenTree, path: Sequence[int], weights: dict[str, float]) -> None:
        on_path = set(path)
        for i, (score, sources) in enumerate(zip(tree.scores.tolist(), tree.sources)):
            for s in sources.split("+"):
                self.claimed[s] = self.claimed.get(s, 0.0) + score / weights.get(s, 1.0)
                self.accepted[s] = self.accepted.get(s, 0.0) + (i in on_path)


class TreeProposer(Proposer):
    """A token tree from the draft's top-k per position and/or n-gram matches of the text so far,
    cut each step to the node budget that maximises (1 + expected accepted) / step time (the 1:
    the recovered or bonus token every step commits), where the expected accepted tokens of a
    tree are the sum of its nodes' calibrated path scores.
    `verify_cost(n)`: the time of a verify pass over n tokens (a cost model); None: always
    `max_nodes`. A budget of 0 makes the step a plain decoding step. With a cost model the draft
    pass itself is skipped while it does not pay for itself: after each drafted step the tree
    also says what the step would have committed without the draft's nodes (its accepted path
    up to the first node only the draft proposed) and what that smaller tree would have cost,
    so `DraftGain` compares tokens per ms with and without the draft; while the draft loses,
    it runs only as a probe every `probe_every` steps, to notice when it would win again.
    That comparison is kept apart per *offer* (`offer_bucket`): what the text sources propose
    this step, known before the draft would run. The draft that pays when the n-gram index
    has nothing (it is then the only source) may not pay beside a long, trusted match, so each
    step asks the gain of its own offer. The draft pass is charged at its measured time
    (the pass, its softmax and its nodes' insertion, timed each drafted step; `draft_cost`,
    the cost model's figure, until then). Each verify pass is timed too, and the running ratio
    of timed to modelled kept (`TreeState.verify_scale`: how far the cost model is off now);
    `TreeState.scale_verify` would charge verify passes at it (off by default: on the AMD EPYC
    it drafted more and ran no faster; see benchmarks/README.md). What it learns lives in a `TreeState`:
    pass one a pipeline keeps, and a request starts from what earlier ones learned."""

    def __init__(self, draft: DraftProposer | None = None, suffix: bool = True, top_k: int = 4,
                 max_nodes: int = 24, verify_cost: Callable[[int], float] | None = None, draft_cost: float = 0.0,
                 global_index: GlobalSuffixIndex | None = None, branches: int = 4, probe_every: int = 8,
                 state: TreeState | None = None, sharing: Callable[[], int] | None = None):
        if draft is None and not suffix and global_index is None:
            raise ValueError("a tree proposer needs a source: the draft, the suffix index or a global index")
        self.draft, self.use_suffix, self.global_index = draft, suffix, global_index
        self.top_k, self.max_nodes, self.branches = top_k, max_nodes, branches
        self.verify_cost, self._draft_cost = verify_cost, draft_cost
        self.layer_ids = draft.layer_ids if draft is not None else None
        self.state = state if state is not None else TreeState()
        self.index: SuffixIndex | None = None
        self._last: tuple[TokenTree, dict[str, float]] | None = None
        self.probe_every = probe_every
        self.sharing = sharing  # the rows sharing each pass now (continuous batching; None: one)
        self._offer = 0  # this step's offer bucket
        self.drafted = False
        self._verify_from: tuple[float, int] | None = None  # (clock, tokens) of the verify pass under way

    def start(self, prompt: Sequence[int]) -> None:
        self.index = SuffixIndex(prompt)
        self.state.begin_request()
        if self.draft is not None:
            self.draft.start(prompt)

    @property
    def calibration(self) -> Calibration:
        return self.state.calibration

    @property
    def gains(self) -> dict[int, DraftGain]:
        """The draft's gain per offer bucket (`offer_bucket`)."""
        return self.state.gains

    @property
    def draft_cost(self) -> float:
        """The draft pass's cost in ms: as measured in this state's steps, else the cost model's."""
        return self._draft_cost if self.state.draft_ms is None else self.state.draft_ms

    def propose(self, context, last, pos, size, want_conf=False) -> TokenTree | Proposal:
        depth = size - 1  # the tree's paths may commit at most `size` tokens
        weights = {s: self.calibration.weight(s) for s in ("draft", "suffix", "global")}
        builder, offered = TreeBuilder(), 0.0
        for source, cands in self._text_candidates(depth):  # the cheap sources first: their offer
            builder.add_candidates(cands, weights[source])  # decides whether the draft runs
            offered = max([offered] + [weights[source] * sum(c.scores) for c in cands])
        self._offer = offer_bucket(offered)
        self.drafted = self.draft is not None and self._draft_pays()
        if self.drafted:  # (a step that skips the draft leaves the context pending)
            start = time.perf_counter()
            probs = torch.softmax(self.draft.logits(context.take(), last, pos, size).float(), dim=-1)  # (1, S-1, Kv)
            builder.add_draft(probs[0], self.top_k, 2 * self.max_nodes, weights["draft"], self.draft.head.vocab)
            self.state.observe_draft_ms((time.perf_counter() - start) * 1e3, self.draft_cost)
        nodes = self.budget(builder.build(self.max_nodes, last.device))
        self._verify_from = (time.perf_counter(), nodes + 1)  # the verify pass runs until `commit`
        if nodes == 0 and not self.drafted:  # nothing pays: a plain step, with no tree to learn from
            return Proposal(torch.empty(1, 0, dtype=torch.long, device=last.device), source="tree")
        tree = builder.build(nodes, last.device)
        self._last = (tree, weights)
        return tree

    def _text_candidates(self, depth: int) -> list[tuple[str, list[Candidate]]]:
        """(source, candidates) of the n-gram index of this text and of the shared index."""
        if self.index is None:
            return []
        out = []
        if self.use_suffix:
            out.append(("suffix", self.index.propose(depth, self.branches)))
        if self.global_index is not None:
            context = self.index.tail(self.global_index.max_context)
            out.append(("global", self.global_index.propose(context, depth, self.branches)))
        return out

    @property
    def gain(self) -> DraftGain:
        """The draft's gain beside this step's offer."""
        return self.gains[self._offer]

    def _draft_pays(self) -> bool:
        """Run the draft pass this step? Yes while it wins on tokens per ms beside what the
        text sources offer this step (`DraftGain` of the offer's bucket), and once every
        `probe_every` skipped steps of that bucket (times the rows sharing the pass, times a wait
        that doubles with each probe that did not pay: `TreeState.probe_wait`), and on this
        request's first step in it while it has the pass to itself (`TreeState.probe_first`)."""
        skipped, unprobed = self.state.skipped, self.state.unprobed
        sharing = self.sharing() if self.sharing is not None else 1
        first = self._offer in unprobed and sharing == 1  # a shared pass's rows do not each probe first
        pays = self.verify_cost is None or self.gain.pays()
        if pays or first:
            skipped[self._offer] = 0
            unprobed.discard(self._offer)
            if pays:
                self.state.probe_wait[self._offer].reset()
            return True
        skipped[self._offer] += 1
        # a probe is this row's own draft pass, which every row of a shared pass waits for: rows
        # probe as often together as one row alone; each probe that finds the draft still not
        # paying doubles the wait for the next (up to 8 times `probe_every`: `TreeState.probe_wait`)
        wait = self.state.probe_wait[self._offer]
        if skipped[self._offer] > self.probe_every * wait.steps * sharing:
            skipped[self._offer] = 0
            wait.grow()
            return True
        return False

    def _verify_ms(self, n: int) -> float:
        """A verify pass over n tokens: the cost model's figure, times the measured scale where the
        state applies it (`TreeState.scale_verify`)."""
        return self.verify_cost(n) * (self.state.verify_scale if self.state.scale_verify else 1.0)

    def observe_host(self, proposed: bool, ms: float) -> None:
        self.state.observe_host(proposed, ms)

    def budget(self, tree: TokenTree) -> int:
        """The number of `tree`'s best-first nodes n maximising (1 + their summed scores) / step
        time, the step's draft pass charged when this step drafted (`drafted`), and a tree's
        measured host time beyond a plain step's (`TreeState.tree_host_ms`) when n > 0."""
        if self.verify_cost is None or len(tree) == 0:
            return len(tree)
        gain = torch.cat([tree.scores.new_zeros(1), tree.scores.cumsum(0)]).tolist()  # (N+1,) expected accepted
        spent = self.draft_cost if self.drafted else 0.0  # a skipped draft pass costs this step nothing
        host = self.state.tree_host_ms()
        rate = [(1 + g) / (spent + (host if n else 0.0) + self._verify_ms(n + 1)) for n, g in enumerate(gain)]
        return max(range(len(rate)), key=rate.__getitem__)

    def commit(self, tokens, path) -> None:
        if self.draft is not None:
            self.draft.commit(tokens, None)
        if self.index is not None:
            self.index.extend(tokens)
        if self._verify_from is not None and self.verify_cost is not None:
            start, n = self._verify_from
            self.state.observe_verify_ms((time.perf_counter() - start) * 1e3, self.verify_cost(n))
        self._verify_from = None
        if self._last is not None and path is not None:
            tree, weights = self._last
            self.calibration.observe(tree, path, weights)
            if self.drafted and self.verify_cost is not None:
                self._observe_gain(tree, path)
        self._last = None

    def _observe_gain(self, tree: TokenTree, path: Sequence[int]) -> None:
        """What this drafted step committed and cost, beside the same tree without the nodes
        only the draft proposed (the other sources' nodes are closed under parents)."""
        own = [s == "draft" for s in tree.sources]  # (N,) proposed by the draft alone
        kept = next((j for j, i in enumerate(path) if own[i]), len(path))  # path length without the draft
        self.gain.observe(1 + len(path), self.draft_cost + self._verify_ms(len(tree) + 1),
                          1 + kept, self._verify_ms(len(tree) - sum(own) + 1))


OFFER_EDGES = (0.25, 1.0)  # expected accepted tokens of the text sources' best candidate
OFFERS = range(len(OFFER_EDGES) + 2)  # the buckets `offer_bucket` returns


def offer_bucket(expected: float) -> int:
    """0: the text sources offer nothing; 1: a weak offer (under 0.25 expected accepted tokens);
    2: a middling one; 3: at least one expected accepted token."""
    if expected <= 0:
        return 0
    return 1 + sum(expected >= edge for edge in OFFER_EDGES)


@dataclass
class DraftGain:
    """Tokens per ms of drafted steps, with the draft's nodes and (counterfactually) without
    them, exponentially forgotten at `decay` per drafted step. The draft pays while the first
    rate is at least the second; with no drafted step seen yet, it does."""
    decay: float = 0.9
    tokens: float = 0.0  # committed by the drafted steps
    ms: float = 0.0  # what they cost
    tokens_without: float = 0.0  # what the same trees without the draft's own nodes would have committed
    ms_without: float = 0.0  # and cost

    def observe(self, tokens: float, ms: float, tokens_without: float, ms_without: float) -> None:
        d = self.decay
        self.tokens, self.ms = d * self.tokens + tokens, d * self.ms + ms
        self.tokens_without, self.ms_without = d * self.tokens_without + tokens_without, d * self.ms_without + ms_without

    def fade(self, keep: float) -> None:
        """Scale what was observed by `keep`: the next observations weigh more beside it."""
        self.tokens, self.ms, self.tokens_without, self.ms_without = (
            keep * self.tokens, keep * self.ms, keep * self.tokens_without, keep * self.ms_without)

    def pays(self) -> bool:
        return self.ms == 0 or self.tokens * self.ms_without >= self.tokens_without * self.ms


@dataclass
class TreeState:
    """What a tree proposer learns while it runs: each source's calibration, the draft's gain
    per offer bucket (and the skipped steps since its last probe), the draft pass's measured
    time. A pipeline keeps one per proposer kind and decoding mode and hands it to each
    request's proposer, so a short answer (a 100-token function) does not end before its
    proposer has learned what the requests before it already knew; each new request fades
    the calibration's evidence by `carry` and the gains' by `gain_carry`, so they weigh less
    than what this request shows, and (`probe_first`) runs the draft on its first step of each
    offer bucket: a math question after a chat must not decode plainly for a dozen steps
    because the chat's draft did not pay. It also keeps how much slower (or faster) the verify
    passes run than the cost model says (`verify_scale`); `scale_verify=True` charges them at
    that scale, so the measured draft pass is weighed in the same units (off by default: see
    `TreeProposer`; for A/B runs)."""
    calibration: Calibration = field(default_factory=Calibration)
    gains: dict[int, DraftGain] = field(default_factory=lambda: {o: DraftGain() for o in OFFERS})
    skipped: dict[int, int] = field(default_factory=lambda: dict.fromkeys(OFFERS, 0))
    unprobed: set[int] = field(default_factory=set)  # the offer buckets this request has not drafted in yet
    probe_wait: dict[int, ProbeWait] = field(  # in probe_every's: 1, doubling up to 8
        default_factory=lambda: {o: ProbeWait(1, 8) for o in OFFERS})
    draft_ms: float | None = None  # running mean of the timed draft passes; None: none timed yet
    verify_scale: float = 1.0  # running mean of timed verify passes over the cost model's figures (from 1)
    verify_timed: int = 0  # verify passes timed so far
    scale_verify: bool = False  # True: the gate and the node budget charge verify passes at verify_scale
    carry: float = 0.5
    gain_carry: float = 0.5  # 1: the gains carry over whole
    probe_first: bool = True
    decay: float = 0.8  # of the running mean of draft_ms
    host_ms_tree: float | None = None  # running mean of a step's host ms with proposals (no draft pass)
    host_ms_plain: float | None = None  # and of a plain step's
    host_decay: float = 0.9

    def begin_request(self) -> None:
        self.calibration.fade(self.carry)
        for gain in self.gains.values():
            gain.fade(self.gain_carry)
        self.unprobed = set(OFFERS) if self.probe_first else set()

    def observe_draft_ms(self, ms: float, current: float) -> None:
        """One timed draft pass; a pass over 4x the `current` estimate (a first call's warm-up,
        a pause of the machine) counts as 4x."""
        ms = min(ms, 4 * current) if current > 0 else ms
        self.draft_ms = ms if self.draft_ms is None else self.decay * self.draft_ms + (1 - self.decay) * ms

    def observe_host(self, proposed: bool, ms: float) -> None:
        """A step's host time (its proposals and commit, no draft pass), with proposals or plain."""
        old = self.host_ms_tree if proposed else self.host_ms_plain
        new = ms if old is None else self.host_decay * old + (1 - self.host_decay) * ms
        if proposed:
            self.host_ms_tree = new
        else:
            self.host_ms_plain = new

    def tree_host_ms(self) -> float:
        """What verifying proposals costs on the host beyond a plain step (building the tree, its
        mask and inputs, walking and committing it): ~2 ms beside a 5.4 ms int4 step on the AMD
        EPYC, and more than a row's share of a pass of 16 rows."""
        if self.host_ms_tree is None or self.host_ms_plain is None:
            return 0.0
        return max(0.0, self.host_ms_tree - self.host_ms_plain)

    def observe_verify_ms(self, ms: float, modelled: float) -> None:
        """One timed verify pass (from the proposal's end to its commit) beside the cost model's
        figure for it; the ratio counts between 1/4 and 4 (a warm-up or a pause counts as 4)."""
        if modelled <= 0:
            return
        ratio = min(max(ms / modelled, 0.25), 4.0)
        self.verify_scale = self.decay * self.verify_scale + (1 - self.decay) * ratio  # from 1: the model's figures
        self.verify_timed += 1


PROPOSERS = ("draft", "tree", "suffix", "hybrid")


def build_proposer(kind: str, draft: DFlashDraftModel | None, target: TargetModel, params: SamplingParams,
                   mask_id: int | None, generator: torch.Generator | None = None, window: int | None = None,
                   timer: NullTimer = NULL_TIMER, cost_model=None, block_size: int = 16,
                   global_index: GlobalSuffixIndex | None = None, state: TreeState | None = None,
                   layout=None) -> Proposer:
    """A proposer by name: "draft" (the DFlash draft's chain), "tree" (a tree over the draft's
    top-k), "suffix" (n-gram matches of the prompt and the text so far, no draft), "hybrid"
    (both in one tree). `cost_model` (engine/costmodel.py) sizes each tree by expected tokens
    per second; without one a tree keeps its fixed node budget. `state`: a tree's learned state
    carried over from earlier requests (`TreeState`; None: a fresh one). `layout`: the draft's
    layout the caller keeps (`TargetModel.draft_layout`; None: built now)."""
    if kind not in PROPOSERS:
        raise ValueError(f"unknown proposer {kind!r}: use one of {', '.join(PROPOSERS)}")
    if draft is None and kind != "suffix":
        raise ValueError(f"the {kind!r} proposer needs a draft model")
    drafter = (DraftProposer(draft, target, params, mask_id, generator, window, timer, layout=layout)
               if draft is not None else None)
    if kind == "draft":
        return drafter
    verify_cost = None if cost_model is None else cost_model.verify_ms
    draft_cost = 0.0 if cost_model is None or kind == "suffix" else cost_model.draft_ms(block_size)
    return TreeProposer(drafter if kind != "suffix" else None, suffix=kind != "tree", verify_cost=verify_cost,
                        draft_cost=draft_cost, global_index=global_index, state=state,
                        sharing=getattr(cost_model, "sharing", None))
