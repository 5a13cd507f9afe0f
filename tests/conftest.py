"""Fixtures shared by the tests; the tiny random models themselves live in `dflash.testing`."""

import pytest
import torch

from dflash.testing import tiny_draft, tiny_target

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def llama_draft(llama):
    return tiny_draft(llama)
