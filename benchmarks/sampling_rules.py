"""Measure tau of the two lossless sampling rules side by side (docs/METHOD.md §2).

    .venv/bin/python benchmarks/sampling_rules.py [--limit 6] [--temperature 1.0] [--max-new-tokens 96]

Interleaves the rules prompt by prompt on math, code and chat prompts with the shipped draft and
writes benchmarks/sampling_rules.json. The rule with the higher tau is the library's default."""

import argparse
import json
import statistics
from pathlib import Path

import torch

from dflash.engine.loop import dflash_generate
from dflash.text.pipeline import Pipeline
from dflash.text.prompts import load_dataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output", default=str(Path(__file__).with_name("sampling_rules.json")))
    args = ap.parse_args()
    pipe = Pipeline.load(None, None)
    taus = {"rejection": {}, "match": {}}
    for name in ("math", "humaneval", "mtbench"):
        for rule in taus:
            taus[rule][name] = []
        for i, prompt in enumerate(load_dataset(name, limit=args.limit)):
            ids = pipe.encode_chat(prompt.messages)
            for rule in taus:
                res = dflash_generate(pipe.draft, pipe.target, ids, args.max_new_tokens, pipe.stop_token_ids,
                                      args.temperature, block_size=args.block_size, return_stats=True, rule=rule,
                                      generator=torch.Generator().manual_seed(i))
                taus[rule][name].append(res.tau)
            print(name, i, {r: round(taus[r][name][-1], 2) for r in taus}, flush=True)
    summary = {rule: {name: round(statistics.mean(v), 3) for name, v in per.items()} for rule, per in taus.items()}
    out = {"command": "python benchmarks/sampling_rules.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
        "draft": pipe.draft_path, "temperature": args.temperature, "mean_tau": summary, "per_prompt": taus}
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
