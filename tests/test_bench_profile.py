"""dflash profile on a tiny random target: step parts, overhead ratio, cost curves, report."""

import pytest
from conftest import tiny_draft, tiny_target

from dflash.bench import profile as bp
from dflash.bench.report import plot_cost_curve, profile_markdown
from dflash.engine.loop import DraftHead
from dflash.engine.target import TargetModel

_draft_head_logits = DraftHead.logits


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    return TargetModel(target), tiny_draft(target, block_size=8)


def test_step_parts_add_up_and_timers_are_removed(models):
    import torch

    target, draft = models
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    s = bp.profile_steps(draft, target, ids, 8, 20)
    assert s.steps > 0 and s.tokens_per_step >= 1
    assert all(s.parts_ms[k] >= 0 for k in bp.PARTS)
    assert s.parts_ms["draft_forward"] > 0 and s.parts_ms["draft_head"] > 0 and s.parts_ms["verify_head"] > 0
    assert not {"forward_hidden", "logits"} & set(vars(target)) and "forward" not in vars(draft)
    assert DraftHead.logits is _draft_head_logits  # the class's method is put back
    plain = bp.profile_steps(None, target, ids, 1, 10)
    assert plain.parts_ms["draft_forward"] == 0 and plain.tokens_per_step == 1


def test_overhead_curves_and_report(models, tmp_path):
    import torch

    target, draft = models
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    o = bp.overhead_ratio(bp.random_like(draft), target, ids, 8, 12, rounds=1)
    assert o["ratio"] > 0 and o["bare_forward_ratio"] > 0 and o["block_size"] == 8
    curve = bp.target_cost_curve(target, (1, 4, 8), (16, 32), repeats=1)
    assert curve["ns"] == [1, 4, 8] and [r["context"] for r in curve["rows"]] == [16, 32]
    assert all(len(r["ms"]) == 3 and min(r["ms"]) > 0 for r in curve["rows"])
    assert all(r["rest_head_ms"][0] < r["rest_head_ms"][2] for r in curve["rows"])  # n=1 has no other rows
    d = bp.draft_cost_curve(draft, target, (2, 4, 8), context=16, repeats=1)
    assert len(d["ms"]) == 3 and d["draft_layers"] == 2
    h = bp.head_cost(target, 7, (None, 32), repeats=1)
    assert h["vocab"] == [96, 32]
    result = {"machine": {"threads": 1, "load_average": [1.0, 1.0, 1.0]}, "draft": "random", "overhead": o,
              "steps": [bp.profile_steps(draft, target, ids, 4, 8).to_dict()], "target_curve": curve,
              "draft_curve": d, "head_cost": h}
    md = profile_markdown(result)
    assert "Engine overhead" in md and "| 16 |" in md and "| 32 |" in md
    assert plot_cost_curve(result, tmp_path / "c.png").stat().st_size > 0


def test_cpu_clock_can_be_chosen():
    bp.set_clock("cpu")
    try:
        assert bp.clock() >= 0
    finally:
        bp.set_clock("wall")
