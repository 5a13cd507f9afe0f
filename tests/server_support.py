"""Helpers for the server and chat tests: a tiny random pipeline (no downloads, no 135M
model), a live server on a loopback port run in a thread, `dflash serve` as a process on a
tiny model saved to a folder, the offline answers to compare with, /metrics parsed."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dflash.engine.request import SamplingParams
from dflash.engine.target import TargetModel
from dflash.testing import tiny_pipeline, tiny_tokenizer  # noqa: F401  (re-exported for the server tests)
from dflash.text.detok import complete_text
from dflash.text.pipeline import Pipeline, SpecSettings

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[1]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """`dflash serve`'s app on 127.0.0.1:<free port>, in a background thread."""

    def __init__(self, pipe: Pipeline, start_worker: bool = True, **options):
        from dflash.serve.server import ServerOptions, build_server

        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = build_server(pipe, ServerOptions(port=self.port, **options), start_worker=start_worker)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def worker(self):
        return self.server.worker

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def offline_answer(pipe, ids, max_tokens, temperature=0.0, seed=None, top_p=1.0, top_k=0,
                   spec=None) -> tuple[str, str]:
    """What the server should answer, computed offline through the same loop entry
    (`Pipeline.stream`, with `spec` or the pipeline's settings): (text, finish_reason)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens, finish = [], "length"
    for step in pipe.stream(ids, max_tokens, SamplingParams(temperature, top_p, top_k), gen, spec):
        tokens += step.tokens
        finish = step.finish_reason or finish
    return complete_text(pipe.tokenizer.decode(tokens, skip_special_tokens=True)), finish


def offline(pipe, ids, max_tokens, **kw) -> str:
    return offline_answer(pipe, ids, max_tokens, **kw)[0]


def offline_text(pipe, prompt, max_tokens, **kw):
    return offline(pipe, pipe.encode_text(prompt), max_tokens, **kw)


def offline_chat(pipe, messages, max_tokens, **kw):
    return offline(pipe, pipe.encode_chat(messages), max_tokens, **kw)


def metrics(url: str) -> dict:
    """Samples of /metrics, parsed by prometheus-client: {(name, labels): value}."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def save_tiny_model(folder: Path, **kw) -> Path:
    """A tiny random target (tiny_pipeline's) and its tokenizer as an HF folder, for
    `dflash serve --target FOLDER --draft random`."""
    pipe = tiny_pipeline(**kw)
    pipe.target.model.save_pretrained(folder)
    pipe.tokenizer.save_pretrained(folder)
    return folder


class ServeProcess:
    """`dflash serve ARGS` as a child process on 127.0.0.1:<free port>; entering waits (up to
    `start_timeout` s) until /health answers 200; leaving kills it if it is still running."""

    def __init__(self, *args: str, env: dict | None = None, start_timeout: float = 240):
        sock = free_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.start_timeout = args, start_timeout
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: the child never blocks on it

    def __enter__(self) -> "ServeProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "serve", "--port", str(self.port),
                                      "--threads", "1", "--log-level", "warning", *self.args], env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"dflash serve did not start: {self.output()}")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class SlowTarget(TargetModel):
    def __init__(self, model, delay: float):
        super().__init__(model)
        self.delay = delay

    def forward_hidden(self, *args, **kwargs):  # every target pass (prefill and verify) goes through it
        time.sleep(self.delay)
        return super().forward_hidden(*args, **kwargs)


# the draft's whole chain every step: at most a block of tokens per target pass, whatever the
# text (the default hybrid proposer copies a tiny model's repetitive text many tokens a pass)
CHAIN = SpecSettings(proposer="draft", policy="fixed")


def slow_pipeline(pipe: Pipeline, delay: float) -> Pipeline:
    """`pipe` on a target that takes at least `delay` seconds a forward pass, speculating by
    the draft's chain (so a long answer takes many passes)."""
    return dataclasses.replace(pipe, target=SlowTarget(pipe.target.model, delay), spec=CHAIN)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


@pytest.fixture(scope="module")
def server(pipe):
    with LiveServer(pipe, model_name=MODEL) as s:
        yield s
