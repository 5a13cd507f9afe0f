"""Soft labels (the target's top-k distribution over every response token), kept beside the
features by the generator and by the prefill rebuild, and the distillation loss on them."""

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from dflash.testing import tiny_target
from dflash.train.data import DataConfig, DataError, load_sequences, write_shard
from dflash.train.generator import SoftLabels, generate_batch, prefill_features

LAYERS = [0, 2]
K = 5


def reference_soft(model, prompt: list[int], response: list[int]) -> SoftLabels:
    """The top-k of a plain HF forward's distribution over each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0]  # (L-1, V)
    return SoftLabels.from_logits(logits[len(prompt) - 1:], K)


def assert_same_soft(got: SoftLabels, ref: SoftLabels) -> None:
    assert got.ids.dtype == torch.int32 and got.logprobs.dtype == torch.float16 and got.rest.dtype == torch.float16
    assert got.ids.shape == ref.ids.shape and got.rest.shape == ref.rest.shape
    assert torch.equal(got.ids[:, 0], ref.ids[:, 0])  # the argmax (ties below it may swap on rounding)
    assert torch.allclose(got.logprobs.float(), ref.logprobs.float(), atol=2e-2)
    assert torch.allclose(got.rest.float(), ref.rest.float(), atol=2e-2)
    mass = got.logprobs.float().exp().sum(-1) + got.rest.float().exp()  # (R,)
    assert torch.allclose(mass, torch.ones_like(mass), atol=1e-2)


@pytest.mark.parametrize("kind,static", [("llama", True), ("llama", False), ("gemma3", None)])
def test_generator_and_rebuild_keep_the_targets_top_k_over_every_response_token(kind, static):
    target = tiny_target(kind, seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (4, 11, 6)]
    probe = generate_batch(target, prompts, LAYERS, 12, stop_ids=[], pad_id=0, static=static)
    stop = [probe[1].response_ids[3]]  # one row stops early
    got = generate_batch(target, prompts, LAYERS, 12, stop_ids=stop, pad_id=0, static=static, topk=K)
    assert len(got[1].response_ids) <= 4
    for p, r in zip(prompts, got):
        assert len(r.soft) == len(r.response_ids)
        assert_same_soft(r.soft, reference_soft(target, p, r.response_ids))
    feats, soft = prefill_features(target, [r.prompt_ids + r.response_ids for r in got], LAYERS, static=static,
                                   prompt_lens=[len(p) for p in prompts], topk=K)
    for r, f, s in zip(got, feats, soft):
        assert torch.allclose(f.float(), r.features.float(), atol=2e-2)
        assert_same_soft(s, r.soft)
    with pytest.raises(ValueError, match="prompt length"):
        prefill_features(target, [prompts[0] + [1, 2]], LAYERS, topk=K)


def _rows_and_soft(target):
    gen = generate_batch(target, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], LAYERS, 6, stop_ids=[], pad_id=0, topk=K)
    rows = [{"id": f"p{i}", "dataset": "math", "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
             "finished": r.finished} for i, r in enumerate(gen)]
    return gen, rows


def test_a_rebuilt_shard_gains_soft_labels_and_an_old_shard_still_loads(tmp_path):
    from dflash.train.data import _rebuild_shard

    target = tiny_target("llama", seed=3)
    gen, rows = _rows_and_soft(target)
    (tmp_path / "data_config.json").write_text(json.dumps(asdict(DataConfig(layer_ids=LAYERS))))
    write_shard(tmp_path, 0, [dict(r) for r in rows], [g.features for g in gen])  # an old shard: hard labels only
    new_rows, feats, soft = _rebuild_shard(target, rows, LAYERS, topk=K)  # the kept responses, by prefill
    write_shard(tmp_path, 1, new_rows, feats, soft)
    assert not (tmp_path / "shard-00000.topk.npz").exists() and (tmp_path / "shard-00001.topk.npz").exists()
    with np.load(tmp_path / "shard-00001.topk.npz") as z:
        assert z["ids"].dtype == np.int32 and z["logprobs"].dtype == np.float16 and z["rest"].dtype == np.float16
        assert z["ids"].shape == (18, K) and z["rest"].shape == (18,)  # 3 responses of 6 tokens
    old, new = load_sequences(tmp_path, shards=[0]), load_sequences(tmp_path, shards=[1])
    assert all(s.soft is None for s in old)
    for s, g in zip(new, gen):
        assert s.tokens.tolist() == g.prompt_ids + g.response_ids
        assert_same_soft(s.soft, g.soft)
    with pytest.raises(DataError, match="soft labels do not match"):
        write_shard(tmp_path, 2, new_rows, feats, soft[:2])
    (tmp_path / "shard-00000.topk.npz").write_bytes((tmp_path / "shard-00001.topk.npz").read_bytes())
    bad = [dict(r, response_ids=r["response_ids"][:-1]) for r in rows]  # shorter responses than its soft rows
    write_shard(tmp_path, 3, bad, [f[:-1] for f in feats])
    (tmp_path / "shard-00003.topk.npz").write_bytes((tmp_path / "shard-00001.topk.npz").read_bytes())
    with pytest.raises(DataError, match="has 18 rows, the shard's responses 15 tokens"):
        load_sequences(tmp_path, shards=[3])
