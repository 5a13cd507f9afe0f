"""The `dflash` command: the registry of subcommands (each module adds its parsers and imports its
heavy dependencies only when it runs), the shared model and thread flags, and the one error handler."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, function adding its subparsers): each adds parsers with set_defaults(func=...)
SUBCOMMANDS = (
    ("dflash.cli.generate", "add_generate"),
    ("dflash.cli.train", "add_train"),
    ("dflash.cli.serve", "add_serve"),
    ("dflash.cli.bench", "add_bench"),
    ("dflash.cli.export", "add_export"),
)


def add_model_args(p) -> None:
    p.add_argument("--target", default=None, help="HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--draft", default=None, help='draft checkpoint folder (default: the shipped one; "random" for an untrained draft)')
    add_kernels(p)


KERNEL_MODES = ("auto", "precise", "torch")  # engine/kernels.MODES (not imported: the CLI parses without torch)
PRECISIONS = ("auto", "fp32", "bf16", "int8", "int4")  # engine/precision.PRECISIONS


def add_kernels(p) -> None:
    p.add_argument("--kernels", choices=KERNEL_MODES, default="auto",
                   help="auto: time the matrix-product kernels of the target's and the draft's linears at load "
                        "(cached per machine) and run the fastest, the draft's in bf16 where that is faster; "
                        "precise: the same at the weights' own precision; torch: the models' own modules "
                        "(default: auto; the output is the target's in every setting)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="the numbers the target computes: auto, the weights as they ship (the default target's "
                        "GGUF: its own 4-bit blocks); fp32, HF's numbers; bf16, int8, int4 convert at load "
                        "(output equals plain decoding at that precision; docs/PERFORMANCE.md, Precision)")


def add_spec_args(p) -> None:
    """How the loop speculates: the flags of `text.pipeline.SpecSettings`, with its defaults."""
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the draft's)")
    p.add_argument("--draft-threshold", type=float, default=0.0, metavar="P",
                   help="verify only the leading proposals the draft gives probability >= P (default 0: all)")
    p.add_argument("--proposer", choices=("draft", "tree", "suffix", "hybrid"), default=None,
                   help="what each step verifies: the draft's chain, a tree over its top-k, n-gram matches of the "
                        "text, or both in one tree (trees sized by this machine's cost model; default: hybrid, "
                        "or draft with --draft-threshold)")
    p.add_argument("--policy", choices=("fixed", "adaptive"), default=None,
                   help="how much of the draft's chain (--proposer draft) each step verifies: fixed, the whole "
                        "block (or what --draft-threshold keeps); adaptive, a length chosen per step by this "
                        "machine's cost model, plain steps included (default: adaptive, fixed with a threshold)")


def spec_from_args(args):
    from dflash.text.pipeline import SpecSettings

    return SpecSettings(args.block_size, args.draft_threshold, args.proposer, args.policy)


def mebibytes(text: str) -> float:
    """A size in MiB, >= 0 (argparse reports the error before anything loads)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of MiB >= 0, got {text!r}")
    return value


def add_prompt_cache(p) -> None:
    p.add_argument("--prompt-cache-mb", type=mebibytes, default=256.0, metavar="MB",
                   help="MiB of recent prompts' and replies' K/V kept, so a prompt that starts like an earlier "
                        "one (a chat's next turn) computes only the rest; 0: off (default 256; low-bit "
                        "targets on the native kernels)")


def add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is often fastest for small models on busy CPUs)")


def set_threads(args) -> None:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def deferred(target: str):
    """A subcommand's func that imports its code only when it runs: set the thread count, then
    call "module:function" with the parsed args."""
    module, name = target.split(":")

    def run(args) -> int:
        set_threads(args)
        return getattr(importlib.import_module(module), name)(args)

    run.__qualname__ = run.__name__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Lossless DFlash speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for module, fn in SUBCOMMANDS:
        getattr(importlib.import_module(module), fn)(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        # the library raises errors that name the problem; show them without a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
