"""How much the measured cost model moves between measurements on one machine.

The hybrid default sizes each tree and decides whether the draft pass pays from the cost
model (engine/costmodel.py), measured once per machine, target and draft and then cached. A
noisy measurement therefore steers every later request. This script measures the model
`--repeats` times for each `--reps` setting (rounds per token count, the minimum kept),
interleaved so a drift of the machine falls on every setting alike, and prints the spread of
the figures the tree proposer reads: verify(1), verify(8), verify(16), their ratios, and
the draft step at the block size.

    .venv/bin/python benchmarks/costmodel_spread.py --repeats 4 --reps 2 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def summary(models) -> dict:
    """Per figure: median, min, max and max/min over the measured models."""
    figures = {
        "verify1_ms": [m.verify_ms(1) for m in models],
        "verify8_ms": [m.verify_ms(8) for m in models],
        "verify16_ms": [m.verify_ms(16) for m in models],
        "ratio16_1": [m.verify_ms(16) / m.verify_ms(1) for m in models],
        "ratio8_1": [m.verify_ms(8) / m.verify_ms(1) for m in models],
        "draft16_ms": [m.draft_ms(16) for m in models],
        "measure_s": [m.info["measure_s"] for m in models],
    }
    return {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3),
                "spread": round(max(v) / min(v), 3)} for k, v in figures.items()}


def main(argv=None) -> int:
    from dflash.engine import machine
    from dflash.engine.costmodel import measure
    from dflash.text.pipeline import Pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4, help="measurements per setting")
    p.add_argument("--reps", type=int, nargs="+", default=[2, 5], help="rounds per token count (settings)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(quiet=True)
    models: dict[int, list] = {r: [] for r in args.reps}
    start = time.time()
    for _ in range(args.repeats):
        for r in args.reps:
            models[r].append(measure(pipe.target, pipe.draft, reps=r))
    out = {"cpu": machine.cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "load_average_end": machine.load_average(), "wall_s": round(time.time() - start, 1),
           "settings": {str(r): summary(ms) for r, ms in models.items()},
           "models": {str(r): [{"verify": m.verify, "draft": m.draft} for m in ms] for r, ms in models.items()}}
    print(f"{out['cpu']}, {out['threads']} threads, torch {out['torch']}, {args.repeats} measurements per setting")
    for r, s in out["settings"].items():
        print(f"reps {r}: " + "; ".join(f"{k} {v['median']} ({v['min']}-{v['max']}, x{v['spread']})"
                                       for k, v in s.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
