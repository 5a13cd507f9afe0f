"""How many of a block's proposals a verify step checks. The loop asks its policy, before each
step, whether to run the draft at all (`draft_now`), then how many of the K proposals to verify
given the draft's own probability of each (`verify_count`), and tells it what was accepted
(`observe`). A policy sees only the past and the draft's numbers, never the target's verdict on
this step, so every policy keeps the output exact (greedy and sampled)."""

from __future__ import annotations

from typing import Protocol

import torch

from dflash.engine.sampling import accepted_prefix


class VerifyPolicy(Protocol):
    needs_confidence: bool  # False: verify_count ignores conf, so the loop need not compute it

    def draft_now(self) -> bool: ...

    def verify_count(self, conf: torch.Tensor | None, proposed: int) -> int: ...

    def observe(self, proposed: int, accepted: int) -> None: ...


class ThresholdPolicy:
    """The fixed policy: draft every step; verify the leading proposals whose draft probability is
    at least `threshold` (0: the whole block; 1: no draft is ever that sure, so plain steps)."""

    def __init__(self, threshold: float = 0.0):
        self.threshold = threshold
        self.needs_confidence = threshold > 0

    def draft_now(self) -> bool:
        return True

    def verify_count(self, conf: torch.Tensor | None, proposed: int) -> int:
        """conf: (K,) the draft's probability of each proposal."""
        if not self.needs_confidence or conf is None:
            return proposed
        return int(accepted_prefix((conf >= self.threshold)[None])[0])

    def observe(self, proposed: int, accepted: int) -> None:
        pass
