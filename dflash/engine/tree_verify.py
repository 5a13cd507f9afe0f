"""Tree verification on the target: one forward over [root ; tree nodes] with the tree's
attention mask (each node sees the cached context, the root, its ancestors and itself) at
positions committed length + depth, then `commit_path` keeps only the accepted path's K/V.

Two paths, as `TargetModel` picks them: the static decoder (Llama family: the mask goes into
its attention over the KV buffer) and HF's decoder on a DynamicCache through a custom 4D
additive mask (1, 1, T, past+T). Models whose layers are all full attention take one mask;
models mixing full and sliding-window layers take one mask per layer type (a dict, which only
some HF decoders accept: SLIDING_FAMILIES), where a sliding layer's mask also hides keys at
least `sliding_window` positions behind the query, as HF's own mask does."""

from __future__ import annotations

from typing import Sequence

import torch

from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache, TargetCache
from dflash.engine.target import TargetModel
from dflash.engine.tree import TokenTree, path_rows

# HF decoders that take a {layer type: mask} dict as attention_mask (transformers 5.x source)
SLIDING_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")


@torch.inference_mode()
def tree_forward(target: TargetModel, cache: TargetCache | StaticTargetCache, root: int, tree: TokenTree,
                 layer_ids: list[int] | None):
    """One target pass over [root ; tree nodes]: the root (the last committed token, not yet
    in the cache) at position cache.length, node i at cache.length + depth[i]. Appends their
    1+N positions to the cache. Returns the final normed hidden states (1, 1+N, H), ready for
    `target.logits`, and the chosen layers' outputs (1, 1+N, k*H) or None."""
    start = cache.length
    ids, positions, mask = tree_inputs(tree, int(root), start, target.device)
    ids, positions = ids[None], positions[None]  # (1, 1+N)
    if isinstance(cache, StaticTargetCache):
        cache.kv.reserve(start + ids.shape[1])
        return static_decoder.forward(target.model, ids, positions, cache.kv, None, layer_ids, tree_mask=mask,
                                      linears=target.linears)  # the adapter's measured kernels
    attention = hf_tree_mask(target, cache, positions[0], mask)
    out = target.decoder(input_ids=ids, position_ids=positions, attention_mask=attention, use_cache=True,
                         output_hidden_states=bool(layer_ids), **{target._cache_arg: cache.hf})
    hidden = None
    if layer_ids:
        hidden = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (1, 1+N, k*H)
    return out.last_hidden_state, hidden


def tree_inputs(tree: TokenTree, root: int, start: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree pass's tokens [root ; nodes] (1+N,), their positions (the root at `start`, node i
    at start + depth[i]) and its attention mask (1+N, 1+N)."""
    ids = torch.cat([torch.tensor([root], device=device), tree.tokens.to(device)])
    return ids, tree.positions(start).to(device), tree.attention_mask().to(device)


def commit_path(cache: TargetCache | StaticTargetCache, committed_len: int, path: Sequence[int]) -> None:
    """After a tree pass from `committed_len`: keep the root's and the accepted path's K/V
    (node indices, root to leaf), moved in place to committed_len.. ; the cache then holds
    committed_len + 1 + len(path) positions. A prefix of the path (a stop token among the
    accepted ones) keeps that prefix only."""
    cache.keep(committed_len, path_rows(path))


def hf_tree_mask(target: TargetModel, cache: TargetCache, positions: torch.Tensor, tree_mask: torch.Tensor):
    """positions: (T,) of the new tokens; tree_mask: (T, T) bool. Returns the additive
    (1, 1, T, past+T) mask for HF's decoder, or {layer type: mask} for mixed-attention models."""
    types, window = _layer_types(target, cache)
    masks = {}
    for kind in sorted(set(types)):
        seen = _layer_mask(cache, types.index(kind), positions, tree_mask,
                           window if kind == "sliding_attention" else None)  # (T, S)
        masks[kind] = torch.zeros(seen.shape, dtype=target.dtype, device=seen.device).masked_fill(
            ~seen, torch.finfo(target.dtype).min)[None, None]  # (1, 1, T, S)
    return masks["full_attention"] if set(types) == {"full_attention"} else masks


def _layer_types(target: TargetModel, cache: TargetCache) -> tuple[list[str], int | None]:
    """Each layer's attention type and the sliding window; raises where the tree mask cannot
    be handed to the model (other layer types, or sliding layers in a decoder without a
    per-type mask dict)."""
    cfg = target.model.config
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    types = list(getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers)
    if not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"tree verification covers {LAYER_TYPES} layers, {tc.model_type!r} has {sorted(set(types))}")
    sliding = [getattr(layer, "is_sliding", False) for layer in cache.hf.layers]
    if any(sliding) or "sliding_attention" in types:
        if tc.model_type not in SLIDING_FAMILIES or sliding != [t == "sliding_attention" for t in types]:
            raise ValueError(f"tree verification of sliding-window layers covers {', '.join(SLIDING_FAMILIES)}, "
                             f"not {tc.model_type!r}")
    return types, getattr(tc, "sliding_window", None)


def _layer_mask(cache: TargetCache, layer: int, positions: torch.Tensor, tree_mask: torch.Tensor,
                window: int | None) -> torch.Tensor:
    """(T, S) bool over the keys HF's cache layer `layer` hands its attention: the cached ones
    it keeps (all, or a sliding window's last) then the T new ones."""
    t = positions.shape[0]
    kv_length, kv_offset = cache.hf.get_mask_sizes(t, layer)
    past = kv_length - t
    seen = torch.cat([tree_mask.new_ones(t, past), tree_mask], dim=1)  # (T, S)
    if window is not None:
        keys = torch.cat([torch.arange(kv_offset, kv_offset + past, device=positions.device), positions])  # (S,)
        seen &= positions[:, None] - keys[None] < window
    return seen
