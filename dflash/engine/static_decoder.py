"""A lean forward over a Llama-family HF model (llama, qwen2, qwen3, mistral without a
window) on a preallocated KV buffer. It calls the model's own modules in order (norms,
projections, rotary, MLP), so the numbers are HF's; what it leaves out is the per-step cost
around them: HF's DynamicCache concatenates every layer's whole K/V at every step (at batch
64 and a few hundred tokens that copy moves more bytes than the weights), and each call
rebuilds its masks. The batched data generator uses it; other models take HF's path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def supports(model) -> bool:
    """True when `model` is a decoder this forward reproduces exactly: a Llama-style stack
    with full attention in every layer (no sliding window) and the usual module names."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    base = getattr(model, "model", None)
    return base is not None and all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))


class KVBuffer:
    """K and V of every layer, (L, B, KV, T_max, D) each, written in place; `length` is the
    number of positions filled (the same for every row: rows are left padded)."""

    def __init__(self, model, batch: int, max_len: int, dtype: torch.dtype | None = None):
        """`dtype`: the storage (None: the model's; the native layers keep float16, see
        TargetModel.kv_dtype)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, head_dim)
        w = model.get_input_embeddings().weight
        self.k = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
        self.v = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (doubling, so growing one step at a time stays cheap)."""
        if total > self.max_len:
            self._reallocate(None, max(total, 2 * self.max_len))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: (B, KV, T, D) at positions length..length+T-1 -> all filled K, V (B, KV, length+T, D)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    @torch.inference_mode()
    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep the slots before `start` and the slots start+offsets (A,), moved to start..start+A-1
        in place (a tree pass's accepted path); the rest of the filled part is dropped."""
        src = start + offsets.to(self.k.device)  # (A,)
        if len(src) and not (int(src.min()) >= start and int(src.max()) < self.length):
            raise ValueError(f"slots {src.tolist()} are not all in the filled part {start}..{self.length - 1}")
        for buf in (self.k, self.v):
            buf[:, :, :, start:start + len(src)] = buf[:, :, :, src]  # the gather copies before the write
        self.length = start + len(src)

    @torch.inference_mode()
    def shift(self, n: int) -> None:
        """Drop the first `n` filled slots of every row, the rest moved to the front (a layer
        at a time, so the copy it needs is one layer's)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} of {self.length} filled slots")
        for buf in (self.k, self.v):
            for layer in buf:  # (B, KV, T_max, D)
                layer[:, :, :self.length - n] = layer[:, :, n:self.length].clone()
        self.length -= n

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (A,) of the batch (a copy of the filled part)."""
        self._reallocate(rows, self.max_len)

    def _reallocate(self, rows: torch.Tensor | None, size: int) -> None:
        """New buffers of `size` positions holding the filled part of `rows` (None: all)."""
        for name in ("k", "v"):
            old = getattr(self, name)
            filled = old[:, :, :, :self.length] if rows is None else old[:, rows, :, :self.length]
            new = old.new_zeros(old.shape[0], filled.shape[1], old.shape[2], size, old.shape[4])
            new[:, :, :, :self.length] = filled
            setattr(self, name, new)


@torch.inference_mode()
def forward(model, ids: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, key_valid: torch.Tensor | None,
            layer_ids: list[int] | None, tree_mask: torch.Tensor | None = None, linears=None):
    """ids, positions: (B, T) at buffer slots kv.length.. ; key_valid: (B, kv.length+T) bool,
    False at padding (None: no padding); tree_mask: (T, T) bool, the new tokens each new token
    sees (a token tree's; None: causal); linears: the adapter's projections in its own weight
    layout (`projections.DecoderLinears`; None: the model's own modules). Returns the final normed
    hidden states (B, T, H) and the chosen layers' outputs (B, T, k*H) or None. Advances kv.length by T."""
    base = model.model
    t = ids.shape[1]
    if kv.length + t > kv.max_len:
        raise ValueError(f"KV buffer of {kv.max_len} positions cannot take {kv.length + t}")
    x = base.embed_tokens(ids)  # (B, T, H)
    cos, sin = base.rotary_emb(x, positions)  # (B, T, D) each
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
    layer_ids = layer_ids or []
    whole = getattr(linears, "whole", None)  # every layer in one native call (engine/precision.py)
    if whole is not None:  # it masks by `tree_mask` itself
        x, feats = whole(x, cos[0, 0], sin[0, 0], [kv], [t], [tree_mask], sorted(set(layer_ids)))
    else:
        x, feats = _layers(base, x, cos, sin, kv, key_valid, tree_mask, layer_ids, linears)
    kv.length += t
    final = base.norm(x)  # (B, T, H)
    return final, _features(base, final, feats, layer_ids)


def _features(base, final, feats, layer_ids):
    """The outputs of the layers in `layer_ids` (in their order), concatenated: (B, T, k*H), or None."""
    if not layer_ids:
        return None
    by_layer = dict(zip(sorted(set(layer_ids)), feats))
    by_layer[len(base.layers) - 1] = final  # as HF's hidden_states: the last entry is after the final norm
    return torch.cat([by_layer[i] for i in layer_ids], dim=-1)  # (B, T, k*H)


def supports_rows(linears) -> bool:
    """Several sequences can share one pass (`forward_rows`): the adapter runs every layer in one
    native call (engine/precision.py), whose rows do not depend on the rows beside them."""
    return getattr(linears, "whole", None) is not None


@torch.inference_mode()
def forward_rows(model, ids: list[torch.Tensor], positions: list[torch.Tensor], kvs: list[KVBuffer],
                 trees: list[torch.Tensor | None], layer_ids: list[int] | None, linears):
    """One pass over the new tokens of several sequences, each on its own KVBuffer: ids[i],
    positions[i] (T_i,) at its slots kvs[i].length.., masked by trees[i] (T_i, T_i) (None:
    causal). The products run over all the rows at once; each row's numbers are those of its
    sequence run alone (`supports_rows`). Returns per sequence the final normed hidden states
    (1, T_i, H) and the chosen layers' outputs (1, T_i, k*H) or None. Advances each kv.length."""
    if not supports_rows(linears):
        raise ValueError("several sequences share a pass only on the adapter's native layers")
    base = model.model
    counts = [int(i.shape[0]) for i in ids]
    for kv, n in zip(kvs, counts):
        if kv.length + n > kv.max_len:
            raise ValueError(f"KV buffer of {kv.max_len} positions cannot take {kv.length + n}")
    x = base.embed_tokens(torch.cat(ids)[None])  # (1, T, H)
    cos, sin = base.rotary_emb(x, torch.cat(positions)[None])  # (1, T, D) each
    keep = sorted(set(layer_ids or []))
    x, feats = linears.whole(x, cos[0], sin[0], kvs, counts, trees, keep)
    for kv, n in zip(kvs, counts):
        kv.length += n
    final = base.norm(x)  # (1, T, H)
    hidden = _features(base, final, feats, layer_ids)
    bounds = torch.tensor([0] + counts).cumsum(0).tolist()
    return [(final[:, a:b], None if hidden is None else hidden[:, a:b]) for a, b in zip(bounds, bounds[1:])]


def _layers(base, x, cos, sin, kv: KVBuffer, key_valid, tree_mask, layer_ids, linears):
    """The layers one by one (the model's modules, or the adapter's `linears`): the final x and
    the outputs of the layers in `layer_ids`, in layer order."""
    b, t, _ = x.shape
    mask = _mask(t, kv.length, key_valid, x.device, tree_mask)  # (B, 1, T, S) or (T, S) or None
    projs = linears.for_tokens(b * t) if linears is not None else None  # the kernels of this token count
    feats = []
    for i, layer in enumerate(base.layers):
        p = projs[i] if projs is not None else None
        h = layer.input_layernorm(x) if p is None else p.norm1(x)
        x = x + _attention(layer.self_attn, h, cos, sin, mask, kv, i, p, tree_mask)
        h = layer.post_attention_layernorm(x) if p is None else p.norm2(x)
        x = x + (layer.mlp(h) if p is None else p.mlp(h))
        if i in layer_ids:
            feats.append(x)
    return x, feats


def _mask(t: int, past: int, key_valid, device, tree=None):
    """Query i (at slot past+i) sees slots <= past+i that are not padding; with `tree` (T, T),
    every cached slot and the new slots tree[i] marks."""
    if key_valid is None and tree is None and t == 1:
        return None
    if tree is None:
        causal = torch.ones(t, past + t, dtype=torch.bool, device=device).tril(past)  # (T, S)
    else:
        causal = torch.cat([torch.ones(t, past, dtype=torch.bool, device=device), tree.to(device)], dim=1)  # (T, S)
    if key_valid is None:
        return causal
    mask = (causal[None] & key_valid[:, None, :])[:, None]  # (B, 1, T, S)
    if t > 1:  # a padding query would see no key at all (NaN): let it see its own slot
        own = torch.zeros(t, past + t, dtype=torch.bool, device=device)  # (T, S)
        own[torch.arange(t, device=device), past + torch.arange(t, device=device)] = True
        mask = mask | own
    return mask


def _attention(attn, h, cos, sin, mask, kv: KVBuffer, layer: int, proj=None, tree=None):
    b, t, _ = h.shape
    if proj is not None and proj.attend is not None:
        return _own_attention(attn, h, cos, sin, kv, layer, proj, tree)
    shape = (b, t, -1, attn.head_dim)
    if proj is None:
        q, k, v, o_proj = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), attn.o_proj
    else:
        (q, k, v), o_proj = proj.qkv(h), proj.o  # maybe one stacked product, split (projections.py)
    q = q.view(shape).transpose(1, 2)  # (B, NH, T, D)
    k = k.view(shape).transpose(1, 2)  # (B, KV, T, D)
    v = v.view(shape).transpose(1, 2)  # (B, KV, T, D)
    if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    keys, values = kv.write(layer, k, v)  # (B, KV, S, D)
    heads, groups = q.shape[1], keys.shape[1]
    if t == 1 and b > 1 and heads != groups:
        # a batched decode step (the data generator): the query heads that share a K/V head
        # become that head's query rows, (B, KV, NH/KV, D), so attention needs no copy of K and V
        # per query head (1.7x on a 2-core CPU at batch 64 and 500 slots; equal up to rounding)
        o = F.scaled_dot_product_attention(q.reshape(b, groups, heads // groups, -1), keys, values,
                                           attn_mask=mask, scale=attn.scaling).reshape(b, heads, 1, -1)
    else:
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                           enable_gqa=heads != groups)  # (B, NH, T, D)
    return o_proj(o.transpose(1, 2).reshape(b, t, -1))  # (B, T, H)


def _own_attention(attn, h, cos, sin, kv: KVBuffer, layer: int, proj, tree):
    """One sequence's attention on the adapter's own kernel (`proj.attend`): each new row over
    the cached slots and the new slots `tree` (T, T) lets it see (None: causal), in slot order."""
    b, t, _ = h.shape
    if b != 1:
        raise ValueError("the engine's own attention runs one sequence")
    q, k, v = proj.qkv(h)
    q = q.view(t, -1, attn.head_dim)  # (T, NH, D)
    k = k.view(t, -1, attn.head_dim).transpose(0, 1)  # (KV, T, D)
    v = v.view(t, -1, attn.head_dim).transpose(0, 1)  # (KV, T, D)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    c, s = cos[0, 0], sin[0, 0]  # (T, D)
    q = q * c[:, None] + _rotate_half(q) * s[:, None]
    k = k * c + _rotate_half(k) * s
    past = kv.length
    kv.write(layer, k[None], v[None])
    o = proj.attend(q, kv.k[layer, 0], kv.v[layer, 0], past, tree)  # (T, NH, D)
    return proj.o(o.reshape(1, t, -1))  # (1, T, H)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
