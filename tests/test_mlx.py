"""The MLX backend (dflash.backends.mlx.loop) against the PyTorch engine and mlx-lm itself.

Tiny random HF models (written with transformers, loaded through mlx-lm) keep this file
fast: MLX is ~40x slower than torch on this CPU. Tolerances (fp32): draft block hidden
states 1e-5 and logits 1e-4 against PyTorch; target hidden states 1e-4 against HF;
the layer walk against mlx-lm's own forward 1e-5; greedy tokens exactly equal."""

import json
import shutil

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e '.[mlx]'; on Linux "
                                            "it needs mlx[cpu], plain mlx fails to import)")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')")

import torch  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from dflash.backends.mlx.loop import (  # noqa: E402
    MLXTarget,
    WindowKVCache,
    _rope_overrides,
    load,
    load_draft,
    stream_generate,
    stream_tokens,
)
from dflash.engine.config import DFlashConfig  # noqa: E402
from dflash.engine.draft import DFlashDraftModel  # noqa: E402
from dflash.engine.errors import (
    CheckpointError,  # noqa: E402
    IncompatibleDraftError,  # noqa: E402
)
from dflash.engine.target import TargetModel  # noqa: E402

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
    hf = TargetModel(__import__("transformers").AutoModelForCausalLM.from_pretrained(path))
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
    hf = TargetModel(__import__("transformers").AutoModelForCausalLM.from_pretrained(path))
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


# ---- the loop: greedy output is the target's own ----------------------------------------

@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "qwen3", "gemma3"])
def test_greedy_equals_mlx_lm(tiny, kind):
    _, model, tok, draft = tiny(kind)
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 24)
    for block_size in (1, 4, 7):
        out = [t for step in stream_tokens(model, draft, ids, block_size, 24) for t in step[0]]
        assert out == ref, f"block_size {block_size}"


def test_chunked_prefill_and_quantized_target(tiny):
    """A prompt prefilled in chunks (past the sliding window), and a 4-bit target (what MLX
    users mostly run), still give the target's own greedy tokens."""
    import mlx.nn as nn

    path, model, tok, draft = tiny("llama_sliding")
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 12)
    assert [t for s in stream_tokens(model, draft, ids, 4, 12, prefill_step_size=7) for t in s[0]] == ref
    q_model, _ = load(path)
    nn.quantize(q_model, group_size=64, bits=4)
    q_ref = _ref_greedy(q_model, ids, 12)
    assert [t for s in stream_tokens(q_model, draft, ids, 4, 12) for t in s[0]] == q_ref


class OracleDraft:
    """A draft that proposes the reference continuation, wrong at one block slot per step
    (a different one each step), so the loop accepts 0..B-2 tokens and rolls back the rest.
    It runs the real draft too, so the draft cache is exercised as usual."""

    def __init__(self, draft, target: MLXTarget, ref, n_prompt):
        self.draft, self.ref, self.n_prompt, self.calls = draft, ref, n_prompt, 0
        self.rows = target.model.lm_head.weight if hasattr(target.model, "lm_head") else \
            target.inner.embed_tokens.weight  # (V, H): logits = h @ rows.T

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def __call__(self, noise, ctx, cache):
        pos = cache.length + ctx.shape[1]  # the block's first position
        self.draft(noise, ctx, cache)
        size, self.calls = noise.shape[1], self.calls + 1
        want = [self.ref[min(pos + j - self.n_prompt, len(self.ref) - 1)] for j in range(size)]
        want[self.calls % size] = (want[self.calls % size] + 1) % VOCAB
        rows = self.rows[mx.array(want)]  # (S, H)
        return 20 * rows[None] / mx.linalg.norm(rows, axis=-1, keepdims=True)


@pytest.mark.parametrize("kind", ["llama", "llama_sliding", "gemma3"])
def test_greedy_with_accepting_draft_equals_mlx_lm(tiny, kind):
    _, model, tok, draft = tiny(kind)
    ids = tok.encode(PROMPT)
    ref = _ref_greedy(model, ids, 30)
    oracle = OracleDraft(draft, MLXTarget(model), ref, len(ids))
    steps = list(stream_tokens(model, oracle, ids, 6, 30, draft_window=4 if kind == "llama" else None))
    assert [t for s in steps for t in s[0]] == ref
    accepted = [s[2] for s in steps[1:]]
    assert set(accepted) >= {0, 1, 2, 3}, accepted  # partial acceptance, then rollback


def test_stream_generate_responses_and_stop(tiny):
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
    full = list(stream_generate(model, draft, tok, ids, max_tokens=5))
    assert sum(len(r.tokens) for r in full) == 5 and full[-1].finish_reason in ("length", "stop")
    plain = list(stream_generate(model, None, tok, ids, max_tokens=5, stop_token_ids=()))  # no draft: block 1
    assert [t for r in plain for t in r.tokens] == ref[:5] and all(r.proposed == 0 for r in plain)
    with pytest.raises(ValueError, match="context holds 256"):
        next(stream_generate(model, draft, tok, [1] * 256))
    with pytest.raises(ValueError, match="needs a draft"):
        next(stream_generate(model, None, tok, ids, block_size=4))


def test_sampling_is_seeded_and_near_greedy_at_tiny_temperature(tiny):
    _, model, tok, draft = tiny("qwen3")
    ids = tok.encode(PROMPT)

    def run(temperature, seed):
        mx.random.seed(seed)
        return [t for s in stream_tokens(model, draft, ids, 4, 12, temperature) for t in s[0]]

    assert run(1.0, 3) == run(1.0, 3)
    assert all(0 <= t < VOCAB for t in run(1.0, 4))
    assert run(1e-4, 0) == _ref_greedy(model, ids, 12)


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
    oracle = OracleDraft(draft, MLXTarget(model), ref, len(ids))  # accepts some, rolls back the rest
    steps = list(stream_tokens(model, oracle, ids, 4, 10))
    assert [t for s in steps for t in s[0]] == ref
    assert sum(s[2] for s in steps) > 0


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
