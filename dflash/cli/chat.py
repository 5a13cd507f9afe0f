"""`dflash chat`: a terminal chat with the model, in this process. The answer streams as it
is verified, with a live status line: tokens, tau (tokens per verify step) and tokens/s.

Commands at the prompt: /reset (forget the conversation), /exit (or Ctrl-D). Ctrl-C while
an answer streams stops that answer."""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from dflash.engine.stats import SpecStats
from dflash.text.session import Delta, Done, GenSettings, generate_text

HELP = "commands: /reset forgets the conversation, /exit leaves (or Ctrl-D); Ctrl-C stops an answer"


def status_line(tokens: int, stats: SpecStats, elapsed: float, done: bool = False) -> str:
    speed = tokens / elapsed if elapsed > 0 else 0.0
    line = f"{tokens} tokens · tau {stats.mean_acceptance_length:.2f} · {speed:.1f} tokens/s"
    return f"[{line} · {elapsed:.1f}s]" if done else f"[{line}]"


class PlainView:
    """Streams the answer as plain text; the status line comes after it."""

    def __init__(self, out: TextIO):
        self.out = out

    def begin(self) -> None:
        self.out.write("assistant> ")
        self.out.flush()

    def update(self, text: str, delta: Delta) -> None:
        self.out.write(text)
        self.out.flush()

    def end(self, answer: str, done: Done) -> None:
        self.out.write("\n" + status_line(done.completion_tokens, done.stats, done.elapsed, True) + "\n")
        self.out.flush()


class LiveView:
    """A rich Live region: the tail of the answer and a status line that updates every step;
    when the answer is done the region is replaced by the whole answer and the final status."""

    def __init__(self, console):
        self.console = console
        self.live = None

    def begin(self) -> None:
        from rich.live import Live

        self.live = Live(console=self.console, refresh_per_second=10, transient=True)
        self.live.start()
        self._answer = ""

    def update(self, text: str, delta: Delta) -> None:
        from rich.console import Group
        from rich.text import Text

        self._answer += text
        lines = Text("assistant> " + self._answer).wrap(self.console, self.console.width)
        tail = lines[-max(self.console.height - 3, 1):]
        status = Text(status_line(delta.completion_tokens, delta.stats, delta.elapsed), style="dim")
        self.live.update(Group(*tail, status))

    def end(self, answer: str, done: Done) -> None:
        self.live.stop()
        self.console.print("assistant> " + answer, markup=False, highlight=False)
        self.console.print(status_line(done.completion_tokens, done.stats, done.elapsed, True), style="dim",
                           markup=False, highlight=False)


def chat_loop(pipe, settings: GenSettings, read: Callable[[str], str] = input, view=None, out: TextIO = sys.stdout,
              system: str | None = None) -> list[dict]:
    """Read user lines until /exit or EOF; answer each one. Returns the conversation."""
    view = view or PlainView(out)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    context = pipe.target.info.max_positions
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(base)
            out.write("(conversation forgotten)\n")
            continue
        if line.startswith("/"):
            out.write(HELP + "\n")
            continue
        messages.append({"role": "user", "content": line})
        ids = _fit_context(pipe, messages, base, context)
        if ids is None:
            messages.pop()
            out.write(f"(that message does not fit the model's context of {context} tokens)\n")
            continue
        room = min(settings.max_tokens, context - ids.shape[1])
        answer = _answer(pipe, ids, GenSettings(room, settings.temperature, settings.top_p, settings.top_k,
                                                settings.seed, settings.stop), view)
        messages.append({"role": "assistant", "content": answer})
    return messages


def _fit_context(pipe, messages: list[dict], base: list[dict], context: int):
    """Encode the conversation, dropping the oldest turns while it leaves no room to answer."""
    while True:
        ids = pipe.encode_chat(messages)
        if ids.shape[1] < context - 1:
            return ids
        if len(messages) <= len(base) + 1:
            return None
        del messages[len(base):len(base) + 2]  # the oldest user turn and its answer


def _answer(pipe, ids, settings: GenSettings, view) -> str:
    parts: list[str] = []
    view.begin()
    events = generate_text(pipe, ids, settings, pipe.stop_token_ids)
    done, last = None, None
    try:
        for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
                view.update(ev.text, ev)
                last = ev
            else:
                done = ev
    except KeyboardInterrupt:  # stop this answer, keep the chat
        events.close()
    if done is None:
        n, stats, t = (last.completion_tokens, last.stats, last.elapsed) if last else (0, SpecStats(), 0.0)
        done = Done("abort", int(ids.shape[1]), n, stats, 0.0, t)
    answer = "".join(parts)
    view.end(answer, done)
    return answer


def run_chat(args) -> int:
    from dflash.cli.commands import spec_from_args
    from dflash.text.pipeline import Pipeline

    pipe = Pipeline.load(args.target, args.draft, kernels=getattr(args, "kernels", "auto"),
                         precision=getattr(args, "precision", "auto"), spec=spec_from_args(args))
    pipe = pipe.with_prompt_cache(args.prompt_cache_mb)
    settings = GenSettings(args.max_new_tokens, args.temperature, args.top_p, 0, args.seed)
    view = None
    if not args.plain and sys.stdout.isatty():
        from rich.console import Console

        view = LiveView(Console())
    note = "" if pipe.draft_trained else " (untrained random draft: expect tau ~1)"
    print(f"dflash chat{note}. {HELP}", file=sys.stderr)
    chat_loop(pipe, settings, view=view, system=args.system)
    return 0
