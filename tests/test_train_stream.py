"""The data generator's continuous batch: rows that end take the next prompt at once, each
with its own response limit, and what every prompt gets is what the target alone gives it."""

import pytest
import torch
from train_support import LAYERS, features

from dflash.engine import static_decoder
from dflash.testing import tiny_target
from dflash.train.generator import Request, SoftLabels, _StaticSteps, generate_stream

K = 5


def _requests(n: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 15, (n,), generator=g).tolist()
    limits = torch.randint(1, 21, (n,), generator=g).tolist()
    return [Request(torch.randint(0, 90, (m,), generator=g).tolist(), lim, i)
            for i, (m, lim) in enumerate(zip(lengths, limits))]


def _greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])  # (1, n); a 0 in it is a token, not padding: the mask says so
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind,static", [("llama", True), ("llama", False), ("gemma3", None)])
def test_a_refilled_batch_answers_each_prompt_as_the_target_alone(kind, static, monkeypatch):
    """18 prompts of 2-14 tokens, limits 1-20, three stop tokens, three rows at a time: every
    response is HF greedy `generate` on its prompt alone, cut at its first stop token or its
    own limit, and its features and top-k are a plain forward's. The static buffer shifts
    every two free slots here (64 in use), so the shift is exercised many times."""
    target = tiny_target(kind, seed=3)
    requests = _requests(18, seed=4)
    refs = {r.key: _greedy(target, r.prompt, 20) for r in requests}
    stop = sorted({refs[0][3], refs[5][9], refs[11][1]})
    monkeypatch.setattr(_StaticSteps, "SLACK", 2)
    shifts = []
    real_shift = static_decoder.KVBuffer.shift
    monkeypatch.setattr(static_decoder.KVBuffer, "shift", lambda kv, n: (shifts.append(n), real_shift(kv, n)))
    order = []
    for req, got in generate_stream(target, requests, LAYERS, stop, 0, batch=3, longest_prompt=14,
                                    longest_response=20, static=static, topk=K):
        ref = refs[req.key][:req.max_new_tokens]
        cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
        assert got.response_ids == ref[:cut], req.key
        assert got.finished == (ref[cut - 1] in stop)
        toks = torch.tensor(req.prompt + got.response_ids)
        assert got.features.shape == (len(toks) - 1, 2 * 64)
        assert torch.allclose(got.features.float(), features(target, toks), atol=2e-2)
        with torch.no_grad():
            logits = target(input_ids=toks[None, :-1]).logits[0, len(req.prompt) - 1:]  # (R, V)
        ref_soft = SoftLabels.from_logits(logits, K)
        assert torch.equal(got.soft.ids[:, 0], ref_soft.ids[:, 0])
        assert torch.allclose(got.soft.logprobs.float(), ref_soft.logprobs.float(), atol=2e-2)
        order.append(req.key)
    assert sorted(order) == list(range(18)) and order != sorted(order)  # all answered, as rows ended
    if static is not False and kind == "llama":
        assert len(shifts) > 5 and all(n >= 2 for n in shifts)


def test_a_stream_refuses_a_prompt_or_limit_it_has_no_room_for():
    target = tiny_target("llama", seed=3)
    for bad, match in [(Request([1] * 9, 4), "prompt of 9 tokens"), (Request([1, 2], 0), "max_new_tokens 0"),
                       (Request([], 3), "prompt of 0 tokens"), (Request([1, 2], 7), "max_new_tokens 7")]:
        with pytest.raises(ValueError, match=match):
            list(generate_stream(target, [bad], LAYERS, [], 0, batch=2, longest_prompt=8, longest_response=6))
