"""`dflash serve` (an OpenAI-compatible HTTP server) and `dflash chat` (a terminal chat).

The server is FastAPI on uvicorn. One worker thread owns the model (server_worker.py); the
HTTP side (server_api.py) validates requests, queues them and streams the answers back.
On shutdown (Ctrl-C / SIGTERM) it stops taking requests, lets the queued and running ones
finish for `--shutdown-grace` seconds, then ends the rest with a clean error."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from dataclasses import dataclass

import uvicorn

from .server_api import ServerState, create_app
from .server_metrics import Metrics
from .server_worker import Worker

API_KEY_ENV = "DFLASH_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "dflash"
    max_queue: int = 64  # requests waiting for the worker; beyond it: 503
    max_model_len: int | None = None  # context (prompt + completion); default: the target's
    block_size: int | None = None  # default: the draft's
    draft_threshold: float = 0.0  # verify only the leading proposals the draft gives at least this probability
    shutdown_grace: float = 30.0
    log_level: str = "warning"


class DFlashServer(uvicorn.Server):
    """uvicorn's server, draining the model worker first when it shuts down."""

    def __init__(self, config: uvicorn.Config, worker: Worker, grace: float):
        super().__init__(config)
        self.worker, self.grace = worker, grace

    async def shutdown(self, sockets=None) -> None:
        self.worker.drain(self.grace)
        await super().shutdown(sockets)


def build_server(pipe, options: ServerOptions, start_worker: bool = True) -> DFlashServer:
    if options.max_model_len is not None and options.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {options.max_model_len}")
    max_len = min(options.max_model_len or pipe.target.info.max_positions, pipe.target.info.max_positions)
    if not 0.0 <= options.draft_threshold <= 1.0:
        raise ValueError(f"--draft-threshold must be a probability in [0, 1], got {options.draft_threshold}")
    block = options.block_size or (pipe.draft.config.block_size if pipe.draft is not None else 1)
    metrics = Metrics(num_positions=max(block - 1, 0))
    worker = Worker(pipe, options.max_queue, metrics, options.block_size, draft_threshold=options.draft_threshold)
    state = ServerState(pipe, worker, metrics, options.model_name, max_len, options.api_key or None)
    config = uvicorn.Config(create_app(state), host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=int(options.shutdown_grace) + 5, access_log=False)
    server = DFlashServer(config, worker, options.shutdown_grace)
    if start_worker:
        worker.start()
    return server


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_serve(sub) -> None:
    from .cli import add_model_args

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 503 (default 64)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit, prompt + completion")
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the draft's)")
    p.add_argument("--draft-threshold", type=float, default=0.0,
                   help="verify only the leading proposals the draft gives at least this probability (default 0: all)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_threads(p)
    p.set_defaults(func=run_serve)

    c = sub.add_parser("chat", help="chat in the terminal, streaming, with tau and tokens/s shown live")
    add_model_args(c)
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--block-size", type=int, default=None)
    c.add_argument("--draft-threshold", type=float, default=0.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--plain", action="store_true", help="no live status line (the default when not a terminal)")
    _add_threads(c)
    c.set_defaults(func=_run_chat)


def _add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is often fastest for small models on busy CPUs)")


def _set_threads(args) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def _run_chat(args) -> int:
    from .chat import run_chat

    _set_threads(args)
    return run_chat(args)


def run_serve(args) -> int:
    from .pipeline import Pipeline

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it "
              f"(set --api-key or ${API_KEY_ENV})", file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    _set_threads(args)
    pipe = Pipeline.load(args.target, args.draft)
    name = args.model_name or _default_name(args.target)
    options = ServerOptions(args.host, args.port, api_key, name, args.max_queue, args.max_model_len,
                            args.block_size, args.draft_threshold, args.shutdown_grace, args.log_level)
    server = build_server(pipe, options)
    print(f"dflash: serving '{name}' on http://{args.host}:{args.port}/v1 "
          f"(draft: {pipe.draft_path or 'random, untrained'}; API key {'required' if api_key else 'off'})",
          file=sys.stderr)
    server.run()
    return 0


def _default_name(target: str | None) -> str:
    if target is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(target)) or target
