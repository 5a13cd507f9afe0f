"""The loop's profiling seam: the loop wraps each part of a step in `timer.span(part)`; the
default timer does nothing, and a profiler passes a `PartTimer` that sums seconds per part.
Nothing is patched: the profiler sees only what the loop chose to time."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager

PARTS = ("draft_forward", "draft_head", "verify_forward", "verify_head")
_NOTHING = nullcontext()


class NullTimer:
    """Times nothing (the default): one shared no-op context per span."""

    def span(self, part: str) -> ContextManager:
        return _NOTHING


class PartTimer(NullTimer):
    """Seconds per part, summed over every span of that part, on the clock it is given
    (`time.perf_counter` for wall time, `time.process_time` for this process's CPU time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def span(self, part: str):
        start = self.clock()
        try:
            yield
        finally:
            self.totals[part] += self.clock() - start

    def snapshot(self) -> dict[str, float]:
        return {part: self.totals[part] for part in PARTS}


NULL_TIMER = NullTimer()
