"""The model worker: one thread owns the pipeline and serves jobs from a bounded queue with
continuous batching: up to `max_batch` requests are decoded together, one engine step for all
of them at a time (engine/step.py); waiting requests join, first come first served, at step
boundaries, and finished or cancelled ones leave there. `max_batch=1` serves one request at a
time. Each job hands its events (Delta..., then Done or Failed) to its own sink; a job can be
cancelled at any time and the worker notices at the next step boundary."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from dflash.engine import native
from dflash.engine.request import SamplingParams
from dflash.engine.stats import SpecStats
from dflash.engine.step import prefill
from dflash.engine.step import step as engine_step
from dflash.serve.metrics import Metrics
from dflash.text.session import Done, GenSettings, TextStream, make_generator

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


def failed(e: Exception) -> Failed:
    """A generation that raised: logged here, and told to its client without its internals."""
    log.error("generation failed", exc_info=e)
    return Failed(f"the generation failed: an internal error ({type(e).__name__}), logged on the server")


@dataclass
class Active:
    """A job being decoded: its loop row and its text."""
    job: Job
    row: object  # engine.step.Row
    text: TextStream
    started: float


class Worker:
    def __init__(self, pipe, max_queue: int = 64, metrics: Metrics | None = None, max_batch: int = 1):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.pipe = pipe
        self.max_queue, self.max_batch = max_queue, max_batch
        self.metrics = metrics
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop_ids = pipe.stop_token_ids
        self._active: list[Active] = []
        self._accepting = True
        self._stop = threading.Event()
        self._timer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-model-worker", daemon=True)
        self._batch_cost = None  # the rows' shared cost model (engine/costmodel.py), built in the thread
        if metrics is not None:
            metrics.track_queue(self._queue.qsize, lambda: len(self._active))

    # -- called from the server's threads -------------------------------------------------
    def start(self) -> "Worker":
        native.release_threads()  # this thread loaded the model: its OpenMP team would slow the worker's
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
        for job in waiting + [a.job for a in list(self._active)]:
            job.cancel(reason)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (at the next step boundary); running and queued jobs end as aborted."""
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
        self._batch_cost = self.pipe.batch_cost() if self.max_batch > 1 else None
        while not self._stop.is_set() or self._active:
            self._admit()
            if self._active:
                self._step()
        while True:  # the thread is stopping: end whatever is still queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.cancel(SHUTDOWN_REASON)
            self._finish(job, Done("abort", int(job.input_ids.shape[1]), 0, SpecStats(), 0.0, 0.0), time.perf_counter())

    def _admit(self) -> None:
        """Start waiting jobs, in arrival order, while the batch has room (wait a little for one
        when nothing runs)."""
        while len(self._active) < self.max_batch and not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.1) if not self._active else self._queue.get_nowait()
            except queue.Empty:
                return
            self._start(job)

    def _start(self, job: Job) -> None:
        """The job's prefill and first token; it joins the batch unless it ended there."""
        started = time.perf_counter()
        if job.cancelled:  # the client left (or the server is ending) while it waited
            self._finish(job, Done("abort", int(job.input_ids.shape[1]), 0, SpecStats(), 0.0, 0.0), started)
            return
        s = job.settings
        text = TextStream(self.pipe, job.input_ids, s)
        try:
            row = self.pipe.open_row(job.input_ids, s.max_tokens, SamplingParams(s.temperature, s.top_p, s.top_k),
                                     make_generator(s), stop_token_ids=self._stop_ids, batch=self._batch_cost)
            active = Active(job, row, text, started)
            if row.max_new_tokens == 0:
                self._end(active)
                return
            self._deliver(active, prefill(row, job.input_ids))
        except Exception as e:
            self._emit(job, failed(e))
            return
        if text.finish is None:
            self._active.append(active)

    def _step(self) -> None:
        """One engine step for every running job; then each one's text, its end, or its abort."""
        batch = self._active
        try:
            steps = engine_step([a.row for a in batch], self._batch_cost)
        except Exception as e:  # keep serving: these requests fail, the next ones run
            event = failed(e)
            for a in batch:
                self._emit(a.job, event)
            self._active = []
            return
        if self.metrics is not None:
            self.metrics.observe_step(len(batch), sum(len(s.tokens) for s in steps))
        for a, s in zip(batch, steps):
            self._deliver(a, s)
        self._active = [a for a in batch if a.text.finish is None]

    def _deliver(self, a: Active, step) -> None:
        """A step's text to the job's client; the job's end when it ended or was cancelled."""
        self._emit(a.job, a.text.feed(step))
        if a.text.finish is None and a.job.cancelled:
            a.text.finish = "abort"
        if a.text.finish is not None:
            self._end(a)

    def _end(self, a: Active) -> None:
        a.text.finish = a.text.finish or "length"
        self.pipe.remember(a.text.tokens)  # the n-gram source may match it in later requests
        if self._batch_cost is not None:
            self.pipe.close_row(a.row)
        self._finish(a.job, replace(a.text.done(), cached_tokens=a.row.cached), a.started)

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
