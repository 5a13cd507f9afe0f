"""llama-server on loopback, asked for completions over its HTTP API (standard library only).

    with LlamaServer(target_gguf, draft=draft_gguf, spec_types=("draft-dflash",), draft_max=15) as srv:
        c = srv.complete(prompt_ids, max_new_tokens=128)
        c.tokens, c.seconds, c.tokens_per_pass  # its tokens, wall time (prefill included), from its timings

One server is one configuration (target, draft, speculative types, threads); it serves one
request at a time (`-np 1`) on a free port of 127.0.0.1. Prompts go in as token ids, so llama.cpp
sees exactly the tokens our tokenizer and chat template made, and its tokens come back as ids
(`return_tokens`). Each request starts from an empty cache (`cache_prompt: false`), so every
timing includes its prefill."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash.backends.llamacpp.build import ensure_server


class LlamaServerError(RuntimeError):
    """llama-server did not start, died, or answered with an error."""


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # wall time of the request, prefill included
    stop_type: str  # llama.cpp's: "eos", "limit", "word", "none"
    timings: dict = field(default_factory=dict)  # llama.cpp's own: prompt_ms, predicted_n, draft_n, ...

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))

    @property
    def target_passes(self) -> int:
        """Target passes after the prefill: each commits its accepted draft tokens plus one of
        its own, and the prefill gives the first token."""
        return max(len(self.tokens) - 1 - self.accepted, 0)

    @property
    def tokens_per_pass(self) -> float | None:
        passes = self.target_passes
        return (len(self.tokens) - 1) / passes if passes else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process (see the module doc); a context manager that stops it."""

    def __init__(self, model: str | Path, *, draft: str | Path | None = None, spec_types: tuple[str, ...] = (),
                 draft_max: int | None = None, threads: int = 2, context: int = 4096, binary: str | Path | None = None,
                 start_timeout: float = 180.0):
        self.model, self.draft, self.spec_types = Path(model), draft, tuple(spec_types)
        self.draft_max, self.threads, self.context = draft_max, threads, context
        self.binary, self.start_timeout = binary, start_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log = b""

    def command(self) -> list[str]:
        binary = str(self.binary or ensure_server())
        cmd = [binary, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(self.threads),
               "-tb", str(self.threads), "-c", str(self.context), "-np", "1", "--no-webui"]
        if self.draft is not None:
            cmd += ["-md", str(self.draft)]
        if self.spec_types:
            cmd += ["--spec-type", ",".join(self.spec_types)]
        if self.draft_max is not None:
            cmd += ["--spec-draft-n-max", str(self.draft_max)]
        return cmd

    def start(self) -> "LlamaServer":
        if self.proc is not None:
            return self
        self.port = _free_port()
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log = self.proc.stdout.read() if self.proc.stdout else b""
                self.proc = None
                raise LlamaServerError(f"llama-server exited at start ({' '.join(self.command())}):\n"
                                       + self.log.decode(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise LlamaServerError(f"llama-server did not become healthy in {self.start_timeout:.0f} s")

    def complete(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, timeout: float = 1800.0) -> Completion:
        """One completion of `prompt_ids` (greedy at temperature 0)."""
        self.start()
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": temperature,
                "seed": seed, "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaServerError(f"llama-server answered {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            raise LlamaServerError(f"llama-server did not answer: {e}") from None
        seconds = time.perf_counter() - start
        return Completion([int(t) for t in out.get("tokens", [])], seconds, str(out.get("stop_type", "")),
                          dict(out.get("timings", {})))

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
