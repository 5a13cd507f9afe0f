"""`dflash bench`: the target alone (HF generate), our loop at block 1, DFlash at the chosen
block sizes and HF prompt lookup, interleaved prompt by prompt in one process, with the
output of every method checked equal to the target alone's at temperature 0.
`dflash profile`: where one speculative step's time goes, and the cost curve."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.bench.machine import machine_info
from dflash.bench.methods import BASELINE, Settings, build_methods
from dflash.bench.stats import Record, Summary, first_mismatch, summarize
from dflash.text.prompts import EVAL_DATASETS as DATASETS


class BenchMismatchError(RuntimeError):
    """A method's greedy output differs from the target alone's."""


@dataclass
class Mismatch:
    dataset: str
    prompt_id: str
    method: str
    position: int  # first differing new token
    expected: list[int]  # a few tokens from there on
    got: list[int]


def load_prompts(datasets, prompts_file, limit):
    """The prompts, round-robin across the sets (a run stopped early still covers each)."""
    from dflash.text.prompts import load_dataset, load_prompts_file

    groups = [load_prompts_file(prompts_file)[: limit or None]] if prompts_file else []
    groups += [load_dataset(name, limit) for name in datasets]
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def encode(pipe, prompt) -> torch.Tensor:
    if prompt.text is not None:
        return pipe.encode_text(prompt.text)
    return pipe.encode_chat(prompt.messages)


def run_bench(pipe, prompts, methods, max_new_tokens: int, on_record=None, warmup: bool = True,
              deadline: float | None = None) -> list[Record]:
    """Every method on every prompt, prompt by prompt; the method order rotates from one
    prompt to the next so no method always runs first (or right after another). No new
    prompt starts after `deadline` (a time.monotonic() value)."""
    if warmup and prompts:
        ids = encode(pipe, prompts[0])
        for _, fn in methods:
            fn(pipe, ids, min(8, max_new_tokens))
    records = []
    for i, prompt in enumerate(prompts):
        if deadline is not None and time.monotonic() > deadline:
            break
        ids = encode(pipe, prompt)
        k = i % len(methods)
        for name, fn in methods[k:] + methods[:k]:
            rec = fn(pipe, ids, max_new_tokens)
            rec.method, rec.prompt_id, rec.dataset = name, prompt.id, prompt.dataset
            rec.text = pipe.tokenizer.decode(rec.output_ids, skip_special_tokens=True)
            records.append(rec)
            if on_record:
                on_record(prompt, rec)
    return records


def check_equal(records: list[Record], baseline: str = BASELINE) -> list[Mismatch]:
    """Every method's output against its reference's on the same prompt: the baseline's, or
    the method named by `extra["exact_against"]` (an engine with its own target, e.g. llama.cpp's
    GGUF, is exact against its own plain decoding)."""
    outputs = {(r.method, r.dataset, r.prompt_id): r.output_ids for r in records}
    out = []
    for r in records:
        reference = (r.extra or {}).get("exact_against", baseline)
        ref = outputs.get((reference, r.dataset, r.prompt_id))
        if r.method == reference or ref is None:
            continue
        i = first_mismatch(ref, r.output_ids)
        if i is not None:
            out.append(Mismatch(r.dataset, r.prompt_id, r.method, i, ref[i: i + 5], r.output_ids[i: i + 5]))
    return out


def summaries(records: list[Record], block_sizes: dict[str, int], baseline: str = BASELINE) -> list[Summary]:
    """One Summary per dataset and method, then "all" per method (if several datasets)."""
    datasets = list(dict.fromkeys(r.dataset for r in records))
    methods = list(dict.fromkeys(r.method for r in records))
    groups = datasets + (["all"] if len(datasets) > 1 else [])
    return [summarize(records, d, m, baseline, block_sizes.get(m, 1)) for d in groups for m in methods]


def method_block_sizes(records: list[Record]) -> dict[str, int]:
    """The block each method verifies: the largest (proposed + 1) seen, 1 without proposals."""
    out: dict[str, int] = {}
    for r in records:
        longest = max((p for p, _, _ in r.steps), default=0)
        if longest < 0:  # proposals not reported (prompt lookup): the longest commit bounds it
            longest = max(c for _, _, c in r.steps) - 1
        out[r.method] = max(out.get(r.method, 1), longest + 1)
    return out


def results_json(args, pipe, prompts, records, sums, mismatches, notes) -> dict:
    by_id = {(p.dataset, p.id): p for p in prompts}
    recs = []
    for r in records:
        d = r.to_dict()
        p = by_id[(r.dataset, r.prompt_id)]
        d["prompt"] = {"messages": p.messages, "text": p.text}
        recs.append(d)
    return {"command": "dflash " + shlex.join(sys.argv[1:]) if args is not None else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(pipe.target.kernel_info(pipe.draft_layout()) if hasattr(pipe.target, "kernel_info")
                                    else None),
            "draft": pipe.draft_path or "random (untrained)", "draft_trained": pipe.draft_trained,
            "settings": {k: v for k, v in vars(args).items() if k != "func"} if args is not None else None,
            "notes": notes, "mismatches": [vars(m) for m in mismatches],
            "summaries": [s.to_dict() for s in sums], "records": recs}


def _progress(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console)


def run_bench_command(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from dflash.text.pipeline import Pipeline

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=140)
    datasets = args.datasets if args.datasets is not None else ([] if args.prompts else list(DATASETS))
    prompts = load_prompts(datasets, args.prompts, args.limit)
    pipe = Pipeline.load(args.target, args.draft, kernels=getattr(args, "kernels", "auto"),
                         precision=getattr(args, "precision", "auto"))
    pipe = pipe.with_prompt_cache(0)  # every method computes every prompt: no method reuses another's prefill
    blocks = tuple(args.block_size or [pipe.draft.config.block_size])
    settings = Settings(blocks, args.temperature, args.seed, args.prompt_lookup, not args.no_loop_baseline,
                        tuple(args.draft_vocab), draft_thresholds=tuple(args.draft_threshold),
                        proposers=tuple(args.proposers), adaptive=args.adaptive,
                        plain_vocab=getattr(args, "plain_vocab", False),
                        compare_drafts=tuple(getattr(args, "compare_draft", ())),
                        compare_kernels=tuple(getattr(args, "compare_kernels", ())),
                        compare_precisions=tuple(getattr(args, "compare_precision", ())),
                        llamacpp=getattr(args, "llamacpp", False), llamacpp_target=getattr(args, "llamacpp_target", None),
                        llamacpp_draft_max=getattr(args, "llamacpp_draft_max", None),
                        llamacpp_threads=getattr(args, "threads", None) or 2)
    methods = build_methods(settings)
    for note in settings.notes:
        console.print(note, style="yellow", markup=False)
    console.print(f"{len(prompts)} prompts x {len(methods)} methods ({', '.join(n for n, _ in methods)}), "
                  f"max {args.max_new_tokens} new tokens, temperature {args.temperature}, "
                  f"{torch.get_num_threads()} threads, draft: {pipe.draft_path or 'random (untrained)'}")
    with _progress(console) as bar:
        task = bar.add_task("warm-up", total=len(prompts) * len(methods))

        def on_record(prompt, rec):
            bar.update(task, advance=1, description=escape(f"{prompt.id} {rec.method}"))
            if not console.is_terminal:  # a log file gets one line per record instead of the bar
                console.print(_record_line(rec, bar.tasks[0]), markup=False, highlight=False)

        deadline = time.monotonic() + args.time_budget if args.time_budget else None
        records = run_bench(pipe, prompts, methods, args.max_new_tokens, on_record, deadline=deadline)
    done = len(records) // len(methods)
    if done < len(prompts):
        settings.notes.append(f"time budget reached: {done} of {len(prompts)} prompts done")
        console.print(settings.notes[-1], style="yellow", markup=False)
    mismatches = check_equal(records) if args.temperature == 0 else []
    sums = summaries(records, method_block_sizes(records))
    console.print(_title(args, pipe))
    from dflash.bench.report import rich_table

    console.print(rich_table(sums, "dflash bench"))
    _write_outputs(args, pipe, prompts, records, sums, mismatches, settings.notes, console)
    return _report_mismatches(mismatches, console)


def _record_line(rec: Record, task) -> str:
    tau = f" tau {sum(rec.acceptance_lengths) / len(rec.acceptance_lengths):.2f}" if rec.steps else ""
    eta = f", ETA {task.time_remaining:.0f} s" if task.time_remaining else ""
    name = rec.prompt_id if rec.prompt_id.startswith(f"{rec.dataset}/") else f"{rec.dataset}/{rec.prompt_id}"
    return (f"[{task.completed}/{task.total}] {name} {rec.method}: {rec.num_output_tokens} tokens "
            f"in {rec.total_time:.1f} s ({rec.tokens_per_s:.1f} tok/s){tau}{eta}")


def _title(args, pipe) -> str:
    draft = pipe.draft_path or "[red]UNTRAINED random draft[/red]"
    return (f"speedup = median tok/s over the target alone (HF generate, greedy) on the same prompts; vs loop-b1 = "
            f"the same over our own loop at block 1 (what speculation adds); draft: {draft}; "
            f"target precision: {getattr(pipe.target, 'precision', 'fp32')}")


def _write_outputs(args, pipe, prompts, records, sums, mismatches, notes, console) -> None:
    from dflash.bench.report import (
        markdown_block_choice,
        markdown_machine,
        markdown_positions,
        markdown_sources,
        markdown_table,
        write_plots,
    )

    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results_json(args, pipe, prompts, records, sums, mismatches, notes), indent=1) + "\n")
        console.print(f"wrote {path}")
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (markdown_machine(machine_info(pipe.target.kernel_info(pipe.draft_layout()))) + "\n" + markdown_table(sums)
                + "\nWhat each pass verified, and where the accepted proposals came from:\n\n" + markdown_sources(sums)
                + "\nPer-position acceptance:\n\n" + markdown_positions(sums))
        if args.profile_json:
            text += "\n" + markdown_block_choice(sums, json.loads(Path(args.profile_json).read_text()))
        path.write_text(text)
        console.print(f"wrote {path}")
    if args.plots:
        for p in write_plots(sums, BASELINE, Path(args.plots)):
            console.print(f"wrote {p}")


def _report_mismatches(mismatches: list[Mismatch], console) -> int:
    if not mismatches:
        return 0
    console.print(f"[bold red]MISMATCH: {len(mismatches)} greedy output(s) differ from the target alone's[/bold red]")
    for m in mismatches:
        console.print(f"  {m.dataset}/{m.prompt_id} {m.method}: first difference at new token {m.position}: "
                      f"expected {m.expected}, got {m.got}", style="red", markup=False)
    return 1
