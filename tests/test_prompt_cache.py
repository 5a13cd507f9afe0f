"""The prompt cache (engine/prompt_cache.py): a prompt that starts like an earlier sequence
(prompt, or prompt and reply) computes only the rest, and its output, K/V and draft context are
those of the full prefill, bit for bit; bounded in bytes; off where passes are not row-invariant."""

import pytest
import torch

from dflash.engine import native
from dflash.engine.loop import open_row, run_row
from dflash.engine.prompt_cache import PromptCache
from dflash.engine.sampling import SamplingParams
from dflash.engine.step import prefill
from dflash.engine.target import TargetModel
from dflash.testing import tiny_draft, tiny_pipeline, tiny_target

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.problem()}")


@pytest.fixture(scope="module")
def pair():
    model = tiny_target("llama", max_position_embeddings=512)
    return tiny_draft(model, block_size=8), TargetModel(model, precision="int4")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(draft, target, ids, n, cache=None, proposer="hybrid", params=SamplingParams(), seed=None):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    row = open_row(draft, target, ids, n, block_size=8 if draft is not None else 1, proposer=proposer, params=params,
                   generator=generator, prompt_cache=cache)
    return [t for s in run_row(row, ids) for t in s.tokens], row


@needs_native
@pytest.mark.parametrize("proposer", ["hybrid", "draft", None])
def test_a_next_turn_reuses_prompt_and_reply_and_answers_as_if_computed(pair, proposer):
    """Turn 2's prompt is turn 1's prompt, its reply and more: everything but the reply's last
    token comes from the cache, and the greedy answer equals the uncached one."""
    draft, target = pair
    cache = PromptCache()
    first = _ids(20, 0)
    reply, row = _run(draft, target, first, 40, cache, proposer)
    assert row.cached == 0
    second = torch.cat([first, torch.tensor([reply]), _ids(7, 1)], dim=1)
    again, row = _run(draft, target, second, 40, cache, proposer)
    assert row.cached == first.shape[1] + len(reply) - 1  # the last token was never in the target cache
    assert again == _run(draft, target, second, 40, None, proposer)[0]


@needs_native
def test_restored_kv_and_draft_context_are_the_full_prefills_bits(pair):
    draft, target = pair
    cache = PromptCache()
    _run(draft, target, _ids(30, 2), 1, cache)  # caches the 30-token prompt
    ids = torch.cat([_ids(30, 2), _ids(9, 3)], dim=1)
    rows = [open_row(draft, target, ids, 8, block_size=8, proposer="hybrid", prompt_cache=c) for c in (cache, None)]
    firsts = [prefill(r, ids).tokens for r in rows]
    assert rows[0].cached == 30 and rows[1].cached == 0
    assert firsts[0] == firsts[1]
    t = ids.shape[1]
    for name in ("k", "v"):
        assert torch.equal(getattr(rows[0].cache.kv, name)[..., :t, :], getattr(rows[1].cache.kv, name)[..., :t, :])
    assert torch.equal(rows[0].context.peek(), rows[1].context.peek())


@needs_native
def test_seeded_sampling_draws_the_same_with_the_cache(pair):
    draft, target = pair
    cache = PromptCache()
    ids = _ids(25, 4)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    _run(draft, target, ids[:, :20], 10, cache, params=params, seed=5)
    got, row = _run(draft, target, ids, 30, cache, params=params, seed=7)
    assert row.cached == 20
    assert got == _run(draft, target, ids, 30, None, params=params, seed=7)[0]


@needs_native
def test_the_cache_keeps_to_its_size_longest_extension_first(pair):
    draft, target = pair
    probe = PromptCache()
    _run(None, target, _ids(40, 5), 1, probe, proposer=None)
    one = probe.nbytes  # a 40-token prompt, no draft context
    cache = PromptCache(capacity_mb=2.5 * one / 2**20)
    _run(None, target, _ids(40, 5), 1, cache, proposer=None)
    _run(None, target, _ids(40, 6), 1, cache, proposer=None)
    assert len(cache) == 2
    _run(None, target, _ids(40, 7), 1, cache, proposer=None)  # the oldest leaves
    assert len(cache) == 2 and cache.nbytes <= cache.capacity
    _, row = _run(None, target, _ids(40, 5), 1, cache, proposer=None)
    assert row.cached == 0  # it was the one that left
    longer = torch.cat([_ids(40, 7), _ids(10, 8)], dim=1)
    _, row = _run(None, target, longer, 1, cache, proposer=None)
    assert row.cached == 40 and len(cache) == 2  # the longer prompt replaced the one it extends


@needs_native
def test_off_and_where_passes_are_not_row_invariant_every_prompt_is_computed(pair):
    draft, target = pair
    off = PromptCache(0)
    for _ in range(2):
        _, row = _run(draft, target, _ids(20, 9), 5, off)
        assert row.cached == 0
    assert len(off) == 0
    hf = TargetModel(target.model, kernels="torch")  # the model's own modules
    cache = PromptCache()
    for _ in range(2):
        _, row = _run(draft, hf, _ids(20, 9), 5, cache)
        assert row.cached == 0
    assert len(cache) == 0


def test_a_bad_size_is_refused():
    for bad in (-1, "big", True):
        with pytest.raises(ValueError, match="prompt cache size"):
            PromptCache(bad)
    with pytest.raises(ValueError, match="prompt cache size"):
        tiny_pipeline().with_prompt_cache(-5)
