"""Checkpoints round-trip, and a checkpoint written from the documented format loads and runs."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash.model import CheckpointError, DFlashDraftModel, dflash_generate
from dflash.testing import tiny_draft


def _draft_inputs(draft, ctx_len=7, block=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, k = draft.config.hidden_size, len(draft.config.target_layer_ids)
    return dict(position_ids=torch.arange(ctx_len + block)[None],
                noise_embedding=torch.randn(1, block, h, generator=g),
                target_hidden=torch.randn(1, ctx_len, k * h, generator=g))


def test_round_trip_identical_outputs(tmp_path, llama, llama_draft):
    llama_draft.save_pretrained(tmp_path / "d")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.config == llama_draft.config
    inputs = _draft_inputs(llama_draft)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs), llama_draft(**inputs))
    ids = torch.tensor([[5, 9, 2]])
    a = dflash_generate(llama_draft, llama, ids, 20, None, 1.0, generator=torch.Generator().manual_seed(3))
    b = dflash_generate(loaded, llama, ids, 20, None, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    names = set(json.loads((tmp_path / "d" / "config.json").read_text()))
    assert {"architectures", "model_type", "block_size", "num_target_layers", "dflash_config"} <= names


def _reference_draft_forward(sd, cfg, ctx_hidden, noise, positions):
    """An independent, plain-math reading of docs/METHOD.md §1 (explicit softmax), to check the
    model against the documented semantics rather than against itself."""
    nh, nkv, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        ang = pos[:, None].float() * inv[None]  # (T, d/2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(ctx_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"])  # (C, H)
    x, Q = noise, noise.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
        h = rms(x, p("input_layernorm.weight"))
        kv = torch.cat([ctx, h])  # (C+Q, H)
        q = rms((h @ p("self_attn.q_proj.weight").T).view(Q, nh, d), p("self_attn.q_norm.weight"))
        k = rms((kv @ p("self_attn.k_proj.weight").T).view(-1, nkv, d), p("self_attn.k_norm.weight"))
        v = (kv @ p("self_attn.v_proj.weight").T).view(-1, nkv, d)
        q, k = rope(q.transpose(0, 1), positions[-Q:]), rope(k.transpose(0, 1), positions)  # (heads, T, d)
        k, v = k.repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / d ** 0.5, -1)  # no causal mask
        x = x + (att @ v).transpose(0, 1).reshape(Q, -1) @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        gate, up = h @ p("mlp.gate_proj.weight").T, h @ p("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ p("mlp.down_proj.weight").T
    return rms(x, sd["norm.weight"])


def test_reference_format_checkpoint_loads_and_matches(tmp_path, llama):
    """Write a folder by hand from the documented names and config keys (bf16, extra keys a
    Qwen3 config carries), load it, and compare with an independent forward."""
    H, L = 64, 2
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_target_layers": 4,
        "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 95},
        "hidden_size": H, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "rope_scaling": None, "layer_types": ["full_attention"] * L,
        "sliding_window": None, "use_sliding_window": False, "attention_bias": False, "attention_dropout": 0.0,
        "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1", "use_cache": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        shapes |= {f"layers.{i}.self_attn.q_proj.weight": (64, H), f"layers.{i}.self_attn.k_proj.weight": (32, H),
                   f"layers.{i}.self_attn.v_proj.weight": (32, H), f"layers.{i}.self_attn.o_proj.weight": (H, 64),
                   f"layers.{i}.self_attn.q_norm.weight": (16,), f"layers.{i}.self_attn.k_norm.weight": (16,),
                   f"layers.{i}.mlp.gate_proj.weight": (96, H), f"layers.{i}.mlp.up_proj.weight": (96, H),
                   f"layers.{i}.mlp.down_proj.weight": (H, 96), f"layers.{i}.input_layernorm.weight": (H,),
                   f"layers.{i}.post_attention_layernorm.weight": (H,)}
    sd = {k: (1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else 0.1 * torch.randn(s, generator=g))
          for k, s in shapes.items()}
    (tmp_path / "ref").mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(tmp_path / "ref" / "model.safetensors"))
    (tmp_path / "ref" / "config.json").write_text(json.dumps(cfg))

    draft = DFlashDraftModel.from_pretrained(tmp_path / "ref")
    assert draft.target_layer_ids == [1, 2] and draft.mask_token_id == 95 and draft.block_size == 16
    sd32 = {k: v.to(torch.bfloat16).float() for k, v in sd.items()}
    inputs = _draft_inputs(draft, ctx_len=5, block=16)
    with torch.no_grad():
        ours = draft(**inputs)[0]
    ref = _reference_draft_forward(sd32, cfg, inputs["target_hidden"][0], inputs["noise_embedding"][0],
                                   inputs["position_ids"][0])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    out = dflash_generate(draft, llama, ids, 12, None)
    ref_ids = llama.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(out, ref_ids)


def test_save_overwrites_atomically(tmp_path, llama_draft):
    llama_draft.save_pretrained(tmp_path / "d")
    llama_draft.save_pretrained(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temp folders left behind


@pytest.mark.parametrize("damage, message", [
    ("no_folder", "does not exist"),
    ("no_config", "no config.json"),
    ("bad_json", "not valid JSON"),
    ("no_weights", "no model.safetensors"),
    ("corrupt_weights", "corrupt"),
    ("missing_tensor", "missing"),
    ("no_layer_ids", "target_layer_ids"),
])
def test_bad_checkpoints_give_clear_errors(tmp_path, llama_draft, damage, message):
    d = tmp_path / "d"
    llama_draft.save_pretrained(d)
    if damage == "no_folder":
        d = tmp_path / "nowhere"
    elif damage == "no_config":
        (d / "config.json").unlink()
    elif damage == "bad_json":
        (d / "config.json").write_text("{not json")
    elif damage == "no_weights":
        (d / "model.safetensors").unlink()
    elif damage == "corrupt_weights":
        (d / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    elif damage == "missing_tensor":
        sd = {k: v for k, v in llama_draft.state_dict().items() if k != "fc.weight"}
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    elif damage == "no_layer_ids":
        cfg = json.loads((d / "config.json").read_text())
        del cfg["dflash_config"]["target_layer_ids"]
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        DFlashDraftModel.from_pretrained(d)


def test_truncated_weights_file(tmp_path, llama_draft):
    llama_draft.save_pretrained(tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")


def test_default_layer_ids():
    from dflash.engine.config import default_target_layer_ids
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(4, 2) == [1, 1]


def test_draft_vocabulary_round_trips(tmp_path, llama):
    draft = tiny_draft(llama)
    draft.config.draft_vocab = [0, 5, 7, 95]
    draft.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["draft_vocab"] == [0, 5, 7, 95]
    assert DFlashDraftModel.from_pretrained(tmp_path / "d").config.draft_vocab == [0, 5, 7, 95]
    cfg["dflash_config"]["draft_vocab"] = [0, 500]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="draft_vocab"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
