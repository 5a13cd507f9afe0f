"""KV caches that roll back exactly: `trim(n)` drops the last n positions."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class DraftCache:
    """The draft's per-layer K/V of the context it has seen, shape (B, KV, T, D) each.

    `update` appends and returns the full K/V; the generation loop `trim`s the block's
    K/V off again after each draft step so only committed context stays."""

    def __init__(self, num_layers: int, sliding_window: int | None = None):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.offset = 0  # positions dropped from the front by the sliding window
        self.sliding_window = sliding_window

    @property
    def length(self) -> int:
        """Absolute number of positions seen (including any dropped by the window)."""
        k = self.keys[0]
        return self.offset + (0 if k is None else k.shape[-2])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)  # (B, KV, T+t, D)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def trim(self, n: int) -> None:
        """Drop the last n positions (the block's), then apply the optional sliding window."""
        if n < 0 or n > self.length - self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length - self.offset}")
        keep = self.length - self.offset - n
        if self.sliding_window is not None and keep > self.sliding_window:
            self.offset += keep - self.sliding_window
            start = keep - self.sliding_window
        else:
            start = 0
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., start:keep, :], v[..., start:keep, :]

    def crop_to(self, length: int) -> None:
        self.trim(self.length - length)


class _TargetRollback:
    """`trim(n)` / `crop_to(length)` for the target caches below; each drops positions its way."""

    def trim(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        self._drop(n)

    def crop_to(self, length: int) -> None:
        self.trim(self.length - length)


class TargetCache(_TargetRollback):
    """The target's HF DynamicCache, built so it can roll back: sliding-window layers keep
    their past until `trim` (transformers' past recording), then shrink to the window."""

    def __init__(self, config):
        self.hf = DynamicCache(config=config)
        self.hf.activate_past_recording()

    @property
    def length(self) -> int:
        return self.hf.get_seq_length()

    def _drop(self, n: int) -> None:
        self.hf.crop(-n)  # crop(0) still shrinks sliding layers back to their window

    @torch.inference_mode()
    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Of the positions from `start` on (the last pass's), keep those at start+offsets (A,),
        in that order, compacted in place right after `start`; drop the rest."""
        new, offsets = self.length - start, offsets.tolist()
        if offsets and not (min(offsets) >= 0 and max(offsets) < new):
            raise ValueError(f"offsets {offsets} are not all within the last {new} positions")
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            first = layer.keys.shape[-2] - new  # each layer holds the pass's positions last
            src = torch.tensor(offsets, dtype=torch.long, device=layer.keys.device) + first  # (A,)
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (B, KV, S, D)
                t[..., first:first + len(offsets), :] = t[..., src, :]
                setattr(layer, name, t[..., :first + len(offsets), :])
            if layer.is_sliding:
                layer.cumulative_length -= new - len(offsets)
        self.hf.crop(0)  # sliding layers back to their window


class StaticTargetCache(_TargetRollback):
    """The target's K/V in static_decoder's preallocated buffer (Llama-family targets):
    appending writes in place and `trim` only moves the length back."""

    def __init__(self, model, capacity: int = 1024, dtype: torch.dtype | None = None):
        from dflash.engine.static_decoder import KVBuffer

        self.kv = KVBuffer(model, 1, capacity, dtype)

    @property
    def length(self) -> int:
        return self.kv.length

    def _drop(self, n: int) -> None:
        self.kv.length -= n

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """As TargetCache.keep, moved within the preallocated buffer."""
        self.kv.keep(start, offsets)
