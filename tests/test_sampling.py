"""Sampled speculative output has the target's distribution, for both verification rules."""

import copy

import pytest
import torch
from scipy.stats import chisquare

from dflash.engine.sampling import SamplingParams, verify_rejection
from dflash.model import dflash_generate
from dflash.testing import chi2_pvalue, exact_law, tiny_draft, tiny_target

V = 4  # a tiny vocabulary so the exact joint law of three tokens (64 cells) can be enumerated


@pytest.fixture(scope="module")
def peaked():
    """A target and a draft with peaked, different distributions (scaled-up output heads)."""
    target = tiny_target("llama", seed=3, vocab_size=V)
    with torch.no_grad():
        target.lm_head.weight.mul_(60.0)
    draft = tiny_draft(target, seed=4, layers=1, block_size=4, mask_token_id=0)
    return target, draft


def draw(target, draft, prompt, params, n, seed, threshold=0.0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V ** 3)
    for _ in range(n):
        out = dflash_generate(draft, target, prompt, 3, None, params.temperature, block_size=4, top_p=params.top_p,
                              top_k=params.top_k, generator=g, rule=params.rule, draft_threshold=threshold)
        a, b, c = out[0, -3:].tolist()
        counts[a * V * V + b * V + c] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(1.0, rule="rejection"),
    SamplingParams(1.0, rule="match"),
    SamplingParams(0.8, top_p=0.9, top_k=3, rule="rejection"),
    "draft-vocab",
    "threshold",
], ids=["rejection", "match", "rejection-topk-topp", "rejection-draft-vocab", "rejection-draft-threshold"])
def test_sampled_tokens_follow_target_distribution(peaked, params):
    """2000 seeded draws of three tokens (the 2nd and 3rd come from one verified block);
    chi-square goodness of fit against the exact law, rejecting at p < 0.001."""
    target, draft = peaked
    threshold = 0.0
    if params == "threshold":  # proposals end at the first one the draft samples with q < 0.5
        params, threshold = SamplingParams(1.0), 0.5
    if params == "draft-vocab":  # the draft may only propose ids 1 and 3
        params, draft = SamplingParams(1.0), copy.deepcopy(draft)
        draft.config.draft_vocab = [1, 3]
    prompt = torch.tensor([[1, 3, 2]])
    law = exact_law(target, prompt, params)
    assert law.max() < 0.9  # the law is spread, so a biased sampler would show
    counts = draw(target, draft, prompt, params, 2000, seed=11, threshold=threshold)
    assert chi2_pvalue(counts, law) > 1e-3
    # the test has power: the draft's own law differs enough to be rejected
    biased = law.clone().view(V, V, V)
    biased[..., 0] += 0.05 * biased.sum(-1)
    biased = (biased / biased.sum()).flatten()
    assert chi2_pvalue(counts, biased) < 1e-3


def test_rejection_sampler_is_exact_on_one_position():
    """The recovered/bonus law of one verify step equals p exactly (enumerating the draft)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(1, 2, 6) * 2, -1)  # (B, K+1, V) target
    q = torch.softmax(torch.randn(1, 1, 6) * 2, -1)  # (B, K, V) draft
    g = torch.Generator().manual_seed(1)
    n = 40000  # one batch row per trial
    drafts = torch.multinomial(q[0, 0], n, replacement=True, generator=g)[:, None]  # (n, 1)
    acc, tok = verify_rejection(drafts, q.expand(n, -1, -1), p.expand(n, -1, -1), g)
    out = torch.where(acc == 1, drafts[:, 0], tok)  # accepted draft token, else the recovered one
    counts = torch.bincount(out, minlength=6).float()
    assert chisquare(counts.numpy(), (p[0, 0] * n).numpy()).pvalue > 1e-3


def test_seeded_sampling_is_reproducible(llama, llama_draft):
    ids = torch.tensor([[1, 2, 3]])
    a = dflash_generate(llama_draft, llama, ids, 20, None, 1.0, generator=torch.Generator().manual_seed(7))
    b = dflash_generate(llama_draft, llama, ids, 20, None, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_bad_sampling_arguments(llama, llama_draft):
    ids = torch.tensor([[1, 2]])
    for kw, word in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
                     ({"rule": "magic"}, "rule")]:
        with pytest.raises(ValueError, match=word):
            dflash_generate(llama_draft, llama, ids, 4, None, **kw)


class SteepCost:
    """A cost model where each verified token costs half a plain step: the adaptive policy
    verifies only the proposals it expects to be accepted."""
    def verify_ms(self, n):
        return 10.0 + 5.0 * (n - 1)

    def draft_ms(self, block):
        return 0.0


@pytest.mark.parametrize("policy", ["threshold", "adaptive"])
def test_a_policy_cut_keeps_rejection_sampling_exact(policy):
    """A long sampled generation on a Markov target (attention off): every transition is a draw
    from a known row, so 3000 tokens test the cut at every block position. A cut on the sampled
    token's own probability failed this at p ~ 1e-36; the cut on the draft's top probability holds."""
    from dflash.engine.policy import AdaptivePolicy, ThresholdPolicy
    from dflash.testing import markov_target, transition_pvalue, transition_table

    target = markov_target(4)
    draft = tiny_draft(target, seed=4, layers=1, block_size=4, mask_token_id=0)
    params = SamplingParams(1.0, top_p=0.9, top_k=3, rule="rejection")
    cut = ThresholdPolicy(0.6) if policy == "threshold" else AdaptivePolicy(SteepCost(), 4)
    g = torch.Generator().manual_seed(0)
    res = dflash_generate(draft, target, torch.tensor([[1, 3, 2]]), 3000, None, 1.0, block_size=4, top_p=0.9,
                          top_k=3, generator=g, policy=cut, return_stats=True)
    tokens = res.output_ids[0, 2:].tolist()  # from the prompt's last token on
    assert res.stats.num_drafts > 0 and res.stats.num_draft_tokens < 3 * res.stats.num_drafts  # some were cut
    assert transition_pvalue(tokens, transition_table(target, params)) > 1e-3
