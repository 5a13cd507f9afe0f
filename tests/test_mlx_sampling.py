"""Sampled MLX output has the target's own distribution, for both verification rules.

The target is a tiny 4-token Llama with its attention switched off (every o_proj is zero):
each position then sees only its own token, so the target is a Markov chain whose transition
table P[prev, next] is computed exactly by the torch engine's `probabilities`. Every token of
one long seeded MLX generation (accepted proposals at any block position, recovered and bonus
tokens alike) is then a draw from a known row of P: a chi-square test of the transition
counts checks the whole loop, rollback included, at a few thousand tokens."""

import json
import os

import numpy as np
import pytest

if os.environ.get("CI", "").lower() not in ("true", "1"):  # CI installs .[mlx]: there a missing MLX fails
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e '.[mlx]'; on Linux "
                                           "it needs mlx[cpu], plain mlx fails to import)", exc_type=ImportError)
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')", exc_type=ImportError)

from mlx_lm.utils import load_model

from dflash.backends.mlx.api import _rope_overrides, load_draft
from dflash.backends.mlx.loop import DraftProposer, stream_tokens
from dflash.backends.mlx.sampling import Keys
from dflash.backends.mlx.target import MLXTarget
from dflash.engine.request import SamplingParams
from dflash.testing import markov_target, tiny_draft, transition_pvalue, transition_table

V = 4
PROMPT = [1, 3, 2]


@pytest.fixture(scope="module")
def markov(tmp_path_factory):
    """(torch target, MLX target, the folder with draft/): the same weights in both frameworks."""
    path = tmp_path_factory.mktemp("markov")
    target = markov_target(V)
    target.save_pretrained(path)
    tiny_draft(target, seed=4, layers=1, block_size=4, mask_token_id=0).save_pretrained(path / "draft")
    model, _ = load_model(path, model_config=_rope_overrides(json.loads((path / "config.json").read_text())))
    return target, MLXTarget(model), path


CASES = {  # (params, draft vocabulary, draft threshold)
    "rejection": (SamplingParams(1.0, top_p=0.9, top_k=3, rule="rejection"), None, 0.0),
    "match": (SamplingParams(1.0, top_p=0.9, top_k=3, rule="match"), None, 0.0),
    "rejection-draft-vocab-threshold": (SamplingParams(1.0, top_p=0.95), [1, 3], 0.7),
}


def shifted(table: np.ndarray, by: float) -> np.ndarray:
    """Each row with `by` of its mass moved to its most likely token."""
    out = table * (1 - by)
    out[np.arange(V), table.argmax(-1)] += by
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_follow_the_target_distribution(markov, case):
    """1200 tokens of one seeded generation (block 4): chi-square of the transition counts
    against the exact law, rejecting at p < 0.001; the test has power: the same counts reject
    a law with a quarter of each row moved to its top token."""
    target, mlx_target, path = markov  # path: the folder, its draft in draft/
    params, vocab, threshold = CASES[case]
    draft = load_draft(path / "draft")
    draft.config.draft_vocab = vocab
    proposer = None
    if vocab:  # the vocabulary alone (the prompt shows every id outside it: a widened head has all V)
        proposer = DraftProposer(draft, mlx_target, params, draft.config.mask_token_id, Keys(1), 8, context_vocab=False)
    steps = list(stream_tokens(mlx_target, draft, PROMPT, max_tokens=1200, params=params, block_size=4,
                               seed=0, draft_window=8, draft_threshold=threshold, proposer=proposer))
    tokens = PROMPT[-1:] + [t for s in steps for t in s.tokens]
    table = transition_table(target, params)
    assert table.max() < 0.9 and (table > 0).sum() >= 2 * V  # spread, so a biased sampler would show
    accepted, proposed = [s.accepted for s in steps[1:]], [s.proposed for s in steps[1:]]
    assert max(accepted) == 3 and 0 in accepted and 1 in accepted  # bonus tokens, rejections at any slot
    if threshold:  # the threshold cuts some blocks, not all
        assert 0 in proposed and 3 in proposed
    if vocab:
        assert all(set(s.tokens[:s.accepted]) <= set(vocab) for s in steps)
    p = transition_pvalue(tokens, table)
    print(f"{case}: chi-square p = {p:.3f} over {len(tokens) - 1} transitions; "
          f"against a 25% shift p = {transition_pvalue(tokens, shifted(table, 0.25)):.2g}")
    assert p > 1e-3
    assert transition_pvalue(tokens, shifted(table, 0.25)) < 1e-3
