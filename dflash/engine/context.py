"""The draft's pending context: the target's hidden states (at the draft's context layers) of
committed positions that no draft pass has read yet.

A sequence adds each step's positions; a draft pass takes them all at once. Steps without a
draft pass (plain steps, or tree steps that skip the draft) only append a part: nothing is
copied until a draft pass joins the parts, so a long run of such steps costs one join, not a
copy of the growing context every step."""

from __future__ import annotations

import torch


class DraftContext:
    """Parts of (1, n, kH) hidden states, oldest first."""

    def __init__(self, hidden: torch.Tensor | None = None):
        self._parts: list[torch.Tensor] = []
        self.add(hidden)

    def add(self, hidden: torch.Tensor | None) -> None:
        """Positions just committed, (1, n, kH); None (nothing for the draft) is ignored."""
        if hidden is not None and hidden.shape[1] > 0:
            self._parts.append(hidden)

    def peek(self) -> torch.Tensor | None:
        """Every pending position, (1, C, kH), kept pending (joined once, kept as one part)."""
        if len(self._parts) > 1:
            self._parts = [torch.cat(self._parts, dim=1)]
        return self._parts[0] if self._parts else None

    def take(self) -> torch.Tensor | None:
        """Every pending position, (1, C, kH), now no longer pending (a draft pass reads them)."""
        joined = self.peek()
        self._parts = []
        return joined

    def __len__(self) -> int:
        return sum(p.shape[1] for p in self._parts)
