"""The machine's cost model (engine/costmodel.py): measured on a tiny target, interpolated,
cached per machine, and its break-even tau."""

import json

import pytest
import torch
from dflash.testing import tiny_draft, tiny_target

from dflash.engine import costmodel as cm
from dflash.engine.target import TargetModel


@pytest.fixture(scope="module")
def pair():
    model = tiny_target("llama")
    return TargetModel(model, kernels="torch"), tiny_draft(model, block_size=8)


def fake_model(**kw):
    d = dict(ns=[1, 2, 4, 8], verify=[10.0, 12.0, 14.0, 22.0], contexts=[100, 300], context_ns=[1, 8],
             context_verify=[[10.0, 22.0], [20.0, 33.0]], rest_ns=[1, 3, 7], rest=[1.0, 3.0, 7.0],
             draft_blocks=[2, 8], draft=[2.0, 5.0])
    d.update(kw)
    return cm.CostModel(**d)


def test_interpolation_in_tokens_and_context():
    m = fake_model()
    assert m.verify_ms(1) == 10.0 and m.verify_ms(3) == 13.0 and m.verify_ms(6) == 18.0
    assert m.verify_ms(10) == pytest.approx(26.0)  # past the last point: the last slope
    assert m.verify_ms(1, 300) == pytest.approx(20.0) and m.verify_ms(1, 200) == pytest.approx(15.0)
    assert m.verify_ms(8, 300) == pytest.approx(33.0)
    assert m.rest_head_ms(0) == 0.0 and m.rest_head_ms(5) == pytest.approx(5.0)
    assert m.draft_ms(4) == pytest.approx(3.0)
    assert m.break_even_tau(8) == pytest.approx((5.0 + 22.0 + 7.0) / 10.0)
    assert cm.CostModel.from_dict(m.to_dict()) == m


def _ms_clock():
    reads = []

    def clock():  # one ms per reading: every timed span lasts exactly 1 ms
        reads.append(None)
        return len(reads) * 1e-3
    return clock


def test_measure_on_a_tiny_target_with_a_counting_clock(pair):
    target, draft = pair
    m = cm.measure(target, draft, ns=(1, 2, 4), contexts=(16, 32), second_ns=(1, 4), draft_blocks=(2, 4), reps=1,
                   clock=_ms_clock())
    assert m.ns == [1, 2, 4] and m.contexts == [16, 32] and len(m.context_verify) == 2
    assert m.verify == [1.0, 1.0, 1.0]  # layers + row 0's head: between two readings
    assert m.rest == [1.0, 1.0]  # the other rows' head, for k = 1 and 3
    assert m.draft_blocks == [2, 4] and m.draft == [1.0, 1.0]
    assert m.info["kernels"] == "torch"


def test_the_cache_makes_a_second_start_free(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target, draft = pair
    kw = dict(ns=(1, 8, 32), contexts=(16,), second_ns=(1,), draft_blocks=(2, 8), reps=2, clock=_ms_clock())
    first = cm.load_or_measure(target, draft, **kw)
    assert first.ns == [1, 8, 32] and len(first.verify) == 3  # measured at each count (times are not compared)
    assert list((tmp_path / "costmodel").glob("*.json"))

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(cm, "measure", boom)
    assert cm.load_or_measure(target, draft, **kw) == first
    with pytest.raises(AssertionError):
        cm.load_or_measure(target, draft, refresh=True, **kw)
    with pytest.raises(AssertionError):  # another draft shape: another entry
        cm.load_or_measure(target, tiny_draft(target.model, layers=1, block_size=8), **kw)


def test_a_cache_measured_busy_is_measured_again_when_a_spot_check_is_quicker(pair, tmp_path, monkeypatch):
    """A cached model is re-timed at SPOT_NS on load; figures a fifth or more above what the
    machine does now were measured while something else ran: measure again. A spot check
    as slow as the cache (or slower: busy now) keeps it."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target, draft = pair
    kw = dict(ns=(1, 8, 32), contexts=(16,), second_ns=(1,), draft_blocks=(2, 8), reps=1, clock=_ms_clock())
    first = cm.load_or_measure(target, draft, **kw)
    assert first.verify == [1.0, 1.0, 1.0]
    assert not cm.measured_busy(first, target, draft, _ms_clock())
    (path,) = (tmp_path / "costmodel").glob("*.json")
    entry = json.loads(path.read_text())
    entry["value"]["verify"] = [1.1, 1.1, 1.1]  # within the slack: kept
    path.write_text(json.dumps(entry))
    monkeypatch.setattr(cm, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert cm.load_or_measure(target, draft, **kw).verify == [1.1, 1.1, 1.1]
    entry["value"]["verify"] = [1.0, 1.5, 2.0]  # verify(16) cached at 1.5 ms, re-timed at 1 ms: busy then
    path.write_text(json.dumps(entry))
    measured = []
    monkeypatch.setattr(cm, "measure", lambda *a, **k: measured.append(1) or first)
    assert cm.load_or_measure(target, draft, **kw) is first and measured == [1]


def test_the_static_cache_is_filled_by_its_length_only(pair):
    target, _ = pair
    cache = cm.fill_cache(target, 40, torch.Generator().manual_seed(0))
    assert cache.length == 40 and cache.kv.max_len >= 40 + 64
