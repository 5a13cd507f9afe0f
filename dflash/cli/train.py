"""`dflash train data` and `dflash train fit`: flags are generated from the config dataclasses,
and `--config FILE` reads a saved config (flags given on the command line win)."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import MISSING, fields


def _add_dataclass_args(p: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        t = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default {default})")
        elif typing.get_origin(t) in (list, dict) or t in (list, dict):
            p.add_argument(flag, type=json.loads, default=None, help=f"JSON (default {json.dumps(default)})")
        else:
            base = [a for a in typing.get_args(t) if a is not type(None)] or [t]
            conv = base[0] if base[0] in (int, float, str) else str
            p.add_argument(flag, type=conv, default=None, help=f"(default {default})")


def _build(cls, args):
    values = {}
    if getattr(args, "config", None):
        with open(args.config) as fh:
            values.update(json.load(fh))
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def add_train(sub) -> None:
    from dflash.train.config import DataConfig, FitConfig

    p = sub.add_parser("train", help="build training data and train DFlash drafts")
    tsub = p.add_subparsers(dest="train_command", required=True)
    d = tsub.add_parser("data", help="regenerate responses with the target and cache its features (resumable)")
    d.add_argument("--config", help="a data_config.json to start from")
    _add_dataclass_args(d, DataConfig)
    d.set_defaults(func=lambda a: _run_data(_build(DataConfig, a)))
    f = tsub.add_parser("fit", help="train a draft on cached data (resumable with --resume)")
    f.add_argument("--config", help="a train_config.json to start from")
    _add_dataclass_args(f, FitConfig)
    f.set_defaults(func=lambda a: _run_fit(_build(FitConfig, a)))
    pl = tsub.add_parser("plot", help="learning curve PNG of one or more runs")
    pl.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    pl.add_argument("--out", required=True, help="PNG path")
    pl.add_argument("--labels", nargs="*", help="legend names, one per run")
    pl.add_argument("--chain", action="store_true",
                    help="the runs are warm-started stages of one lineage: draw them end to end")
    pl.set_defaults(func=_run_plot)
    sh = tsub.add_parser("ship", help="copy a run's best draft into a folder with MANIFEST.json")
    sh.add_argument("run")
    sh.add_argument("--dest", default="dflash/drafts/smollm2-135m-instruct")
    sh.add_argument("--which", default="best", help="best, final, or a subfolder of the run")
    sh.add_argument("--extra", type=json.loads, default=None, help="JSON merged into the manifest (e.g. measured tau)")
    sh.set_defaults(func=_run_ship)


def _run_data(cfg) -> int:
    from dflash.train.data import run_data

    run_data(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    return 0


def _run_fit(cfg) -> int:
    from dflash.train.fit import run_fit

    run_fit(cfg)
    return 0


def _run_plot(args) -> int:
    from dflash.train.report import plot_runs

    print(plot_runs(args.runs, args.out, args.labels, chain=args.chain))
    return 0


def _run_ship(args) -> int:
    from dflash.train.report import ship

    print(ship(args.run, args.dest, args.extra, args.which))
    return 0
