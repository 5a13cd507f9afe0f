"""Where a speculative step's time goes, and the cost curve that decides the block size.

- `step_profile`: run the real loop with timers around the draft forward, the draft's
  lm_head, the target's verify forward; the rest of each step is host work.
- `overhead_ratio`: one block-B step with a random draft (tau = 1) against one plain
  decode step (block 1) of the same loop, interleaved in one run.
- `target_cost_curve` / `draft_cost_curve`: forward time for n query tokens at a few
  context lengths, and the draft's time per block size.
Nothing here changes the engine: timers wrap the pipeline's objects and are removed after."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch

from dflash.engine.loop import DraftHead, DraftProposer, stream_generate
from dflash.engine.sampling import SamplingParams

TARGET_NS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 512, 1024)
DRAFT_BLOCKS = (2, 4, 8, 12, 16, 24, 32)
PARTS = ("draft_forward", "draft_head", "verify_forward", "verify_head")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = [time.perf_counter]


def clock() -> float:
    return _clock[0]()


def set_clock(name: str) -> None:
    """"wall" (default) or "cpu": this process's CPU time, which a loaded machine's time
    slicing does not inflate (use it with --threads 1: with more threads it counts spinning)."""
    _clock[0] = CLOCKS[name]


def median_ms(xs) -> float:
    return round(statistics.median(xs) * 1e3, 3) if xs else float("nan")


@contextmanager
def _timed(obj, name: str, key: str, sink: dict):
    """Shadow obj.<name> (an instance's or a class's) with a timed wrapper that adds its
    seconds to sink[key]; the original is put back after."""
    own = name in vars(obj)
    fn = vars(obj)[name] if own else getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[key] += clock() - t

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, fn)
        else:
            delattr(obj, name)


@contextmanager
def instrument(draft, target):
    """Yield a dict accumulating seconds per part while the loop runs: `verify_forward`
    (the target's layers, prefill included), `verify_head` (the target's lm_head on its own
    rows), `draft_head` (the lm_head on the draft's hidden states) and `draft_forward` (the
    draft network). Both heads go through `target.logits`; the draft's share is timed at
    `DraftHead.logits` and taken off."""
    raw = defaultdict(float)
    with (_timed(target, "forward_hidden", "verify_forward", raw), _timed(target, "logits", "head", raw),
          _timed(DraftHead, "logits", "draft_head", raw),
          _timed(draft, "forward", "draft_forward", raw) if draft is not None else nullcontext()):
        yield _Parts(raw)


class _Parts:
    """A read view of the raw sums with verify_head = all head time - the draft's."""

    def __init__(self, raw):
        self.raw = raw

    def __getitem__(self, name):
        if name == "verify_head":
            return self.raw["head"] - self.raw["draft_head"]
        return self.raw[name]

    def snapshot(self) -> dict:
        return {name: self[name] for name in PARTS}


@dataclass
class StepTimes:
    block_size: int
    steps: int
    tokens_per_step: float
    step_ms: float  # median over steps
    parts_ms: dict = field(default_factory=dict)  # median per part: PARTS + host

    def to_dict(self):
        return asdict(self)


def profile_steps(draft, target, input_ids, block_size: int, max_new_tokens: int) -> StepTimes:
    """Per-step medians of each part of the loop (the prefill step is left out); host is the
    step's wall time minus its timed parts (sampling, verification, cache crops, Python)."""
    per_step, wall, tokens = defaultdict(list), [], []
    with instrument(draft, target) as raw:
        snap, last = raw.snapshot(), clock()
        for i, step in enumerate(stream_generate(draft, target, input_ids, max_new_tokens, (), SamplingParams(),
                                                 block_size)):
            now = clock()
            if i > 0:
                wall.append(now - last)
                tokens.append(len(step.tokens))
                for name in PARTS:
                    per_step[name].append(raw[name] - snap[name])
            snap, last = raw.snapshot(), clock()
    parts = {name: median_ms(per_step[name]) for name in PARTS}
    parts["host"] = median_ms([w - sum(per_step[n][i] for n in PARTS) for i, w in enumerate(wall)])
    return StepTimes(block_size, len(wall), sum(tokens) / max(len(tokens), 1), median_ms(wall), parts)


def overhead_ratio(draft, target, input_ids, block_size: int = 16, max_new_tokens: int = 48, rounds: int = 3) -> dict:
    """Block-`block_size` steps against plain decode steps of the same loop, alternated in
    `rounds` rounds; with an untrained draft (tau ~1) each step commits ~1 token, so the
    ratio is the engine's cost per step. Also the bare forward ratio n=block_size vs n=1."""
    plain, spec = [], []
    for _ in range(rounds):
        plain.append(profile_steps(None, target, input_ids, 1, max_new_tokens))
        spec.append(profile_steps(draft, target, input_ids, block_size, max_new_tokens))
    p_ms = statistics.median(s.step_ms for s in plain)
    s_ms = statistics.median(s.step_ms for s in spec)
    bare = target_cost_curve(target, (1, block_size), (input_ids.shape[1] + max_new_tokens // 2,), repeats=3 * rounds)
    (row,) = bare["rows"]  # the bare forward: every row's logits
    return {"block_size": block_size, "plain_step_ms": round(p_ms, 2), "block_step_ms": round(s_ms, 2),
            "ratio": round(s_ms / p_ms, 3), "bare_forward_ratio": round((row["ms"][1] + row["rest_head_ms"][1]) / row["ms"][0], 3),
            "tokens_per_step": round(statistics.median(s.tokens_per_step for s in spec), 3),
            "block_parts_ms": _median_parts(spec), "plain_parts_ms": _median_parts(plain)}


def _median_parts(runs: list[StepTimes]) -> dict:
    return {k: round(statistics.median(r.parts_ms[k] for r in runs), 2) for k in runs[0].parts_ms}


def _prefill(target, ctx: int, generator: torch.Generator):
    cache = target.new_cache()
    ids = torch.randint(0, target.info.vocab_size, (1, ctx), generator=generator)
    target.forward(ids, cache, None, logits_to_keep=1)
    return cache


@torch.inference_mode()
def target_cost_curve(target, ns=TARGET_NS, contexts=CONTEXTS, repeats: int = 5, layer_ids=None, seed: int = 0) -> dict:
    """Median ms of one verify pass over n query tokens after `ctx` cached tokens, as the loop
    runs it when proposal 1 is rejected: the target's layers, then its lm_head on row 0
    (`ms`); and of the lm_head on the other n-1 rows, paid when proposal 1 is accepted
    (`rest_head_ms`). n values interleaved within each repeat."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for ctx in contexts:
        cache, times, rest = _prefill(target, ctx, g), defaultdict(list), defaultdict(list)
        for _ in range(repeats + 1):  # the first pass warms up
            for n in ns:
                ids = torch.randint(0, target.info.vocab_size, (1, n), generator=g)
                t = clock()
                final, _ = target.forward_hidden(ids, cache, layer_ids)
                target.logits(final[:, :1])
                t1 = clock()
                if n > 1:
                    target.logits(final[:, 1:])
                times[n].append(t1 - t)
                rest[n].append(clock() - t1)
                cache.crop_to(ctx)
        rows.append({"context": ctx, "ms": [median_ms(times[n][1:]) for n in ns],
                     "rest_head_ms": [median_ms(rest[n][1:]) for n in ns]})
    return {"ns": list(ns), "rows": rows}


@torch.inference_mode()
def draft_cost_curve(draft, target, blocks=DRAFT_BLOCKS, context: int = 512, repeats: int = 5, seed: int = 0) -> dict:
    """Median ms of one draft step (noise embedding, draft forward over 1 new context token
    + the block, lm_head on the proposals, argmax) with `context` tokens in its cache."""
    g = torch.Generator().manual_seed(seed)
    k_h = len(draft.config.target_layer_ids) * target.info.hidden_size
    ctx_hidden = torch.randn(1, context, k_h, generator=g)
    last = torch.tensor([1])
    proposer = DraftProposer(draft, target, SamplingParams(), draft.config.mask_token_id)  # as the loop drafts
    cache = proposer.cache
    proposer.propose(ctx_hidden, last, context, 2)  # fills the cache
    times = defaultdict(list)
    for _ in range(repeats + 1):
        for b in blocks:
            one = torch.randn(1, 1, k_h, generator=g)
            t = clock()
            proposer.propose(one, last, context + 1, b)
            times[b].append(clock() - t)
            cache.crop_to(context)
    return {"context": context, "blocks": list(blocks), "ms": [median_ms(times[b][1:]) for b in blocks],
            "draft_layers": draft.config.num_hidden_layers}


PROFILE_PROMPT = "Write a Python function that returns the first n prime numbers, with a docstring and a test."


def random_like(draft):
    """An untrained draft with the same shape as `draft` (tau ~1: the engine's bare cost)."""
    from dflash.engine.draft import DFlashDraftModel

    torch.manual_seed(0)
    return DFlashDraftModel(draft.config).eval()


def run_profile_command(args) -> int:
    from pathlib import Path

    from dflash.bench.machine import machine_info
    from dflash.bench.report import plot_cost_curve, profile_markdown
    from dflash.text.pipeline import Pipeline

    set_clock(args.clock)
    pipe = Pipeline.load(args.target, args.draft)
    ids = pipe.encode_chat([{"role": "user", "content": PROFILE_PROMPT}])
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    say(f"overhead check: block {args.block_size} with a random draft vs plain decoding ...")
    result = {"machine": machine_info(), "clock": args.clock, "draft": pipe.draft_path or "random (untrained)",
              "overhead": overhead_ratio(random_like(pipe.draft), pipe.target, ids, args.block_size,
                                         args.max_new_tokens, args.rounds)}
    say(f"step profile with the {'shipped' if pipe.draft_trained else 'random'} draft ...")
    result["steps"] = [profile_steps(None, pipe.target, ids, 1, args.max_new_tokens).to_dict()]
    result["steps"] += [profile_steps(pipe.draft, pipe.target, ids, b, args.max_new_tokens).to_dict()
                        for b in args.profile_blocks]
    say("target cost curve ...")
    result["target_curve"] = target_cost_curve(pipe.target, TARGET_NS, tuple(args.contexts), args.repeats,
                                               pipe.draft.config.target_layer_ids)
    say("draft cost curve ...")
    result["draft_curve"] = draft_cost_curve(pipe.draft, pipe.target, DRAFT_BLOCKS, 512, args.repeats)
    result["head_cost"] = head_cost(pipe.target, args.block_size - 1, repeats=args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "profile.md").write_text(profile_markdown(result))
    plot_cost_curve(result, out / "cost_curve.png")
    print(profile_markdown(result))
    say(f"wrote {out}/profile.json, profile.md, cost_curve.png")
    return 0


@torch.inference_mode()
def head_cost(target, positions: int = 15, vocab_sizes=(None, 16384, 8192, 4096), repeats: int = 5) -> dict:
    """What the draft's lm_head + argmax over `positions` proposals costs with the full
    vocabulary (None) and with only the first K rows (a draft vocabulary; a what-if: the
    engine uses the full head today)."""
    w = target.embed_weight if target.head is None else target.head.weight  # (V, H)
    hidden = torch.randn(1, positions, w.shape[1])
    times = defaultdict(list)
    for _ in range(repeats + 1):
        for k in vocab_sizes:
            rows = w if k is None else w[:k]
            t = clock()
            (hidden @ rows.T).argmax(-1)
            times[k].append(clock() - t)
    return {"positions": positions, "vocab": [k or w.shape[0] for k in vocab_sizes],
            "ms": [median_ms(times[k][1:]) for k in vocab_sizes]}
