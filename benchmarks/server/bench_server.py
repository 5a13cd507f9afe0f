"""Load benchmark for `dflash serve`: N streaming requests at a fixed concurrency, on loopback.

Reports requests/s, output tokens/s, latency and time-to-first-token percentiles, refusals
(503 when the queue is full) and the server's tau from /metrics. Targets:

  --model tiny      the test suite's tiny random Llama, served in this process
  --model smollm2   `dflash serve` (SmolLM2-135M-Instruct + its draft) as a subprocess
  --url URL         any running server (OpenAI-compatible, with dflash's /metrics)

Example:  python benchmarks/server/bench_server.py --model tiny --requests 128 --concurrency 1 8 32
Results are appended to --out (JSON lines) and printed as a markdown table."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Explain what a hash table is.", "Write a haiku about the sea.", "What is 17 times 23?",
           "List three uses of Python.", "Why is the sky blue?", "Describe a cat in one sentence.",
           "Give me a tip for learning to cook.", "What does a CPU do?"]


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, key: str | None):
    body = {"messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (#{i})"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    ttft, usage, error = None, None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "latency": time.perf_counter() - start}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("usage"):
                usage = chunk["usage"]
            elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
    return {"status": 200 if error is None else 500, "latency": time.perf_counter() - start, "ttft": ttft,
            "tokens": usage["completion_tokens"] if usage else 0, "error": error}


async def run_load(url: str, n: int, concurrency: int, max_tokens: int, key: str | None):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        async def bounded(i):
            async with sem:
                return await one_request(client, url, i, max_tokens, key)
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(n)))
        return results, time.perf_counter() - start


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", trust_env=False).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def summarize(results, wall, before, after, **info) -> dict:
    ok = [r for r in results if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    tokens = sum(r["tokens"] for r in ok)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("dflash:spec_decode_num_drafts_total",
                                                          "dflash:spec_decode_num_accepted_tokens_total")}
    drafts = d["dflash:spec_decode_num_drafts_total"]
    return {**info, "requests": len(results), "ok": len(ok), "refused_503": sum(r["status"] == 503 for r in results),
            "failed": sum(r["status"] not in (200, 503) for r in results), "wall_s": round(wall, 2),
            "requests_per_s": round(len(ok) / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
            "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p99_s": round(percentile(lat, 0.99), 3),
            "ttft_p50_s": round(percentile(ttft, 0.5), 3), "ttft_p99_s": round(percentile(ttft, 0.99), 3),
            "tau": round(1 + d["dflash:spec_decode_num_accepted_tokens_total"] / drafts, 3) if drafts else None}


@contextmanager
def tiny_server(max_queue: int):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_server_support import LiveServer, tiny_pipeline

    with LiveServer(tiny_pipeline(max_positions=512), model_name="tiny", max_queue=max_queue) as s:
        yield s.url


@contextmanager
def smollm2_server(port: int, max_queue: int, threads: int, extra: list[str]):
    cmd = [sys.executable, "-m", "dflash.cli", "serve", "--port", str(port), "--max-queue", str(max_queue),
           "--threads", str(threads), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dflash serve did not come up")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()  # SIGTERM: a graceful shutdown
        proc.wait(60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--url", default=None, help="benchmark a server that is already running")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=64, help="the server's queue bound (tiny/smollm2)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the served model")
    ap.add_argument("--serve-args", default="", help='more `dflash serve` options (smollm2), e.g. "--block-size 1"')
    ap.add_argument("--out", default=str(Path(__file__).parent / "results.jsonl"))
    args = ap.parse_args(argv)

    if args.url:
        server, name = contextmanager(lambda: (yield args.url))(), "external"
    elif args.model == "tiny":
        import torch

        torch.set_num_threads(args.threads)
        server, name = tiny_server(args.max_queue), "tiny random Llama (2 layers, hidden 64), random 1-layer draft"
    else:
        extra = args.serve_args.split()
        server = smollm2_server(args.port, args.max_queue, args.threads, extra)
        name = "SmolLM2-135M-Instruct (dflash serve" + (f" {args.serve_args}" if extra else "") + ")"
    rows = []
    with server as url:
        asyncio.run(run_load(url, 2, 1, 4, args.api_key))  # warm up
        for c in args.concurrency:
            before = scrape(url)
            results, wall = asyncio.run(run_load(url, args.requests, c, args.max_tokens, args.api_key))
            row = summarize(results, wall, before, scrape(url), model=name, concurrency=c, max_queue=args.max_queue,
                            max_tokens=args.max_tokens, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    cols = ["concurrency", "requests", "ok", "refused_503", "requests_per_s", "output_tokens_per_s",
            "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "tau"]
    print(f"\n{name}, max_tokens {args.max_tokens}, queue {args.max_queue}\n")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
