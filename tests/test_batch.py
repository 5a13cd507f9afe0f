"""Continuous batching (engine/step.py, serve/worker.py): rows of different lengths, proposers
and sampling settings share each target pass, join and leave between steps, and every row's
output equals its request run alone, token for token (greedy and seeded sampling)."""

import threading

import pytest
import torch

from dflash.engine import native, static_decoder
from dflash.engine.costmodel import BatchCost, CostModel, SpeculationGate, batch_limit
from dflash.engine.loop import open_row, run_row
from dflash.engine.proposers import DraftProposer, TreeProposer
from dflash.engine.sampling import SamplingParams
from dflash.engine.step import prefill, step
from dflash.engine.target import TargetModel
from dflash.model import dflash_generate
from dflash.serve.metrics import Metrics
from dflash.serve.worker import Job, Worker
from dflash.text.pipeline import Pipeline, SpecSettings
from dflash.text.session import Delta, Done, GenSettings
from dflash.testing import tiny_draft, tiny_pipeline, tiny_target
from server_support import offline

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.problem()}")


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (1, 5 + 3 * i), generator=g) for i in range(n)]


def _run_batched(rows, prompts, joins):
    """Rows join at the step numbers `joins` (row i before step joins[i]); every row runs to its
    end -> each row's tokens, and the largest batch a step ran."""
    out, live, widest, k = [[] for _ in rows], [], 0, 0
    while k == 0 or live or any(j >= k for j in joins):
        for i, j in enumerate(joins):
            if j == k:
                out[i] += prefill(rows[i], prompts[i]).tokens
                if rows[i].finish is None:
                    live.append(i)
        if live:
            widest = max(widest, len(live))
            for i, s in zip(live, step([rows[i] for i in live])):
                out[i] += s.tokens
            live = [i for i in live if rows[i].finish is None]
        k += 1
    return out, widest


@needs_native
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_rows_joining_and_leaving_each_equal_their_request_alone(precision):
    """Six rows (plain, chain, tree, hybrid and n-gram proposers; prompts of 5-20 tokens; 40-130
    new tokens) in one shared native pass, joining at steps 0-7: each row's greedy output is
    the target's own plain greedy output at that precision."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, precision=precision)
    assert static_decoder.supports_rows(target.linears)
    prompts = _prompts(6)
    kinds = [(1, None), (8, "draft"), (8, "tree"), (8, "hybrid"), (8, "suffix"), (4, "hybrid")]
    budgets = [40, 130, 90, 120, 70, 100]
    rows = [open_row(draft, target, p, n, block_size=b, proposer=k) for p, n, (b, k) in zip(prompts, budgets, kinds)]
    out, widest = _run_batched(rows, prompts, joins=[0, 0, 2, 3, 5, 7])
    assert widest == 6
    for p, n, tokens in zip(prompts, budgets, out):
        alone = dflash_generate(None, target, p, n, block_size=1)[0, p.shape[1]:].tolist()
        assert tokens == alone


@needs_native
def test_seeded_sampled_rows_draw_what_they_draw_alone():
    """Sampling: each row draws from its own generator, so a batched row gives exactly the
    tokens of the same request with the same seed alone (the draft's chain; plain rows)."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=6)
    target = TargetModel(model, precision="int4")
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.2, top_p=0.9), SamplingParams(0.8)]
    blocks = [6, 6, 1, 6]

    def row(i):
        return open_row(draft, target, prompts[i], 60, params=params[i], block_size=blocks[i], proposer="draft",
                        generator=torch.Generator().manual_seed(100 + i))

    out, _ = _run_batched([row(i) for i in range(4)], prompts, joins=[0, 1, 1, 4])
    for i in range(4):
        alone = [t for s in run_row(row(i), prompts[i]) for t in s.tokens]
        assert out[i] == alone


class _Ways:
    """A batch whose gate speculates on the steps `ways` says (the step's seam for its gate)."""

    def __init__(self, ways):
        self.rows, self.gate, self._ways = 0, self, iter(ways)

    def speculate(self, rows: int) -> bool:
        return next(self._ways)

    def observe(self, *measured) -> None:
        pass


@needs_native
def test_the_draft_reads_every_committed_position_once_through_steps_without_it():
    """Steps without a draft pass (the gate's plain steps, tree steps that skip the draft) leave
    the positions they commit pending for the draft; the next draft pass reads them all: the
    draft's cache and the pending context together hold exactly the committed positions."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, precision="int4")
    skipping = TreeProposer(DraftProposer(draft, target, SamplingParams(), draft.config.mask_token_id),
                            verify_cost=lambda n: 1.0, draft_cost=1.0, probe_every=3)
    for bucket in range(4):  # the draft measured a loss beside every offer: skipped, probed now and then
        skipping.gains[bucket].observe(1, 2.0, 3, 1.0)
    prompts = [torch.tensor([[5, 6, 7, 8] * 6]), *_prompts(2, seed=7)]
    rows = [open_row(draft, target, p, 80, block_size=8, proposer=k)
            for p, k in zip(prompts, [skipping, "hybrid", "draft"])]
    for r, p in zip(rows, prompts):
        prefill(r, p)
    batch, drafted, skipped, plain = _Ways([False, False, True, False, True, True] * 40), 0, 0, 0
    while all(r.finish is None for r in rows):
        for r, s in zip(rows, step(rows, batch)):
            drafts = r.proposer if isinstance(r.proposer, DraftProposer) else r.proposer.draft
            assert drafts.cache.length + len(r.context) == r.pos
            drafted, plain = drafted + s.drafted, plain + (s.proposed == 0)
            skipped += s.proposed > 0 and not s.drafted
    assert drafted > 0 and skipped > 0 and plain > 0


@needs_native
def test_a_drafted_step_whose_tree_keeps_no_node_is_verified_as_a_tree_in_a_shared_pass():
    """A tree proposer whose draft ran but whose budget keeps no node proposes an empty tree (it
    still learns from the draft's pass); beside another row in one pass, its greedy output is
    the target's own."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, precision="int4")
    empty = TreeProposer(DraftProposer(draft, target, SamplingParams(), draft.config.mask_token_id),
                         verify_cost=lambda n: 1.0 if n <= 1 else 1e6, draft_cost=1.0)
    for bucket in range(4):  # the draft measured a gain beside every offer: it runs every step
        empty.gains[bucket].observe(3, 2.0, 1, 1.0)
    prompts = _prompts(2, seed=11)
    rows = [open_row(draft, target, prompts[0], 30, block_size=8, proposer=empty),
            open_row(draft, target, prompts[1], 30, block_size=8, proposer="hybrid")]
    out, widest = _run_batched(rows, prompts, joins=[0, 0])
    assert widest == 2 and empty.state.draft_ms is not None  # the draft ran
    for p, tokens in zip(prompts, out):
        assert tokens == dflash_generate(None, target, p, 30, block_size=1)[0, p.shape[1]:].tolist()


def test_rows_on_a_target_without_shared_passes_still_equal_their_requests():
    """fp32 (HF's numbers): rows take their passes one after another, outputs unchanged."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, precision="fp32")
    assert not static_decoder.supports_rows(target.linears)
    prompts = _prompts(3, seed=5)
    rows = [open_row(draft, target, p, 50, block_size=8, proposer="hybrid") for p in prompts]
    out, _ = _run_batched(rows, prompts, joins=[0, 1, 2])
    for p, tokens in zip(prompts, out):
        assert tokens == dflash_generate(None, target, p, 50, block_size=1)[0, p.shape[1]:].tolist()


def _cost(row_ms):
    ns = [1, 2, 4, 8, 16, 32]
    return CostModel(ns, [5.0 + 0.8 * n for n in ns], [256], [1], [[5.8]], [1, 3, 7, 15, 31],
                     [0.5 * k for k in [1, 3, 7, 15, 31]], [2, 16], [3.0, 3.5], row_ms=row_ms)


def test_a_rows_share_of_a_shared_pass_falls_with_the_batch():
    model = _cost(0.2)
    share = BatchCost(model)
    assert share.verify_ms(4) == model.verify_ms(4)  # one row: the cost model itself
    share.rows = 16
    assert share.verify_ms(1) < model.verify_ms(1) / 2  # the weights are read once for 16 rows
    extra_alone, extra_shared = model.verify_ms(5) - model.verify_ms(1), share.verify_ms(5) - share.verify_ms(1)
    assert extra_shared / share.verify_ms(1) > extra_alone / model.verify_ms(1)  # a proposal costs relatively more
    assert share.draft_ms(16) == model.draft_ms(16)  # a draft pass is the row's own
    assert batch_limit(model) > 1 and batch_limit(_cost(None)) == 1
    assert model.pass_ms(4, 4) <= 4 * model.pass_ms(1, 1)


@needs_native
def test_the_gate_stops_a_batch_speculating_where_plain_steps_measure_faster():
    gate = SpeculationGate(probe_every=4)
    assert gate.speculate(1)  # one row: its proposer decides
    assert gate.speculate(16)  # each way measured first
    gate.observe(16, True, tokens=20, ms=30.0)
    assert not gate.speculate(16)
    gate.observe(16, False, tokens=16, ms=16.0)  # plain: 1 token/ms beside 0.67
    ways = []
    for _ in range(40):
        ways.append(gate.speculate(16))
        gate.observe(16, ways[-1], tokens=20 if ways[-1] else 16, ms=30.0 if ways[-1] else 16.0)
    probes = [i for i, way in enumerate(ways) if way]
    assert probes == [4, 13, 30]  # the other way tried after 4 steps, then 8, then 16: each probe lost
    assert gate.speculate(3)  # a smaller batch size: measured apart
    assert not gate.speculate(32)  # a larger one starts plainly (plain steps were faster at 16)...
    gate.observe(32, False, tokens=32, ms=40.0)
    assert [gate.speculate(32) for _ in range(5)] == [False] * 4 + [True]  # ...until its first probe
    for _ in range(20):
        gate.observe(16, True, tokens=40, ms=30.0)  # proposals now pay (1.33 tokens/ms)
    assert gate.speculate(16) and gate.speculate(16)


def test_the_worker_batches_requests_and_each_answer_is_its_request_alone():
    """Eight requests at once on a worker of max_batch 4 (int4 tiny target, hybrid trees):
    every answer equals the request run alone; a cancelled one ends with "abort" at a step
    boundary and the others finish; the steps ran several requests at once."""
    base = tiny_pipeline()
    pipe = Pipeline(TargetModel(base.target.model, precision="int4"), base.draft, base.tokenizer, False,
                    spec=SpecSettings())
    prompts = [pipe.encode_text(t) for t in ["the quick brown fox", "hello world", "speculative decoding drafts",
                                             "the target verifies", "caf\u00e9 na\u00efve", "how are you today",
                                             "a block of tokens", "over the lazy dog"]]
    settings = GenSettings(max_tokens=48)
    alone = [offline(pipe, p, 48) for p in prompts]
    metrics = Metrics(num_positions=3)
    worker = Worker(pipe, max_queue=16, metrics=metrics, max_batch=4)
    events = [[] for _ in prompts]
    ended = [threading.Event() for _ in prompts]

    def sink(i):
        def take(event):
            events[i].append(event)
            if isinstance(event, Done):
                ended[i].set()
        return take

    jobs = [Job(p, settings, sink(i)) for i, p in enumerate(prompts)]
    jobs[5].cancel("test")  # before it starts: it ends as "abort" without tokens
    for job in jobs:
        worker.submit(job)
    worker.start()
    try:
        assert all(e.wait(120) for e in ended)
    finally:
        worker.close()
    for i, evs in enumerate(events):
        done = evs[-1]
        text = "".join(e.text for e in evs if isinstance(e, Delta))
        if i == 5:
            assert done.finish_reason == "abort" and done.completion_tokens == 0
            continue
        assert done.finish_reason in ("length", "stop")
        assert text == alone[i]
    steps_alone = sum(evs[-1].stats.num_drafts + evs[-1].stats.num_plain_steps for evs in events)  # + prefills
    steps = metrics.step_tokens.collect()[0]
    count = next(x.value for x in steps.samples if x.name.endswith("_count"))
    assert 0 < count < 0.6 * steps_alone  # the steps ran several requests at once


def test_max_batch_is_checked():
    with pytest.raises(ValueError, match="max_batch"):
        Worker(tiny_pipeline(), max_batch=0)
