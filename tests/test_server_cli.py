"""`dflash serve` as a real process on the default SmolLM2 target (slow): the API key from
the environment, the probe's temperature of 1e-38 answered greedily (it was a 500), a
streamed answer, and SIGTERM mid-stream finishing that answer."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
from server_support import ServeProcess


@pytest.mark.slow
def test_dflash_serve_process_sigterm_finishes_the_stream():
    from dflash.text import assets

    assets.default_target_dir(progress=False)  # converts the GGUF once if this machine has not yet
    with ServeProcess("--model-name", "smol", env={"DFLASH_API_KEY": "k3y"}) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="k3y", max_retries=0, timeout=240)
        tiny, greedy = (c.completions.create(model="smol", prompt="hi", max_tokens=4, temperature=t).choices[0].text
                        for t in (1e-38, 0))
        assert tiny == greedy
        stream = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count to ten."}],
                                           max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)  # the stream is open: now ask the server to stop
        s.terminate()
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 12 or rest[-2].choices[0].finish_reason == "stop"
        assert "".join(ch.choices[0].delta.content or "" for ch in rest if ch.choices).strip()
        s.proc.wait(60)
        assert s.proc.returncode == -signal.SIGTERM  # drained, then uvicorn re-raises the signal
