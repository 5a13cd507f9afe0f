"""A bounded soak of `dflash serve`, slow: the real process on a tiny random model,
64 concurrent clients for SOAK_S seconds mixing streamed and plain, chat and completions,
mid-stream disconnects and bad inputs. Every answer is checked against its prompt's solo
(offline greedy) answer; every request is accounted for in /metrics; the server is healthy
after it and its RSS is back within 10% of where it started (after a warm-up round). Once one
request at a time, once with continuous batching (up to 16 requests a step)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from server_support import MODEL, ServeProcess, metrics, offline_answer, rss_bytes, save_tiny_model

from dflash.engine import native
from dflash.text.pipeline import Pipeline

CLIENTS = 64
SOAK_S = 60
PROMPTS = 24
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # > the 256-token context
BAD = [  # (body, extra headers, expected status)
    (b'{"prompt": "hi",', {}, 400),
    ({"prompt": "hi", "temperature": "hot"}, {}, 400),
    ({"prompt": "hi", "stop": ["x"] * 17}, {}, 400),
    ({"prompt": "hi", "max_tokens": 10 ** 12}, {}, 400),
    ({"prompt": LONG_PROMPT}, {}, 400),
    ({"prompt": "hi"}, {"content-type": "text/plain"}, 415),
    ({"prompt": "hi"}, {"origin": "http://evil.example"}, 403),
    ({"prompt": "x" * (4 * 1024 * 1024 + 1)}, {}, 413),
]


def _requests():
    """PROMPTS requests, half chat and half completions, 6 to 20 tokens each."""
    out = []
    for i in range(PROMPTS):
        n = 6 + i % 15
        if i % 2:
            out.append(("chat/completions", {"messages": [{"role": "user", "content": f"soak {i}: how are you?"}]}, n))
        else:
            out.append(("completions", {"prompt": f"soak {i}: the quick brown fox"}, n))
    return out


class Tally:
    def __init__(self):
        self.sent = self.checked = self.disconnects = self.bad = 0
        self.wrong: list[str] = []


async def _answer(http: httpx.AsyncClient, path: str, body: dict, stream: bool, disconnect: bool):
    """The text and finish reason of one request (None, None after a deliberate disconnect)."""
    if not stream:
        r = await http.post("/v1/" + path, json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]
    parts, finish = [], None
    async with http.stream("POST", "/v1/" + path, json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if disconnect:
                return None, None  # hang up mid-stream
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(parts), finish


async def _bad(http: httpx.AsyncClient, rng: random.Random) -> str | None:
    body, headers, status = rng.choice(BAD)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await http.post("/v1/completions", content=raw, headers={"content-type": "application/json", **headers})
    if r.status_code != status or "error" not in r.json():
        return f"bad input {str(body)[:40]}: {r.status_code} {r.text[:200]}"
    return None


async def _client(k: int, http: httpx.AsyncClient, reqs, expected, until: float, tally: Tally, max_requests: int):
    rng = random.Random(k)
    for _ in range(max_requests):  # bounded; stops at `until` in any case
        if time.monotonic() >= until:
            return
        tally.sent += 1
        roll = rng.random()
        if roll < 0.06:
            tally.bad += 1
            problem = await _bad(http, rng)
            if problem:
                tally.wrong.append(problem)
            continue
        i = rng.randrange(len(reqs))
        path, body, n = reqs[i]
        disconnect = roll < 0.16
        body = {**body, "model": MODEL, "max_tokens": 120 if disconnect else n,
                "temperature": rng.choice([0, 0, 1e-38])}
        try:
            text, finish = await _answer(http, path, body, stream=disconnect or rng.random() < 0.5,
                                         disconnect=disconnect)
        except (httpx.HTTPError, AssertionError) as e:
            tally.wrong.append(f"request {i}: {type(e).__name__}: {e}")
            continue
        if disconnect:
            tally.disconnects += 1
        elif (text, finish) != expected[i]:
            tally.wrong.append(f"request {i}: got {(text, finish)!r}, its solo answer is {expected[i]!r}")
        else:
            tally.checked += 1


async def _run(url: str, clients: int, reqs, expected, seconds: float, max_requests: int) -> Tally:
    tally = Tally()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(k, http, reqs, expected, until, tally, max_requests) for k in range(clients)))
    return tally


def _jobs(url: str) -> float:
    """Requests the worker finished (any reason, aborts included), from /metrics."""
    return sum(v for (name, _), v in metrics(url).items() if name == "dflash:request_success_total")


@pytest.mark.slow
@pytest.mark.parametrize("precision,serve_args", [
    ("auto", ()),  # one request at a time (the tiny fp32 target's passes cannot be shared)
    pytest.param("int4", ("--max-batch", "16"), id="batched",  # continuous batching on the native layers
                 marks=pytest.mark.skipif(not native.available(), reason="native kernels")),
])
def test_soak_64_clients(tmp_path, precision, serve_args):
    folder = save_tiny_model(tmp_path / "tiny", max_positions=256)
    pipe = Pipeline.load(str(folder), "random", quiet=True, precision=precision)
    reqs = _requests()
    expected = [offline_answer(pipe, pipe.encode_chat(body["messages"]) if "messages" in body
                               else pipe.encode_text(body["prompt"]), n) for _, body, n in reqs]
    assert len({t for t, _ in expected}) == len(expected)  # distinct: a cross-wired answer cannot pass
    with ServeProcess("--target", str(folder), "--draft", "random", "--block-size", "4", "--model-name", MODEL,
                      "--max-queue", "512", "--precision", precision, *serve_args) as s:
        warm = asyncio.run(_run(s.url, CLIENTS, reqs, expected, 3600, max_requests=1))  # one request each
        assert not warm.wrong, warm.wrong[:5]
        jobs_before, rss_before = _jobs(s.url), rss_bytes(s.pid)
        tally = asyncio.run(_run(s.url, CLIENTS, reqs, expected, SOAK_S, max_requests=10_000))
        assert not tally.wrong, tally.wrong[:5]
        m = metrics(s.url)
        assert m[("dflash:num_requests_running", ())] == 0 and m[("dflash:num_requests_waiting", ())] == 0
        assert _jobs(s.url) - jobs_before == tally.checked + tally.disconnects  # none lost
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        rss_after = rss_bytes(s.pid)
        print(f"\nsoak: {CLIENTS} clients, {SOAK_S} s: {tally.sent} requests, {tally.checked} answers checked, "
              f"{tally.disconnects} disconnects, {tally.bad} bad inputs; RSS {rss_before / 2 ** 20:.0f} MiB "
              f"before, {rss_after / 2 ** 20:.0f} MiB after")
        assert tally.checked > CLIENTS and tally.disconnects > 0 and tally.bad > 0
        assert rss_after <= 1.10 * rss_before

