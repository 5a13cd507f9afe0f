"""Stacked products (engine/projections.py): a layer's q/k/v and gate/up run as one product
where the measurement says it pays, within the memory rule, and output stays the target's."""

import pytest
import torch
from dflash.testing import fake_timer as fake
from dflash.testing import tiny_draft, tiny_target

from dflash.engine import kernels as K
from dflash.engine import projections as P
from dflash.engine.loop import dflash_generate
from dflash.engine.target import TargetModel

B = K.BUCKETS


def _choice(impl, us, stacked=False, shape=(10, 10)):
    """A ShapeChoice running `impl` at every bucket at `us` microseconds (a list or one number)."""
    us = us if isinstance(us, list) else [us] * len(B)
    return K.ShapeChoice(shape, B, {b: impl for b in B}, {impl: us}, stacked)


def test_plan_stacks_where_one_product_is_faster_and_keeps_the_separate_ones_where_not():
    sep = [_choice("linear", 10.0), _choice("linear", 5.0)]  # 15 us together, on the model's own weights
    assert not any(P.plan(sep, _choice("linear", 15.0, True), budget_bytes=800).values())  # even: no copy
    fast = [6.0, 8, 10, 15, 16, 17, 18]  # the stack wins at 1-4 rows only
    use = P.plan(sep, _choice("onednn", fast, True), budget_bytes=800)
    assert use == {b: b <= 4 for b in B}  # both held: the separate products need no copy


def test_plan_keeps_to_one_copy_of_the_groups_weights():
    sep = [_choice("onednn", 10.0), _choice("onednn", 5.0)]  # each holds its copy: 2 x 400 bytes
    # holding both layouts would be two copies: the plan is one or the other, the faster overall
    fast_small = _choice("onednn", [6.0, 8, 10, 15, 16, 17, 18], True, shape=(20, 10))
    assert all(P.plan(sep, fast_small, budget_bytes=800).values())
    slow_large = _choice("onednn", [12.0, 14, 14, 20, 30, 40, 60], True, shape=(20, 10))
    assert not any(P.plan(sep, slow_large, budget_bytes=800).values())
    assert P.plan(sep, fast_small, budget_bytes=1600) == {b: b <= 4 for b in B}  # a budget of two copies: both


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stacked_projections_run_where_they_measure_faster_and_greedy_output_stays_hfs(family, tmp_path, monkeypatch):
    """A fixed cost per product (what stacking saves) makes the stacks faster: the adapter
    holds q+k+v and gate+up stacked and not the separate weights' copies, the hidden states
    agree with HF's, and greedy output (target and draft on stacks) equals HF generate's."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target(family)
    timer = fake({"linear": 1.0, "wx": 9.0, "transposed": 9.0, "onednn": 9.0}, per_call=1.0)
    target = TargetModel(model, time_fn=timer)
    qkv, o, gate_up, down = target.linears.rows[0]
    assert all(qkv.use_stacked.values()) and qkv.parts == [] and qkv.stacked.key == "128x64 stacked"
    assert all(gate_up.use_stacked.values()) and gate_up.stacked.key == "256x64 stacked"
    cfg = model.config
    stack_bytes = 4 * cfg.hidden_size * (cfg.hidden_size + 2 * 32 + 2 * cfg.intermediate_size) * cfg.num_hidden_layers
    assert target.linears.extra_bytes == stack_bytes  # the stacks, one copy; o and down run on the model's weights
    assert target.kernel_info()["extra_mb"] == pytest.approx(stack_bytes / 2**20, abs=0.1)
    ref = TargetModel(model, kernels="torch")
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    ca, cb = target.new_cache(), ref.new_cache()
    for chunk in (ids[:, :13], ids[:, 13:14], ids[:, 14:]):
        (fa, ha), (fb, hb) = target.forward_hidden(chunk, ca, [1, 2]), ref.forward_hidden(chunk, cb, [1, 2])
        assert torch.allclose(fa, fb, atol=1e-5) and torch.allclose(ha, hb, atol=1e-5)
    draft = tiny_draft(model, block_size=8)
    layout = target.draft_layout(draft)
    assert all(layer.kv.stacked is not None and layer.gate_up.stacked is not None for layer in layout.layers)
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 8, 64, generator=g), torch.randn(1, 5, draft.fc.in_features, generator=g)
    with torch.inference_mode():
        own = draft(torch.arange(13)[None], noise_embedding=noise, target_hidden=ctx)
        laid = draft(torch.arange(13)[None], noise_embedding=noise, target_hidden=ctx, layout=layout)
    assert torch.allclose(own, laid, atol=1e-5)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    for block in (1, 4, 8):
        assert torch.equal(dflash_generate(draft, target, prompt, 20, None, block_size=block), expected)
    apart = TargetModel(model, time_fn=timer, stacking=False)  # the A/B seam: every product alone
    assert all(not any(grp.use_stacked.values()) for row in apart.linears.rows for grp in (row[0], row[2]))
    assert not any(r["shape"].endswith("stacked") for r in apart.kernel_info()["shapes"])


def test_a_group_with_and_without_biases_mixed_is_never_stacked():
    table = K.KernelTable(fake({"linear": 1.0}, per_call=5.0))
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(8, 16, generator=g), torch.randn(4, 16, generator=g)]
    grp = P.Group(table, w, [torch.zeros(8), None], ["a", "b"])
    assert not any(grp.use_stacked.values()) and grp.stacked is None
    x = torch.randn(1, 3, 16, generator=g)
    a, b = grp(x)
    assert torch.equal(a, x @ w[0].T + torch.zeros(8)) and torch.equal(b, x @ w[1].T)


def test_a_stacks_choice_holds_one_layout_and_a_cap_of_no_copies_holds_none():
    times = {"linear": [2.0] * len(B), "wx": [3.0] * len(B), "transposed": [1.0] * len(B), "onednn": [None] * len(B)}
    assert K.choose(times, B, max_copies=0).copies == []  # the model's own weight, however slow
    c = K.choose(times, B, stacked=True, shape=(30, 10))
    assert c.stacked and c.copies == ["transposed"] and c.extra_bytes() == 30 * 10 * 4
    own = K.choose({**times, "transposed": [9.0] * len(B)}, B, stacked=True, shape=(30, 10))
    assert own.copies == ["linear"] and own.extra_bytes() == 30 * 10 * 4  # F.linear on the stack: the stack is the copy
