"""Bad input gets a clear message naming the problem."""

import pytest
import torch

from dflash.model import GenerationError, IncompatibleDraftError, dflash_generate
from dflash.testing import tiny_draft, tiny_target


def test_empty_prompt(llama, llama_draft):
    with pytest.raises(GenerationError, match="prompt is empty"):
        dflash_generate(llama_draft, llama, torch.zeros(1, 0, dtype=torch.long), 5, None)


def test_prompt_longer_than_context(llama, llama_draft):
    ids = torch.ones(1, 300, dtype=torch.long)  # the tiny target holds 256 positions
    with pytest.raises(GenerationError, match="300 tokens but the target's context holds 256"):
        dflash_generate(llama_draft, llama, ids, 5, None)


def test_generation_stops_at_the_context_end(llama, llama_draft):
    ids = torch.ones(1, 250, dtype=torch.long)
    res = dflash_generate(llama_draft, llama, ids, 50, None, return_stats=True)
    assert res.num_output_tokens == 6 and res.finish_reason == "length"


@pytest.mark.parametrize("block_size", [0, -3, 2.5])
def test_bad_block_size(llama, llama_draft, block_size):
    with pytest.raises(GenerationError, match="block_size must be an integer >= 1"):
        dflash_generate(llama_draft, llama, torch.tensor([[1, 2]]), 5, None, block_size=block_size)


def test_mismatched_draft_names_every_problem(llama):
    other = tiny_target("llama", hidden_size=32, vocab_size=80, num_hidden_layers=12)
    draft = tiny_draft(other, layers=3)
    with pytest.raises(IncompatibleDraftError) as e:
        dflash_generate(draft, llama, torch.tensor([[1, 2]]), 5, None)
    msg = str(e.value)
    for part in ("hidden_size 32 != target hidden_size 64", "vocab_size 80 != target vocabulary 96",
                 "outside the target's 4 layers", "12-layer target"):
        assert part in msg


def test_bad_mask_token(llama, llama_draft):
    with pytest.raises(GenerationError, match="mask_token_id 500"):
        dflash_generate(llama_draft, llama, torch.tensor([[1, 2]]), 5, None, mask_token_id=500)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1, 2, 3]), "LongTensor"),
    (torch.tensor([[1.0, 2.0]]), "LongTensor"),
    (torch.tensor([[1, 2], [3, 4]]), "batch size 2"),
    (torch.tensor([[1, 200]]), "outside the target vocabulary"),
])
def test_bad_input_ids(llama, llama_draft, ids, message):
    with pytest.raises(GenerationError, match=message):
        dflash_generate(llama_draft, llama, ids, 5, None)


def test_bad_max_new_tokens(llama, llama_draft):
    with pytest.raises(GenerationError, match="max_new_tokens"):
        dflash_generate(llama_draft, llama, torch.tensor([[1, 2]]), -1, None)


def test_block_size_above_one_needs_a_draft(llama):
    with pytest.raises(GenerationError, match="needs a draft"):
        dflash_generate(None, llama, torch.tensor([[1, 2]]), 5, None, block_size=4)
    assert dflash_generate(None, llama, torch.tensor([[1, 2]]), 5, None).shape == (1, 7)
