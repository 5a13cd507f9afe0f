"""Where a speculative step's time goes, and the cost curves that decide the block size.

- `profile_steps`: run the real loop with its profiling seam (`stream_generate(...,
  timer=PartTimer(clock))`: the draft forward, the draft's lm_head, the target's verify
  forward, its lm_head); the rest of each step is host work.
- `overhead_ratio`: one block-B step with a random draft (tau = 1) against one plain decode
  step (block 1) of the same loop, interleaved in one run.
- `target_cost_curve` / `draft_cost_curve`: verify time for n query tokens at a few context
  lengths, and the draft's time per block size (the draft network and its head, called
  directly).
- `decode_op_profile`: torch.profiler's per-op split of one plain decode step.
- `kernel_comparison`: the same figures for the other kernel setting (`kernels="torch"`
  beside the measured `"auto"`), and the machine's cost model with its break-even tau.
Nothing here changes the engine or patches anything: the clock is an argument, and the loop
times only what it chose to time."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from dflash.engine.costmodel import fill_cache, time_draft_step
from dflash.engine.loop import DraftHead, stream_generate
from dflash.engine.request import SamplingParams
from dflash.engine.timing import PARTS, PartTimer

TARGET_NS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 512, 1024)
DRAFT_BLOCKS = (2, 4, 8, 12, 16, 24, 32)
BREAK_EVEN_BLOCKS = (2, 4, 8, 16, 32)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time (use with --threads 1)
Clock = Callable[[], float]


def median_ms(xs) -> float:
    return round(statistics.median(xs) * 1e3, 3) if xs else float("nan")


@dataclass
class StepTimes:
    block_size: int
    steps: int
    tokens_per_step: float
    step_ms: float  # median over steps
    parts_ms: dict = field(default_factory=dict)  # median per part: PARTS + host

    def to_dict(self):
        return asdict(self)


def profile_steps(draft, target, input_ids, block_size: int, max_new_tokens: int,
                  clock: Clock = time.perf_counter) -> StepTimes:
    """Per-step medians of each part of the loop (the prefill step is left out); host is the
    step's time minus its timed parts (sampling, verification, cache crops, Python)."""
    timer = PartTimer(clock)
    per_step, wall, tokens = defaultdict(list), [], []
    snap, last = timer.snapshot(), clock()
    for i, step in enumerate(stream_generate(draft, target, input_ids, max_new_tokens, stop_token_ids=(),
                                             params=SamplingParams(), block_size=block_size, timer=timer)):
        now = clock()
        if i > 0:
            wall.append(now - last)
            tokens.append(len(step.tokens))
            totals = timer.snapshot()
            for name in PARTS:
                per_step[name].append(totals[name] - snap[name])
        snap, last = timer.snapshot(), clock()
    parts = {name: median_ms(per_step[name]) for name in PARTS}
    parts["host"] = median_ms([w - sum(per_step[n][i] for n in PARTS) for i, w in enumerate(wall)])
    return StepTimes(block_size, len(wall), sum(tokens) / max(len(tokens), 1), median_ms(wall), parts)


def overhead_ratio(draft, target, input_ids, block_size: int = 16, max_new_tokens: int = 48, rounds: int = 3,
                   clock: Clock = time.perf_counter) -> dict:
    """Block-`block_size` steps against plain decode steps of the same loop, alternated in
    `rounds` rounds; with an untrained draft (tau ~1) each step commits ~1 token, so the
    ratio is the engine's cost per step. Also the bare forward ratio n=block_size vs n=1."""
    plain, spec = [], []
    for _ in range(rounds):
        plain.append(profile_steps(None, target, input_ids, 1, max_new_tokens, clock))
        spec.append(profile_steps(draft, target, input_ids, block_size, max_new_tokens, clock))
    p_ms = statistics.median(s.step_ms for s in plain)
    s_ms = statistics.median(s.step_ms for s in spec)
    bare = target_cost_curve(target, (1, block_size), (input_ids.shape[1] + max_new_tokens // 2,), repeats=3 * rounds,
                             clock=clock)
    (row,) = bare["rows"]  # the bare forward: every row's logits
    return {"block_size": block_size, "plain_step_ms": round(p_ms, 2), "block_step_ms": round(s_ms, 2),
            "ratio": round(s_ms / p_ms, 3), "bare_forward_ratio": round((row["ms"][1] + row["rest_head_ms"][1]) / row["ms"][0], 3),
            "tokens_per_step": round(statistics.median(s.tokens_per_step for s in spec), 3),
            "block_parts_ms": _median_parts(spec), "plain_parts_ms": _median_parts(plain)}


def _median_parts(runs: list[StepTimes]) -> dict:
    return {k: round(statistics.median(r.parts_ms[k] for r in runs), 2) for k in runs[0].parts_ms}


@torch.inference_mode()
def target_cost_curve(target, ns=TARGET_NS, contexts=CONTEXTS, repeats: int = 5, layer_ids=None, seed: int = 0,
                      clock: Clock = time.perf_counter) -> dict:
    """Median ms of one verify pass over n query tokens after `ctx` cached tokens, as the loop
    runs it when proposal 1 is rejected: the target's layers, then its lm_head on row 0
    (`ms`); and of the lm_head on the other n-1 rows, paid when proposal 1 is accepted
    (`rest_head_ms`). n values interleaved within each repeat."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for ctx in contexts:
        cache, times, rest = fill_cache(target, ctx, g), defaultdict(list), defaultdict(list)
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
def draft_cost_curve(draft, target, blocks=DRAFT_BLOCKS, context: int = 512, repeats: int = 5, seed: int = 0,
                     clock: Clock = time.perf_counter) -> dict:
    """Median ms of one draft step (noise embedding, the draft network over 1 new context
    token + the block, its lm_head on the proposals, argmax and their probabilities) with
    `context` tokens in its cache; the draft and its `DraftHead` called directly."""
    g = torch.Generator().manual_seed(seed)
    k_h = len(draft.config.target_layer_ids) * target.info.hidden_size
    cache = draft.new_cache()
    head = DraftHead.build(draft, target)  # its draft vocabulary's rows, as the loop uses them
    mask_id = draft.config.mask_token_id
    layout = target.draft_layout(draft)  # the loop's kernels, built once as a Pipeline builds them
    time_draft_step(draft, target, head, cache, torch.randn(1, context, k_h, generator=g), 2, mask_id, context, layout)
    times = defaultdict(list)
    for _ in range(repeats + 1):
        for b in blocks:
            one = torch.randn(1, 1, k_h, generator=g)
            t = clock()
            time_draft_step(draft, target, head, cache, one, b, mask_id, context + 1, layout)
            times[b].append(clock() - t)
            cache.crop_to(context)
    return {"context": context, "blocks": list(blocks), "ms": [median_ms(times[b][1:]) for b in blocks],
            "draft_layers": draft.config.num_hidden_layers}


@torch.inference_mode()
def head_cost(target, positions: int = 15, vocab_sizes=(None, 16384, 8192, 4096), repeats: int = 5,
              clock: Clock = time.perf_counter) -> dict:
    """What the draft's lm_head + argmax over `positions` proposals costs with the full
    vocabulary (None) and with only the first K rows (a draft vocabulary's size), through the
    target's `logits` (its measured kernel)."""
    w = target.embed_weight if target.head is None else target.head.weight  # (V, H)
    vocab_sizes = [k for k in vocab_sizes if k is None or k < w.shape[0]]
    hidden = torch.randn(1, positions, w.shape[1])
    heads = {k: None if k is None else target.head_rows(torch.arange(k)) for k in vocab_sizes}
    times = defaultdict(list)
    for _ in range(repeats + 1):
        for k in vocab_sizes:
            t = clock()
            target.logits(hidden, heads[k]).argmax(-1)
            times[k].append(clock() - t)
    return {"positions": positions, "vocab": [k or w.shape[0] for k in vocab_sizes],
            "ms": [median_ms(times[k][1:]) for k in vocab_sizes]}


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::linear", "aten::matmul",
              "dflash_lowbit::qmm")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "dflash_lowbit::attend")
LAYER_OPS = ("dflash_lowbit::llama_forward",)  # every layer in one native call: products, attention and the rest


VERIFY_OPS_TOKENS = 16  # the verify pass whose ops the profile splits beside a decode step's


@torch.inference_mode()
def decode_op_profile(target, context: int = 256, steps: int = 10, top: int = 14,
                      clock: Clock = time.perf_counter, tokens: int = 1) -> dict:
    """Per-op split of one plain decode step (the target's layers and its lm_head on one
    row), or of a verify pass of `tokens` (the lm_head on every row), by torch.profiler: self
    time per step of the costliest ops, and the step grouped as matrix products / attention /
    whole native layers / the rest. `step_ms`: the median step outside the profiler."""
    from torch.profiler import ProfilerActivity, profile

    cache = fill_cache(target, context, torch.Generator().manual_seed(0))
    ids = torch.full((1, tokens), 5, device=target.device)

    def step():
        final, _ = target.forward_hidden(ids, cache, None)
        target.logits(final)
        cache.crop_to(context)

    wall = []
    for i in range(steps + 2):
        t = clock()
        step()
        if i >= 2:
            wall.append(clock() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    total = sum(e.self_cpu_time_total for e in events)
    groups = {"matmul": 0.0, "attention": 0.0, "layer": 0.0, "other": 0.0}
    for e in events:
        g = ("matmul" if e.key in MATMUL_OPS else "attention" if e.key in ATTENTION_OPS
             else "layer" if e.key in LAYER_OPS else "other")
        groups[g] += e.self_cpu_time_total
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"context": context, "tokens": tokens, "step_ms": median_ms(wall), "profiled_ms": per_step(total),
            "groups_ms": {g: per_step(v) for g, v in groups.items()},
            "ops_per_step": round(sum(e.count for e in events) / steps, 1),
            "ops": [{"op": e.key, "ms": per_step(e.self_cpu_time_total), "calls": round(e.count / steps, 1)}
                    for e in ops]}


def cost_model_summary(target, draft, clock: Clock = time.perf_counter, blocks=BREAK_EVEN_BLOCKS) -> dict:
    """The engine's cost model of this machine (engine/costmodel.py, measured now, not from the
    cache) and the break-even tau per block size: the tokens per step at which a block-B step
    is as fast as plain decoding (proposal 1 accepted, so the whole lm_head is paid)."""
    from dflash.engine import costmodel

    model = costmodel.measure(target, draft, draft_blocks=tuple(blocks), clock=clock)
    return {"model": model.to_dict(), "blocks": list(blocks),
            "break_even_tau": [round(model.break_even_tau(b), 3) for b in blocks],
            "verify_ratio": [round(model.verify_ms(b) / model.verify_ms(1), 3) for b in blocks]}


def time_draft_kernels(target, draft) -> list[str]:
    """The draft's linears in the target adapter's layout (`TargetModel.draft_layout`: measured
    or cached like the target's, and what the loop's draft pass runs), so the report's kernel
    table holds them. Returns their table names ([] with kernels="torch")."""
    layout = None if draft is None else target.draft_layout(draft)
    if layout is None:
        return []
    return sorted({lin.key for lin in layout.linears})


PROFILE_PROMPT = "Write a Python function that returns the first n prime numbers, with a docstring and a test."


def random_like(draft):
    """An untrained draft with the same shape as `draft` (tau ~1: the engine's bare cost)."""
    from dflash.engine.draft import DFlashDraftModel

    torch.manual_seed(0)
    return DFlashDraftModel(draft.config).eval()


def kernel_comparison(target, draft, ids, args, clock: Clock, say=lambda s: None) -> dict:
    """The figures that the kernel setting changes, for one TargetModel: the overhead check,
    the verify curve, a decode step's ops and the cost model."""
    say(f"  [{target.kernels}] overhead check ...")
    out = {"kernels": target.kernel_info(),
           "overhead": overhead_ratio(random_like(draft), target, ids, args.block_size, args.max_new_tokens,
                                      args.rounds, clock)}
    say(f"  [{target.kernels}] decode-step and verify-pass ops ...")
    out["decode_ops"] = decode_op_profile(target, clock=clock)
    out["verify_ops"] = decode_op_profile(target, clock=clock, tokens=VERIFY_OPS_TOKENS)
    if getattr(target, "layout", None) is not None and target.layout.fused:  # the same step op by op
        from dflash.engine.target import TargetModel

        apart = TargetModel(target.model, kernels=target.kernels, precision=target.precision, gguf=target.gguf,
                            fuse=False)
        out["unfused_ops"] = [decode_op_profile(apart, clock=clock, tokens=n) for n in (1, VERIFY_OPS_TOKENS)]
    say(f"  [{target.kernels}] verify curve ...")
    out["target_curve"] = target_cost_curve(target, TARGET_NS, tuple(args.contexts), args.repeats,
                                            draft.config.target_layer_ids, clock=clock)
    say(f"  [{target.kernels}] cost model ...")
    out["cost_model"] = cost_model_summary(target, draft, clock)
    return out


def run_profile_command(args) -> int:
    from pathlib import Path

    from dflash.bench.machine import machine_info
    from dflash.bench.report import plot_cost_curve, profile_markdown
    from dflash.engine.target import TargetModel
    from dflash.text.pipeline import Pipeline

    clock = CLOCKS[args.clock]
    kernels = getattr(args, "kernels", "auto")
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    pipe = Pipeline.load(args.target, args.draft, kernels=kernels, precision=getattr(args, "precision", "auto"))
    load_s = time.perf_counter() - start
    ids = pipe.encode_chat([{"role": "user", "content": PROFILE_PROMPT}])
    time_draft_kernels(pipe.target, pipe.draft)
    from dflash.bench.methods import rss_bytes

    result = {"machine": machine_info(pipe.target.kernel_info(pipe.draft_layout())), "clock": args.clock,
              "kernels": kernels,
              "load_s": round(load_s, 2), "draft": pipe.draft_path or "random (untrained)",
              "precision": pipe.target.precision_info(), "rss_mb": round(rss_bytes() / 2**20)}
    say(f"kernels {kernels}: {pipe.target.kernel_info().get('measure_s', 0)} s measuring at load")
    say(f"step profile with the {'shipped' if pipe.draft_trained else 'random'} draft ...")
    result["steps"] = [profile_steps(None, pipe.target, ids, 1, args.max_new_tokens, clock).to_dict()]
    result["steps"] += [profile_steps(pipe.draft, pipe.target, ids, b, args.max_new_tokens, clock).to_dict()
                        for b in args.profile_blocks]
    say("draft cost curve ...")
    result["draft_curve"] = draft_cost_curve(pipe.draft, pipe.target, DRAFT_BLOCKS, 512, args.repeats, clock=clock)
    result["head_cost"] = head_cost(pipe.target, args.block_size - 1, repeats=args.repeats, clock=clock)
    others = [] if getattr(args, "no_compare", False) else [m for m in ("auto", "torch") if m != kernels]
    modes = [kernels] + others
    result["by_kernels"] = {}
    for mode in modes:
        target = pipe.target if mode == kernels else TargetModel(pipe.target.model, kernels=mode,
                                                                 precision=pipe.target.precision, gguf=pipe.target.gguf)
        say(f"kernels={mode}:")
        result["by_kernels"][mode] = kernel_comparison(target, pipe.draft, ids, args, clock, say)
    main = result["by_kernels"][kernels]
    result["overhead"], result["target_curve"] = main["overhead"], main["target_curve"]  # the chosen setting's
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "profile.md").write_text(profile_markdown(result))
    plot_cost_curve(result, out / "cost_curve.png")
    print(profile_markdown(result))
    say(f"wrote {out}/profile.json, profile.md, cost_curve.png")
    return 0
