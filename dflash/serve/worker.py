"""The model worker: one thread owns the pipeline and serves jobs from a bounded queue, one
at a time. Each job hands its events (Delta..., then Done or Failed) to its own sink; a job
can be cancelled at any time and the worker notices between two loop steps."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash.engine.stats import SpecStats
from dflash.serve.metrics import Metrics
from dflash.text.session import Done, GenSettings, generate_text

log = logging.getLogger("dflash.server")

SHUTDOWN_REASON = "the server is shutting down"


class Unavailable(RuntimeError):
    """The worker cannot take the job now (queue full, or shutting down): HTTP 503."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Failed:
    """The generation raised: the message, for a 500 (or an error event mid-stream)."""
    message: str


class Job:
    def __init__(self, input_ids: torch.Tensor, settings: GenSettings, sink: Callable[[object], None]):
        self.input_ids = input_ids  # (1, T)
        self.settings = settings
        self.sink = sink  # called from the worker thread with each event
        self.arrived = time.perf_counter()
        self.abort_reason: str | None = None
        self._cancel = threading.Event()

    def cancel(self, reason: str = "the client went away") -> None:
        if not self._cancel.is_set():
            self.abort_reason = reason
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


class Worker:
    def __init__(self, pipe, max_queue: int = 64, metrics: Metrics | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.pipe = pipe
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop_ids = pipe.stop_token_ids
        self._active: Job | None = None
        self._accepting = True
        self._stop = threading.Event()
        self._timer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-model-worker", daemon=True)
        if metrics is not None:
            metrics.track_queue(self._queue.qsize, lambda: int(self._active is not None))

    # -- called from the server's threads -------------------------------------------------
    def start(self) -> "Worker":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise Unavailable at once: never blocks."""
        if not self._accepting or self._stop.is_set():
            raise Unavailable(f"{SHUTDOWN_REASON}; retry on another server", "shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Unavailable(f"the server is busy: {self.max_queue} requests are already waiting; retry later",
                              "queue_full") from None

    def drain(self, grace: float) -> None:
        """Let the queued and running jobs (and those of requests already on their way in)
        finish for `grace` seconds; then take no more and end the rest (their clients get a
        clean error saying the server is shutting down). New requests are refused before
        they get here (the server's guard)."""
        if self._timer is None:
            self._timer = threading.Timer(max(grace, 0.0), self._end_all)
            self._timer.daemon = True
            self._timer.start()

    def _end_all(self) -> None:
        self._accepting = False
        self.abort_all(SHUTDOWN_REASON)

    def abort_all(self, reason: str) -> None:
        with self._queue.mutex:
            waiting = list(self._queue.queue)
        for job in waiting + [self._active]:
            if job is not None:
                job.cancel(reason)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (after the job it is on); jobs still queued end as aborted."""
        self._accepting = False
        self.abort_all(SHUTDOWN_REASON)
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._active = job
            try:
                self._serve(job)
            finally:
                self._active = None
        while True:  # the thread is stopping: end whatever is still queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.cancel(SHUTDOWN_REASON)
            self._serve(job)

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        if job.cancelled:  # the client left (or the server is ending) while it waited
            self._finish(job, Done("abort", int(job.input_ids.shape[1]), 0, SpecStats(), 0.0, 0.0), started)
            return
        try:
            for event in generate_text(self.pipe, job.input_ids, job.settings, self._stop_ids, lambda: job.cancelled):
                if isinstance(event, Done):
                    self._finish(job, event, started)
                else:
                    self._emit(job, event)
        except Exception as e:  # keep serving: this request fails, the next one runs
            log.exception("generation failed")
            self._emit(job, Failed(f"the generation failed: an internal error ({type(e).__name__}), "
                                   "logged on the server"))

    def _finish(self, job: Job, done: Done, started: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(done, started - job.arrived, time.perf_counter() - job.arrived)
        self._emit(job, done)

    @staticmethod
    def _emit(job: Job, event) -> None:
        try:
            job.sink(event)
        except Exception:  # the listener is gone (e.g. its event loop closed): stop the job
            job.cancel("the listener went away")
