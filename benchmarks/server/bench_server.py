"""Serving benchmark for continuous batching: `dflash serve` at several batch sizes, beside
llama-server (and vLLM where it is installed), on the same prompts, on loopback.

Each configuration is one server process this script starts and stops; each concurrency level
sends a fixed number of streaming chat requests (greedy, fixed `max_tokens`), request i always
with prompt i of one list (a mix of the benchmark prompt sets), so every request's text can be
compared across configurations. Configurations (`--configs`):

  max1      dflash serve --max-batch 1              one request at a time, default speculation
  plain     dflash serve --max-batch N --block-size 1   batched plain decoding
  spec      dflash serve --max-batch N              batched, with speculation
  llamacpp  llama-server -np N (continuous batching) on the target's GGUF
  vllm      vLLM's OpenAI server, --max-num-seqs N, where it is installed
  tiny      the test suite's tiny random model, served in this process (a quick check)
  external  the server at --url (started by someone else)

Measured per level: aggregate output tokens/s (completion tokens of the answers over the
level's wall time), time to first token and request latency (p50, p99), refusals, tau and the
engine's batch gauges from /metrics. Exactness: every dflash configuration's text of request i
must equal `max1`'s (0 differences expected: plain and speculative decoding both reproduce
greedy decoding); llama-server's and vLLM's differences are reported as information.

Writes --out-dir/results.json (every level of every configuration, with each request's text)
and --out-dir/results.md (a table per concurrency). How to run it: README.md beside this file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DATASETS = ("humaneval", "math", "mtbench", "sharegpt")
DFLASH_CONFIGS = ("max1", "plain", "spec")
ALL_CONFIGS = DFLASH_CONFIGS + ("llamacpp", "vllm", "tiny", "external")
REFERENCE = "max1"
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]
ALONE = "Nothing else ran on the machine during the run."
NOT_ALONE = ("Not confirmed that the machine was otherwise idle (the runner confirms it with --alone); "
             "treat the figures as indicative.")


# ---- configurations ---------------------------------------------------------------------------
@dataclass
class Config:
    name: str
    label: str  # the command line, as the table shows it
    kind: str  # "dflash", "llamacpp", "vllm", "tiny", "external"
    command: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)  # more fields of every request body
    note: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags() -> str:
    """`dflash serve --help`, to see which flags this checkout's server has."""
    out = subprocess.run([sys.executable, "-m", "dflash.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out.stdout


def dflash_config(name: str, args, port: int, has_max_batch: bool, has_prompt_cache: bool = False) -> Config:
    batch = 1 if name == "max1" else args.max_batch
    serve = ["--max-batch", str(batch)] if has_max_batch else []
    if name == "plain":
        serve += ["--block-size", "1"]
    for flag in ("target", "draft", "precision"):
        if getattr(args, flag):
            serve += [f"--{flag}", getattr(args, flag)]
    serve += ["--threads", str(args.threads), "--max-queue", str(max(64, *args.concurrency))]
    if has_prompt_cache:  # prompts repeat across levels: measure decoding, as llama-server's --no-cache-prompt
        serve += ["--prompt-cache-mb", "0"]
    serve += args.serve_args.split()
    cmd = [sys.executable, "-m", "dflash.cli", "serve", "--port", str(port), "--log-level", "warning", *serve]
    note = "" if has_max_batch else "dflash serve has no --max-batch here: run without it (one request at a time)"
    return Config(name, "dflash serve " + " ".join(serve), "dflash", cmd, {"PYTHONPATH": str(ROOT)}, note=note)


def llamacpp_config(args, port: int) -> Config | str:
    """llama-server's configuration, or a one-line reason to skip it."""
    from dflash.backends.llamacpp.build import SERVER_ENV, server_path

    binary = server_path()
    if binary is None:
        return (f"llama-server not found: build it once with `make llama-server` (python -m "
                f"dflash.backends.llamacpp build) or name one with ${SERVER_ENV}; skipping llamacpp")
    gguf = args.llamacpp_gguf or _target_gguf(args.target)
    if gguf is None:
        return "no GGUF for this target: give it with --llamacpp-gguf; skipping llamacpp"
    n = args.max_batch
    flags = ["-np", str(n), "-c", str(n * args.llamacpp_ctx_per_slot), "-t", str(args.threads), "-tb",
             str(args.threads), "--no-cache-prompt", "--metrics", "--no-webui", *args.llamacpp_args.split()]
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    return Config("llamacpp", f"llama-server -m {Path(gguf).name} " + " ".join(flags), "llamacpp", cmd,
                  extra_body={"cache_prompt": False})


def _target_gguf(target: str | None) -> str | None:
    from dflash.text.assets import AssetError, source_gguf

    try:
        path = source_gguf(target)
    except AssetError:
        return None
    return str(path) if path else None


def vllm_config(args, port: int) -> Config | str:
    from dflash.backends.vllm.worker import vllm_python
    from dflash.text.assets import resolve_target

    python = vllm_python()
    if python is None:
        return "vLLM not found (docs/VLLM.md: scripts/vllm_env.sh, or $DFLASH_VLLM_PYTHON); skipping vllm"
    target = str(resolve_target(args.target))
    flags = ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", str(args.max_batch), "--max-model-len",
             "4096", "--no-enable-prefix-caching", "--seed", "0"]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
           "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return Config("vllm", f"vLLM api_server --model {Path(target).name} " + " ".join(flags), "vllm", cmd, env,
                  extra_body={"model": "target"})


def make_config(name: str, args, has_max_batch: bool, has_prompt_cache: bool = False) -> Config | str:
    port = free_port()
    if name in DFLASH_CONFIGS:
        return dflash_config(name, args, port, has_max_batch, has_prompt_cache)
    if name == "llamacpp":
        return llamacpp_config(args, port)
    if name == "vllm":
        return vllm_config(args, port)
    if name == "tiny":
        return Config("tiny", "tiny random Llama (2 layers, hidden 64), random 1-layer draft, in-process", "tiny")
    if not args.url:
        return "external needs --url; skipping it"
    return Config("external", f"the server at {args.url}", "external")


# ---- servers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def running(config: Config, log_dir: Path, url: str | None = None, start_timeout: float = 600):
    """The configuration's server, up and healthy; yields its base URL and stops it after."""
    if config.kind == "external":
        yield url
        return
    if config.kind == "tiny":
        with tiny_server() as u:
            yield u
        return
    port = config.command[config.command.index("--port") + 1]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{config.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(config.command, cwd=ROOT, env={**os.environ, **config.env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield wait_healthy(proc, f"http://127.0.0.1:{port}", config.name, log_path, start_timeout)
        finally:
            stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, name: str, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name}: the server exited at start (code {proc.returncode}); its log "
                               f"{log_path} ends:\n{tail}")
        try:
            if httpx.get(url + "/health", trust_env=False, timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name}: the server was not healthy after {timeout:.0f} s (log: {log_path})")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    proc.terminate()  # SIGTERM: dflash serve drains, llama-server exits
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def tiny_server():
    sys.path.insert(0, str(ROOT / "tests"))
    from server_support import LiveServer

    from dflash.testing import tiny_pipeline

    with LiveServer(tiny_pipeline(max_positions=4096), model_name="tiny", max_queue=256) as s:
        yield s.url


# ---- prompts and requests -----------------------------------------------------------------------
def load_prompt_list(n: int, datasets=DATASETS) -> list[list[dict]]:
    """n chat prompts: the sets round-robin (dflash bench's order), cycled if n is larger."""
    from dflash.bench.runner import load_prompts

    prompts = [p.messages for p in load_prompts(list(datasets), None, -(-n // len(datasets)))]
    if not prompts:
        raise SystemExit(f"no prompts in {', '.join(datasets)}")
    return [prompts[i % len(prompts)] for i in range(n)]


def requests_for(concurrency: int, override: int | None) -> int:
    return override if override else max(2 * concurrency, 8)


def parse_chunk(chunk: dict, state: dict) -> None:
    """Fold one streamed chunk (dflash's, llama-server's or vLLM's) into `state`: text, the
    time of the first content, usage (any chunk may carry it), timings (llama-server), error."""
    if "error" in chunk:
        err = chunk["error"]
        state["error"] = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    if chunk.get("usage"):
        state["usage"] = chunk["usage"]
    if chunk.get("timings"):
        state["timings"] = chunk["timings"]
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            state["text"] += content
            state.setdefault("first", time.perf_counter())


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      extra_body: dict) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra_body}
    start = time.perf_counter()
    state = {"text": "", "usage": None, "error": None}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return {"status": r.status_code, "latency": time.perf_counter() - start, "error": detail}
            async for line in r.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    parse_chunk(json.loads(line[5:]), state)
    except httpx.HTTPError as e:
        return {"status": 0, "latency": time.perf_counter() - start, "error": f"{type(e).__name__}: {e}"}
    usage = state["usage"] or {}
    return {"status": 200 if state["error"] is None else 500, "latency": time.perf_counter() - start,
            "ttft": state["first"] - start if "first" in state else None, "error": state["error"],
            "tokens": int(usage.get("completion_tokens", 0)), "text": state["text"], "usage": usage,
            "timings": state.get("timings")}


# ---- one level ----------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict:
    """{sample name: value} of a Prometheus text page, summed over labels (vLLM labels every
    sample with its model); histogram buckets and quantiles left out."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "le" not in s.labels and "quantile" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> dict:
    """The server's /metrics, or {} where it has none (llama-server without --metrics, ...)."""
    try:
        r = await client.get(url + "/metrics", timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def poll(client: httpx.AsyncClient, url: str, interval: float, samples: list) -> None:
    while True:
        samples.append(await scrape(client, url))
        await asyncio.sleep(interval)


async def run_level(url: str, prompts: list, n: int, concurrency: int, max_tokens: int, extra_body: dict,
                    interval: float = 0.5) -> dict:
    """n requests (request i: prompts[i % len]) with at most `concurrency` in flight, and
    /metrics before, after and every `interval` s in between."""
    # a connection per request: a kept-alive one that the server closes meanwhile fails the next request
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    timeout = httpx.Timeout(3600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client, \
            httpx.AsyncClient(trust_env=False) as metrics_client:
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i):
            async with sem:
                return await one_request(client, url, prompts[i % len(prompts)], max_tokens, extra_body)

        before, samples = await scrape(metrics_client, url), []
        poller = asyncio.create_task(poll(metrics_client, url, interval, samples))
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(n)))
        wall = time.perf_counter() - start
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        after = await scrape(metrics_client, url)
    return {"results": results, "wall": wall, "before": before, "after": after, "samples": samples}


# ---- summaries ----------------------------------------------------------------------------------
RUNNING = ("dflash:num_requests_running", "llamacpp:requests_processing", "vllm:num_requests_running")
SPEC = ("dflash:spec_decode_num_drafts_total", "dflash:spec_decode_num_accepted_tokens_total")


def percentile(xs, q: float) -> float | None:
    """The q-quantile (0..1) of xs, linear between neighbours; None for no values."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def is_engine_metric(name: str) -> bool:
    low = name.lower()
    return name in RUNNING or (low.startswith(("dflash", "llamacpp", "vllm")) and ("batch" in low or "step" in low)
                               and not low.endswith("_created"))


def engine_metrics(before: dict, after: dict, samples: list[dict]) -> dict:
    """The batch and step metrics, whatever their names: gauges averaged over the samples taken
    while requests ran, counters (`_total`) as the level's increase, histograms as the mean of
    the level's observations (increase of `_sum` over increase of `_count`)."""
    busy = [s for s in samples if any(s.get(k, 0) > 0 for k in RUNNING)] or samples
    names = sorted({k for s in (after, *samples) for k in s if is_engine_metric(k)})
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in names}
    out = {}
    for name in names:
        if name.endswith("_sum") and name[:-4] + "_count" in delta:
            count = delta[name[:-4] + "_count"]
            out[name[:-4]] = delta[name] / count if count else None
        elif name.endswith("_count") and name[:-6] + "_sum" in delta:
            continue
        elif name.endswith("_total"):
            out[name] = delta[name]
        else:
            values = [s[name] for s in busy if name in s]
            out[name] = sum(values) / len(values) if values else None
    return out


def batch_columns(metrics: dict, kind: str) -> tuple[float | None, float | None]:
    """(mean running batch, tokens per step) of engine_metrics' output. dflash: its metrics
    named *batch* and *per_step*; llama-server and vLLM: their running-request gauges."""
    def first(pred):
        return next((v for k, v in metrics.items() if v is not None and pred(k.lower())), None)

    per_step = first(lambda k: "per_step" in k)
    batch = first(lambda k: "batch" in k and "per_step" not in k and not k.endswith("_total"))
    if batch is None and kind in ("llamacpp", "vllm"):
        batch = first(lambda k: k in RUNNING)
    return batch, per_step


def rounded(x, digits: int = 3):
    return None if x is None else round(x, digits)


def summarize(level: dict, kind: str = "dflash") -> dict:
    """The numbers of one level (run_level's output); texts of the answered requests by index."""
    results, wall, before, after = level["results"], level["wall"], level["before"], level["after"]
    ok = [r for r in results if r["status"] == 200]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok if r.get("ttft") is not None]
    tokens = sum(r["tokens"] for r in ok)
    drafts, accepted = (after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC)
    metrics = engine_metrics(before, after, level["samples"])
    batch, per_step = batch_columns(metrics, kind)
    errors = sorted({str(r.get("error"))[:200] for r in results if r["status"] != 200})
    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "refused_503": sum(r["status"] == 503 for r in results), "wall_s": round(wall, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2) if wall else None,
            "requests_per_s": round(len(ok) / wall, 3) if wall else None,
            "ttft_p50_s": rounded(percentile(ttft, 0.5)), "ttft_p99_s": rounded(percentile(ttft, 0.99)),
            "latency_p50_s": rounded(percentile(lat, 0.5)), "latency_p99_s": rounded(percentile(lat, 0.99)),
            "tau": round(1 + accepted / drafts, 3) if drafts else None,
            "mean_running_batch": rounded(batch), "tokens_per_step": rounded(per_step),
            "engine_metrics": {k: rounded(v, 4) for k, v in metrics.items()}, "errors": errors[:5],
            "per_request": [{"i": i, "status": r["status"], "tokens": r.get("tokens", 0),
                             "ttft_s": rounded(r.get("ttft")), "latency_s": rounded(r["latency"])}
                            for i, r in enumerate(results)],
            "texts": {str(i): r["text"] for i, r in enumerate(results) if r["status"] == 200}}


# ---- exactness ----------------------------------------------------------------------------------
def differing(texts: dict, reference: dict) -> list[str]:
    """Indices of the requests in both whose texts differ, in order."""
    return sorted((i for i in texts if i in reference and texts[i] != reference[i]), key=int)


def reference_texts(record: dict, name: str, level: str) -> dict:
    """`max1`'s text of each request: its run at the same level first, then at the others. For
    `max1` itself, its other levels only (its consistency across concurrency)."""
    ref = record["configs"].get(REFERENCE)
    if not ref:
        return {}
    order = [level] + [c for c in ref["levels"] if c != level]
    if name == REFERENCE:
        order = order[1:]
    merged: dict = {}
    for c in order:
        for i, text in ref["levels"].get(c, {}).get("texts", {}).items():
            merged.setdefault(i, text)
    return merged


def check_exactness(record: dict) -> dict:
    """Sets each level's `compared`/`differ`/`differ_ids` against `max1`; returns the totals,
    dflash configurations apart from the other engines (information only)."""
    totals = {"dflash": {"compared": 0, "differ": 0}, "other": {}}
    for name, cfg in record["configs"].items():
        for c, lv in cfg["levels"].items():
            ref = reference_texts(record, name, c)
            diff = differing(lv["texts"], ref)
            lv.update(compared=len(set(lv["texts"]) & set(ref)), differ=len(diff), differ_ids=diff[:50])
            bucket = totals["dflash"] if cfg["kind"] in ("dflash", "tiny") else \
                totals["other"].setdefault(name, {"compared": 0, "differ": 0})
            bucket["compared"] += lv["compared"]
            bucket["differ"] += lv["differ"]
    record["exactness"] = totals
    return totals


# ---- the record ---------------------------------------------------------------------------------
def machine_info() -> dict:
    from dflash.engine.machine import cpu_model

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_at_start": load}


def cell(x, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


TABLE_HEAD = ("| configuration | ok/failed | tok/s | vs max1 | TTFT p50 (s) | TTFT p99 (s) | latency p50 (s) | "
              "latency p99 (s) | mean batch | tokens/step | tau | texts ≠ max1 |\n|---|---|---|---|---|---|---|---|"
              "---|---|---|---|")


def table_row(name: str, lv: dict, base: dict | None) -> str:
    ratio = (lv["output_tokens_per_s"] / base["output_tokens_per_s"]
             if base and base.get("output_tokens_per_s") and lv.get("output_tokens_per_s") is not None else None)
    differ = f"{lv['differ']} of {lv['compared']}" if lv.get("compared") else "—"
    cells = [f"`{name}`", f"{lv['ok']}/{lv['failed']}", cell(lv["output_tokens_per_s"], "{:.1f}"),
             cell(ratio, "{:.2f}x"), cell(lv["ttft_p50_s"]), cell(lv["ttft_p99_s"]), cell(lv["latency_p50_s"]),
             cell(lv["latency_p99_s"]), cell(lv["mean_running_batch"], "{:.2f}"), cell(lv["tokens_per_step"], "{:.2f}"),
             cell(lv["tau"], "{:.2f}"), differ]
    return "| " + " | ".join(cells) + " |"


def level_tables(record: dict) -> list[str]:
    lines = []
    levels = sorted({int(c) for cfg in record["configs"].values() for c in cfg["levels"]})
    for c in levels:
        rows = [(name, cfg["levels"][str(c)]) for name, cfg in record["configs"].items() if str(c) in cfg["levels"]]
        base = record["configs"].get(REFERENCE, {}).get("levels", {}).get(str(c))
        lines += [f"## Concurrency {c} ({rows[0][1]['requests']} requests)", "", TABLE_HEAD]
        lines += [table_row(name, lv, base) for name, lv in rows] + [""]
    return lines


def exactness_lines(record: dict) -> list[str]:
    ex = record.get("exactness") or check_exactness(record)
    d = ex["dflash"]
    lines = ["## Exactness", "",
             f"dflash configurations: **{d['differ']} of {d['compared']}** request texts differ from `{REFERENCE}`'s "
             "for the same prompt (0 expected: greedy decoding, batched or not, speculative or not)."]
    for name, o in ex["other"].items():
        lines.append(f"`{name}` (information; another numeric path and chat template): {o['differ']} of "
                     f"{o['compared']} differ from `{REFERENCE}`'s.")
    return lines + [""]


def markdown(record: dict) -> str:
    m, s = record["machine"], record["settings"]
    lines = ["# Serving benchmark: continuous batching", "",
             f"Machine: {m['cpu']}, {m['cores']} cores; {m['date']}; load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'] or [])}.",
             ALONE if s["alone"] else NOT_ALONE, "",
             f"Each level: {s['requests_per_level'] or 'max(2 x concurrency, 8)'} streaming chat requests, "
             f"max_tokens {s['max_tokens']}, temperature 0, on 127.0.0.1; request i is prompt i of "
             f"{', '.join(s['datasets'])} in turn, in every configuration. Servers on {s['threads']} threads; "
             f"N = {s['max_batch']}. tok/s: completion tokens of the level over its wall time; vs max1: over "
             f"`max1` at the same concurrency; mean batch and tokens/step: the server's /metrics, sampled while "
             "requests ran.", "", "| configuration | command |", "|---|---|"]
    lines += [f"| `{name}` | `{cfg['label']}`" + (f" ({cfg['note']})" if cfg.get("note") else "") + " |"
              for name, cfg in record["configs"].items()]
    lines += [f"| `{name}` | skipped: {why.splitlines()[0]} |" for name, why in record["skipped"].items()]
    return "\n".join(lines + [""] + level_tables(record) + exactness_lines(record))


def write_outputs(out_dir: Path, record: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    check_exactness(record)
    (out_dir / "results.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    (out_dir / "results.md").write_text(markdown(record))


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True, help="record folder: results.json, results.md, logs/")
    ap.add_argument("--configs", nargs="+", choices=ALL_CONFIGS, default=["max1", "plain", "spec", "llamacpp", "vllm"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-batch", type=int, default=None,
                    help="N: --max-batch of plain/spec, -np of llama-server, --max-num-seqs of vLLM "
                         "(default: the largest concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: max(2 x concurrency, 8)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every server")
    ap.add_argument("--target", default=None, help="dflash serve --target (and the GGUF llama-server runs)")
    ap.add_argument("--draft", default=None, help="dflash serve --draft")
    ap.add_argument("--precision", default=None, help="dflash serve --precision")
    ap.add_argument("--serve-args", default="", help='more `dflash serve` options, e.g. "--proposer draft"')
    ap.add_argument("--llamacpp-gguf", default=None, help="llama-server's model (default: the target's GGUF)")
    ap.add_argument("--llamacpp-args", default="", help='more llama-server options, e.g. "--poll 0"')
    ap.add_argument("--llamacpp-ctx-per-slot", type=int, default=1024, help="llama-server -c is N times this")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS))
    ap.add_argument("--url", default=None, help="the server of the `external` configuration")
    ap.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    ap.add_argument("--alone", action="store_true", help="the runner confirms nothing else ran on the machine")
    args = ap.parse_args(argv)
    args.configs = list(dict.fromkeys(args.configs))
    args.max_batch = args.max_batch or max(args.concurrency)
    if min(args.concurrency) < 1 or args.max_batch < 1 or args.max_tokens < 1:
        ap.error("--concurrency, --max-batch and --max-tokens must be positive")
    return args


def run_config(cfg: Config, args, prompts: list, out_dir: Path) -> dict:
    print(f"== {cfg.name}: {cfg.label}" + (f" ({cfg.note})" if cfg.note else ""), flush=True)
    levels = {}
    with running(cfg, out_dir / "logs", args.url, args.start_timeout) as url:
        asyncio.run(run_level(url, [WARMUP_MESSAGES], 4, 4, 8, cfg.extra_body))  # not measured
        for c in args.concurrency:
            n = requests_for(c, args.requests_per_level)
            lv = summarize(asyncio.run(run_level(url, prompts, n, c, args.max_tokens, cfg.extra_body,
                                                 args.metrics_interval)), cfg.kind)
            levels[str(c)] = lv
            print(f"   concurrency {c}: {lv['ok']}/{lv['requests']} ok, {lv['output_tokens_per_s']} tok/s, "
                  f"TTFT p50 {lv['ttft_p50_s']} s, latency p50 {lv['latency_p50_s']} s, batch "
                  f"{lv['mean_running_batch']}, tokens/step {lv['tokens_per_step']}", flush=True)
    return {"label": cfg.label, "kind": cfg.kind, "command": cfg.command, "note": cfg.note, "levels": levels}


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    flags = serve_flags() if set(args.configs) & set(DFLASH_CONFIGS) else ""
    has_max_batch = "--max-batch" in flags if flags else True
    if not has_max_batch:
        print("note: dflash serve has no --max-batch in this checkout: its configurations run without it")
    prompts = load_prompt_list(max(requests_for(c, args.requests_per_level) for c in args.concurrency), args.datasets)
    settings = {k: getattr(args, k) for k in ("configs", "concurrency", "max_batch", "max_tokens", "requests_per_level",
                                              "threads", "target", "draft", "precision", "serve_args", "datasets",
                                              "alone")}
    record = {"machine": machine_info(), "settings": settings, "configs": {}, "skipped": {}}
    for name in args.configs:
        cfg = make_config(name, args, has_max_batch, "--prompt-cache-mb" in flags)
        if isinstance(cfg, str):
            print(cfg, flush=True)
            record["skipped"][name] = cfg
            continue
        try:
            record["configs"][name] = run_config(cfg, args, prompts, out_dir)
        except RuntimeError as e:
            print(f"{name} skipped: {e}", flush=True)
            record["skipped"][name] = str(e)
        write_outputs(out_dir, record)  # what has run so far survives a later failure
    write_outputs(out_dir, record)
    print("\n" + (out_dir / "results.md").read_text())
    return 1 if record["exactness"]["dflash"]["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
