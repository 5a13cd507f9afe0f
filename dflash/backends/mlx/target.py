"""The MLX target: an mlx-lm model seen through the few operations DFlash needs.

`MLXTarget` walks the mlx-lm model's own `embed_tokens`, `layers` and `norm` itself, calling
each layer with its cache and the mask mlx-lm would build, and keeps the outputs of the
chosen layers (layer i's output = HF `hidden_states[i + 1]`). Nothing in the mlx-lm model is
patched or replaced. `TargetCache` rolls back exactly, sliding-window layers included. The
target describes itself to the shared request checks as a `TargetInfo` (engine/request.py)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from dflash.engine.request import TargetInfo

# model types whose inner model is exactly: h = embed(ids) * scale; h = layer(h, mask, cache)
# for each layer (mask: causal, or causal + sliding window for sliding layers); norm(h)
_SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class UnsupportedTargetError(ValueError):
    """The mlx-lm model is not one whose forward pass MLXTarget knows how to walk."""


class WindowKVCache:
    """K/V of a sliding-window layer that rolls back exactly, for mlx-lm attention layers
    (they read `offset` and call `update_and_fetch`).

    Holds keys of absolute positions `start .. offset-1`, shape (B, KV, offset - start, D).
    Old keys are dropped only when a new chunk arrives, and only those no query at or after
    `offset` can see, so `trim(n)` of up to the last chunk is always exact (mlx-lm's
    RotatingKVCache overwrites its ring buffer and cannot trim once it is full)."""

    def __init__(self, window: int):
        self.window = window
        self.keys = self.values = None
        self.offset = 0  # absolute positions seen
        self.start = 0  # absolute position of the first key held

    def _keep_from(self) -> int:
        """First position a query at `offset` or later can still attend to."""
        return max(self.start, self.offset - self.window + 1)

    def make_mask(self, n: int, window_size=None, return_array: bool = False):
        """Mask for n new queries at offset..offset+n-1 over the keys after the update:
        bool (n, K), True = attend; None when one query sees every key held."""
        first = self._keep_from()
        if n == 1:
            return None  # every key kept is within the window of the one query
        q_pos = mx.arange(self.offset, self.offset + n)[:, None]  # (n, 1)
        k_pos = mx.arange(first, self.offset + n)[None]  # (1, K)
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)  # (n, K)

    def update_and_fetch(self, keys, values):  # keys, values: (B, KV, S, D)
        if self.keys is None:
            self.keys, self.values, self.start = keys, values, self.offset
        else:
            first = self._keep_from()
            cut = first - self.start
            self.keys = mx.concatenate([self.keys[..., cut:, :], keys], axis=2)
            self.values = mx.concatenate([self.values[..., cut:, :], values], axis=2)
            self.start = first
        self.offset += keys.shape[2]
        return self.keys, self.values  # (B, KV, offset - start, D)

    def trim(self, n: int) -> int:
        new = self.offset - n
        if n < 0 or new < 0 or max(0, new - self.window + 1) < self.start:
            raise ValueError(f"cannot trim {n} of {self.offset} positions: a sliding-window cache "
                             f"holding {self.start}..{self.offset - 1} rolls back only its last chunk")
        self.offset = new
        if self.keys is not None:
            self.keys = self.keys[..., : new - self.start, :]
            self.values = self.values[..., : new - self.start, :]
        return n

    @property
    def state(self):
        return self.keys, self.values


class TargetCache:
    """One cache per target layer: mlx-lm's KVCache for full attention (its `trim` is
    exact), WindowKVCache for sliding-window layers."""

    def __init__(self, windows: list[int | None]):
        self.layers = [KVCache() if w is None else WindowKVCache(w) for w in windows]

    @property
    def length(self) -> int:
        return self.layers[0].offset

    def trim(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        for c in self.layers:
            c.trim(n)

    def crop_to(self, length: int) -> None:
        self.trim(self.length - length)


class MLXTarget:
    """An mlx-lm `Model` (from `mlx_lm.load`), walked layer by layer."""

    def __init__(self, model):
        if isinstance(model, MLXTarget):
            raise TypeError("already an MLXTarget")
        model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "?")
        if model_type not in _SUPPORTED:
            raise UnsupportedTargetError(f"the MLX backend supports mlx-lm model types {', '.join(_SUPPORTED)}; "
                                         f"got {model_type!r}")
        self.model, self.model_type = model, model_type
        self.inner = model.model
        self.layers = self.inner.layers
        emb = self.inner.embed_tokens
        hidden_size = int(model.args.hidden_size)
        # gemma scales the embedding by sqrt(H), rounded to bf16 as mlx-lm does
        self.embed_scale = (float(mx.array(hidden_size ** 0.5, mx.bfloat16).astype(mx.float32).item())
                            if model_type.startswith("gemma") else None)
        self.windows = []  # per layer: the sliding window, or None for full attention
        for c in make_prompt_cache(model):
            if isinstance(c, RotatingKVCache):
                self.windows.append(int(c.max_size))
            elif type(c) is KVCache:
                self.windows.append(None)
            else:
                raise UnsupportedTargetError(f"unexpected mlx-lm cache {type(c).__name__} for {model_type}")
        self._dtype = emb(mx.array([[0]])).dtype
        self.info = TargetInfo(num_layers=len(self.layers), hidden_size=hidden_size,
                               vocab_size=int(emb.weight.shape[0]), model_type=model_type,
                               max_positions=int(getattr(model.args, "max_position_embeddings", None) or 1 << 30))

    @property
    def dtype(self):
        """The activations' dtype (a quantized embedding stores its weight as uint32)."""
        return self._dtype

    def new_cache(self) -> TargetCache:
        return TargetCache(self.windows)

    def embed(self, ids: mx.array, scale: float = 1.0) -> mx.array:
        """Raw embedding rows (no model-specific scaling), as the draft's noise embedding."""
        out = self.inner.embed_tokens(ids)  # (B, T, H)
        return out * scale if scale != 1.0 else out

    @property
    def _head(self):
        """The output projection: the lm_head, or the tied embedding."""
        return self.model.lm_head if hasattr(self.model, "lm_head") else self.inner.embed_tokens

    def logits(self, hidden: mx.array, head_rows: mx.array | None = None) -> mx.array:
        """hidden: (B, T, H) -> (B, T, V), or (B, T, K) over `head_rows` (K, H) of the head."""
        if head_rows is not None:
            return hidden @ head_rows.T
        head = self._head
        return head(hidden) if head is not self.inner.embed_tokens else head.as_linear(hidden)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The output projection's rows of `ids` (K,) as a (K, H) matrix, dequantized."""
        head = self._head
        if "bias" in head:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        if "scales" not in head:  # full precision
            return head.weight[ids]
        biases = head.get("biases")
        return mx.dequantize(head.weight[ids], head.scales[ids], None if biases is None else biases[ids],
                             group_size=head.group_size, bits=head.bits, mode=getattr(head, "mode", "affine"))

    def forward_hidden(self, ids: mx.array, cache: TargetCache, layer_ids=None):
        """ids: (B, T) at positions cache.length... Returns the final (normed) hidden states
        (B, T, H), ready for `logits`, and the chosen layers' outputs (B, T, k*H) or None."""
        h = self.inner.embed_tokens(ids)  # (B, T, H)
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, h.dtype)
        masks = {}  # one mask per window size, as mlx-lm builds one per layer kind
        keep = {i: None for i in (layer_ids or ())}
        for i, (layer, c) in enumerate(zip(self.layers, cache.layers)):
            w = self.windows[i]
            if w not in masks:
                masks[w] = create_attention_mask(h, c, window_size=w)
            h = layer(h, masks[w], c)
            if i in keep:
                keep[i] = h
        out = self.inner.norm(h)  # (B, T, H)
        if len(self.layers) - 1 in keep:
            keep[len(self.layers) - 1] = out  # HF's last hidden_states entry is after the norm
        return out, (mx.concatenate([keep[i] for i in layer_ids], axis=-1) if layer_ids else None)

    def __call__(self, ids: mx.array, cache: TargetCache, layer_ids=None, last_only: bool = False):
        """As `forward_hidden`, with the logits (B, T or 1, V) instead of the final hidden states."""
        out, hidden = self.forward_hidden(ids, cache, layer_ids)
        return self.logits(out[:, -1:] if last_only else out), hidden


def as_target(model) -> MLXTarget:
    return model if isinstance(model, MLXTarget) else MLXTarget(model)
