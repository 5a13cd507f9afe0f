"""What every request shares (`ServerState`: the pipeline, the worker, the metrics, the limits)
and how a request body becomes a job: parse it, run the cheap checks, then tokenise. All of
that is synchronous and runs in a thread of the pool (`prepare`), never on the event loop, so
one request's large input delays no one else's /health or stream."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time
from dataclasses import dataclass, field

from dflash.serve.limits import Limits
from dflash.serve.metrics import Metrics
from dflash.serve.schema import ApiError, ChatRequest, CompletionRequest, parse_body
from dflash.serve.worker import Worker
from dflash.text.session import GenSettings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DRAIN_MARGIN_S = 5.0  # after the grace, how long the drain waits for responses still being sent


@dataclass
class ServerState:
    pipe: object
    worker: Worker
    metrics: Metrics
    model_name: str
    max_model_len: int
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set once on shutdown: new API requests get 503
    in_flight: int = 0  # API requests being answered (changed on the event loop only)

    def __post_init__(self):
        self.limits = self.limits.resolved(self.max_model_len)
        # the request threads encode with their own tokenizer, so they never wait for the
        # worker's detokenizer (nor it for them); they take turns on it among themselves
        self.encoder = dataclasses.replace(self.pipe, tokenizer=copy.deepcopy(self.pipe.tokenizer))
        self.encode_lock = threading.Lock()

    def count_error(self, e: ApiError) -> None:
        self.metrics.errors.labels(code=e.code or str(e.status)).inc()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")

    # -- a request body -> (request, prompt ids, settings); called in a pool thread ---------
    def prepare_completion(self, raw: bytes):
        req = parse_body(CompletionRequest, raw)
        self._check_cheap(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            self._check_chars(req, len(prompt))
            with self.encode_lock:
                ids = self.encoder.encode_text(prompt)
        else:
            self._check_prompt_tokens(req, len(prompt))
            ids = self._token_ids(prompt)
        return req, ids, self.settings(req, ids.shape[1], min(DEFAULT_COMPLETION_TOKENS, self.limits.max_tokens_default))

    def prepare_chat(self, raw: bytes):
        req = parse_body(ChatRequest, raw)
        self._check_cheap(req)
        self._check_chars(req, req.prompt_chars())
        try:
            with self.encode_lock:
                ids = self.encoder.encode_chat([m.as_dict() for m in req.messages])
        except Exception as e:  # e.g. a chat template that refuses this order of roles
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
        return req, ids, self.settings(req, ids.shape[1], self.limits.max_tokens_default)

    def _check_cheap(self, req) -> None:
        """What can be refused before looking at the prompt: the model, and a max_tokens that
        no prompt leaves room for (the stop strings were checked by parse_body)."""
        self.check_model(req.model)
        wanted = req.token_limit
        if wanted is not None and wanted >= self.max_model_len:
            raise ApiError(400, f"max_tokens={wanted} is too large: the context holds {self.max_model_len} tokens, "
                                "prompt and completion together", "max_tokens", "context_length_exceeded")

    def _check_chars(self, req, chars: int) -> None:
        limit = self.limits.max_prompt_chars
        if chars > limit:
            raise ApiError(400, f"the prompt has {chars} characters; this server takes at most {limit} "
                                "(--max-prompt-chars)", req.PROMPT_FIELD, "context_length_exceeded")

    def _check_prompt_tokens(self, req, prompt_tokens: int) -> None:
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, but this model's context holds {limit} "
                                "tokens (prompt and completion together)", req.PROMPT_FIELD, "context_length_exceeded")

    def _token_ids(self, ids: list[int]):
        import torch

        vocab = self.pipe.target.info.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ApiError(400, f"the prompt holds token ids outside the vocabulary of {vocab}", "prompt")
        return torch.tensor([ids], dtype=torch.long, device=self.pipe.target.device)

    def settings(self, req, prompt_tokens: int, default_max: int) -> GenSettings:
        """Sampling settings, with max_tokens checked against the context left by the prompt and
        lowered to the server's limit."""
        self._check_prompt_tokens(req, prompt_tokens)
        room = self.max_model_len - prompt_tokens
        wanted = req.token_limit
        if wanted is None:
            wanted = min(default_max, room)
        elif wanted > room:
            raise ApiError(400, f"max_tokens={wanted} is too large: the context holds {self.max_model_len} tokens "
                                f"and the prompt takes {prompt_tokens}, so at most {room} new tokens fit",
                           "max_tokens", "context_length_exceeded")
        top_k = req.top_k if req.top_k and req.top_k > 0 else 0
        return GenSettings(min(wanted, self.limits.max_tokens_limit), 1.0 if req.temperature is None else req.temperature,
                           1.0 if req.top_p is None else req.top_p, top_k, req.seed, req.stop_strings(),
                           time_limit=self.limits.request_timeout)

    # -- shutdown -----------------------------------------------------------------------------
    async def drain(self, grace: float, forced=lambda: False) -> None:
        """Refuse new API requests (503) and let those in flight finish: the worker ends what is
        still running after `grace` seconds; returns once no API request is in flight (or
        DRAIN_MARGIN_S after that, should a client stop reading, or when `forced()`)."""
        self.draining = True
        self.worker.drain(grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace, 0.0) + DRAIN_MARGIN_S
        while self.in_flight and not forced() and loop.time() < deadline:
            await asyncio.sleep(0.05)
