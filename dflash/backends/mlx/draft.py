"""The DFlash draft in MLX, reading the same checkpoint as the PyTorch one (docs/METHOD.md §1, §4):
queries from the block only, keys/values from [fc + hidden_norm projected context ; block],
k_norm on all keys, RoPE at absolute positions, no causal mask, final norm."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from dflash.engine.config import DFlashConfig
from dflash.engine.errors import CheckpointError, ConfigError


def _checkpoint_error(message: str) -> Exception:
    return CheckpointError(message)  # one error type for both backends


class DraftCache:
    """Per-layer K/V of the context the draft has seen, (B, KV, T, D) each; mirrors
    dflash.engine.cache.DraftCache: `trim` drops the block's K/V, then keeps at most
    `sliding_window` context positions (`offset` counts the ones dropped)."""

    def __init__(self, num_layers: int, sliding_window: int | None = None):
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        self.offset = 0
        self.sliding_window = sliding_window

    @property
    def length(self) -> int:
        """Absolute number of positions seen (including any dropped by the window)."""
        k = self.keys[0]
        return self.offset + (0 if k is None else k.shape[2])

    def update(self, layer: int, k: mx.array, v: mx.array):
        if self.keys[layer] is not None:
            k = mx.concatenate([self.keys[layer], k], axis=2)  # (B, KV, T+t, D)
            v = mx.concatenate([self.values[layer], v], axis=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def trim(self, n: int) -> None:
        held = self.length - self.offset
        if n < 0 or n > held:
            raise ValueError(f"cannot trim {n} positions from a cache of {held}")
        keep, start = held - n, 0
        if self.sliding_window is not None and keep > self.sliding_window:
            start = keep - self.sliding_window
            self.offset += start
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., start:keep, :], v[..., start:keep, :]

    def crop_to(self, length: int) -> None:
        self.trim(self.length - length)


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        scaling = config.rope_scaling or {}
        linear = scaling.get("rope_type", scaling.get("type")) == "linear"
        self.rope = nn.RoPE(d, traditional=False, base=config.rope_theta,
                            scale=1.0 / float(scaling["factor"]) if linear else 1.0)
        self.layer_idx = layer_idx
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.is_causal = sliding if config.is_causal is None else config.is_causal
        self.sliding_window = config.sliding_window if sliding else None

    def __call__(self, x, ctx, start: int, cache: DraftCache):
        b, q_len, _ = x.shape  # x: (B, Q, H) the block; ctx: (B, C, H) projected new context at start..
        kv_in = mx.concatenate([ctx, x], axis=1)  # (B, C+Q, H)
        q = self.q_norm(self.q_proj(x).reshape(b, q_len, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(kv_in).reshape(b, -1, self.n_kv, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(kv_in).reshape(b, -1, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start + ctx.shape[1])  # (B, nH, Q, D)
        k = self.rope(k, offset=start)  # (B, KV, C+Q, D)
        offset = cache.offset
        k, v = cache.update(self.layer_idx, k, v)  # (B, KV, T, D)
        mask = None
        if self.is_causal or self.sliding_window is not None:
            mask = self._positional_mask(q_len, k.shape[2], offset)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, mask=mask)  # (B, nH, Q, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q_len, -1))

    def _positional_mask(self, q_len, k_len, offset):
        k_pos = offset + mx.arange(k_len)[None]  # (1, K)
        q_pos = k_pos[:, -q_len:].T  # (Q, 1): the block is the last q_len keys
        mask = mx.ones((q_len, k_len), dtype=mx.bool_)
        if self.is_causal:
            mask = mask & (k_pos <= q_pos)
        if self.sliding_window is not None:
            mask = mask & (mx.abs(q_pos - k_pos) < self.sliding_window)
        return mask  # (Q, K)


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, ctx, start, cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MLXDraftModel(nn.Module):
    """The draft network; embedding and lm_head are the target's."""

    def __init__(self, config: DFlashConfig, sliding_window_size: int | None = None):
        super().__init__()
        self.config = config
        self.sliding_window_size = sliding_window_size  # default window of new_cache()
        self.layers = [DraftLayer(config, i) for i in range(config.num_hidden_layers)]
        self.fc = nn.Linear(config.num_context_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def dtype(self):
        return self.fc.weight.dtype

    def new_cache(self, sliding_window: int | None = None) -> DraftCache:
        return DraftCache(len(self.layers), sliding_window or self.sliding_window_size)

    def __call__(self, noise_embedding: mx.array, target_hidden: mx.array, cache: DraftCache) -> mx.array:
        """noise_embedding: (B, Q, H) at positions cache.length + C ..; target_hidden:
        (B, C, k*H) the new context (not yet in the cache). Returns final-normed (B, Q, H);
        the cache then holds the context *and* the block: crop it back after."""
        x = noise_embedding.astype(self.dtype)  # (B, Q, H)
        ctx = self.hidden_norm(self.fc(target_hidden.astype(self.dtype)))  # (B, C, H)
        start = cache.length  # absolute position of ctx[:, 0]
        for layer in self.layers:
            x = layer(x, ctx, start, cache)
        return self.norm(x)


def load_draft(path: str | Path, sliding_window_size: int | None = None, dtype=None) -> MLXDraftModel:
    """Read a DFlash checkpoint folder (config.json + model.safetensors, docs/METHOD.md §4).
    dtype: an mx dtype to cast the weights to (default: as stored)."""
    path = Path(path)
    if not path.is_dir():
        raise _checkpoint_error(f"draft checkpoint folder {path} does not exist")
    try:
        config = DFlashConfig.from_json(path / "config.json")
    except ConfigError as e:
        raise _checkpoint_error(f"bad draft checkpoint {path}: {e}") from None
    weights = path / "model.safetensors"
    if not weights.exists():
        raise _checkpoint_error(f"draft checkpoint {path} has no model.safetensors")
    try:
        state = mx.load(str(weights))
    except (RuntimeError, OSError, ValueError) as e:
        raise _checkpoint_error(f"draft checkpoint {weights} is corrupt: {e}") from None
    state = {k.removeprefix("model."): v for k, v in state.items()
             if not k.endswith("embed_tokens.weight") and k != "lm_head.weight"}
    model = MLXDraftModel(config, sliding_window_size)
    expected = dict(tree_flatten(model.parameters()))
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:6]}" if missing else "", f"unexpected {unexpected[:6]}" if unexpected else "",
                 f"wrong shapes {wrong[:6]}" if wrong else ""]
        raise _checkpoint_error(f"draft checkpoint {weights} does not match its config.json: "
                                + "; ".join(p for p in parts if p))
    if dtype is not None:
        state = {k: v.astype(dtype) for k, v in state.items()}
    model.load_weights(list(state.items()))
    mx.eval(model.parameters())
    model.eval()
    return model
