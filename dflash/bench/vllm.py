"""The benchmark's vLLM methods: vLLM's plain decoding and vLLM with our draft, each run through
the worker process of `dflash.backends.vllm.worker` (vLLM lives in its own interpreter)."""

from __future__ import annotations

import os

from dflash.backends.vllm.worker import EnginePool, vllm_python
from dflash.bench.stats import Record, spec_stats
from dflash.engine.stats import SpecStats

VLLM_BENCH_MISSING = ("vLLM not found (docs/VLLM.md: scripts/vllm_env.sh, or DFLASH_VLLM_PYTHON): "
                      "vLLM plain and vLLM + draft methods skipped")


def wanted(settings) -> bool:
    """vLLM methods are opt-in (each engine takes minutes to start): `settings.vllm` or
    DFLASH_BENCH_VLLM=1."""
    return bool(getattr(settings, "vllm", False)) or os.environ.get("DFLASH_BENCH_VLLM") == "1"


def bench_methods(settings, pool: EnginePool | None = None) -> list:
    """[(name, method)] for `dflash bench`: `vllm` (plain), and per block size B > 1
    `vllm-dflash-b{B}` (our draft in vLLM) and `vllm-ngram-b{B}` (vLLM's n-gram proposer, B - 1
    tokens a step). A method is `(pipeline, input_ids, max_new_tokens) -> Record`. The methods
    share the engines of `pool` (default: a new one, whose engines stop when the process exits)."""
    if not wanted(settings):
        return []
    python = vllm_python()
    if python is None:
        settings.notes.append(VLLM_BENCH_MISSING)
        return []
    pool = pool if pool is not None else EnginePool(python)
    methods = [("vllm", _bench_method("vllm", None, settings, pool))]
    for b in dict.fromkeys(settings.block_sizes):
        if b > 1:
            methods.append((f"vllm-dflash-b{b}", _bench_method(f"vllm-dflash-b{b}", b, settings, pool)))
            methods.append((f"vllm-ngram-b{b}", _bench_method(f"vllm-ngram-b{b}", b, settings, pool, ngram=True)))
    settings.notes.append("vLLM methods run in a worker process (one compute thread pinned to one core, its "
                          "engine loop on another); their peak memory is not measured")
    return methods


def _bench_method(name: str, block_size: int | None, settings, pool: EnginePool, ngram: bool = False):
    def run(pipe, input_ids, max_new_tokens):
        eng = pool.engine_for(pipe, block_size, seed=getattr(settings, "seed", 0), ngram=ngram)
        r = eng.generate(input_ids, max_new_tokens, pipe.stop_token_ids, getattr(settings, "temperature", 0.0))
        k = block_size - 1 if block_size else 0
        steps = [(k, c - 1, c) for c in r.commits] if block_size else []
        extra = {"engine": "vllm", "vllm_spec": r.spec, "vllm_mean_acceptance_length": r.mean_acceptance_length}
        return Record(name, list(r.output_ids), int(input_ids.shape[-1]), r.total_time, r.time_to_first_token,
                      steps, r.finish_reason, 0.0, extra=extra)

    return run


def records_acceptance(records) -> float | None:
    """Mean acceptance length over records, vLLM's way: 1 + accepted / drafts. For vLLM
    records, from vLLM's own counters; for ours, from the steps that proposed tokens."""
    total = SpecStats()
    for r in records:
        spec = (r.extra or {}).get("vllm_spec")
        if spec is not None:
            total = total.merge(SpecStats(num_drafts=spec.get("drafts", 0), num_accepted_tokens=spec.get("accepted", 0)))
        else:
            total = total.merge(spec_stats(r.steps))
    return total.mean_acceptance_length if total.num_drafts else None
