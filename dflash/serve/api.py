"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions (plain JSON or
server-sent events), /v1/models, plus /health and /metrics. Everything a request needs
lives on `app.state.dflash` (a ServerState); the model itself is only touched by the worker.
Every request first passes the Guard (guard.py); a body is parsed and tokenised in a pool
thread (state.py), so the event loop only moves bytes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash.serve.guard import AccessPolicy, Guard
from dflash.serve.metrics import CONTENT_TYPE
from dflash.serve.schema import ApiError
from dflash.serve.state import ServerState
from dflash.serve.worker import SHUTDOWN_REASON, Failed, Job, Unavailable
from dflash.text.session import Delta, GenSettings


def create_app(state: ServerState, policy: AccessPolicy | None = None, cors_origins=()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.worker.close()

    app = FastAPI(title="dflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dflash = state
    _add_error_handlers(app, state)
    app.add_middleware(Guard, state=state, policy=policy or AccessPolicy())
    if cors_origins:  # outside the guard: it answers the browsers' preflight requests itself
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health():
        status = "shutting_down" if state.draining else "ok" if state.worker.alive else "unavailable"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

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
        req, ids, settings = await run_in_threadpool(state.prepare_completion, await request.body())
        return await _respond(request, state, ids, settings, _CompletionFormat(state.model_name), req)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req, ids, settings = await run_in_threadpool(state.prepare_chat, await request.body())
        return await _respond(request, state, ids, settings, _ChatFormat(state.model_name), req)

    app.include_router(v1)
    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dflash",
            "max_model_len": state.max_model_len}


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def error(e: ApiError):
        state.count_error(e)
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
        return StreamingResponse(_stream(state, job, events, fmt, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(request, job, events, fmt)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _abort_error(job: Job) -> ApiError:
    reason = job.abort_reason or "cancelled"
    return ApiError(503 if reason == SHUTDOWN_REASON else 499, f"generation ended early: {reason}", None,
                    "shutting_down" if reason == SHUTDOWN_REASON else "cancelled")


def _failure(job: Job, end) -> ApiError | None:
    """The error a job's last event means, if any: a failed or an aborted generation."""
    if isinstance(end, Failed):
        return ApiError(500, end.message)
    return _abort_error(job) if end.finish_reason == "abort" else None


async def _stream(state: ServerState, job: Job, events: asyncio.Queue, fmt, include_usage: bool):
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
            error = _failure(job, ev)
            if error is not None:  # counted as the same error of a non-streamed request would be
                state.count_error(error)
                yield _sse(error.body())
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
    error = _failure(job, done)
    if error is not None:
        raise error
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
