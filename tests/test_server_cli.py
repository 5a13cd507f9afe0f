"""`dflash serve` as a real process on the default SmolLM2 target (slow): the API key from
the environment, a streamed answer, and SIGTERM mid-stream finishing that answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server_support import free_socket


@pytest.mark.slow
def test_dflash_serve_process_sigterm_finishes_the_stream():
    from dflash.text import assets

    if not (assets.cache_dir() / assets.DEFAULT_TARGET / "config.json").exists():
        pytest.skip("the default target is not converted on this machine")
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "DFLASH_API_KEY": "k3y"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "serve", "--port", str(port), "--threads", "1",
                             "--log-level", "warning", "--model-name", "smol"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "dflash serve did not start"
            time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=240)
        stream = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count to ten."}],
                                           max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)  # the stream is open: now ask the server to stop
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 12 or rest[-2].choices[0].finish_reason == "stop"
        assert "".join(ch.choices[0].delta.content or "" for ch in rest if ch.choices).strip()
        proc.wait(60)
        assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
