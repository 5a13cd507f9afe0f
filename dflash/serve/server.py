"""The `dflash serve` server: FastAPI on uvicorn. One worker thread owns the model (worker.py); the
HTTP side (api.py) validates requests, queues them and streams the answers back.
On shutdown (Ctrl-C / SIGTERM) it drains: the listener stays open and answers new API
requests and /health with 503 `shutting_down`, the queued and running requests finish (for
at most `--shutdown-grace` seconds, then they end with a clean error), then it exits."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import uvicorn

from dflash.serve.api import create_app
from dflash.serve.guard import AccessPolicy
from dflash.serve.limits import Limits
from dflash.serve.metrics import Metrics
from dflash.serve.state import ServerState
from dflash.serve.worker import Worker
from dflash.text.pipeline import SpecSettings


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "dflash"
    max_queue: int = 64  # requests waiting for the worker; beyond it: 503
    max_model_len: int | None = None  # context (prompt + completion); default: the target's
    spec: SpecSettings | None = None  # how the loop speculates (block, proposer, policy); None: the pipeline's
    shutdown_grace: float = 30.0
    log_level: str = "warning"
    limits: Limits = field(default_factory=Limits)
    allow_origins: tuple[str, ...] = ()  # web origins a browser may call the API from ("*": any)
    max_batch: int | None = None  # requests decoded together; None: the pipeline's measured default


class DFlashServer(uvicorn.Server):
    """uvicorn's server, draining first when it shuts down: the listener stays open (503s) until
    the API requests in flight are answered; a second Ctrl-C skips the wait."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.grace = state, grace

    @property
    def worker(self) -> Worker:
        return self.state.worker

    async def shutdown(self, sockets=None) -> None:
        await self.state.drain(self.grace, lambda: self.force_exit)
        await super().shutdown(sockets)


def build_server(pipe, options: ServerOptions, start_worker: bool = True) -> DFlashServer:
    if options.max_model_len is not None and options.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {options.max_model_len}")
    max_len = min(options.max_model_len or pipe.target.info.max_positions, pipe.target.info.max_positions)
    if options.spec is not None:  # a copy sharing the models: the caller's pipeline keeps its settings
        pipe = dataclasses.replace(pipe, spec=options.spec)
    metrics = Metrics(num_positions=max(pipe.block_size() - 1, 0))
    if options.max_batch is not None and options.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {options.max_batch}")
    max_batch = options.max_batch or pipe.default_max_batch()
    worker = Worker(pipe, options.max_queue, metrics, max_batch)
    api_key = options.api_key or None
    state = ServerState(pipe, worker, metrics, options.model_name, max_len, api_key, options.limits)
    policy = AccessPolicy.build(options.host, options.port, api_key, options.allow_origins)
    config = uvicorn.Config(create_app(state, policy, options.allow_origins), host=options.host, port=options.port,
                            log_level=options.log_level, timeout_graceful_shutdown=int(options.shutdown_grace) + 5,
                            access_log=False)
    server = DFlashServer(config, state, options.shutdown_grace)
    if start_worker:
        worker.start()
    return server


def default_name(target: str | None) -> str:
    if target is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(target)) or target
