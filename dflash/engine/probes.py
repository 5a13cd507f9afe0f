"""How long to wait before trying again what measured slower: `ProbeWait`, shared by the
chain's verify policy (the draft pass), the tree proposer (the draft beside the n-gram
matches) and the batch's speculation gate (proposals at all). No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProbeWait:
    """Steps before the next probe of a way not taken: `first` to start with; doubled by
    `grow()` (a probe that changed nothing), up to `most`; back to `first` by `reset()`."""
    first: int
    most: int
    steps: int = 0  # 0: `first`

    def __post_init__(self):
        if not 1 <= self.first <= self.most:
            raise ValueError(f"a probe wait needs 1 <= first <= most, got {self.first} and {self.most}")
        self.steps = self.steps or self.first

    def grow(self) -> None:
        self.steps = min(2 * self.steps, self.most)

    def reset(self) -> None:
        self.steps = self.first
