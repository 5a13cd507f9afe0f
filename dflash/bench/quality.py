"""How far each precision of the target is from fp32 (engine/precision.py): greedy agreement with
fp32 on benchmark prompts (tokens until the first difference) and perplexity on held-out text.

    python -m dflash.bench.quality [--limit 5] [--max-new-tokens 256] [--out FILE.json]

The held-out text is the eval prompts of ShareGPT and HumanEval (kept out of every draft's
training data), scored token by token with the target's own chat template rendering."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from dflash.engine.loop import dflash_generate
from dflash.engine.target import TargetModel

PRECISIONS = ("fp32", "bf16", "int8", "int4")
CHUNK = 128  # prefill chunk when scoring text


@torch.inference_mode()
def nll(target: TargetModel, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given the ones before, and the count."""
    cache, total = target.new_cache(), 0.0
    x = torch.tensor([ids])
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = x[:, start:min(start + CHUNK, len(ids) - 1)]
        logits, _ = target.forward(chunk, cache, None, logits_to_keep=chunk.shape[1])  # (1, C, V)
        nxt = x[0, start + 1:start + 1 + chunk.shape[1]]
        total -= torch.log_softmax(logits[0].double(), -1).gather(-1, nxt[:, None]).sum().item()
    return total, len(ids) - 1


def agreement(reference: list[int], tokens: list[int]) -> int:
    """Tokens until the first difference (the whole length when equal)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return min(len(reference), len(tokens))


def measure(model, tokenizer, stop, gguf, prompts: list[list[int]], texts: list[list[int]],
            max_new_tokens: int, precisions=PRECISIONS, say=print) -> list[dict]:
    """One row per precision: its source, agreement with fp32's greedy output per prompt, the
    perplexity of `texts`, and the MB its weights take."""
    outputs, rows = {}, []
    for precision in precisions:
        start = time.perf_counter()
        target = TargetModel(model, precision=precision, gguf=gguf)
        load_s = time.perf_counter() - start
        outs = [dflash_generate(None, target, torch.tensor([p]), max_new_tokens, stop, block_size=1)[0, len(p):].tolist()
                for p in prompts]
        outputs[precision] = outs
        nll_sum, count = 0.0, 0
        for t in texts:
            a, b = nll(target, t)
            nll_sum, count = nll_sum + a, count + b
        info = target.precision_info()
        ref = outputs.get("fp32", outs)
        agree = [agreement(r, o) for r, o in zip(ref, outs)]
        differ = sorted(a for a, r, o in zip(agree, ref, outs) if r != o)
        rows.append({"precision": precision, "source": info.get("source"), "weights_mb": info.get("mb"),
                     "agree_tokens": agree, "identical": sum(r == o for r, o in zip(ref, outs)),
                     "prompts": len(outs), "median_agree": differ[len(differ) // 2] if differ else None,
                     "perplexity": round(math.exp(nll_sum / max(count, 1)), 4), "scored_tokens": count,
                     "load_s": round(load_s, 1)})
        say(f"{precision}: perplexity {rows[-1]['perplexity']}, identical to fp32 {rows[-1]['identical']}/{len(outs)}, "
            f"tokens until the first difference {agree}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| precision | weights from | MB | perplexity | answers identical to fp32 | where the others first differ (median token) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['source']} | {r['weights_mb'] if r['weights_mb'] is not None else '-'} "
                     f"| {r['perplexity']:.3f} | {r['identical']}/{r['prompts']} | "
                     f"{r['median_agree'] if r['median_agree'] is not None else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dflash.text.assets import load_target, source_gguf
    from dflash.text.pipeline import stop_token_ids
    from dflash.text.prompts import chat_ids, load_dataset

    p = argparse.ArgumentParser(prog="python -m dflash.bench.quality", description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=5, help="prompts per set (math, humaneval, mtbench)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--texts", type=int, default=20, help="held-out texts scored for perplexity")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_target(None)
    prompts = [chat_ids(tok, pr.messages) for name in ("math", "humaneval", "mtbench")
               for pr in load_dataset(name, args.limit)]
    held = load_dataset("sharegpt", args.texts // 2) + load_dataset("humaneval", args.texts - args.texts // 2, split="eval")
    texts = [tok(pr.render(tok), add_special_tokens=False)["input_ids"] for pr in held]
    rows = measure(model, tok, stop_token_ids(tok), source_gguf(None), prompts, texts, args.max_new_tokens,
                   say=lambda s: print(s, file=sys.stderr))
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "prompts": len(prompts), "texts": len(texts),
                       "max_new_tokens": args.max_new_tokens}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
