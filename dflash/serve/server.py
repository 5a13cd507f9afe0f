"""The `dflash serve` server: FastAPI on uvicorn. One worker thread owns the model (worker.py); the
HTTP side (api.py) validates requests, queues them and streams the answers back.
On shutdown (Ctrl-C / SIGTERM) it stops taking requests, lets the queued and running ones
finish for `--shutdown-grace` seconds, then ends the rest with a clean error."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import uvicorn

from dflash.serve.api import ServerState, create_app
from dflash.serve.metrics import Metrics
from dflash.serve.worker import Worker


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_name(target: str | None) -> str:
    if target is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(target)) or target
