"""32 concurrent streaming clients (chat and completions) against one live server: every
answer complete and equal to offline greedy decoding, none lost, all within a time bound."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from server_support import MODEL, LiveServer, metrics, offline_chat, offline_text, tiny_pipeline

CLIENTS = 32
TIME_LIMIT_S = 90


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=3)


def _requests():
    out = []
    for i in range(CLIENTS):
        n = 8 + i % 9
        if i % 2:
            out.append(("chat", [{"role": "user", "content": f"client {i}: how are you?"}], n))
        else:
            out.append(("completion", f"client {i} says the quick brown fox", n))
    return out


async def _one(c: openai.AsyncOpenAI, kind, prompt, n):
    if kind == "chat":
        stream = await c.chat.completions.create(model=MODEL, messages=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    else:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append((ch.delta.content or "") if kind == "chat" else ch.text)
            finish = ch.finish_reason or finish
    return "".join(parts), finish, usage


def test_32_concurrent_streaming_clients(pipe):
    reqs = _requests()
    expected = [offline_chat(pipe, p, n) if k == "chat" else offline_text(pipe, p, n) for k, p, n in reqs]
    with LiveServer(pipe, model_name=MODEL, max_queue=CLIENTS) as s:
        async def run_all():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=TIME_LIMIT_S)
            try:
                return await asyncio.wait_for(asyncio.gather(*(_one(c, *r) for r in reqs)), TIME_LIMIT_S)
            finally:
                await c.close()

        start = time.monotonic()
        results = asyncio.run(run_all())
        elapsed = time.monotonic() - start
        assert len(results) == CLIENTS
        for (kind, _, n), want, (text, finish, usage) in zip(reqs, expected, results):
            assert text == want
            assert finish in ("length", "stop") and usage is not None
            assert usage.completion_tokens == n or finish == "stop"
        m = metrics(s.url)
        done = sum(v for (name, _), v in m.items() if name == "dflash:request_success_total")
        assert done == CLIENTS and m[("dflash:e2e_request_latency_seconds_count", ())] == CLIENTS
        assert elapsed < TIME_LIMIT_S
