"""Speculative greedy output equals the target's own HF greedy output, token for token."""

import pytest
import torch

from dflash.engine import loop as gen
from dflash.engine.cache import StaticTargetCache
from dflash.engine.errors import GenerationError
from dflash.engine.sampling import SamplingParams
from dflash.engine.target import TargetModel
from dflash.model import dflash_generate
from dflash.testing import tiny_draft, tiny_target


def hf_greedy(model, ids, max_new_tokens, stop=None):
    if max_new_tokens == 0:
        return ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_greedy_equals_hf_generate(family):
    target = tiny_target(family)
    draft = tiny_draft(target, block_size=16)
    torch.manual_seed(5)
    for prompt_len in (1, 6, 23):
        ids = torch.randint(0, 96, (1, prompt_len))
        ref = hf_greedy(target, ids, 37)  # 37: not a multiple of any block size
        for block_size in (1, 2, 8, 16):
            out = dflash_generate(draft, target, ids, 37, None, 0.0, block_size=block_size)
            assert torch.equal(out, ref), (family, prompt_len, block_size)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_decoder_gives_hf_numbers_and_rolls_back(family):
    """The static KV buffer path (default for Llama-family targets) returns HF's hidden
    states and logits, and after a trim the next block sees exactly the kept context."""
    model = tiny_target(family)
    static, hf = TargetModel(model), TargetModel(model, static=False)
    assert static.static and not hf.static
    assert isinstance(static.new_cache(), StaticTargetCache)
    caches = StaticTargetCache(model, capacity=8), hf.new_cache()  # 8: the buffer must grow
    layers = [0, 2, 3]  # 3 is the last layer: HF gives it after the final norm
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    for chunk, trim in ((ids[:, :23], 0), (ids[:, 23:24], 0), (ids[:, 24:40], 9), (ids[:, 31:36], 2)):
        (a, ha), (b, hb) = static.forward(chunk, caches[0], layers), hf.forward(chunk, caches[1], layers)
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ha, hb, atol=1e-5)
        for c in caches:
            c.trim(trim)
        assert caches[0].length == caches[1].length
    with pytest.raises(ValueError, match="does not support"):
        TargetModel(tiny_target("gemma3"), static=True)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 17])
def test_max_new_tokens_edges(llama, llama_draft, max_new_tokens):
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    ref = hf_greedy(llama, ids, max_new_tokens)
    for block_size in (1, 8, 16):
        res = dflash_generate(llama_draft, llama, ids, max_new_tokens, None, block_size=block_size, return_stats=True)
        assert torch.equal(res.output_ids, ref)
        assert res.num_output_tokens == max_new_tokens


def test_stop_tokens_end_generation(llama, llama_draft):
    ids = torch.tensor([[7, 1, 8, 2, 8]])
    ref = hf_greedy(llama, ids, 40)[0, ids.shape[1]:].tolist()
    stop = ref[9]  # a token the target emits; generation must end at its first occurrence
    expected = ref[: ref.index(stop) + 1]
    for block_size in (1, 4, 16):
        res = dflash_generate(llama_draft, llama, ids, 40, [stop], block_size=block_size, return_stats=True)
        assert res.output_ids[0, ids.shape[1]:].tolist() == expected
        assert res.finish_reason == "stop"
    assert torch.equal(dflash_generate(llama_draft, llama, ids, 40, [stop]), hf_greedy(llama, ids, 40, stop=stop))


def test_stop_token_in_prompt_is_ignored(llama, llama_draft):
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = hf_greedy(llama, ids, 12)
    # a stop token that only appears in the prompt must not end generation
    assert torch.equal(dflash_generate(llama_draft, llama, ids, 12, [5], block_size=8), ref)


class OracleProposer(gen.Proposer):
    """Proposes the target's own continuation (optionally with a wrong token planted at block
    position `plant_at`): the loop's proposer seam, no patching. Reads no hidden states."""

    def __init__(self, continuation, prompt_len, plant_at=None):
        self.continuation, self.prompt_len, self.plant_at = continuation, prompt_len, plant_at

    def propose(self, context, last, pos, size, want_conf=False):
        done = pos - self.prompt_len + 1  # tokens generated so far (including `last`)
        tokens = self.continuation[done: done + size - 1].clone()
        if self.plant_at is not None and self.plant_at - 1 < len(tokens):
            tokens[self.plant_at - 1] = (tokens[self.plant_at - 1] + 1) % 96
        return gen.Proposal(tokens[None])


def test_oracle_draft_reaches_block_size(llama, llama_draft):
    ids = torch.tensor([[11, 12, 13]])
    ref = hf_greedy(llama, ids, 1 + 16 * 4)
    oracle = OracleProposer(ref[0, ids.shape[1]:], ids.shape[1])
    res = dflash_generate(llama_draft, llama, ids, 1 + 16 * 4, None, block_size=16, return_stats=True,
                          proposer=oracle)
    assert torch.equal(res.output_ids, ref)
    assert res.acceptance_lengths == [16, 16, 16, 16]
    assert res.tau == 16
    assert res.acceptance_counts == [4] * 15


@pytest.mark.parametrize("j", [0, 5, 14])  # 0-based index of the wrong proposal
def test_planted_mismatch_gives_acceptance_j_plus_1(llama, llama_draft, j):
    ids = torch.tensor([[21, 22, 23, 24]])
    ref = hf_greedy(llama, ids, 33)
    oracle = OracleProposer(ref[0, ids.shape[1]:], ids.shape[1], plant_at=j + 1)
    res = dflash_generate(llama_draft, llama, ids, 33, None, block_size=16, return_stats=True, proposer=oracle)
    assert torch.equal(res.output_ids, ref)  # the target corrects the planted token
    *full, last = res.acceptance_lengths  # the last block may be cut short by max_new_tokens
    assert full and all(a == j + 1 for a in full) and last <= j + 1
    assert res.acceptance_counts[j] == 0  # the planted position is never accepted


def test_stats_are_consistent(llama, llama_draft):
    ids = torch.tensor([[1, 2, 3]])
    res = dflash_generate(llama_draft, llama, ids, 30, None, block_size=8, return_stats=True)
    assert res.num_input_tokens == 3 and res.num_output_tokens == 30
    assert 1 + sum(res.acceptance_lengths) == res.num_output_tokens  # the first token comes from prefill
    assert all(1 <= a <= 8 for a in res.acceptance_lengths)
    assert len(res.acceptance_counts) == 7
    assert res.time_to_first_token > 0 and res.time_per_output_token > 0


def test_stream_yields_new_tokens_only(llama, llama_draft):
    ids = torch.tensor([[4, 4, 4]])
    steps = list(gen.stream_generate(llama_draft, TargetModel(llama), ids, 20, block_size=8))
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == dflash_generate(llama_draft, llama, ids, 20, None, block_size=8)[0, 3:].tolist()
    assert steps[-1].finish_reason == "length" and all(s.finish_reason is None for s in steps[:-1])


def test_spec_generate_method(llama, llama_draft):
    ids = torch.tensor([[9, 8, 7]])
    assert torch.equal(llama_draft.spec_generate(llama, ids, 10, None, 0.0), hf_greedy(llama, ids, 10))


class RecordingProposer(gen.DraftProposer):
    """The draft's own proposer, keeping every token it proposed."""
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.proposed = []

    def propose(self, *args, **kw):
        block = super().propose(*args, **kw)
        self.proposed.extend(block.tokens[0].tolist())
        return block


@pytest.mark.parametrize("context_vocab", [False, True])
def test_draft_vocabulary_keeps_output_exact(llama, context_vocab):
    """A draft restricted to a vocabulary subset proposes only those ids (with its context
    vocabulary, also the prompt's and the output's ids); output is unchanged."""
    vocab = list(range(0, 96, 3))
    draft = tiny_draft(llama, block_size=8)
    draft.config.draft_vocab = vocab
    proposed, seen = [], {2, 7, 1, 8}
    ids = torch.tensor([[2, 7, 1, 8]])
    for temperature in (0.0, 1.0):
        gen_ = torch.Generator().manual_seed(0)
        spy = RecordingProposer(draft, TargetModel(llama), SamplingParams(temperature), draft.config.mask_token_id, gen_,
                                context_vocab=context_vocab)
        out = dflash_generate(draft, llama, ids, 30, None, temperature, generator=gen_, proposer=spy)
        proposed += spy.proposed
        seen |= set(out[0].tolist())
        if temperature == 0.0:
            assert torch.equal(out, hf_greedy(llama, ids, 30))
    if context_vocab:  # ids outside the vocabulary are proposed, only ones the text had shown
        assert set(proposed) - set(vocab) and set(proposed) <= set(vocab) | seen
    else:
        assert proposed and set(proposed) <= set(vocab)


def test_a_widened_head_adds_the_texts_ids_and_leaves_the_vocabulary_alone(llama):
    from dflash.engine.proposers import DraftHead

    target = TargetModel(llama)
    base = DraftHead.of([0, 3, 6, 9], target)
    assert base.widened([3, 9, 0], target) is base  # nothing new: the same head
    head = base.widened([5, 3, 5, 1], target).widened([1, 2], target)
    assert base.extra_ids is None and base.ids.tolist() == [0, 3, 6, 9]  # the vocabulary's head is unchanged
    assert head.vocab.tolist() == [0, 3, 6, 9, 1, 5, 2] and head.rows is base.rows
    hidden = torch.randn(1, 3, llama.config.hidden_size)  # (1, S, H)
    full = target.logits(hidden)  # (1, S, V)
    assert torch.allclose(head.logits(target, hidden), full[..., head.vocab], atol=1e-5)
    q = torch.softmax(head.logits(target, hidden), -1)  # (1, S, 7)
    assert torch.equal(head.full_probs(q, full.shape[-1])[..., head.vocab], q)
    assert head.to_vocab(torch.tensor([[4, 6]])).tolist() == [[1, 2]]
    assert DraftHead().widened([1, 2], target).vocab is None  # the full head has every id already


@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.2, 1.0])
def test_draft_threshold_verifies_fewer_tokens_and_stays_exact(llama, threshold):
    """Proposals end at the first one the draft is less sure of than `threshold`: the target
    verifies fewer tokens per step, and the greedy output is still the target's own."""
    draft = tiny_draft(llama, block_size=8)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    steps = list(gen.stream_generate(draft, TargetModel(llama), ids, 40, block_size=8, draft_threshold=threshold))
    out = [t for s in steps for t in s.tokens]
    assert out == hf_greedy(llama, ids, 40)[0, 5:].tolist()
    proposed, room, done = [], [], 1
    for s in steps[1:]:
        proposed.append(s.proposed)
        room.append(min(8, 40 - done) - 1)  # proposals the block had room for
        done += len(s.tokens)
    if threshold == 0.0:
        assert proposed == room
    elif threshold == 1.0:  # no draft is ever certain: every step is a plain decoding step
        assert set(proposed) == {0} and all(len(s.tokens) == 1 for s in steps)
        sampled = list(gen.stream_generate(draft, TargetModel(llama), ids, 12, params=SamplingParams(1.0),
                                           block_size=8, generator=torch.Generator().manual_seed(0),
                                           draft_threshold=threshold))  # rejection sampling with no proposals
        assert [s.proposed for s in sampled[1:]] == [0] * 11 and sum(len(s.tokens) for s in sampled) == 12
    else:
        assert all(p <= r for p, r in zip(proposed, room)) and proposed != room
    assert all(s.accepted <= s.proposed for s in steps)


def test_draft_threshold_must_be_a_probability(llama, llama_draft):
    with pytest.raises(GenerationError, match="draft_threshold"):
        dflash_generate(llama_draft, llama, torch.tensor([[1, 2]]), 4, None, draft_threshold=1.5)
