"""The checks every HTTP request meets before it is routed, as one ASGI middleware:

1. without an API key, a `Host` other than the loopback name the server is bound to, or an
   `Origin` that is not the server's own or one given with `--allow-origin`, gets 403 (so a
   web page cannot drive the local server, nor read it through DNS rebinding);
2. while the server drains, the API answers 503 `shutting_down`;
3. with an API key, everything under /v1/ needs it (401), known route or not;
4. a POST body must be `application/json` (415) and at most `--max-body-bytes` (413), the
   size checked from `Content-Length` before reading and while reading.

It also counts the API requests in flight, which the drain waits for."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from dflash.serve.schema import ApiError
from dflash.serve.worker import SHUTDOWN_REASON

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def host_name(header: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1', 'Name' -> 'name'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class AccessPolicy:
    """Which Host and Origin headers are let through. None: any."""
    hosts: frozenset[str] | None = None
    origins: frozenset[str] | None = None

    @classmethod
    def build(cls, bind_host: str, port: int, api_key: str | None, allow_origins=()) -> AccessPolicy:
        """With an API key, the key is the protection: any Host and Origin. Without one: a
        loopback server answers only to loopback names, and only its own origin (plus
        `allow_origins`; "*" allows all) may call it from a browser."""
        allowed = {o.rstrip("/").lower() for o in allow_origins}
        if api_key is not None or "*" in allowed:
            return cls(None, None)
        if not is_loopback(bind_host):
            return cls(None, frozenset(allowed))
        names = set(LOOPBACK_NAMES) | {bind_host.lower()}
        own = {f"http://{'[' + n + ']' if ':' in n else n}:{port}" for n in names}
        return cls(frozenset(names), frozenset(own | allowed))

    def refusal(self, headers: Headers) -> ApiError | None:
        host, origin = headers.get("host"), headers.get("origin")
        if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
            return ApiError(403, f"this server answers only to {', '.join(sorted(self.hosts))} without an API key, "
                                 f"not to Host '{host}'", None, "host_not_allowed")
        if self.origins is not None and origin is not None and origin.rstrip("/").lower() not in self.origins:
            return ApiError(403, f"requests from the web origin '{origin}' are not allowed; start the server with "
                                 "--allow-origin to allow it (or --api-key)", None, "origin_not_allowed")
        return None


def key_refusal(headers: Headers, key: str | None) -> ApiError | None:
    if key is None:
        return None
    given = headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else ""
    if token and hmac.compare_digest(token.encode(), key.encode()):
        return None
    return ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", None,
                    "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_refusal(headers: Headers, limit: int) -> ApiError | None:
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        return ApiError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                             f"(got {media or 'no content type'!r})", None, "unsupported_media_type")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return too_large(limit)
    return None


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-body-bytes)", None, "request_too_large")


class Guard:
    """ASGI middleware: the checks above, in that order, then the app."""

    def __init__(self, app, state, policy: AccessPolicy):
        self.app, self.state, self.policy = app, state, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._refusal(scope)
        if error is not None:
            self.state.count_error(error)
            return await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send)
        if not is_api(scope["path"]):
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.state.in_flight -= 1

    def _refusal(self, scope) -> ApiError | None:
        headers = Headers(scope=scope)
        error = self.policy.refusal(headers)
        api = is_api(scope["path"])
        if error is None and api and self.state.draining:
            error = ApiError(503, f"{SHUTDOWN_REASON}; retry on another server", None, "shutting_down",
                             headers={"Retry-After": "1"})
        if error is None and api:
            error = key_refusal(headers, self.state.api_key)
        if error is None and scope["method"] == "POST":
            error = body_refusal(headers, self.state.limits.max_body_bytes)
        return error

    def _limited(self, receive):
        """`receive`, raising a 413 once the body read so far passes the limit (a chunked body
        has no Content-Length to check first)."""
        limit, seen = self.state.limits.max_body_bytes, 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit)
            return message

        return wrapped
