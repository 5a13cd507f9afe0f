"""A draft vocabulary: the K most frequent token ids of a corpus. The draft's lm_head then
scores only those rows, which cuts the draft step's largest cost (docs/METHOD.md §6); output stays
exact because the target verifies every proposal."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def frequent_ids(tokenizer, texts, size: int, always=()) -> list[int]:
    """The `size` most frequent ids of `texts` under `tokenizer`, plus `always` (e.g. stop tokens)."""
    counts: Counter = Counter()
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            counts.update(i for ids in tokenizer(batch, add_special_tokens=False).input_ids for i in ids)
            batch = []
    if batch:
        counts.update(i for ids in tokenizer(batch, add_special_tokens=False).input_ids for i in ids)
    return most_frequent(counts, size, always)


def most_frequent(counts: Counter, size: int, always=()) -> list[int]:
    """`always` plus the most frequent ids of `counts` up to `size` in all (ties: the smaller
    id first), sorted."""
    chosen = {int(i) for i in always}
    for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(int(i))
    return sorted(chosen)


def coverage(ids: list[int], token_stream) -> float:
    vocab, hit, n = set(ids), 0, 0
    for t in token_stream:
        hit += t in vocab
        n += 1
    return hit / max(n, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write a draft vocabulary into a draft checkpoint's config.json")
    ap.add_argument("draft", help="draft checkpoint folder")
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--check", help="a JSONL with response_ids (e.g. regenerated data) to report coverage on")
    args = ap.parse_args(argv)
    from dflash.text.assets import load_target
    from dflash.text.pipeline import stop_token_ids
    from dflash.text.prompts import sharegpt

    _, tok = load_target(None)
    texts = [p.content for p in sharegpt(split="train")]
    ids = frequent_ids(tok, texts, args.size, always=stop_token_ids(tok))
    cfg_path = Path(args.draft) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dflash_config"]["draft_vocab"] = ids
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    print(f"draft vocabulary of {len(ids)} ids written to {cfg_path}")
    if args.check:
        stream = (t for line in open(args.check) for t in json.loads(line)["response_ids"])
        print(f"coverage of {args.check}: {coverage(ids, stream):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
