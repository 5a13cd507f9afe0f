"""Helpers shared by the training tests and the processes they start (DDP ranks, a job that is
killed): tiny feature sequences and a small training config. Not a test module."""

import torch

from dflash.train.config import FitConfig
from dflash.train.data import Sequence

LAYERS = [0, 2]
MASK = 95


def features(model, tokens):
    with torch.no_grad():
        out = model(input_ids=tokens[None, :-1], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in LAYERS], -1)[0]  # (L-1, k*H)


def make_seqs(model, n=6, length=40, prompt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        toks = torch.randint(0, 90, (length,), generator=g)
        seqs.append(Sequence(f"s{i}", "test", toks, prompt, features(model, toks).half().numpy()))
    return seqs


def fit_cfg(**kw):
    base = dict(block_size=8, gamma=4.0, anchors_per_seq=4, batch_size=2, lr=1e-3, max_steps=6, heldout_frac=0.0,
                eval_tau_prompts=0, device="cpu", intermediate_size=64, warmup_frac=0.2)
    return FitConfig(**{**base, **kw})


def params(draft):
    return torch.cat([p.detach().flatten() for p in draft.parameters()])


def grads(draft):  # compare gradients: Adam's first step is sign-like and amplifies rounding
    return torch.cat([p.grad.flatten() for p in draft.parameters()])
