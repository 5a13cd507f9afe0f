"""One request's generation as text: the speculative loop, detokenized and cut at stop
strings, with its acceptance statistics. Shared by the server's worker and `dflash chat`."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from dflash.engine.params import effective_temperature
from dflash.engine.sampling import SamplingParams
from dflash.engine.stats import SpecStats
from dflash.text.detok import IncrementalDecoder, StopMatcher


@dataclass(frozen=True)
class GenSettings:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    time_limit: float | None = None  # seconds of generation; then it ends with finish_reason "length"


@dataclass
class Delta:
    """New text (may be empty when tokens arrived but their text is held back)."""
    text: str
    completion_tokens: int  # generated so far
    stats: SpecStats
    elapsed: float  # seconds since the generation started


@dataclass
class Done:
    finish_reason: str  # "stop", "length" or "abort" (cancelled)
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats
    time_to_first_token: float  # seconds from the start of the generation
    elapsed: float
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prompt cache (engine/prompt_cache.py)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def usage(self) -> dict:
        """OpenAI's usage object plus this request's acceptance statistics and speed."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "spec_decode": self.stats.as_dict(),
                "tokens_per_second": round(self.tokens_per_second, 3),
                "time_to_first_token_s": round(self.time_to_first_token, 5)}


def make_generator(settings: GenSettings) -> torch.Generator | None:
    if effective_temperature(settings.temperature) == 0:  # greedy: below the floor too
        return None
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


class TextStream:
    """One request's text as its loop steps arrive: detokenized, cut at stop strings and at its
    time limit, with its statistics. `feed` takes each Step and gives the Delta to send;
    `finish` is set once the request has ended ("stop", "length"; "abort" from the caller)."""

    def __init__(self, pipe, input_ids: torch.Tensor, settings: GenSettings):
        self.settings, self.prompt_tokens = settings, int(input_ids.shape[1])
        self.decoder, self.stops, self.stats = IncrementalDecoder(pipe.tokenizer), StopMatcher(settings.stop), SpecStats()
        self.start = time.perf_counter()
        self.ttft, self.tokens, self.finish = 0.0, [], None

    def feed(self, step) -> Delta:
        if not self.tokens:
            self.ttft = time.perf_counter() - self.start
        self.tokens += step.tokens
        self.stats.add_step(step)
        text, hit = self.stops.feed(self.decoder.push(step.tokens))
        end = step.finish_reason or _out_of_time(self.settings, self.start)
        if end and not hit:  # the end: let out what was held back
            tail, hit = self.stops.feed(self.decoder.flush())
            text += tail if hit else tail + self.stops.flush()
        if hit or end:
            self.finish = "stop" if hit else end
        return Delta(text, len(self.tokens), self.stats, time.perf_counter() - self.start)

    def done(self) -> Done:
        return Done(self.finish or "length", self.prompt_tokens, len(self.tokens), self.stats, self.ttft,
                    time.perf_counter() - self.start)


def generate_text(pipe, input_ids: torch.Tensor, settings: GenSettings, stop_token_ids,
                  cancelled: Callable[[], bool] = lambda: False) -> Iterator[Delta | Done]:
    """Run the speculative loop (`pipe.stream`, with the pipeline's SpecSettings); yield a
    Delta per step and one Done at the end. `cancelled` is checked between steps: when it turns
    true the generation ends with "abort". Past `settings.time_limit` seconds it ends with
    "length", as at max_tokens."""
    params = SamplingParams(settings.temperature, settings.top_p, settings.top_k)
    text = TextStream(pipe, input_ids, settings)
    steps = pipe.stream(input_ids, settings.max_tokens, params, make_generator(settings), stop_token_ids=stop_token_ids)
    try:
        for step in steps:
            yield text.feed(step)
            if text.finish is not None:
                break
            if cancelled():
                text.finish = "abort"
                break
    finally:
        steps.close()
    pipe.remember(text.tokens)  # the n-gram source may match it in later requests (when settings share one)
    yield text.done()


def _out_of_time(settings: GenSettings, start: float) -> str | None:
    if settings.time_limit is not None and time.perf_counter() - start >= settings.time_limit:
        return "length"
    return None
