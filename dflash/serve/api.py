"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions (plain JSON or
server-sent events), /v1/models, plus /health and /metrics. Everything a request needs
lives on `app.state.dflash` (a ServerState); the model itself is only touched by the worker."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash.serve.metrics import CONTENT_TYPE, Metrics
from dflash.serve.schema import ApiError, ChatRequest, CompletionRequest, parse_body
from dflash.serve.worker import SHUTDOWN_REASON, Failed, Job, Unavailable, Worker
from dflash.text.session import Delta, GenSettings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class ServerState:
    pipe: object
    worker: Worker
    metrics: Metrics
    model_name: str
    max_model_len: int
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer_lock(self) -> threading.Lock:
        return self.worker.tokenizer_lock

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")

    def settings(self, req, prompt_tokens: int, default_max: int | None) -> GenSettings:
        """Sampling settings, with max_tokens checked against the context left by the prompt."""
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, but this model's context holds {limit} "
                                "tokens (prompt and completion together)", req.PROMPT_FIELD, "context_length_exceeded")
        room = limit - prompt_tokens
        wanted = req.token_limit
        if wanted is None:
            wanted = room if default_max is None else min(default_max, room)
        elif wanted > room:
            raise ApiError(400, f"max_tokens={wanted} is too large: the context holds {limit} tokens and the prompt "
                                f"takes {prompt_tokens}, so at most {room} new tokens fit", "max_tokens",
                           "context_length_exceeded")
        top_k = req.top_k if req.top_k and req.top_k > 0 else 0
        return GenSettings(wanted, 1.0 if req.temperature is None else req.temperature,
                           1.0 if req.top_p is None else req.top_p, top_k, req.seed, req.stop_strings())


def _state(request: Request) -> ServerState:
    return request.app.state.dflash


async def _authorize(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else ""
    if not token or not hmac.compare_digest(token.encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", None,
                       "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.worker.close()

    app = FastAPI(title="dflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dflash = state
    _add_error_handlers(app, state)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorize)])

    @app.get("/health")
    async def health():
        ok = state.worker.alive and state.worker.accepting
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        state.check_model(model)
        return _model_card(state)

    @v1.post("/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await request.body())
        state.check_model(req.model)
        prompt = req.single_prompt()
        with state.tokenizer_lock:
            ids = state.pipe.encode_text(prompt) if isinstance(prompt, str) else _token_ids(state, prompt)
        settings = state.settings(req, ids.shape[1], DEFAULT_COMPLETION_TOKENS)
        return await _respond(request, state, ids, settings, _CompletionFormat(state.model_name), req)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatRequest, await request.body())
        state.check_model(req.model)
        try:
            with state.tokenizer_lock:
                ids = state.pipe.encode_chat([m.as_dict() for m in req.messages])
        except Exception as e:  # e.g. a chat template that refuses this order of roles
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
        settings = state.settings(req, ids.shape[1], None)
        return await _respond(request, state, ids, settings, _ChatFormat(state.model_name), req)

    app.include_router(v1)
    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dflash",
            "max_model_len": state.max_model_len}


def _token_ids(state: ServerState, ids: list[int]):
    import torch

    vocab = state.pipe.target.info.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ApiError(400, f"the prompt holds token ids outside the vocabulary of {vocab}", "prompt")
    return torch.tensor([ids], dtype=torch.long, device=state.pipe.target.device)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def error(e: ApiError):
        state.metrics.errors.labels(code=e.code or str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error(e)

    @app.exception_handler(Unavailable)
    async def unavailable(request, e: Unavailable):
        return error(ApiError(503, str(e), None, e.reason, headers={"Retry-After": "1"}))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error(ApiError(e.status_code, str(e.detail), None, "not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return error(ApiError(400, f"invalid request: {e.errors()[0].get('msg', e)}"))


# -- turning worker events into OpenAI responses ------------------------------------------

async def _respond(request: Request, state: ServerState, ids, settings: GenSettings, fmt, req):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(ids, settings, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    state.worker.submit(job)  # raises Unavailable (503) when the queue is full
    if req.stream:
        return StreamingResponse(_stream(job, events, fmt, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(request, job, events, fmt)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _abort_error(job: Job) -> ApiError:
    reason = job.abort_reason or "cancelled"
    return ApiError(503 if reason == SHUTDOWN_REASON else 499, f"generation ended early: {reason}", None,
                    "shutting_down" if reason == SHUTDOWN_REASON else "cancelled")


async def _stream(job: Job, events: asyncio.Queue, fmt, include_usage: bool):
    finished = False
    try:
        first = fmt.opening_chunk()
        if first:
            yield _sse(first)
        while True:
            ev = await events.get()
            if isinstance(ev, Delta):
                if ev.text:
                    yield _sse(fmt.chunk(ev.text, None))
                continue
            finished = True
            if isinstance(ev, Failed):
                yield _sse(ApiError(500, ev.message).body())
            elif ev.finish_reason == "abort":
                yield _sse(_abort_error(job).body())
            else:
                yield _sse(fmt.chunk("", ev.finish_reason))
                if include_usage:
                    yield _sse(fmt.usage_chunk(ev.usage()))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client left (or the task was cancelled): stop generating for it
            job.cancel()


async def _collect(request: Request, job: Job, events: asyncio.Queue, fmt):
    async def watch_disconnect():
        while not job.cancelled:
            if await request.is_disconnected():
                job.cancel()
                return
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch_disconnect())
    parts, done = [], None
    try:
        while done is None:
            ev = await events.get()
            if isinstance(ev, Delta):
                parts.append(ev.text)
            else:
                done = ev
    finally:
        watcher.cancel()
        if done is None:  # this task was cancelled: stop generating for it
            job.cancel()
    if isinstance(done, Failed):
        raise ApiError(500, done.message)
    if done.finish_reason == "abort":
        raise _abort_error(job)
    return fmt.response("".join(parts), done.finish_reason, done.usage())


class _CompletionFormat:
    def __init__(self, model: str):
        self.id, self.model, self.created = f"cmpl-{uuid.uuid4().hex}", model, int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening_chunk(self):
        return None

    def chunk(self, text: str, finish: str | None) -> dict:
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("text_completion"), "choices": [], "usage": usage}

    def response(self, text: str, finish: str, usage: dict) -> dict:
        return {**self.chunk(text, finish), "usage": usage}


class _ChatFormat(_CompletionFormat):
    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def opening_chunk(self) -> dict:
        return self._delta({"role": "assistant", "content": ""}, None)

    def _delta(self, delta: dict, finish: str | None) -> dict:
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def chunk(self, text: str, finish: str | None) -> dict:
        return self._delta({"content": text} if text else {}, finish)

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}

    def response(self, text: str, finish: str, usage: dict) -> dict:
        return {**self._head("chat.completion"), "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}]}
