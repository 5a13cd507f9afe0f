"""The typed configs of `dflash train`: `DataConfig` (regeneration, saved as data_config.json in the
data folder) and `FitConfig` (training, saved as train_config.json beside every checkpoint).
No torch here: the CLI builds its flags from these dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

OPTIMIZERS = ("adamw", "radam")
LOSS_VOCABS = ("full", "sampled", "draft", "data")
INITS = ("random", "target")


@dataclass
class FitConfig:
    data: str = "runs/data/smollm2"
    # further data folders trained on together with `data`, as one pool (their features must
    # come from the same target layers); their sequence ids get the folder's path in front
    # ("runs/data/smollm2-e/code-12"), so an id repeated across folders keeps apart, and `data`'s held-out split
    # (listed first, so evaluated first) stays the one a run on `data` alone scores on
    more_data: list[str] = field(default_factory=list)
    out: str = "runs/fit/smollm2"
    target: str | None = None
    resume: bool = False
    # draft shape
    num_layers: int = 1
    intermediate_size: int | None = None  # None: the target's
    block_size: int = 16
    init: str = "random"  # "random" or "target": copy target decoder layers where shapes allow
    # anchors and loss
    anchors_per_seq: int = 32
    gamma: float = 7.0
    # the loss per block position: (1 - d) * CE on the target's token + d * KL(target || draft)
    # on the data's soft labels (its top-k plus the remaining mass as one bucket); 0: hard CE only
    distill_weight: float = 0.0
    max_seq_len: int = 1024
    # optimisation
    lr: float = 6e-4
    # "adamw"; or "radam": Adam with its adaptive step rectified while the second moments are
    # still estimated from few steps (plain momentum steps first), for warm starts whose first
    # AdamW updates, sign-like at about lr per parameter, cost the start's tau
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    warmup_frac: float = 0.04
    epochs: float = 6.0
    max_steps: int | None = None  # overrides epochs when set
    batch_size: int = 4  # sequences per optimizer micro-batch (per process)
    grad_accum: int = 1
    clip: float = 1.0
    logits_chunk: int = 1024  # masked positions per lm_head chunk
    # "full": softmax over the whole vocabulary. "sampled": over the data's label tokens plus
    # `loss_negatives` random rows re-drawn every step (cheaper on a CPU; the random rows keep
    # unseen tokens from winning the full-vocabulary argmax). "data": label tokens only, which
    # measured 0% full-vocabulary accuracy: unseen rows win (kept for the record, do not use).
    # "draft": the exact softmax over the draft vocabulary (needs `draft_vocab`): the very head
    # the draft proposes with at inference; labels outside it carry no loss.
    loss_vocab: str = "sampled"
    # K: the draft proposes from the K most frequent label tokens of the data (after --init-from: and from
    # every id its start could propose)
    draft_vocab: int | None = None
    loss_negatives: int = 8192
    data_shards: int | None = None  # train on the first N finished shards only (None: all), after skip_shards
    # per data folder (`data` or one of `more_data`): leave out its first N finished shards, those an
    # earlier stage trained on, so a warm start spends its steps on responses it never saw
    skip_shards: dict[str, int] = field(default_factory=dict)
    init_from: str | None = None  # a draft checkpoint folder to start from (a warm start on more data)
    seed: int = 0
    threads: int = 1
    # bookkeeping
    heldout_frac: float = 0.05
    eval_every: int = 100
    eval_tau_prompts: int = 2  # per domain; 0 disables tau evaluation
    tau_every: int = 400
    eval_tau_tokens: int = 96
    ckpt_every: int = 50
    log_every: int = 10
    backend: str | None = None  # torch.distributed backend under torchrun; None: gloo on CPU, nccl on GPU
    device: str | None = None  # None: cuda if available, else cpu

    def check(self) -> None:
        """Raise ValueError naming every setting that cannot work, before a model or data loads
        (`dflash train fit` calls it first, so a typo costs no minutes of loading)."""
        problems = []
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.loss_vocab not in LOSS_VOCABS:
            problems.append(f"loss_vocab must be one of {', '.join(LOSS_VOCABS)}, got {self.loss_vocab!r}")
        elif self.loss_vocab == "draft" and not self.draft_vocab:
            problems.append("loss_vocab 'draft' needs draft_vocab (the number of ids the draft proposes from)")
        if self.init not in INITS:
            problems.append(f"init must be one of {', '.join(INITS)}, got {self.init!r}")
        if not 0.0 <= self.distill_weight <= 1.0:
            problems.append(f"distill_weight must be in [0, 1], got {self.distill_weight}")
        if not 0.0 <= self.heldout_frac < 1.0:
            problems.append(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")
        for name in ("gamma", "lr"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        least = {"block_size": 2, "anchors_per_seq": 1, "batch_size": 1, "grad_accum": 1, "num_layers": 1, "threads": 1}
        problems += [f"{name} must be >= {low}, got {getattr(self, name)}" for name, low in least.items()
                     if getattr(self, name) < low]
        folders = [os.path.normpath(f) for f in (self.data, *self.more_data)]
        problems += [f"data folder {f!r} is listed twice" for f in sorted(set(folders)) if folders.count(f) > 1]
        problems += [f"skip_shards names {f!r}, which is not --data or one of --more-data" for f in self.skip_shards
                     if os.path.normpath(f) not in folders]
        problems += [f"skip_shards[{f!r}] must be an integer >= 0, got {n!r}" for f, n in self.skip_shards.items()
                     if not isinstance(n, int) or isinstance(n, bool) or n < 0]
        if self.data_shards is not None and self.data_shards < 1:
            problems.append(f"data_shards must be >= 1, got {self.data_shards}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be >= 1, got {self.max_steps}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class DataConfig:
    out: str = "runs/data/smollm2"
    target: str | None = None  # None: the default SmolLM2-135M-Instruct
    num_prompts: int = 3000
    # sources: math, code (templated requests), docstring (standard-library stubs to complete, the
    # HumanEval shape), method (the same from the standard library's class methods), library
    # (functions and methods of sympy, mpmath, networkx, jinja2: torch's own dependencies), package
    # (the same from matplotlib, pandas, rich, numpy, ...: code_prompts.PACKAGES), package2 (the
    # same from transformers, scipy, pytest, ...: code_prompts.MORE_PACKAGES), writing (templated
    # requests for emails, posts, stories, role play: writing_prompts.py), sharegpt (first human
    # turns), followup (ShareGPT's later human turns, the exchange before each as context)
    mix: dict = field(default_factory=lambda: {"math": 0.4, "code": 0.3, "sharegpt": 0.3})
    layer_ids: list[int] = field(default_factory=lambda: [1, 8, 14, 20, 27])
    max_prompt_tokens: int = 320
    max_new_tokens: int = 192
    # a longer limit for the sources whose prompts ask for long answers, e.g. {"math": 448,
    # "code": 448, "docstring": 448}; a source not named here gets max_new_tokens
    max_new_tokens_by_source: dict = field(default_factory=dict)
    temperature: float = 0.0
    # soft labels: the target's top-k log-probabilities (and the log of the remaining mass) over
    # every response token, kept in shard-N.topk.npz beside the features; 0: hard labels only
    topk: int = 32
    # rows the target generates at once; a row that ends takes the next prompt (across shards) on
    # Llama-family targets, other targets run batch after batch
    batch_size: int = 32
    shard_size: int = 64
    threads: int = 1
    seed: int = 0
    max_shards: int | None = None  # stop after this many shards exist (None: all)
    first_shard: int = 0  # generate only shards from this index on (a later part of the prompt list)
    # data folders (each with its data_config.json) whose whole prompt lists stay out of this one:
    # the prompts earlier drafts trained on, e.g. ["data/smollm2-b", "data/smollm2-c"]; a source
    # draws as many more candidates as the lists hold of it, so the mix keeps its size
    exclude_lists: list[str] = field(default_factory=list)
    # a folder of shard-N.jsonl kept from an earlier run (e.g. committed): those shards are
    # rebuilt by one target prefill per sequence instead of being regenerated
    responses: str | None = None
    # "regen": the target writes every response (the paper's recipe); "prefill": existing
    # ShareGPT replies, one target prefill each, labels = the target's own next-token argmax
    source: str = "regen"
    device: str | None = None  # None: cuda when available, else cpu
