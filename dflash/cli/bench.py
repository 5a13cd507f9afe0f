"""`dflash bench` and `dflash profile`: their parsers; the benchmark loads only when run."""

from __future__ import annotations

from dflash.cli.commands import KERNEL_MODES, PRECISIONS, add_model_args, add_threads, deferred

BENCH_DATASETS = ("humaneval", "mtbench", "math", "sharegpt")


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark DFlash against the target alone and its peers")
    p.add_argument("--datasets", nargs="+", default=None, choices=BENCH_DATASETS, metavar="NAME",
                   help=f"offline prompt sets: {', '.join(BENCH_DATASETS)} (default: all, or none with --prompts)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help='your own prompts: one {"prompt": ...} or {"messages": [...]} '
                   "per line")
    p.add_argument("--limit", type=int, default=5, help="prompts per dataset (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, nargs="+", default=None, help="DFlash block sizes (default: the draft's)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens for the peer (0: leave out)")
    p.add_argument("--draft-vocab", type=int, nargs="*", default=[], metavar="K",
                   help="what-if: also DFlash at the largest block with the draft's lm_head over ids < K only")
    p.add_argument("--draft-threshold", type=float, nargs="*", default=[], metavar="P",
                   help="also DFlash at the largest block verifying only the proposals the draft gives probability >= P")
    p.add_argument("--proposers", nargs="*", default=[], choices=["tree", "suffix", "hybrid"], metavar="KIND",
                   help="also these proposers at the largest block: tree (the draft's top-k), suffix (n-gram "
                   "matches of the text), hybrid (both in one tree); trees are sized by this machine's cost model")
    p.add_argument("--adaptive", action="store_true",
                   help="also the draft's chain at the largest block with the adaptive verify policy (cost model)")
    p.add_argument("--plain-vocab", action="store_true",
                   help="also the draft's chain at the largest block with its draft vocabulary as shipped, not "
                   "widened by the ids of the prompt and the answer (the context vocabulary, on by default)")
    p.add_argument("--compare-draft", nargs="+", default=[], metavar="DIR",
                   help="also run every method that uses the draft with these draft checkpoints (named "
                   "METHOD@DIR), interleaved prompt by prompt with the --draft ones on the same target")
    p.add_argument("--compare-kernels", nargs="+", default=[], choices=KERNEL_MODES, metavar="MODE",
                   help="also run every method that uses the draft with these --kernels settings (named "
                   "METHOD@kernels=MODE), interleaved prompt by prompt on the same model")
    p.add_argument("--compare-precision", nargs="+", default=[], choices=PRECISIONS[1:], metavar="P",
                   help="also run every loop method with the target at these precisions (named "
                   "METHOD@precision=P), interleaved prompt by prompt on the same model")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp through llama-server: plain, its n-gram proposer, our draft, both "
                   "(builds llama-server once per machine; docs/LLAMACPP.md)")
    p.add_argument("--llamacpp-target", metavar="FILE.gguf", default=None,
                   help="the target's GGUF for the llama.cpp methods (default: the default target's)")
    p.add_argument("--llamacpp-draft-max", type=int, default=None, metavar="N",
                   help="llama.cpp's --spec-draft-n-max for our draft (default: block size - 1)")
    p.add_argument("--no-loop-baseline", action="store_true", help="leave out our loop at block size 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new prompt after S seconds; the prompts done so far are reported")
    add_threads(p)
    p.add_argument("--output", metavar="results.json", help="write per-prompt records and summaries")
    p.add_argument("--markdown", metavar="FILE.md", help="write the tables as Markdown")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--profile-json", metavar="FILE", help="a `dflash profile` result: adds the predicted speedup "
                   "per block size (this run's acceptance x the cost curve) to the Markdown")
    add_model_args(p)
    p.set_defaults(func=_run_bench)
    add_profile(sub)


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="profile one speculative step and measure the block-size cost curve")
    p.add_argument("--block-size", type=int, default=16, help="block of the overhead check (default 16)")
    p.add_argument("--profile-blocks", type=int, nargs="+", default=[4, 8, 16], help="blocks of the step profile")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024], help="context lengths of the cost curve")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the overhead check")
    p.add_argument("--max-new-tokens", type=int, default=48)
    add_threads(p)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or this process's CPU time (steadier on a busy machine; use with --threads 1)")
    p.add_argument("--no-compare", action="store_true",
                   help="leave out the other --kernels setting (by default both are profiled, side by side)")
    p.add_argument("--out", default="benchmarks/profile", help="folder for profile.json, profile.md, cost_curve.png")
    add_model_args(p)
    p.set_defaults(func=_run_profile)


_run_bench = deferred("dflash.bench.runner:run_bench_command")
_run_profile = deferred("dflash.bench.profile:run_profile_command")
