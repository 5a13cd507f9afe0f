"""`dflash chat`: the loop with scripted input, the plain and the live (rich) views, and
(slow) the real command through stdin."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from server_support import offline_chat, tiny_pipeline

from dflash.cli.chat import LiveView, chat_loop, status_line
from dflash.cli.commands import build_parser
from dflash.engine.stats import SpecStats
from dflash.text.session import GenSettings

STATUS = re.compile(r"\[(\d+) tokens · tau (\d+\.\d\d) · (\d+\.\d) tokens/s · \d+\.\ds\]")


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=5)


def scripted(lines):
    it = iter(lines)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


def test_chat_answers_each_turn_with_history(pipe):
    out = io.StringIO()
    convo = chat_loop(pipe, GenSettings(12), scripted(["hello there", "", "/help", "and again?"]), out=out,
                      system="be brief")
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert convo[2] == {"role": "assistant", "content": offline_chat(pipe, first, 12)}
    second = convo[:3] + [{"role": "user", "content": "and again?"}]
    assert convo[4] == {"role": "assistant", "content": offline_chat(pipe, second, 12)}
    text = out.getvalue()
    assert "commands:" in text
    stats = STATUS.findall(text)
    assert len(stats) == 2 and all(int(n) == 12 and float(tau) >= 1 and float(tps) > 0 for n, tau, tps in stats)


def test_reset_and_exit(pipe):
    out = io.StringIO()
    convo = chat_loop(pipe, GenSettings(4), scripted(["one", "/reset", "two", "/exit", "never read"]), out=out)
    assert [m["content"] for m in convo if m["role"] == "user"] == ["two"]
    assert "forgotten" in out.getvalue()


def test_status_shows_tau_and_speed():
    s = SpecStats()
    s.add(3, 3)
    s.add(3, 1)
    assert status_line(8, s, 2.0) == "[8 tokens · tau 3.00 · 4.0 tokens/s]"


def test_live_view_updates_while_streaming(pipe):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=60, height=12, color_system=None)
    updates = []

    class Recording(LiveView):
        def update(self, text, delta):
            super().update(text, delta)
            updates.append(status_line(delta.completion_tokens, delta.stats, delta.elapsed))

    convo = chat_loop(pipe, GenSettings(20), scripted(["hi"]), view=Recording(console), out=io.StringIO())
    assert len(updates) > 2 and updates[-1].startswith("[20 tokens · tau ")  # live: one status per step
    shown = buf.getvalue()
    assert STATUS.search(shown) and convo[-1]["content"].strip().split("\n")[0][:10] in shown


def test_chat_subcommand_is_registered():
    args = build_parser().parse_args(["chat", "--max-new-tokens", "5", "--plain", "--threads", "1"])
    assert args.func.__name__ == "run_chat" and args.max_new_tokens == 5


@pytest.mark.slow
def test_dflash_chat_command_through_stdin():
    """The real command on the default SmolLM2 target: two turns fed through stdin."""
    from dflash.text import assets

    assets.default_target_dir(progress=False)  # converts the GGUF once if this machine has not yet
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", "chat", "--max-new-tokens", "8", "--plain",
                           "--threads", "1"], input="What is 2+2?\n/exit\n", capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "assistant> " in proc.stdout and STATUS.search(proc.stdout)
