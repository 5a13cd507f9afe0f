"""Tiny random targets and drafts shared by the engine tests."""

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def tiny_target(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    elif family == "gemma3":  # three sliding-window layers of width 4, one global layer
        model = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, sliding_window=4, layer_types=[
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"], **kw))
    else:
        raise ValueError(family)
    return model.eval()


def tiny_draft(target, seed: int = 1, layers: int = 2, block_size: int = 8, **kw):
    torch.manual_seed(seed)
    return DFlashDraftModel(DFlashConfig.for_target(target.config, num_hidden_layers=layers,
                                                    block_size=block_size, **kw)).eval()


@pytest.fixture(scope="session")
def llama():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def llama_draft(llama):
    return tiny_draft(llama)
