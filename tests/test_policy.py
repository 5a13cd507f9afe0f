"""The adaptive verify length (engine/policy.AdaptivePolicy) against fake cost models."""

import pytest

from dflash.engine.policy import AdaptivePolicy, StepPlan
from dflash.engine.probes import ProbeWait


class FakeCosts:
    """verify_ms(n) = base + per_token * (n - 1); a fixed draft step and no rest-of-head cost."""

    def __init__(self, base=40.0, per_token=0.5, draft=3.0, rest=0.0):
        self.base, self.per_token, self.draft, self.rest = base, per_token, draft, rest

    def verify_ms(self, n):
        return self.base + self.per_token * (n - 1)

    def draft_ms(self, block):
        return self.draft

    def rest_head_ms(self, k):
        return self.rest * k


def run(policy, steps, accept_prob, conf, proposed=15):
    """Drive the policy as the loop does: a target that accepts each tested proposal while
    position i's scripted verdict says so (deterministic: accept_prob as a run length)."""
    log = []
    for _ in range(steps):
        plan = policy.plan()
        if not plan.draft:
            policy.observe(plan, 0, 0)
            log.append(None)
            continue
        k = policy.verify_count(plan, [conf] * proposed, proposed)
        accepted = min(k, accept_prob)
        policy.observe(plan, k, accepted)
        log.append(k)
    return log


def test_cheap_verify_and_a_good_draft_verify_the_whole_block():
    p = AdaptivePolicy(FakeCosts(per_token=0.2), 16)
    log = run(p, 30, accept_prob=15, conf=0.9)
    assert all(k == 15 for k in log[-10:])


def test_expensive_verify_verifies_fewer_than_cheap_verify():
    cheap = run(AdaptivePolicy(FakeCosts(per_token=0.2), 16), 30, accept_prob=2, conf=0.6)
    dear = run(AdaptivePolicy(FakeCosts(per_token=6.0), 16), 30, accept_prob=2, conf=0.6)
    assert all(k is not None for k in cheap[-10:] + dear[-10:])
    assert min(cheap[-10:]) > max(dear[-10:]) >= 1


def test_expensive_verify_and_low_acceptance_decode_plainly_then_probe():
    p = AdaptivePolicy(FakeCosts(per_token=8.0, draft=10.0), 16, probe_every=4, max_probe_every=16)
    log = run(p, 200, accept_prob=0, conf=0.3)
    tail = log[-100:]
    assert tail.count(None) >= 90  # plain steps, the draft skipped
    probes = [i for i, k in enumerate(tail) if k is not None]
    assert probes and all(tail[i] >= 1 for i in probes)  # a probe verifies at least one proposal
    # the probe interval backed off to its cap: probes 17 steps apart (16 plain steps between)
    assert all(b - a == 17 for a, b in zip(probes, probes[1:]))


def test_the_probe_brings_drafting_back_when_acceptance_recovers():
    p = AdaptivePolicy(FakeCosts(per_token=8.0, draft=10.0), 16, probe_every=4, max_probe_every=8)
    run(p, 60, accept_prob=0, conf=0.3)
    plan = p.plan()
    assert not plan.draft
    p.observe(plan, 0, 0)
    log = run(p, 80, accept_prob=15, conf=0.95)  # the draft becomes good (say, the text turns repetitive)
    assert all(k is not None and k >= 8 for k in log[-20:])


def test_k_star_maximises_tokens_per_ms_with_the_draft_cost_included():
    costs = FakeCosts(base=10.0, per_token=1.0, draft=2.0)
    p = AdaptivePolicy(costs, 5, prior_weight=1e9)  # calibration pinned at 1: a_i = conf_i
    conf = [0.9, 0.8, 0.1, 0.9]
    k = p.verify_count(p.plan(), conf, 4)

    def rate(k):
        e, run = 1.0, 1.0
        for c in conf[:k]:
            run *= c
            e += run
        return e / (2.0 + 10.0 + 1.0 * k)

    assert k == max(range(5), key=rate) == 2


def test_calibration_learns_an_overconfident_draft():
    p = AdaptivePolicy(FakeCosts(), 16)
    run(p, 50, accept_prob=1, conf=0.9)  # claims 0.9 everywhere, only proposal 1 is ever right
    a = p.calibrated([0.9] * 15)
    assert a[0] > 0.8 and a[1] < 0.3


def test_conf_may_be_any_sequence_and_proposed_zero_is_plain():
    import torch

    p = AdaptivePolicy(FakeCosts(per_token=0.1), 4)
    plan = p.plan()
    assert plan.draft
    assert p.verify_count(plan, torch.tensor([0.99, 0.99, 0.99]), 3) == 3
    p.observe(plan, 3, 3)
    plan = p.plan()
    assert plan.draft and p.verify_count(plan, None, 0) == 0


def test_a_steps_plan_carries_what_the_policy_learns_from_it():
    """The plan of a probe verifies at least one proposal and takes its probabilities back to
    `observe`; two plans in flight (rows of a batch) do not overwrite each other's."""
    p = AdaptivePolicy(FakeCosts(per_token=8.0, draft=10.0), 16, probe_every=1, max_probe_every=1)
    run(p, 10, accept_prob=0, conf=0.3)  # a losing draft: plain steps, a probe after each
    plans = [p.plan() for _ in range(2)]
    probe = next(x for x in plans if x.draft)
    assert probe.probe and p.verify_count(probe, [0.01] * 15, 15) >= 1 and probe.conf == [0.01]
    other = StepPlan(True)
    assert p.verify_count(other, [0.99] * 15, 15) >= 0 and probe.conf == [0.01]
    before = list(p.offered)
    p.observe(probe, 1, 0)
    assert p.offered[0] > before[0] * p.decay and p.conf_sum[0] < 0.02 + before[0]


def test_block_size_one_is_refused():
    with pytest.raises(ValueError):
        AdaptivePolicy(FakeCosts(), 1)


def test_an_unsure_draft_is_given_up_after_its_first_step():
    p = AdaptivePolicy(FakeCosts(per_token=2.0, draft=5.0), 16, probe_every=8)
    log = run(p, 9, accept_prob=0, conf=0.01)  # an untrained draft: ~1/V on every proposal
    assert log[0] == 0 and log[1:] == [None] * 8  # drafted once (the prior), verified nothing, then plain


def test_a_probe_wait_doubles_to_its_most_and_resets():
    wait = ProbeWait(4, 16)
    steps = []
    for _ in range(4):
        steps.append(wait.steps)
        wait.grow()
    assert steps == [4, 8, 16, 16]
    wait.reset()
    assert wait.steps == 4
    with pytest.raises(ValueError, match="probe wait"):
        ProbeWait(8, 4)
