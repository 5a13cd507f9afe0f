"""Measure a draft's tau (greedy, block 16) with dflash_generate on evaluation prompts.

    .venv/bin/python scripts/train_measure_tau.py DRAFT_DIR [--n 10] [--tokens 128] [--json out.json]

Prompts: reasoning-gym math (evaluation seeds), HumanEval, MT-Bench first turns: none of
them is in the training data. One thread, so it can run beside other jobs. The draft runs at
its weights' precision by default (`--kernels precise`), so its figures compare with every
eval tau in docs/TRAINING.md; `auto` lets its linears take bf16 kernels as the engine's default
does (on h14's 5-prompt eval that moved tau by -0.014 / -0.011 / -0.003, within the noise)."""

import argparse
import json
import time

import torch

from dflash.engine.draft import DFlashDraftModel
from dflash.engine.kernels import MODES
from dflash.engine.loop import dflash_generate
from dflash.engine.stats import SpecStats
from dflash.engine.target import TargetModel
from dflash.text import prompts as P
from dflash.text.assets import load_target
from dflash.train.data import data_stop_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("draft")
    ap.add_argument("--n", type=int, default=10, help="prompts per domain")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", choices=MODES, default="precise")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hf, tok = load_target(None)
    target = TargetModel(hf, kernels=a.kernels)
    draft = DFlashDraftModel.from_pretrained(a.draft)
    stop = data_stop_ids(tok)
    sets = {"math": P.math(limit=a.n), "code": P.humaneval(limit=a.n), "chat": P.mtbench(limit=a.n)}
    report = {"draft": a.draft, "block_size": a.block_size, "max_new_tokens": a.tokens, "prompts_per_domain": a.n}
    t0 = time.time()
    for name, prompts in sets.items():
        stats, per_prompt = SpecStats(), []
        for p in prompts:
            ids = tok(p.render(tok), add_special_tokens=False, return_tensors="pt").input_ids
            r = dflash_generate(draft, target, ids, a.tokens, stop, 0.0, block_size=a.block_size, return_stats=True)
            stats = stats.merge(r.stats)
            per_prompt.append(round(r.tau, 3))
        report[f"tau_{name}"] = round(stats.mean_acceptance_length, 3)  # the one tau (engine/stats.py)
        report[f"tau_{name}_per_prompt"] = per_prompt
        print(name, report[f"tau_{name}"], per_prompt, flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("per_prompt")}))


if __name__ == "__main__":
    main()
