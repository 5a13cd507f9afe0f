"""The MLX backend (dflash.backends.mlx) against the PyTorch engine and mlx-lm itself.

Tiny random HF models (written with transformers, loaded through mlx-lm) keep this file
fast: MLX is ~40x slower than torch on this CPU. Tolerances (fp32): draft block hidden
states 1e-5 and logits 1e-4 against PyTorch; target hidden states 1e-4 against HF;
the layer walk against mlx-lm's own forward 1e-5; greedy tokens exactly equal, and the MLX
loop's steps (proposed, accepted) equal the torch loop's. Sampled output: test_mlx_sampling.py."""

import ast
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("CI", "").lower() not in ("true", "1"):  # CI installs .[mlx]: there a missing MLX fails
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e '.[mlx]'; on Linux "
                                           "it needs mlx[cpu], plain mlx fails to import)", exc_type=ImportError)
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')", exc_type=ImportError)

import mlx.core as mx
import torch
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from transformers import AutoModelForCausalLM

from dflash.backends.mlx.api import _rope_overrides, load, load_draft, stream_generate
from dflash.backends.mlx.loop import stream_tokens
from dflash.backends.mlx.sampling import probabilities
from dflash.backends.mlx.target import MLXTarget, WindowKVCache
from dflash.engine import sampling as torch_sampling
from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.errors import CheckpointError, GenerationError, IncompatibleDraftError
from dflash.engine.loop import stream_generate as torch_stream_generate
from dflash.engine.request import SamplingParams
from dflash.engine.target import TargetModel

VOCAB, EOS = 320, 256
PROMPT = "hello world, this is a tiny test of speculative decoding"


def _tokenizer(path):
    """A byte-level BPE with no merges: 256 byte tokens + <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                eos_token_id=EOS, bos_token_id=None, pad_token_id=None, initializer_range=0.1, **kw)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _write_target(root, kind):
    """A tiny random HF target folder of the given kind, with a draft checkpoint in it."""
    import transformers as tf

    path = root / kind
    torch.manual_seed(0)
    if kind in ("llama", "llama_sliding"):
        cfg = tf.LlamaConfig(**_common(tie_word_embeddings=False, rope_theta=50_000.0))
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**_common(tie_word_embeddings=True))
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = tf.Gemma3TextConfig(**_common(sliding_window=4, query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "full_attention"] * 2))
        model = tf.Gemma3ForCausalLM(cfg)
    model.eval().save_pretrained(path)
    _tokenizer(path)
    if kind == "llama_sliding":  # mlx-lm's llama reads per-layer sliding windows
        _edit_config(path, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                        "sliding_attention"], sliding_window=5)
    if kind == "gemma3":  # mlx-lm's gemma3_text places its global layers by this pattern
        _edit_config(path, sliding_window_pattern=2)
    torch.manual_seed(1)
    draft = DFlashDraftModel(DFlashConfig.for_target(cfg, num_hidden_layers=2, block_size=4,
                                                     target_layer_ids=[0, 2]))
    draft.save_pretrained(path / "draft")
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("mlx_targets"), {}

    def get(kind):
        if kind not in made:
            path = _write_target(root, kind)
            model, tokenizer = load(path)
            made[kind] = path, model, tokenizer, load_draft(path / "draft")
        return made[kind]

    return get


def _ref_greedy(model, ids, n):
    """mlx-lm's own greedy generation of the target (its default sampler is argmax)."""
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def _np(x):
    return np.array(x.astype(mx.float32)) if isinstance(x, mx.array) else x.detach().float().numpy()


# ---- the target: layer walk, hidden states, rollback ----------------------------------

@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "qwen3", "gemma3"])
def test_layer_walk_equals_mlx_lm_forward(tiny, kind):
    _, model, tok, _ = tiny(kind)
    target = MLXTarget(model)
    ids = tok.encode(PROMPT)
    cache, ref_cache = target.new_cache(), make_prompt_cache(model)
    for chunk in (ids[:12], ids[12:13], ids[13:]):  # prefill, one token, a block past the window
        logits, _ = target(mx.array([chunk]), cache)
        ref = model(mx.array([chunk]), cache=ref_cache)
        np.testing.assert_allclose(_np(logits), _np(ref), atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_hidden_states_match_hf(tiny, kind):
    path, model, tok, _ = tiny(kind)
    hf = TargetModel(AutoModelForCausalLM.from_pretrained(path))
    ids = tok.encode(PROMPT)
    layer_ids = [0, 2, 3]  # the last layer's entry in HF's hidden_states is after the final norm
    t_logits, t_hidden = hf.forward(torch.tensor([ids]), hf.new_cache(), layer_ids)
    target = MLXTarget(model)
    m_logits, m_hidden = target(mx.array([ids]), target.new_cache(), layer_ids)
    np.testing.assert_allclose(_np(m_hidden), _np(t_hidden), atol=1e-4)
    np.testing.assert_allclose(_np(m_logits), _np(t_logits), atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "gemma3"])
def test_target_rollback_is_exact(tiny, kind):
    """Verifying a block of wrong tokens and trimming it leaves the cache as if the block had
    never been seen, sliding-window layers included (the blocks run past the window)."""
    _, model, tok, _ = tiny(kind)
    target = MLXTarget(model)
    ids = tok.encode(PROMPT)
    rolled, clean = target.new_cache(), target.new_cache()
    target(mx.array([ids[:8]]), rolled)
    target(mx.array([ids[:8]]), clean)
    pos = 8
    # (tokens kept, block size): blocks longer than the window, and one-token blocks
    # (mlx-lm's RotatingKVCache overwrites its ring in place for those and cannot undo it)
    for step, (keep, size) in enumerate([(1, 7), (1, 1), (0, 1), (3, 7), (1, 1), (0, 1), (2, 7), (6, 7)]):
        block = ids[pos: pos + keep] + [(7 * step + j) % VOCAB for j in range(size - keep)]
        target(mx.array([block]), rolled)
        rolled.crop_to(pos + keep)
        if keep:
            target(mx.array([ids[pos: pos + keep]]), clean)
        pos += keep
        assert rolled.length == clean.length == pos
    a, _ = target(mx.array([ids[pos: pos + 2]]), rolled)
    b, _ = target(mx.array([ids[pos: pos + 2]]), clean)
    np.testing.assert_allclose(_np(a), _np(b), atol=1e-5)


def test_window_cache_refuses_inexact_rollback():
    c = WindowKVCache(window=3)
    kv = mx.zeros((1, 1, 5, 2))
    c.update_and_fetch(kv, kv)
    c.update_and_fetch(kv[:, :, :2], kv[:, :, :2])  # offset 7: holds positions 2..6
    c.trim(2)  # the last chunk: exact
    c.update_and_fetch(kv[:, :, :2], kv[:, :, :2])  # holds 3..6
    with pytest.raises(ValueError, match="rolls back only"):
        c.trim(4)  # position 2 would be needed again, and it is gone


def test_rope_parameters_are_translated_for_mlx_lm():
    assert _rope_overrides({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}) == {"rope_theta": 1e5}
    gemma = {"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
                                 "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}
    assert _rope_overrides(gemma) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert _rope_overrides({"rope_theta": 3.0, "rope_parameters": {"rope_theta": 1e5}}) == {}


# ---- the draft: same checkpoint, same numbers as PyTorch --------------------------------

@pytest.mark.parametrize("window", [None, 3])
def test_draft_matches_pytorch(tiny, window):
    path, model, _, draft = tiny("llama")
    torch_draft = DFlashDraftModel.from_pretrained(path / "draft")
    hf = TargetModel(AutoModelForCausalLM.from_pretrained(path))
    target = MLXTarget(model)
    rng = np.random.default_rng(0)
    k_h = len(draft.target_layer_ids) * 64
    t_cache, m_cache = torch_draft.new_cache(window), draft.new_cache(window)
    start = 0
    for n_ctx in (7, 3, 1):  # context steps through the cache, as the loop runs them
        ctx = rng.standard_normal((1, n_ctx, k_h)).astype(np.float32)
        block = [int(rng.integers(VOCAB))] + [draft.mask_token_id] * 3
        with torch.no_grad():
            noise = hf.embed(torch.tensor([block]))
            pos = torch.arange(t_cache.length, start + n_ctx + 4)[None]
            t_out = torch_draft(pos, noise_embedding=noise, target_hidden=torch.from_numpy(ctx),
                                past_key_values=t_cache, use_cache=True)
            t_logits = hf.logits(t_out)
        m_out = draft(target.embed(mx.array([block])), mx.array(ctx), m_cache)
        m_logits = target.logits(m_out)
        np.testing.assert_allclose(_np(m_out), _np(t_out), atol=1e-5)
        np.testing.assert_allclose(_np(m_logits), _np(t_logits), atol=1e-4)
        start += n_ctx
        t_cache.crop_to(start)
        m_cache.crop_to(start)
        assert m_cache.length == t_cache.length and m_cache.offset == t_cache.offset


def test_load_draft_errors(tiny, tmp_path):
    path = tiny("llama")[0]
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft(tmp_path / "nope")
    shutil.copytree(path / "draft", tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_draft(tmp_path / "d")
    shutil.copy(path / "draft" / "model.safetensors", tmp_path / "d")
    _edit_config(tmp_path / "d", intermediate_size=96)
    with pytest.raises(CheckpointError, match="wrong shapes"):
        load_draft(tmp_path / "d")


def test_incompatible_draft_is_refused(tiny):
    _, model, tok, _ = tiny("llama")
    other = load_draft(tiny("gemma3")[0] / "draft")
    other.config.num_target_layers = 6
    with pytest.raises(IncompatibleDraftError, match="6-layer target"):
        next(stream_generate(model, other, tok, PROMPT))


# ---- the loop: greedy output is the target's own, and the torch loop's step for step -----

def _tokens(steps):
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "qwen3", "gemma3"])
def test_greedy_equals_mlx_lm(tiny, kind):
    _, model, tok, draft = tiny(kind)
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 24)
    for block_size in (1, 4, 7):
        assert _tokens(stream_tokens(model, draft, ids, max_tokens=24, block_size=block_size)) == ref, block_size


def test_chunked_prefill_and_quantized_target(tiny):
    """A prompt prefilled in chunks (past the sliding window), and a 4-bit target (what MLX
    users mostly run), still give the target's own greedy tokens; a draft vocabulary reads the
    4-bit head's rows dequantized."""
    from mlx import nn

    path, model, tok, draft = tiny("llama_sliding")
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 12)
    assert _tokens(stream_tokens(model, draft, ids, max_tokens=12, block_size=4, prefill_step_size=7)) == ref
    q_model, _ = load(path)
    nn.quantize(q_model, group_size=64, bits=4)
    q_ref = _ref_greedy(q_model, ids, 12)
    assert _tokens(stream_tokens(q_model, draft, ids, max_tokens=12, block_size=4)) == q_ref
    target, rows = MLXTarget(q_model), mx.array([3, 250, 7])
    hidden = mx.random.normal((1, 2, 64), key=mx.random.key(0))  # (1, 2, H)
    np.testing.assert_allclose(_np(target.logits(hidden, target.head_rows(rows))),
                               _np(target.logits(hidden)[..., rows]), atol=1e-4)
    vocab_draft = load_draft(path / "draft")
    vocab_draft.config.draft_vocab = sorted(set(range(VOCAB)) - {q_ref[3]})
    assert _tokens(stream_tokens(q_model, vocab_draft, ids, max_tokens=12, block_size=4)) == q_ref


class _Oracle:
    """A trained-like draft: it runs the real draft (so the draft cache is exercised), then
    returns hidden states whose logits propose the reference continuation, wrong at one block
    slot per call (a different one each call), sure of every slot but each third position
    (a low draft probability there, for the draft threshold). The same numbers (numpy) in
    both frameworks, so the MLX and torch loops must take the same steps."""

    def __init__(self, draft, rows: np.ndarray, ref, n_prompt):
        self.draft, self.rows, self.ref, self.n_prompt, self.calls = draft, rows, ref, n_prompt, 0

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def _hidden(self, pos: int, size: int) -> np.ndarray:
        """The block at positions pos.. -> (1, S, H)."""
        self.calls += 1
        want = [self.ref[min(pos + j - self.n_prompt, len(self.ref) - 1)] for j in range(size)]
        want[self.calls % size] = (want[self.calls % size] + 1) % VOCAB
        rows = self.rows[want] / np.linalg.norm(self.rows[want], axis=-1, keepdims=True)  # (S, H)
        scale = np.where((pos + np.arange(size)) % 3 == 0, 1.0, 20.0)[:, None]  # (S, 1)
        return (scale * rows)[None].astype(np.float32)


class MLXOracle(_Oracle):
    def __call__(self, noise, ctx, cache):
        pos = cache.length + ctx.shape[1]  # the block's first position
        self.draft(noise, ctx, cache)
        return mx.array(self._hidden(pos, noise.shape[1]))


class TorchOracle(_Oracle):
    def __call__(self, positions, **kw):
        self.draft(positions, **kw)
        size = kw["noise_embedding"].shape[1]
        return torch.from_numpy(self._hidden(int(positions[0, -size]), size))


def _head_rows(model) -> np.ndarray:
    """(V, H) the output projection of an mlx-lm model: logits = h @ rows.T."""
    head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
    return _np(head.weight)


@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "gemma3"])
def test_greedy_with_accepting_draft_equals_mlx_lm(tiny, kind):
    _, model, tok, draft = tiny(kind)
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 30)
    oracle = MLXOracle(draft, _head_rows(model), ref, len(ids))
    steps = list(stream_tokens(model, oracle, ids, max_tokens=30, block_size=6,
                               draft_window=4 if kind == "llama" else None))
    assert _tokens(steps) == ref
    assert {s.accepted for s in steps[1:]} >= {0, 1, 2, 3}  # partial acceptance, then rollback


@pytest.mark.parametrize("case", ["plain", "draft-vocab", "threshold", "draft-vocab+threshold"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_steps_equal_the_torch_loop(tiny, kind, case):
    """Same weights, same trained-like draft: the MLX loop commits the same tokens in the same
    steps (proposed, accepted) as the torch loop, with a draft vocabulary (the reference's 4th
    token left out, so the draft cannot propose it) and a draft threshold."""
    path, model, tok, _ = tiny(kind)
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 40)
    vocab = sorted(set(range(VOCAB)) - {ref[3]}) if "vocab" in case else None
    threshold = 0.5 if "threshold" in case else 0.0
    mlx_draft, torch_draft = load_draft(path / "draft"), DFlashDraftModel.from_pretrained(path / "draft")
    mlx_draft.config.draft_vocab = torch_draft.config.draft_vocab = vocab
    rows = _head_rows(model)
    mlx_steps = list(stream_tokens(model, MLXOracle(mlx_draft, rows, ref, len(ids)), ids, max_tokens=40,
                                   block_size=6, draft_window=5, draft_threshold=threshold))
    torch_steps = list(torch_stream_generate(TorchOracle(torch_draft, rows, ref, len(ids)),
                                             TargetModel(AutoModelForCausalLM.from_pretrained(path)),
                                             torch.tensor([ids]), 40, block_size=6, draft_window=5,
                                             draft_threshold=threshold))
    assert [tuple(s) for s in mlx_steps] == [(s.tokens, s.proposed, s.accepted, s.finish_reason, s.drafted)
                                             for s in torch_steps]
    assert _tokens(mlx_steps) == ref
    proposed = [s.proposed for s in mlx_steps[1:]]
    assert max(s.accepted for s in mlx_steps) >= (2 if threshold else 3)
    if threshold:  # each third position is unsure: it and what follows it are not verified
        assert max(proposed) <= 2 and 0 in proposed
    if vocab and ref[3] not in ids:  # the left-out token is not accepted before the text shows it
        first, done = ref.index(ref[3]), 0  # where the target commits it first, as its own token
        for s in mlx_steps:  # after that both heads are widened by it (the context vocabulary)
            assert done > first or ref[3] not in s.tokens[:s.accepted]
            done += len(s.tokens)


def test_stream_generate_responses_stats_and_stop(tiny):
    _, model, tok, draft = tiny("llama")
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 20)
    stop = ref[9]
    responses = list(stream_generate(model, draft, tok, PROMPT, block_size=4, max_tokens=20,
                                     stop_token_ids=[stop]))
    tokens = [t for r in responses for t in r.tokens]
    assert tokens == ref[: ref.index(stop) + 1]
    assert [r.finish_reason for r in responses] == [None] * (len(responses) - 1) + ["stop"]
    detok = tok.detokenizer  # mlx-lm's streaming detokenizer, fed the same tokens at once
    detok.reset()
    for t in tokens[:-1]:
        detok.add_token(t)
    detok.finalize()
    assert "".join(r.text for r in responses) == detok.text  # the stop token is not decoded
    last = responses[-1]
    assert last.prompt_tokens == len(ids) and last.generation_tokens == len(tokens) and last.token == stop
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory >= 0
    assert all(0 <= r.accepted <= r.proposed <= 3 for r in responses)
    # the engine's stats fold: verify steps only (not the prefill token), tau = 1 + accepted / drafts
    verify = responses[1:]
    assert last.stats.num_drafts == len(verify) and last.stats.num_plain_steps == 0
    assert last.stats.num_accepted_tokens == sum(r.accepted for r in verify)
    assert last.mean_acceptance_length == 1 + sum(r.accepted for r in verify) / len(verify)
    assert responses[1].stats.num_drafts == 1  # each response holds the fold so far, not a shared one
    full = list(stream_generate(model, draft, tok, ids, max_tokens=5))
    assert sum(len(r.tokens) for r in full) == 5 and full[-1].finish_reason in ("length", "stop")
    plain = list(stream_generate(model, None, tok, ids, max_tokens=5, stop_token_ids=()))  # no draft: block 1
    assert [t for r in plain for t in r.tokens] == ref[:5] and all(r.proposed == 0 for r in plain)
    assert plain[-1].stats.num_plain_steps == 4 and plain[-1].stats.num_drafts == 0
    assert plain[-1].mean_acceptance_length == 1.0


def test_arguments_are_checked_by_the_shared_checks(tiny):
    """The engine's check_request refuses for MLX what it refuses for torch, by the same words."""
    _, model, tok, draft = tiny("llama")
    ids = tok.encode(PROMPT)
    for kwargs, match in [({"prompt": [1] * 256}, "context holds 256"), ({"block_size": 4, "draft": None}, "needs a draft"),
                          ({"prompt": []}, "prompt is empty"), ({"prompt": [VOCAB]}, "outside the target vocabulary"),
                          ({"max_tokens": -1}, "max_new_tokens"), ({"draft_threshold": 1.5}, "draft_threshold"),
                          ({"block_size": 0}, "block_size")]:
        args = {"prompt": ids, "draft": draft, **kwargs}
        with pytest.raises(GenerationError, match=match):
            next(stream_generate(model, args.pop("draft"), tok, args.pop("prompt"), **args))
    for kwargs, match in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_k": -2}, "top_k"), ({"rule": "greedy"}, "rule")]:
        with pytest.raises(ValueError, match=match):
            next(stream_generate(model, draft, tok, ids, **kwargs))


# ---- sampling: the engine's definitions, the same numbers ---------------------------------

@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
                                    SamplingParams(1.0, top_p=0.6, top_k=9), SamplingParams(1.0, top_k=3),
                                    SamplingParams(1e-5, top_k=3)],
                         ids=["t1", "topk5", "topp", "topk+topp", "topk3-ties", "floor"])
def test_probabilities_equal_the_torch_engine(params):
    """Temperature, then top-k, then top-p, as torch, on rows with ties and huge scores."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 40)) * 3).astype(np.float32)  # (R, V)
    logits[:, 10:16] = logits[:, :1]  # ties with each row's first score
    logits[0] = np.round(logits[0])  # many ties
    logits[1] *= 1e4  # huge scores
    logits[2, :5] = [9.0, 8.0, 8.0, 8.0, 7.0]  # the 2nd to 4th highest tie
    want = torch_sampling.probabilities(torch.from_numpy(logits), params).numpy()
    got = _np(probabilities(mx.array(logits), params))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-6)
    if params.top_k == 3 and params.temperature == 1.0:  # every token tied with the k-th score is kept
        assert (got[2] > 0).sum() == 4


def test_tiny_temperatures_are_greedy(tiny):
    """Below the engine's floor (1e-5) a temperature is greedy, for both rules: no nan from
    dividing by 1e-38 or a subnormal 5e-324."""
    _, model, tok, draft = tiny("qwen3")
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 12)
    for temperature in (1e-38, 5e-324):
        for rule in ("rejection", "match"):
            params = SamplingParams(temperature, top_p=0.9, top_k=5, rule=rule)
            assert params.greedy
            assert _tokens(stream_tokens(model, draft, ids, max_tokens=12, params=params, block_size=4, seed=0)) == ref


def test_sampling_is_seeded(tiny):
    _, model, tok, draft = tiny("qwen3")
    ids = tok.encode(PROMPT)

    def run(seed, rule="rejection", temperature=1.0):
        params = SamplingParams(temperature, top_k=20, rule=rule)
        return _tokens(stream_tokens(model, draft, ids, max_tokens=12, params=params, block_size=4, seed=seed))

    assert run(3) == run(3) and run(3, "match") == run(3, "match")
    assert run(3) != run(4)
    assert all(0 <= t < VOCAB for t in run(4))
    assert run(0, temperature=1e-4) == _ref_greedy(model, ids, 12)  # just above the floor: still near greedy


def test_backend_imports_no_torch():
    """No module of dflash/backends/mlx imports torch or transformers, nor does any dflash
    module it imports (the engine's request, params, policy, stats, errors and config)."""
    root = Path(__file__).resolve().parent.parent
    todo, seen, outside = sorted((root / "dflash/backends/mlx").glob("*.py")), set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                if name.startswith("dflash."):
                    module = root / (name.replace(".", "/") + ".py")
                    todo.append(module if module.exists() else module.with_suffix("") / "__init__.py")
                else:
                    outside.add(name.split(".")[0])
    assert root / "dflash/engine/policy.py" in seen and root / "dflash/engine/stats.py" in seen
    assert "mlx" in outside and not outside & {"torch", "transformers"}


@pytest.fixture(scope="module")
def smollm2():
    from dflash.text.assets import default_target_dir

    path = default_target_dir()
    return (path, *load(path))


@pytest.mark.slow
def test_smollm2_greedy_equals_mlx_lm(smollm2, tmp_path):
    from transformers import AutoConfig

    path, model, tok = smollm2
    torch.manual_seed(0)
    DFlashDraftModel(DFlashConfig.for_target(AutoConfig.from_pretrained(path), num_hidden_layers=1,
                                             block_size=4)).save_pretrained(tmp_path / "draft")
    draft = load_draft(tmp_path / "draft")
    ids = tok.encode("The three primary colours are")  # short: MLX prefill is slow on this CPU
    ref = _ref_greedy(model, ids, 10)
    oracle = MLXOracle(draft, _head_rows(model), ref, len(ids))  # accepts some, rolls back the rest
    steps = list(stream_tokens(model, oracle, ids, max_tokens=10, block_size=4))
    assert _tokens(steps) == ref
    assert sum(s.accepted for s in steps) > 0


@pytest.mark.slow
def test_smollm2_target_and_draft_match_pytorch(smollm2, tmp_path):
    """The real target: its RoPE settings reach mlx-lm (transformers 5 writes them only as
    rope_parameters), its hidden states and logits and the draft's match PyTorch."""
    from transformers import AutoModelForCausalLM

    path, model, tok = smollm2
    hf = TargetModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    torch.manual_seed(0)
    DFlashDraftModel(DFlashConfig.for_target(hf.model.config, num_hidden_layers=2, block_size=8)
                     ).save_pretrained(tmp_path / "draft")
    draft, torch_draft = load_draft(tmp_path / "draft"), DFlashDraftModel.from_pretrained(tmp_path / "draft")
    ids = tok.encode("The three primary colours are")  # short: MLX prefill is slow on this CPU
    layer_ids = draft.target_layer_ids
    with torch.no_grad():
        t_logits, t_hidden = hf.forward(torch.tensor([ids]), hf.new_cache(), layer_ids)
        block = torch.tensor([[ids[-1]] + [draft.mask_token_id] * 7])
        t_out = torch_draft(torch.arange(len(ids) + 8)[None], noise_embedding=hf.embed(block),
                            target_hidden=t_hidden, past_key_values=torch_draft.new_cache(), use_cache=True)
        t_block = hf.logits(t_out)
    target = MLXTarget(model)
    m_logits, m_hidden = target(mx.array([ids]), target.new_cache(), layer_ids)
    m_out = draft(target.embed(mx.array(block.numpy())), m_hidden, draft.new_cache())
    np.testing.assert_allclose(_np(m_hidden), _np(t_hidden), atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(_np(m_logits), _np(t_logits), atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(_np(m_out), _np(t_out), atol=1e-4)
    np.testing.assert_allclose(_np(target.logits(m_out)), _np(t_block), atol=1e-3)
