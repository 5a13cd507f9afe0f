"""The one fold of loop steps into statistics, and the one definition of tau.

Words as in vLLM's rejection sampler: a verify step commits the draft tokens the target
*accepted*, then one token of the target's own: the *recovered* token at the first rejected
position, or the *bonus* token after a fully accepted block.

tau (mean acceptance length) = tokens committed per verify step that had proposals, the
recovered or bonus token included: 1 + accepted / drafts. It is vLLM's `mean_acceptance_length`. Steps
without proposals (the prefill token, block size 1, a policy that skipped the draft) are
counted apart in `num_plain_steps`: they neither raise nor lower tau. Every report (CLI,
server, benchmark, MLX, training evaluation) folds its steps here. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters for one request, or summed over many (`merge`)."""
    num_drafts: int = 0  # verify steps that had proposals
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of which the target accepted (recovered and bonus tokens not counted)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # by block position 0..B-2
    num_plain_steps: int = 0  # verify steps without proposals (not counted in tau)
    num_tokens: int = 0  # tokens committed by the folded steps, every step's (recovered and bonus included)
    num_accepted_tokens_per_source: dict[str, int] = field(default_factory=dict)  # "draft", "suffix", ...
    num_draft_passes: int = 0  # verify steps for which the draft model ran (a tree may skip it)

    def add(self, proposed: int, accepted: int, committed: int | None = None, sources=(),
            drafted: bool = False) -> None:
        """Fold one step: `proposed` proposals verified, `accepted` of them accepted, `committed`
        tokens added (default accepted + 1: the accepted tokens and the recovered or bonus token;
        less when a stop token or the length cut it);
        `sources`: per accepted token, the source(s) that proposed it ("draft+suffix");
        `drafted`: whether the draft model ran for it."""
        self.num_tokens += accepted + 1 if committed is None else committed
        self.num_draft_passes += bool(drafted)
        for joined in sources:
            for s in joined.split("+"):
                self.num_accepted_tokens_per_source[s] = self.num_accepted_tokens_per_source.get(s, 0) + 1
        if proposed <= 0:
            self.num_plain_steps += 1
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.num_accepted_tokens_per_pos) < proposed:
            self.num_accepted_tokens_per_pos += [0] * (proposed - len(self.num_accepted_tokens_per_pos))
        for k in range(accepted):
            self.num_accepted_tokens_per_pos[k] += 1

    def add_step(self, step) -> None:
        """Fold one verify step of a loop (engine/loop.py's `Step`, or the MLX loop's)."""
        self.add(step.proposed, step.accepted, len(step.tokens), getattr(step, "sources", ()), step.drafted)

    def merge(self, other: "SpecStats") -> "SpecStats":
        """A new SpecStats with both counts summed."""
        out = SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                        list(self.num_accepted_tokens_per_pos), self.num_plain_steps, self.num_tokens,
                        dict(self.num_accepted_tokens_per_source), self.num_draft_passes + other.num_draft_passes)
        for s, c in other.num_accepted_tokens_per_source.items():
            out.num_accepted_tokens_per_source[s] = out.num_accepted_tokens_per_source.get(s, 0) + c
        out.num_drafts += other.num_drafts
        out.num_draft_tokens += other.num_draft_tokens
        out.num_accepted_tokens += other.num_accepted_tokens
        out.num_plain_steps += other.num_plain_steps
        out.num_tokens += other.num_tokens
        for k, c in enumerate(other.num_accepted_tokens_per_pos):
            if k < len(out.num_accepted_tokens_per_pos):
                out.num_accepted_tokens_per_pos[k] += c
            else:
                out.num_accepted_tokens_per_pos.append(c)
        return out

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens per verify step with proposals, the recovered or bonus token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    tau = mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "num_plain_steps": self.num_plain_steps,
                "num_accepted_tokens_per_source": dict(self.num_accepted_tokens_per_source),
                "num_draft_passes": self.num_draft_passes,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "draft_acceptance_rate": round(self.acceptance_rate, 4)}


def fold(steps: Iterable[tuple[int, int, int]]) -> SpecStats:
    """SpecStats of (proposed, accepted, committed) triples, one per verify step."""
    stats = SpecStats()
    for proposed, accepted, committed in steps:
        stats.add(proposed, accepted, committed)
    return stats
