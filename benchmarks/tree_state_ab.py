"""A/B of what the hybrid default learns while it runs (engine TreeState) against an older rule.

`--arm oldcarry`: the default fades the draft's carried gains by `gain_carry` (0.5) at each new
request and runs the draft on its first step in each offer bucket (`probe_first`); the old rule
carried the gains over whole, so a math question after a chat could decode plainly for a dozen
steps because the chat's draft had not paid. `--arm scaled`: every verify pass is timed and the
running ratio of timed to modelled kept (`verify_scale`); this arm charges verify passes at that
scale, as the draft pass is charged at its timed cost, where the default weighs the timed draft
pass against the cost model's verify figures (on the AMD EPYC, 2026-12-07, the scaled hybrid
drafted more and ran no faster: benchmarks/cpu/2026-12-07-amd-epyc-avx2-h22/). This runs,
interleaved prompt by prompt on one loaded pipeline and one cost model: the target alone (HF
generate), the draft's chain, the hybrid default (`hybrid-b16`) and the hybrid under the other
rule (`hybrid-b16-ARM`), then writes the bench's tables (the prompt sets rotate, so every
request follows one of another set) and what each hybrid's TreeState learned.

    .venv/bin/python benchmarks/tree_state_ab.py --arm scaled --limit 5 --max-new-tokens 256 \\
        --output out/results.json --markdown out/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch


ARMS = {"oldcarry": {"gain_carry": 1.0, "probe_first": False}, "scaled": {"scale_verify": True}}


def main(argv=None) -> int:
    from dflash.bench.machine import machine_info
    from dflash.bench.methods import BASELINE, Settings, hf_method, loop_method
    from dflash.bench.report import markdown_machine, markdown_positions, markdown_sources, markdown_table
    from dflash.bench.runner import check_equal, load_prompts, method_block_sizes, run_bench, summaries
    from dflash.engine.proposers import TreeState
    from dflash.engine.request import SamplingParams
    from dflash.text.pipeline import Pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=sorted(ARMS), default="scaled", help="the other rule to run beside the default")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "math", "mtbench", "sharegpt"])
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft", default=None, help="draft checkpoint (default: the shipped one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", metavar="results.json")
    p.add_argument("--markdown", metavar="FILE.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(draft=args.draft)
    cost = pipe.cost_model()
    old_state = TreeState(**ARMS[args.arm])
    old = pipe.with_tree_state("hybrid", old_state)
    settings = Settings((args.block_size,), prompt_lookup=0, loop_baseline=False, cost_source=lambda _: cost)
    hybrid = loop_method(args.block_size, settings, proposer_kind="hybrid")
    b = args.block_size
    methods = [(BASELINE, hf_method(BASELINE, settings)), (f"dflash-b{b}", loop_method(b, settings)),
               (f"hybrid-b{b}", hybrid),
               (f"hybrid-b{b}-{args.arm}", lambda _pipe, ids, n: hybrid(old, ids, n))]
    prompts = load_prompts(args.datasets, None, args.limit)

    def progress(prompt, rec):
        print(f"{prompt.id} {rec.method}: {rec.num_output_tokens} tokens, {rec.tokens_per_s:.1f} tok/s", flush=True)
    records = run_bench(pipe, prompts, methods, args.max_new_tokens, progress)
    new_state = pipe.tree_state("hybrid", SamplingParams())
    assert new_state is not old_state
    learned = {name: {"draft_ms": st.draft_ms, "verify_scale": st.verify_scale, "verify_timed": st.verify_timed}
               for name, st in ((f"hybrid-b{b}", new_state), (f"hybrid-b{b}-{args.arm}", old_state))}
    print(f"cost model: draft step {cost.draft_ms(b):.1f} ms, verify 1 / {b} tokens "
          f"{cost.verify_ms(1):.1f} / {cost.verify_ms(b):.1f} ms; learned: {learned}")
    mismatches = check_equal(records)
    sums = summaries(records, method_block_sizes(records))
    table = markdown_table(sums)
    print(table)
    print(f"mismatches: {len(mismatches)}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({
            "draft": pipe.draft_path, "arm": args.arm, "cost_model": cost.to_dict(), "learned": learned,
            "mismatches": len(mismatches),
            "summaries": [dataclasses.asdict(s) for s in sums],
            "records": [{"method": r.method, "dataset": r.dataset, "prompt_id": r.prompt_id, "steps": r.steps,
                         "total_time": r.total_time, "num_output_tokens": r.num_output_tokens} for r in records]},
            indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(
            markdown_machine(machine_info(pipe.target.kernel_info())) + "\n" + table
            + "\nWhat each pass verified, and where the accepted proposals came from:\n\n" + markdown_sources(sums)
            + "\nPer-position acceptance:\n\n" + markdown_positions(sums))
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
