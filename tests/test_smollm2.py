"""The real default target, SmolLM2-135M-Instruct: speculative greedy output equals HF generate."""

import pytest
import torch

from dflash.model import dflash_generate
from dflash.text.pipeline import Pipeline

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples are left?",
    "Give me three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(2)
    return Pipeline.load(None, None, quiet=True, precision="fp32")  # HF's numbers; the shipped draft


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_hf_generate(pipe, prompt):
    ids = pipe.encode_chat([{"role": "user", "content": prompt}])
    ref = pipe.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                     eos_token_id=pipe.stop_token_ids, pad_token_id=pipe.tokenizer.pad_token_id)
    for block_size in (16, 5):
        res = dflash_generate(pipe.draft, pipe.target, ids, 48, pipe.stop_token_ids, block_size=block_size,
                              return_stats=True)
        assert torch.equal(res.output_ids, ref), (prompt, block_size)


def test_shipped_draft_is_accepted(pipe):
    """The shipped draft commits more than one token per step over these prompts (a random
    draft ~1.0), so a broken loading, layer choice or mask shows here."""
    assert pipe.draft_trained, "no shipped draft at dflash/drafts/smollm2-135m-instruct"
    lengths = []
    for prompt in PROMPTS:
        ids = pipe.encode_chat([{"role": "user", "content": prompt}])
        res = dflash_generate(pipe.draft, pipe.target, ids, 48, pipe.stop_token_ids, block_size=16, return_stats=True)
        lengths += res.acceptance_lengths
    assert sum(lengths) / len(lengths) >= 1.15
