"""The data generator's two schedules side by side on the same prompts (docs/TRAINING.md, Data).

    .venv/bin/python benchmarks/datagen.py [--list data/smollm2-j] [--first-shard 20] [--shards 3]

`batches`: each shard's prompts in batches of one response limit, each batch running until its
last row ends (the generator's old schedule); `stream`: one continuous batch across the
shards, a row that ends taking the next prompt (`generator.generate_stream`). The same prompts,
batch size, layers and top-k as the list's own run, greedy. Writes
benchmarks/cpu/datagen.json: the machine, each schedule's wall time and response tokens/s,
and how many responses differ between them (near-ties may flip with the batch's shape)."""

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch

from dflash.bench.machine import machine_info
from dflash.text.assets import load_target
from dflash.train.config import DataConfig
from dflash.train.data import (
    data_stop_ids,
    encode_prompts,
    limit_batches,
    longest_response,
    max_new_tokens,
    read_jsonl,
)
from dflash.train.generator import Request, generate_batch, generate_stream


def batches(model, enc, cfg, stop, pad):
    """Per shard, per response limit, batches of cfg.batch_size run to their longest row."""
    out = {}
    for shard in enc:
        for limit, part in limit_batches(shard, cfg):
            got = generate_batch(model, [ids for _, ids in part], cfg.layer_ids, limit, stop, pad, topk=cfg.topk)
            out.update({r["id"]: g.response_ids for (r, _), g in zip(part, got)})
    return out


def stream(model, enc, cfg, stop, pad):
    requests = [Request(ids, max_new_tokens(cfg, r["dataset"]), r["id"]) for shard in enc for r, ids in shard]
    return {req.key: g.response_ids for req, g in generate_stream(
        model, requests, cfg.layer_ids, stop, pad, batch=cfg.batch_size, longest_prompt=cfg.max_prompt_tokens,
        longest_response=longest_response(cfg), topk=cfg.topk)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", default="data/smollm2-j")
    ap.add_argument("--first-shard", type=int, default=20)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=str(Path(__file__).parent / "cpu" / "datagen.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kept = json.loads((Path(args.list) / "data_config.json").read_text())
    cfg = DataConfig(**{f.name: kept[f.name] for f in fields(DataConfig) if f.name in kept})
    model, tok = load_target(cfg.target)
    rows = read_jsonl(Path(args.list) / "prompts.jsonl")
    enc = [encode_prompts(tok, rows[i * cfg.shard_size:(i + 1) * cfg.shard_size], cfg)
           for i in range(args.first_shard, args.first_shard + args.shards)]
    stop = data_stop_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop[0]
    result = {"list": args.list, "shards": [args.first_shard, args.first_shard + args.shards - 1],
              "prompts": sum(map(len, enc)), "batch_size": cfg.batch_size, "machine": machine_info()}
    answers = {}
    for name, run in (("batches", batches), ("stream", stream)):
        t0 = time.perf_counter()
        answers[name] = run(model, enc, cfg, stop, pad)
        wall = time.perf_counter() - t0
        n = sum(map(len, answers[name].values()))
        result[name] = {"wall_s": round(wall, 1), "response_tokens": n, "tokens_per_s": round(n / wall, 1)}
        print(name, result[name], flush=True)
    result["speedup"] = round(result["stream"]["tokens_per_s"] / result["batches"]["tokens_per_s"], 3)
    result["responses_differing"] = sum(answers["batches"][k] != answers["stream"][k] for k in answers["batches"])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("prompts", "speedup", "responses_differing")}))


if __name__ == "__main__":
    main()
