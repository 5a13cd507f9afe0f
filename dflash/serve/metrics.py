"""Prometheus metrics for `dflash serve`, on a registry of their own (one per server).

Speculative-decoding counters carry vLLM's names under the `dflash:` prefix
(`dflash:spec_decode_num_drafts_total`, ..._num_draft_tokens_total,
..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position}), so
dashboards written for vLLM need only the prefix changed."""

from __future__ import annotations

from typing import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dflash.text.session import Done

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, num_positions: int):
        """num_positions: draft tokens per block (block_size - 1); their per-position counters
        are exported from the start, at zero."""
        self.registry = r = CollectorRegistry()
        p = "dflash:"
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Verify steps that had draft tokens", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the block (0 = first draft token)",
                                        ["position"], registry=r)
        for k in range(num_positions):
            self.accepted_per_pos.labels(position=str(k))
        self.accepted_per_source = Counter(p + "spec_decode_num_accepted_tokens_per_source",
                                           "Draft tokens accepted, by the source that proposed them (draft, suffix, "
                                           "global; a token two sources proposed counts for both)", ["source"],
                                           registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_tokens_cached = Counter(p + "prompt_tokens_cached", "Prompt tokens whose K/V came from the "
                                            "prompt cache (not computed)", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(p + "request_success", "Finished requests, by finish reason", ["finished_reason"],
                               registry=r)
        self.errors = Counter(p + "request_errors", "Error responses, by code (queue_full, invalid_api_key, "
                              "context_length_exceeded, status for others)", ["code"], registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds", "Request latency, from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time a request waited for the model worker",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.speed = Histogram(p + "request_generation_tokens_per_second",
                               "Per-request generation speed (tokens / generation time)",
                               buckets=SPEED_BUCKETS, registry=r)
        self.tau = Histogram(p + "request_mean_acceptance_length",
                             "Per-request tau (tokens per verify step, the recovered or bonus token included)",
                             buckets=tuple(range(1, 18)), registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for the model worker", registry=r)
        self.batch_size = Gauge(p + "running_batch_size", "Requests in the last engine step (continuous batching)",
                                registry=r)
        self.step_tokens = Histogram(p + "batch_tokens_per_step", "Tokens committed by one engine step, all its "
                                     "requests together", buckets=STEP_BUCKETS, registry=r)

    def track_queue(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        self.waiting.set_function(waiting)
        self.running.set_function(running)

    def observe_step(self, rows: int, tokens: int) -> None:
        """One engine step of `rows` requests that committed `tokens` tokens in all."""
        self.batch_size.set(rows)
        self.step_tokens.observe(tokens)

    def observe(self, done: Done, queue_time: float, latency: float) -> None:
        """Record one finished request."""
        s = done.stats
        self.num_drafts.inc(s.num_drafts)
        self.num_draft_tokens.inc(s.num_draft_tokens)
        self.num_accepted_tokens.inc(s.num_accepted_tokens)
        for k, n in enumerate(s.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(position=str(k)).inc(n)
        for source, n in s.num_accepted_tokens_per_source.items():
            self.accepted_per_source.labels(source=source).inc(n)
        self.prompt_tokens.inc(done.prompt_tokens)
        self.prompt_tokens_cached.inc(done.cached_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        self.success.labels(finished_reason=done.finish_reason).inc()
        self.latency.observe(latency)
        self.queue_time.observe(queue_time)
        if done.completion_tokens:
            self.ttft.observe(queue_time + done.time_to_first_token)
            self.speed.observe(done.tokens_per_second)
        if s.num_drafts:
            self.tau.observe(s.mean_acceptance_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
