"""How many of a block's proposals a verify step checks. The loop asks its policy, before each
step, for a `StepPlan` (`plan`: whether to run the draft at all), then how many of the K
proposals to verify given the draft's own probability of each (`verify_count`), and hands the
plan back with what was accepted (`observe`): what one step's learning needs travels in its
plan, not in the policy's fields. A policy sees only the past and the draft's numbers, never
the target's verdict on this step, so every policy keeps the output exact (greedy and sampled).
No torch: the draft's probabilities come as any 1-d array with `tolist()` (a torch tensor, an mx
or numpy array) or a sequence of floats, so the torch and MLX loops share the policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from dflash.engine.probes import ProbeWait


@dataclass
class StepPlan:
    """A policy's decision for one step, handed back to it with the step's outcome."""
    draft: bool  # run the draft this step (False: a plain step)
    probe: bool = False  # a probe of the way back to drafting: verify at least one proposal
    conf: list[float] = field(default_factory=list)  # the verified proposals' draft probabilities


class VerifyPolicy(Protocol):
    needs_confidence: bool  # False: verify_count ignores conf, so the loop need not compute it

    def plan(self) -> StepPlan: ...

    def verify_count(self, plan: StepPlan, conf: Sequence[float] | None, proposed: int) -> int: ...

    def observe(self, plan: StepPlan, proposed: int, accepted: int) -> None: ...


class ThresholdPolicy:
    """The fixed policy: draft every step; verify the leading proposals whose draft probability is
    at least `threshold` (0: the whole block; 1: no draft is ever that sure, so plain steps)."""

    def __init__(self, threshold: float = 0.0):
        self.threshold = threshold
        self.needs_confidence = threshold > 0

    def plan(self) -> StepPlan:
        return StepPlan(True)

    def verify_count(self, plan: StepPlan, conf: Sequence[float] | None, proposed: int) -> int:
        """conf: (K,) the draft's probability of each proposal -> the leading ones >= threshold."""
        if not self.needs_confidence or conf is None:
            return proposed
        values = conf.tolist() if hasattr(conf, "tolist") else list(conf)  # (K,) floats
        return next((i for i, c in enumerate(values) if not c >= self.threshold), len(values))

    def observe(self, plan: StepPlan, proposed: int, accepted: int) -> None:
        pass


class AdaptivePolicy:
    """The adaptive verify length: each step verifies the k* proposals that maximise expected
    committed tokens per second on this machine,

        k* = argmax_k (1 + E[accepted | k]) / (T_d + T_t(k + 1) + a_1 T_rest(k)),
        E[accepted | k] = sum_{j <= k} prod_{i <= j} a_i,

    with T_d the draft step at this block size, T_t(n) the verify pass over n tokens (the
    target's layers and its lm_head on row 0) and T_rest(k) the lm_head on the other k rows,
    paid only when proposal 1 is accepted (the loop's lazy head), all from the machine's cost
    model (engine/costmodel.py); and a_i = min(1, s_i c_i), the draft's probability c_i of
    proposal i calibrated by this request's own acceptance so far: s_i = accepted / (sum of
    the c_i offered) at position i, exponentially forgotten, shrunk to the all-position ratio,
    which starts at 1 (trust the draft). k* = 0 is a plain decode step: `plan` does not draft
    when even the best k, at the mean calibrated probabilities seen so far, does not beat plain
    decoding's 1 / T_t(1) (the plan: no draft). The way back is a probe: after `probe_every` plain steps one step
    drafts and verifies at least one proposal (the interval doubles after each probe that
    accepts nothing, up to `max_probe_every`, and resets once one accepts).

    It reads only the past and the draft's numbers, so the output stays exact.

    `cost_model`: anything with `verify_ms(n)`, `draft_ms(block)` and optionally
    `rest_head_ms(k)` (milliseconds)."""

    needs_confidence = True

    def __init__(self, cost_model, block_size: int, prior_conf: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.95, probe_every: int = 8, max_probe_every: int = 64):
        if block_size < 2:
            raise ValueError(f"an adaptive policy needs block_size >= 2, got {block_size}")
        self.block_size, self.k_max = block_size, block_size - 1
        self.prior_weight, self.decay = prior_weight, decay
        rest = getattr(cost_model, "rest_head_ms", None)
        self.t_plain = cost_model.verify_ms(1)
        self.t_draft = {b: cost_model.draft_ms(b) for b in range(2, block_size + 1)}  # the draft runs on k+1 tokens
        self.t_verify = [cost_model.verify_ms(k + 1) for k in range(block_size)]  # [k]: T_t(k + 1)
        self.t_rest = [rest(k) if (rest is not None and k > 0) else 0.0 for k in range(block_size)]  # [k]: T_rest(k)
        k = self.k_max
        self.offered = [0.0] * k  # per position: steps that tested it (decayed)
        self.conf_sum = [0.0] * k  # the draft's probability summed over those steps
        self.accepted = [0.0] * k  # of which accepted
        self.mean_conf = [prior_conf] * k  # the draft's probability at each position, running mean over drafts
        self._conf_seen = 0.0
        self._plain_run, self._wait = 0, ProbeWait(probe_every, max_probe_every)
        self.plain_steps = self.probes = 0  # counters for reports

    # ---- the estimates ----
    def scale(self, i: int) -> float:
        """s_i: accepted per unit of the draft's probability at position i (0-based)."""
        w = self.prior_weight
        pooled = (sum(self.accepted) + w) / (sum(self.conf_sum) + w)
        return (self.accepted[i] + w * pooled) / (self.conf_sum[i] + w)

    def calibrated(self, conf: Sequence[float]) -> list[float]:
        return [min(1.0, max(0.0, self.scale(i) * c)) for i, c in enumerate(conf[: self.k_max])]

    def rate(self, k: int, a: Sequence[float], block: int) -> float:
        """Expected committed tokens per ms when verifying the first k of proposals whose
        (calibrated) acceptance probabilities are `a`, after a draft of `block` tokens."""
        expect, run = 1.0, 1.0
        for i in range(k):
            run *= a[i]
            expect += run
        cost = self.t_draft[block] + self.t_verify[k] + (a[0] * self.t_rest[k] if k else 0.0)
        return expect / cost

    def best(self, a: Sequence[float], block: int, least: int = 0) -> tuple[int, float]:
        """(k*, its rate) over k in least..len(a)."""
        k, r = max(((k, self.rate(k, a, block)) for k in range(least, len(a) + 1)), key=lambda kr: kr[1])
        return k, r

    # ---- the policy ----
    def plan(self) -> StepPlan:
        expected = self.calibrated(self.mean_conf)
        if self.best(expected, self.block_size)[1] > 1.0 / self.t_plain:
            self._plain_run = 0
            return StepPlan(True)
        self._plain_run += 1
        if self._plain_run > self._wait.steps:  # a probe: draft once, verify at least one proposal
            self._plain_run = 0
            self.probes += 1
            return StepPlan(True, probe=True)
        self.plain_steps += 1
        return StepPlan(False)

    def verify_count(self, plan: StepPlan, conf: Sequence[float] | None, proposed: int) -> int:
        """conf: (K,) the draft's probability of each of its K = proposed proposals -> k*."""
        if proposed == 0:
            plan.conf = []
            return 0
        values = (conf.tolist() if hasattr(conf, "tolist") else list(conf))[:proposed] if conf is not None else None
        if values is None:
            values = self.mean_conf[:proposed]
        self._seen(values)
        a = self.calibrated(values)
        k, _ = self.best(a, proposed + 1, least=1 if plan.probe else 0)
        plan.conf = values[:k]
        return k

    def observe(self, plan: StepPlan, proposed: int, accepted: int) -> None:
        if not plan.draft:
            return
        if plan.probe:
            self._wait.reset() if accepted else self._wait.grow()
        if not proposed:
            return
        d = self.decay
        self.offered = [x * d for x in self.offered]
        self.conf_sum = [x * d for x in self.conf_sum]
        self.accepted = [x * d for x in self.accepted]
        for i in range(min(proposed, accepted + 1, len(plan.conf))):  # the positions the target tested
            self.offered[i] += 1.0
            self.conf_sum[i] += plan.conf[i]
            self.accepted[i] += i < accepted

    def _seen(self, values: Sequence[float]) -> None:
        """Running mean of the draft's probability per position (what `plan` expects next)."""
        self._conf_seen = min(self._conf_seen + 1.0, 1.0 / (1.0 - self.decay))
        w = 1.0 / self._conf_seen  # the first draft replaces the prior, then a running mean
        for i, c in enumerate(values[: self.k_max]):
            self.mean_conf[i] += w * (c - self.mean_conf[i])
