"""Multi-turn chat benchmark: what prompt caching saves a chat's next turn.

MT-Bench's questions come in pairs: a question, then a follow-up about the answer. Each
conversation sends turn 1, then turn 2 with the whole conversation (question, the server's own
answer, the follow-up), as a chat client does, one request at a time, greedy, on loopback.
Configurations (each a server process this script starts and stops):

  cached     dflash serve --max-batch 1                      the prompt cache on (its default)
  uncached   dflash serve --max-batch 1 --prompt-cache-mb 0  every prompt computed in full
  llamacpp   llama-server -np 1 (its prompt cache on: cache_prompt)  on the target's GGUF

Measured per turn: time to first token and latency (medians), the prompt tokens taken from the
cache (dflash: usage.prompt_tokens_details.cached_tokens; llama-server: its timings' cache_n).
Exactness: `cached`'s texts must equal `uncached`'s, both turns of every conversation.

    .venv/bin/python benchmarks/server/bench_turns.py --alone --out-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import (ALONE, NOT_ALONE, WARMUP_MESSAGES, Config, _target_gguf, free_port,  # noqa: E402
                          machine_info, one_request, percentile, running)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("cached", "uncached", "llamacpp")


def conversations(n: int) -> list[tuple[str, str]]:
    """The first n MT-Bench question pairs (question, follow-up)."""
    from dflash.text.prompts import mtbench

    return [tuple(p.meta["turns"][:2]) for p in mtbench(n)]


def make_config(name: str, args) -> Config | str:
    port = free_port()
    if name in ("cached", "uncached"):
        serve = ["--max-batch", "1", "--threads", str(args.threads)]
        serve += ["--prompt-cache-mb", "0"] if name == "uncached" else []
        cmd = [sys.executable, "-m", "dflash.cli", "serve", "--port", str(port), "--log-level", "warning", *serve]
        return Config(name, "dflash serve " + " ".join(serve), "dflash", cmd, {"PYTHONPATH": str(ROOT)})
    from dflash.backends.llamacpp.build import server_path

    binary, gguf = server_path(), _target_gguf(None)
    if binary is None or gguf is None:
        return "llama-server or the target's GGUF not found (make llama-server); skipping llamacpp"
    flags = ["-np", "1", "-c", "4096", "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"]
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    return Config("llamacpp", f"llama-server -m {Path(gguf).name} " + " ".join(flags), "llamacpp", cmd,
                  extra_body={"cache_prompt": True})


def cached_tokens(reply: dict) -> int | None:
    usage, timings = reply.get("usage") or {}, reply.get("timings") or {}
    if "prompt_tokens_details" in usage:
        return int((usage["prompt_tokens_details"] or {}).get("cached_tokens") or 0)
    return int(timings["cache_n"]) if "cache_n" in timings else None


async def converse(url: str, pairs, max_tokens: int, extra: dict) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await one_request(client, url, WARMUP_MESSAGES, 8, extra)  # not measured
        for question, follow_up in pairs:
            messages = [{"role": "user", "content": question}]
            first = await one_request(client, url, messages, max_tokens, extra)
            messages += [{"role": "assistant", "content": first.get("text", "")},
                         {"role": "user", "content": follow_up}]
            second = await one_request(client, url, messages, max_tokens, extra)
            out.append({"turns": [{k: r.get(k) for k in ("status", "ttft", "latency", "tokens", "text", "error")}
                                  | {"prompt_tokens": (r.get("usage") or {}).get("prompt_tokens"),
                                     "cached_tokens": cached_tokens(r)} for r in (first, second)]})
    return out


def median(xs):
    return percentile([x for x in xs if x is not None], 0.5)


def summary(convs: list[dict]) -> dict:
    s = {}
    for t in (0, 1):
        turns = [c["turns"][t] for c in convs]
        s[f"turn{t + 1}"] = {"ttft_p50_s": median([x["ttft"] for x in turns]),
                             "latency_p50_s": median([x["latency"] for x in turns]),
                             "prompt_tokens_p50": median([x["prompt_tokens"] for x in turns]),
                             "cached_tokens_p50": median([x["cached_tokens"] for x in turns]),
                             "failed": sum(x["status"] != 200 for x in turns)}
    return s


def markdown(record: dict) -> str:
    m, s = record["machine"], record["settings"]
    lines = ["# Multi-turn chat: the prompt cache", "",
             f"Machine: {m['cpu']}, {m['cores']} cores; {m['date']}.", ALONE if s["alone"] else NOT_ALONE, "",
             f"{s['conversations']} MT-Bench question pairs, each as two requests (turn 2 carries turn 1 and "
             f"the server's own answer), max_tokens {s['max_tokens']}, greedy, one request at a time, "
             f"{s['threads']} threads. Medians.", "",
             "| configuration | command | failed | turn 1 TTFT (s) | turn 2 prompt tokens | turn 2 cached "
             "| turn 2 TTFT (s) | turn 2 latency (s) |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.3f}": "—" if x is None else f.format(x)  # noqa: E731
    for name, cfg in record["configs"].items():
        a, b = cfg["summary"]["turn1"], cfg["summary"]["turn2"]
        lines.append(f"| `{name}` | `{cfg['label']}` | {a['failed']} + {b['failed']} | {fmt(a['ttft_p50_s'])} "
                     f"| {fmt(b['prompt_tokens_p50'], '{:.0f}')}"
                     f" | {fmt(b['cached_tokens_p50'], '{:.0f}')} | {fmt(b['ttft_p50_s'])}"
                     f" | {fmt(b['latency_p50_s'])} |")
    lines += [f"| `{name}` | skipped: {why} | | | | | | |" for name, why in record["skipped"].items()]
    ex = record.get("exactness")
    if ex:
        lines += ["", f"Exactness: **{ex['differ']} of {ex['compared']}** texts of `cached` differ from `uncached`'s "
                      "(0 expected: the cache changes no token)."]
    return "\n".join(lines) + "\n"


def exactness(record: dict) -> dict | None:
    a, b = (record["configs"].get(n) for n in ("cached", "uncached"))
    if not (a and b):
        return None
    pairs = [(x["text"], y["text"]) for ca, cb in zip(a["conversations"], b["conversations"])
             for x, y in zip(ca["turns"], cb["turns"])]
    return {"compared": len(pairs), "differ": sum(x != y for x, y in pairs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--alone", action="store_true", help="the runner confirms nothing else ran on the machine")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    pairs = conversations(args.conversations)
    record = {"machine": machine_info(), "settings": {k: getattr(args, k) for k in
                                                      ("configs", "conversations", "max_tokens", "threads", "alone")},
              "configs": {}, "skipped": {}}
    for name in args.configs:
        cfg = make_config(name, args)
        if isinstance(cfg, str):
            record["skipped"][name] = cfg
            continue
        print(f"== {name}: {cfg.label}", flush=True)
        with running(cfg, out / "logs", None, args.start_timeout) as url:
            convs = asyncio.run(converse(url, pairs, args.max_tokens, cfg.extra_body))
        record["configs"][name] = {"label": cfg.label, "summary": summary(convs), "conversations": convs}
        print(json.dumps(record["configs"][name]["summary"]), flush=True)
    record["exactness"] = exactness(record)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    (out / "results.md").write_text(markdown(record))
    print("\n" + markdown(record))
    return 1 if record["exactness"] and record["exactness"]["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
