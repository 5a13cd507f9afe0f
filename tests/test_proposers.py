"""Tree and hybrid proposers through the loop: the draft's top-k tree, n-gram matches of the
text so far, and both in one tree. Output equals the target's own (greedy token for token,
sampled in distribution); sources are reported; the node budget follows the cost model."""

import pytest
import torch

from dflash.engine import loop as gen
from dflash.engine.context import DraftContext
from dflash.engine.proposers import DraftGain, DraftProposer, TreeProposer, TreeState, offer_bucket
from dflash.engine.request import SamplingParams
from dflash.engine.suffix import GlobalSuffixIndex
from dflash.engine.target import TargetModel
from dflash.engine.tree import TokenTree
from dflash.testing import chi2_pvalue, exact_law, tiny_draft, tiny_target


def hf_greedy(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)


def tree_proposer(target, draft, params=SamplingParams(), **kw):
    drafter = None if draft is None else DraftProposer(draft, target, params, draft.config.mask_token_id)
    return TreeProposer(drafter, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("sources", ["draft", "suffix", "hybrid"])
def test_tree_proposers_keep_greedy_output_exact(family, sources):
    model = tiny_target(family)
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[5, 9, 5, 9, 5, 9, 3]])
    proposer = tree_proposer(target, draft if sources != "suffix" else None, suffix=sources != "draft", max_nodes=12)
    res = gen.dflash_generate(draft, target, ids, 40, None, block_size=8, return_stats=True, proposer=proposer)
    assert torch.equal(res.output_ids, hf_greedy(model, ids, 40))
    assert res.stats.num_drafts > 0 and res.stats.num_draft_tokens > res.stats.num_drafts  # trees, not chains
    assert set(res.stats.num_accepted_tokens_per_source) <= {"draft", "suffix"}


def test_suffix_source_copies_repeated_text_and_reports_it():
    """A target whose greedy output repeats: the n-gram source is accepted and counted."""
    model = tiny_target("llama", seed=4)
    with torch.no_grad():  # a near-deterministic cycle: token t -> t + 1 mod 7
        model.lm_head.weight.zero_()
        model.model.embed_tokens.weight[7:] = 0
    target = TargetModel(model, static=False)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    ref = hf_greedy(model, ids, 30)
    res = gen.dflash_generate(None, target, ids, 30, None, block_size=8, return_stats=True,
                              proposer=TreeProposer(None, suffix=True))
    assert torch.equal(res.output_ids, ref)
    assert res.stats.num_accepted_tokens_per_source.get("suffix", 0) > 0
    assert res.tau > 2  # a repeated continuation is copied several tokens at a time


def test_global_index_proposes_from_earlier_responses():
    model = tiny_target("llama")
    target = TargetModel(model)
    ids = torch.tensor([[7, 8, 9]])
    first = gen.dflash_generate(None, target, ids, 24, None, block_size=1)[0, 3:].tolist()
    shared = GlobalSuffixIndex(min_match=2)
    shared.add(first)
    res = gen.dflash_generate(None, target, ids, 24, None, block_size=8, return_stats=True,
                              proposer=TreeProposer(None, suffix=False, global_index=shared))
    assert res.output_ids[0, 3:].tolist() == first
    assert res.stats.num_accepted_tokens_per_source.get("global", 0) > 0


def test_budget_follows_the_cost_model():
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[2, 4, 6, 8]])
    steps = {}
    for name, cost in [("cheap", lambda n: 1.0), ("dear", lambda n: 1.0 if n == 1 else 1e6)]:
        proposer = tree_proposer(target, draft, max_nodes=10, verify_cost=cost)
        run = list(gen.stream_generate(draft, target, ids, 20, block_size=8, proposer=proposer))
        out, steps[name] = [t for s in run for t in s.tokens], run[1:]
        assert out == hf_greedy(model, ids, 20)[0, 4:].tolist()
    assert max(s.proposed for s in steps["cheap"]) == 10  # verifying is free: the whole budget
    assert {s.proposed for s in steps["dear"]} == {0}  # verifying more than one token never pays


def test_a_skipped_draft_pass_is_not_charged_to_the_trees_budget():
    """The budget maximises (1 + expected accepted) / step time; a step that ran the draft pays
    its pass whatever the tree's size (so a bigger tree is worth it), one that skipped it does not."""
    t = torch.tensor
    tree = TokenTree(t([7, 8, 9]), t([-1, 0, 1]), t([1, 2, 3]), t([0.9, 0.5, 0.1]), ("suffix",) * 3)
    proposer = TreeProposer(None, verify_cost=lambda n: float(n), draft_cost=50.0)
    proposer.drafted = False
    assert proposer.budget(tree) == 0  # 1/1 beats 1.9/2: a plain step
    proposer.drafted = True
    assert proposer.budget(tree) == 3  # 2.5/54 beats 1/51: the draft's pass is spent anyway


def test_a_trees_measured_host_time_is_charged_to_its_budget():
    """A step with proposals costs the host more than a plain one (the tree, its mask, its
    walk and commit): the budget charges the measured difference to any tree."""
    t = torch.tensor
    tree = TokenTree(t([7, 8, 9]), t([-1, 0, 1]), t([1, 2, 3]), t([0.9, 0.5, 0.1]), ("suffix",) * 3)
    proposer = TreeProposer(None, verify_cost=lambda n: 5.0 + 0.5 * n)
    assert proposer.budget(tree) == 2  # 2.4/6.5 beats 1/5.5: free host time, two nodes pay
    for _ in range(30):
        proposer.observe_host(True, 8.5)
        proposer.observe_host(False, 0.5)
    assert proposer.state.tree_host_ms() == pytest.approx(8.0)
    assert proposer.budget(tree) == 0  # 1.9/14, 2.4/14.5, 2.5/15 all lose to 1/5.5: a plain step
    loop_state = TreeState()
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[3, 1, 4, 15, 9, 2, 6, 11]])
    steps = list(gen.stream_generate(draft, target, ids, 30, block_size=8,
                                     proposer=tree_proposer(target, draft, verify_cost=lambda n: 1.0, state=loop_state)))
    assert [x for s in steps for x in s.tokens] == hf_greedy(model, ids, 30)[0, 8:].tolist()
    assert loop_state.host_ms_tree is not None and loop_state.host_ms_tree > 0  # the loop measured its steps


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, top_k=3)],
                         ids=["t1", "topk-topp"])
def test_sampled_hybrid_tree_follows_the_target_distribution(params):
    """3000 seeded draws of three tokens through hybrid trees (sample-and-match); chi-square
    against the exact law of the target's own sampling."""
    model = tiny_target("llama", seed=3, vocab_size=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    target, draft = TargetModel(model), tiny_draft(model, block_size=4)
    prompt = torch.tensor([[1, 3, 2, 1, 3]])
    law = exact_law(model, prompt, params)
    g, counts = torch.Generator().manual_seed(0), torch.zeros(4 ** 3)
    for _ in range(3000):
        proposer = tree_proposer(target, draft, params, top_k=2, max_nodes=6)
        out = gen.dflash_generate(draft, target, prompt, 3, None, params.temperature, block_size=4, top_p=params.top_p,
                                  top_k=params.top_k, generator=g, proposer=proposer)
        a, b, c = out[0, -3:].tolist()
        counts[a * 16 + b * 4 + c] += 1
    assert counts[law == 0].sum() == 0
    assert chi2_pvalue(counts, law) > 1e-3


def test_proposers_by_name_and_their_errors():
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = hf_greedy(model, ids, 24)
    for kind in ("draft", "tree", "hybrid"):
        assert torch.equal(gen.dflash_generate(draft, target, ids, 24, None, proposer=kind), ref), kind
    assert torch.equal(gen.dflash_generate(None, target, ids, 24, None, proposer="suffix"), ref)  # no draft needed
    with pytest.raises(ValueError, match="needs a draft"):
        gen.dflash_generate(None, target, ids, 4, None, proposer="hybrid")
    with pytest.raises(ValueError, match="unknown proposer"):
        gen.dflash_generate(draft, target, ids, 4, None, proposer="beam")


def test_a_draft_that_does_not_pay_is_skipped_and_probed():
    """With a draft pass costing ten plain steps, an untrained draft stops being run (the
    tree is the n-gram source's alone) but is probed now and then; output stays exact."""
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[2, 4, 6, 8]])
    proposer = TreeProposer(DraftProposer(draft, target, SamplingParams(), draft.config.mask_token_id),
                            verify_cost=lambda n: 1.0, draft_cost=10.0, probe_every=4)
    steps = list(gen.stream_generate(draft, target, ids, 60, block_size=8, proposer=proposer))
    assert [t for s in steps for t in s.tokens] == hf_greedy(model, ids, 60)[0, 4:].tolist()
    drafted = [s.drafted for s in steps[1:]]  # each step says whether the draft ran for it
    assert not all(drafted) and sum(drafted) >= 2  # skipped, with a probe every fifth step
    chain = gen.dflash_generate(draft, target, ids, 30, None, block_size=8, return_stats=True)
    assert chain.stats.num_draft_passes == chain.stats.num_drafts > 0  # the chain drafts every step
    alone = gen.dflash_generate(None, target, ids, 30, None, block_size=8, proposer="suffix", return_stats=True)
    assert alone.stats.num_draft_passes == 0


def test_the_drafts_gain_is_weighed_against_the_same_tree_without_its_nodes():
    """A drafted step commits its path; without the draft it would have stopped at the first
    node only the draft proposed, on a tree of the other sources' nodes alone."""
    proposer = TreeProposer(None, verify_cost=lambda n: 10.0 * n, draft_cost=5.0)
    seen = []
    proposer.gain.observe = lambda *a: seen.append(a)  # our own object: recording what it is told
    t = torch.tensor
    tree = TokenTree(t([7, 8, 9, 4]), t([-1, 0, 1, -1]), t([1, 2, 3, 1]), t([0.9, 0.5, 0.3, 0.2]),
                     ("draft+suffix", "draft", "suffix", "suffix"))
    proposer._observe_gain(tree, [0, 1])
    assert seen == [(3, 5.0 + 50.0, 2, 40.0)]  # 3 tokens in 55 ms; without: 2 tokens on 3 nodes, 40 ms
    gain = DraftGain()
    assert gain.pays()  # nothing seen yet: draft
    gain.observe(3, 55.0, 2, 30.0)
    assert not gain.pays()  # 3 tokens / 55 ms < 2 / 30
    for _ in range(30):
        gain.observe(4, 55.0, 1, 30.0)
    assert gain.pays()  # forgotten: the draft now wins


def test_the_drafts_gain_is_kept_apart_per_offer_of_the_text_sources():
    """The draft that loses beside a long n-gram match is skipped there, and still runs on a
    step where the n-gram index offers nothing: each step asks the gain of its own offer."""
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    assert offer_bucket(0.0) == 0 and offer_bucket(0.1) == 1 and offer_bucket(0.5) == 2 and offer_bucket(3.0) == 3
    repeated, fresh = [5, 6, 7, 8] * 4 + [5, 6, 7], [3, 1, 4, 15, 9, 2, 6, 11]

    @torch.inference_mode()  # as the loop runs it
    def sources(prompt, probe_first=False):  # a request's first step, after what earlier ones taught the gains
        state = TreeState(probe_first=probe_first)
        proposer = tree_proposer(target, draft, verify_cost=lambda n: 1.0, draft_cost=1.0, probe_every=100,
                                 state=state)
        proposer.gains[3].observe(2, 2.0, 5, 1.0)  # beside a strong match: 1 token/ms, 5 without the draft
        proposer.gains[0].observe(3, 2.0, 1, 1.0)  # with no match: 1.5 tokens/ms against 1
        proposer.start(prompt)
        ids = torch.tensor([prompt])
        _, ctx = target.forward(ids[:, :-1], target.new_cache(), proposer.layer_ids)  # (1, T-1, kH)
        tree = proposer.propose(DraftContext(ctx), ids[0, -1:], len(prompt) - 1, 8)
        return proposer._offer, {s for node in tree.sources for s in node.split("+")}
    assert sources(repeated) == (3, {"suffix"})  # the draft lost beside this offer: not run
    assert sources(fresh) == (0, {"draft"})  # nothing to copy: the draft runs
    assert sources(repeated, probe_first=True) == (3, {"suffix", "draft"})  # a new request's first probe


def test_a_new_request_probes_the_draft_before_trusting_what_earlier_requests_taught():
    """The gains carry over to the next request faded by `gain_carry`, and its first step in
    each offer bucket runs the draft even where the earlier requests found it did not pay;
    later steps follow the gain again (probing every `probe_every`)."""
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[3, 1, 4, 15, 9, 2, 6, 11]])  # nothing repeats: every step offers nothing (bucket 0)
    state = TreeState()
    state.gains[0].observe(1, 10.0, 1, 1.0)  # earlier: the draft's steps 10x slower for the same token

    def drafted(state):
        proposer = tree_proposer(target, draft, verify_cost=lambda n: 1.0, draft_cost=10.0, probe_every=100,
                                 state=state)
        steps = gen.stream_generate(draft, target, ids, 6, block_size=8, proposer=proposer)
        return [s.drafted for s in list(steps)[1:]]  # after the prefill step
    faded = TreeState()
    faded.gains[0].observe(1, 10.0, 1, 1.0)
    faded.begin_request()
    gain = faded.gains[0]
    assert (gain.tokens, gain.ms, gain.tokens_without, gain.ms_without) == (0.5, 5.0, 0.5, 0.5)  # half beside the new
    assert drafted(state)[0]  # the first step (nothing to copy yet: bucket 0) probes the draft
    assert 0 not in state.unprobed and not state.gains[0].pays()  # probed; the probe lost too
    old = TreeState(probe_first=False, gain_carry=1.0)
    old.gains[0].observe(1, 10.0, 1, 1.0)
    assert not drafted(old)[0]  # without the first probe, the earlier requests decide
    assert drafted(TreeState(probe_first=False, gain_carry=1.0))[0]  # nothing learned yet: the draft runs


@pytest.mark.parametrize("kind", ["draft", "tree", "suffix", "hybrid"])
def test_block_size_one_is_plain_decoding_whatever_proposer_is_named(kind):
    """--block-size 1 with the default (hybrid) proposer, or any other: plain target steps."""
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[2, 4, 6, 8]])
    steps = list(gen.stream_generate(draft, target, ids, 12, block_size=1, proposer=kind))
    assert [t for s in steps for t in s.tokens] == hf_greedy(model, ids, 12)[0, 4:].tolist()
    assert all(s.proposed == 0 for s in steps)


def test_a_pipelines_trees_carry_what_they_learned_to_the_next_request():
    """Each request's tree proposer gets the pipeline's `TreeState` for its kind and decoding
    mode: the draft pass's measured time, the gains per offer and the calibration of earlier
    requests (the calibration faded by `carry` as a new request begins); output stays exact."""
    from dflash.engine.costmodel import CostModel
    from dflash.text.pipeline import Pipeline

    model = tiny_target("llama")
    flat = CostModel(ns=[1, 32], verify=[10.0, 10.0], contexts=[256], context_ns=[1], context_verify=[[10.0]],
                     rest_ns=[1], rest=[0.0], draft_blocks=[2, 16], draft=[1.0, 1.0])
    pipe = Pipeline(TargetModel(model), tiny_draft(model, block_size=8), None, False, _cost_model=flat)
    ids = torch.tensor([[2, 4, 6, 8, 2, 4, 6]])
    out = [t for s in pipe.stream(ids, 24, stop_token_ids=[]) for t in s.tokens]
    assert out == hf_greedy(model, ids, 24)[0, 7:].tolist()
    state = pipe.tree_state("hybrid", SamplingParams())
    assert state.draft_ms is not None and state.draft_ms > 0  # the draft's passes were timed
    assert sum(g.ms for g in state.gains.values()) > 0  # and weighed against the tree without them
    claimed = dict(state.calibration.claimed)
    assert claimed.get("draft", 0) > 0
    second = pipe.stream(ids, 24, stop_token_ids=[])
    next(second)  # the prefill step: the new request's proposer has begun
    assert state.calibration.claimed == pytest.approx({s: state.carry * v for s, v in claimed.items()})
    assert pipe.tree_state("hybrid", SamplingParams(1.0)) is not state  # sampled requests learn apart
    old = TreeState(gain_carry=1.0, probe_first=False)
    view = pipe.with_tree_state("hybrid", old)  # one side of a carry-over A/B, on the same models
    assert view.target is pipe.target and view.draft is pipe.draft and view.cost_model() is flat
    assert view.tree_state("hybrid", SamplingParams()) is old and pipe.tree_state("hybrid", SamplingParams()) is state
    out = [t for s in view.stream(ids, 24, stop_token_ids=[]) for t in s.tokens]
    assert out == hf_greedy(model, ids, 24)[0, 7:].tolist() and old.draft_ms is not None  # the view's trees learn there
    assert pipe.tree_state("suffix", SamplingParams()) is not state


def test_the_draft_pass_is_charged_at_its_measured_time():
    """Until a pass is timed the cost model's figure stands; then a running mean of the timed
    passes, where one pass over 4x the estimate (a warm-up, a pause) counts as 4x."""
    proposer = TreeProposer(None, verify_cost=lambda n: 1.0, draft_cost=5.0)
    assert proposer.draft_cost == 5.0
    proposer.state.observe_draft_ms(100.0, proposer.draft_cost)
    assert proposer.draft_cost == 20.0
    proposer.state.observe_draft_ms(5.0, proposer.draft_cost)
    assert proposer.draft_cost == pytest.approx(0.8 * 20.0 + 0.2 * 5.0)


def test_verify_passes_are_timed_and_charged_at_the_measured_scale_only_when_asked():
    """Each verify pass is timed beside the cost model's figure and the running ratio kept
    (ratios count within 1/4..4); with `scale_verify` it scales every verify figure the gate and
    the node budget use, so the measured draft pass is weighed in the same units; without (the
    default) the model's figures stand."""
    state = TreeState()
    for _ in range(10):
        state.observe_verify_ms(20.0, 10.0)  # the machine runs verify passes at twice the model's figure
    assert state.verify_scale == pytest.approx(2.0 - 0.8 ** 10) and state.verify_timed == 10
    capped = TreeState()
    capped.observe_verify_ms(1e6, 10.0)  # a pause counts as 4x
    assert capped.verify_scale == pytest.approx(0.8 + 0.2 * 4.0)
    t = torch.tensor
    tree = TokenTree(t([7, 8, 9, 4]), t([-1, 0, 1, -1]), t([1, 2, 3, 1]), t([0.9, 0.5, 0.3, 0.2]),
                     ("draft+suffix", "draft", "suffix", "suffix"))
    seen = []
    for scale_verify in (True, False):
        proposer = TreeProposer(None, verify_cost=lambda n: 10.0 * n, draft_cost=5.0,
                                state=TreeState(verify_scale=2.0, scale_verify=scale_verify))
        proposer.gain.observe = lambda *a: seen.append(a)  # our own object: recording what it is told
        proposer._observe_gain(tree, [0, 1])
    assert seen == [(3, 5.0 + 100.0, 2, 80.0),  # scaled: the verify figures doubled, the measured draft pass not
                    (3, 5.0 + 50.0, 2, 40.0)]  # the default: the cost model's figures


def test_the_loop_times_every_verify_pass_of_a_tree_proposer():
    """Through the loop each step's verify pass (drafted or plain) is timed once; a cost model
    a million times too fast is corrected as far as the cap allows; output stays exact."""
    model = tiny_target("llama")
    target, draft = TargetModel(model), tiny_draft(model, block_size=8)
    ids = torch.tensor([[3, 1, 4, 15, 9, 2, 6, 11]])
    state = TreeState()
    proposer = tree_proposer(target, draft, verify_cost=lambda n: 1e-6, draft_cost=1e-6, state=state)
    steps = list(gen.stream_generate(draft, target, ids, 30, block_size=8, proposer=proposer))
    assert [t for s in steps for t in s.tokens] == hf_greedy(model, ids, 30)[0, 8:].tolist()
    # every step after the prefill that asked the proposer (a last one with room for one token does not)
    assert len(steps) - 2 <= state.verify_timed <= len(steps) - 1
    assert state.verify_scale == pytest.approx(4.0 - 3.0 * 0.8 ** state.verify_timed)
