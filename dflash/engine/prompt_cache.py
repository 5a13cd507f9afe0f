"""Prompt caching: the target's K/V of recent sequences (and the draft's context for them, the
chosen layers' hidden states), so that a prompt that starts like an earlier one (a chat's next
turn, which re-sends the conversation and the reply; a shared system prompt) computes only the
rest. A sequence is kept twice: its prompt after the prefill, and prompt and reply when it
ends (the longer one replaces the prompt).

`step.prefill` uses it for rows whose target passes are row-invariant (the native low-bit layers
on the static cache, `static_decoder.supports_rows`): there a position's K/V and hidden states
do not depend on the positions computed beside it, so the cached ones are the bits a full
prefill computes and the output stays token for token that of the uncached request. Other
rows prefill in full. Bounded in bytes; the least recently used prompt leaves first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache


@dataclass
class CachedPrompt:
    """One prompt's tokens, K/V and (for a draft's rows) context hidden states."""
    owner: object  # the TargetModel that computed them
    layers: tuple[int, ...] | None  # the draft's context layers of `hidden` (None: no hidden states)
    ids: torch.Tensor  # (T,)
    k: torch.Tensor  # (L, KV, T, D)
    v: torch.Tensor  # (L, KV, T, D)
    hidden: torch.Tensor | None  # (1, T, k*H)

    @property
    def nbytes(self) -> int:
        parts = (self.ids, self.k, self.v) + ((self.hidden,) if self.hidden is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)

    def shared(self, ids: torch.Tensor) -> int:
        """How many leading tokens of ids (T,) this prompt shares."""
        m = min(len(self.ids), len(ids))
        differ = (self.ids[:m] != ids[:m]).nonzero()
        return m if len(differ) == 0 else int(differ[0, 0])


class Transcript:
    """What a row holds in its target cache, kept for the prompt cache: the tokens, and for a
    draft's row their hidden states (the draft's context) as the passes computed them."""

    def __init__(self, ids: torch.Tensor, hidden: torch.Tensor | None):
        self.ids: list[int] = ids[0].tolist()
        self.hidden: list[torch.Tensor] = [] if hidden is None else [hidden]  # (1, n, kH) each

    def add(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Positions just committed to the cache: their tokens, hidden (1, len(tokens), kH) | None."""
        self.ids += tokens
        if hidden is not None:
            self.hidden.append(hidden)

    def whole(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> ids (1, T), hidden (1, T, kH) | None."""
        ids = torch.tensor([self.ids], dtype=torch.long)
        return ids, (torch.cat(self.hidden, dim=1) if self.hidden else None)


class PromptCache:
    """Recent prompts' K/V, at most `capacity_mb` MiB (0: off). Thread-safe."""

    def __init__(self, capacity_mb: float = 256.0):
        if isinstance(capacity_mb, bool) or not isinstance(capacity_mb, (int, float)) or capacity_mb < 0:
            raise ValueError(f"the prompt cache size must be a number of MiB >= 0, got {capacity_mb!r}")
        self.capacity = int(capacity_mb * 2**20)
        self._prompts: OrderedDict[int, CachedPrompt] = OrderedDict()  # oldest use first
        self._next = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._prompts.values())

    def __len__(self) -> int:
        return len(self._prompts)

    def serves(self, row) -> bool:
        """Whether this cache is on and `row`'s prefill can start from cached K/V (its passes are
        row-invariant, see above)."""
        return (self.capacity > 0 and isinstance(row.cache, StaticTargetCache)
                and static_decoder.supports_rows(row.target.linears))

    def restore(self, row, ids: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Fill the row's empty cache with the longest cached prefix of ids (1, T), at most T - 1
        tokens (the last one's logits are the prefill's to compute) -> (n, its hidden states
        (1, n, k*H) for a draft's row, else None); (0, None) when nothing matches."""
        if not self.serves(row) or row.cache.length != 0:
            return 0, None
        flat, layers = ids[0], _layers(row)
        with self._lock:
            best, n = None, 0
            for key, p in self._prompts.items():
                if p.owner is row.target and (layers is None or p.layers == layers):
                    shared = min(p.shared(flat), len(flat) - 1)
                    if shared > n:
                        best, n = key, shared
            if best is None:
                return 0, None
            self._prompts.move_to_end(best)
            p = self._prompts[best]
        kv = row.cache.kv  # (L, 1, KV, S, D) each
        kv.reserve(len(flat))
        kv.k[:, 0, :, :n] = p.k[:, :, :n]
        kv.v[:, 0, :, :n] = p.v[:, :, :n]
        kv.length = n
        return n, (p.hidden[:, :n] if layers is not None else None)

    def store(self, row, ids: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Keep the sequence ids (1, T) that fills `row`'s cache (its K/V, and `hidden` (1, T, k*H),
        the draft's context, for a draft's row); those it extends leave, then the oldest ones
        until the cache fits."""
        if not self.serves(row):
            return
        if row.cache.length != ids.shape[1]:
            raise ValueError(f"the row's cache holds {row.cache.length} positions, not the {ids.shape[1]} tokens given")
        flat, t, kv = ids[0], ids.shape[1], row.cache.kv
        layers = _layers(row) if hidden is not None else None
        entry = CachedPrompt(row.target, layers, flat.clone(), kv.k[:, 0, :, :t].clone(), kv.v[:, 0, :, :t].clone(),
                             hidden if layers is not None else None)  # hidden: a tensor no pass writes to again
        if entry.nbytes > self.capacity:
            return
        with self._lock:
            for key in [k for k, p in self._prompts.items()
                        if p.owner is entry.owner and p.layers == entry.layers and p.shared(flat) == len(p.ids)]:
                del self._prompts[key]  # a prefix of this prompt: the new entry holds all of it
            self._prompts[self._next] = entry
            self._next += 1
            held = self.nbytes
            while held > self.capacity:
                held -= self._prompts.popitem(last=False)[1].nbytes


def _layers(row) -> tuple[int, ...] | None:
    return tuple(row.layer_ids) if row.layer_ids else None
