"""How many of a block's proposals a verify step checks. The loop asks its policy, before each
step, whether to run the draft at all (`draft_now`), then how many of the K proposals to verify
given the draft's own probability of each (`verify_count`), and tells it what was accepted
(`observe`). A policy sees only the past and the draft's numbers, never the target's verdict on
this step, so every policy keeps the output exact (greedy and sampled). No torch: the draft's
probabilities come as any 1-d array with `tolist()` (a torch tensor, an mx or numpy array) or a
sequence of floats, so the torch and MLX loops share the policies."""

from __future__ import annotations

from typing import Protocol, Sequence


class VerifyPolicy(Protocol):
    needs_confidence: bool  # False: verify_count ignores conf, so the loop need not compute it

    def draft_now(self) -> bool: ...

    def verify_count(self, conf: Sequence[float] | None, proposed: int) -> int: ...

    def observe(self, proposed: int, accepted: int) -> None: ...


class ThresholdPolicy:
    """The fixed policy: draft every step; verify the leading proposals whose draft probability is
    at least `threshold` (0: the whole block; 1: no draft is ever that sure, so plain steps)."""

    def __init__(self, threshold: float = 0.0):
        self.threshold = threshold
        self.needs_confidence = threshold > 0

    def draft_now(self) -> bool:
        return True

    def verify_count(self, conf: Sequence[float] | None, proposed: int) -> int:
        """conf: (K,) the draft's probability of each proposal -> the leading ones >= threshold."""
        if not self.needs_confidence or conf is None:
            return proposed
        values = conf.tolist() if hasattr(conf, "tolist") else list(conf)  # (K,) floats
        return next((i for i, c in enumerate(values) if not c >= self.threshold), len(values))

    def observe(self, proposed: int, accepted: int) -> None:
        pass
