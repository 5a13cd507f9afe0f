"""D4 of the serve probe (test_server_hardening.py has the rest): `dflash serve` as a real
process (a tiny random model saved to a folder) gets SIGTERM while a stream runs. While it
drains, the listener stays open: /health and the API answer 503 `shutting_down`; the stream
still finishes; then the process exits by the signal."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from server_support import MODEL, ServeProcess, save_tiny_model

CONTEXT = 4096
# seconds of generation, so the stream outlasts the probes below: plain decoding (block 1), one
# target pass a token (a tiny model's trees copy its repetitive text hundreds of tokens a second)
MAX_TOKENS = 4000


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-target"), max_positions=CONTEXT)


def _first_refusal(url: str, limit_s: float = 30) -> httpx.Response:
    """Poll /health until it stops answering 200 (the server noticed the signal)."""
    deadline = time.monotonic() + limit_s
    while True:
        r = httpx.get(url + "/health", timeout=30)
        if r.status_code != 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_sigterm_drains_with_503s_then_exits(tiny_folder):
    with ServeProcess("--target", str(tiny_folder), "--draft", "random", "--model-name", MODEL,
                      "--block-size", "1", "--shutdown-grace", "300") as s:
        body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=300) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines)  # the stream runs: now ask the server to stop
            s.terminate()
            health = _first_refusal(s.url)
            api = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            rest = list(lines)
        assert health.status_code == 503 and health.json() == {"status": "shutting_down"}
        assert api.status_code == 503 and api.json()["error"]["code"] == "shutting_down"
        assert api.headers["retry-after"] == "1"
        assert rest[-1] == "data: [DONE]"  # the stream in flight finished, in full
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "length"
        s.proc.wait(60)
        assert s.proc.returncode == -signal.SIGTERM, s.output()  # drained, then the signal's own exit
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health")
