"""`dflash export`: write a draft folder that vLLM / SGLang load as it is."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a draft folder that vLLM / SGLang load as it is")
    p.add_argument("draft", help='a draft folder, a training checkpoint or run folder, or "shipped"')
    p.add_argument("output", help="the folder to write")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None, help="tensor dtype (default: the draft's)")
    p.add_argument("--target", default=None,
                   help="the target's HF folder, to check the pair (default: SmolLM2-135M-Instruct if converted)")
    p.add_argument("--no-target-check", action="store_true", help="do not load the target's config")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from dflash.backends.vllm.export import (
        export_draft,
        find_draft_folder,
        serve_commands,
    )
    from dflash.engine.config import DFlashConfig

    draft = args.draft
    if draft == "shipped":
        from dflash.text.pipeline import SHIPPED_DRAFT

        draft = SHIPPED_DRAFT
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
