"""The machine's cost model: what a verify pass over n tokens and a draft step cost HERE,
measured at load and cached per machine (engine/machine.py; re-timed briefly at each load
and measured again when it was measured busy), so the adaptive policy
(engine/policy.py) can weigh a longer verify against its expected extra tokens.

- `verify_ms(n, context)`: the target's layers over n new tokens after `context` cached ones,
  plus its lm_head on row 0 (a step whose proposal 1 is rejected pays just that);
- `rest_head_ms(k)`: the lm_head on the other k rows (paid when proposal 1 is accepted);
- `draft_ms(block)`: one draft step over a block (its forward over one new context token +
  the block, its lm_head on the proposals, argmax and the proposals' probabilities);
- `row_ms`: what each more sequence adds to a pass that several share (continuous batching),
  so `pass_ms(tokens, rows)` is a shared pass; `BatchCost` is one row's share of it.

The measurement is cheap: the static cache's context is a length (its K/V stay zeros: the
attention costs the same), token counts 1..6, then 8..32 in widening steps, at one
context, a few of them at a second, interpolated in between; a few seconds on SmolLM2 on 2
cores, then read from the cache."""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from dflash.engine import machine
from dflash.engine.cache import StaticTargetCache
from dflash.engine.probes import ProbeWait

VERSION = 6  # bump when what is measured or how changes: a cached cost model of an older version is measured again
NS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
SECOND_NS = (1, 4, 16, 32)
CONTEXTS = (256, 1024)
DRAFT_BLOCKS = (2, 4, 8, 16, 32)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys): flat left of xs[0], the last slope right of xs[-1]
    (a longer verify or context costs more, not the same)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    j = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    ns: list[int]  # verify token counts measured at contexts[0]
    verify: list[float]  # ms per n at contexts[0]
    contexts: list[int]
    context_ns: list[int]  # the token counts measured at every context
    context_verify: list[list[float]]  # [context][context_ns] ms
    rest_ns: list[int]
    rest: list[float]  # ms of the lm_head over k = rest_ns rows
    draft_blocks: list[int] = field(default_factory=list)
    draft: list[float] = field(default_factory=list)  # ms per block size
    info: dict = field(default_factory=dict)  # the machine, kernels, measuring time
    row_ms: float | None = None  # what each more sequence adds to a shared pass (None: the target cannot share)

    def verify_ms(self, n: int, context: int | None = None) -> float:
        """Verify pass over n tokens (layers + row 0's lm_head), at `context` (None: contexts[0])."""
        base = _interp(self.ns, self.verify, n)
        if context is None or len(self.contexts) < 2:
            return base
        # the context's factor at this n, from the token counts measured at every context
        at = [_interp(self.context_ns, row, n) for row in self.context_verify]
        return base * max(_interp(self.contexts, [a / at[0] for a in at], context), 0.1)

    def rest_head_ms(self, k: int) -> float:
        return 0.0 if k <= 0 else _interp(self.rest_ns, self.rest, k)

    def draft_ms(self, block: int) -> float:
        return _interp(self.draft_blocks, self.draft, block) if self.draft_blocks else 0.0

    def break_even_tau(self, block: int, p_first: float = 1.0, context: int | None = None) -> float:
        """tau (tokens per step) at which a block-`block` step is as fast as plain decoding:
        (T_d + T_t(block) + p_first T_rest(block - 1)) / T_t(1)."""
        step = self.draft_ms(block) + self.verify_ms(block, context) + p_first * self.rest_head_ms(block - 1)
        return step / self.verify_ms(1, context)

    def pass_ms(self, tokens: int, rows: int, context: int | None = None) -> float:
        """T(tokens, rows): a pass over `tokens` new tokens of `rows` sequences, each row's row 0
        through the lm_head: the one-sequence pass, the head's other rows, each row's overhead."""
        if self.row_ms is None:  # one pass per sequence
            return rows * self.verify_ms(tokens / rows, context)
        return self.verify_ms(tokens, context) + self.rest_head_ms(rows - 1) + (rows - 1) * self.row_ms

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(**d)


class BatchCost:
    """A cost model seen by one of `rows` sequences sharing each pass (continuous batching): a
    verify pass over n tokens costs the row its share T(rows n, rows) / rows of a pass where every
    row verifies n, so a tree weighs a node against what it adds to the shared pass, and at large
    batches rows propose less, stop drafting (a draft pass is the row's own) and decode plainly.
    With one row it is the cost model itself. The step sets `rows` before the rows propose."""

    def __init__(self, model: CostModel):
        self.model, self.rows = model, 1
        self.gate = SpeculationGate()  # whether the batch speculates at all, from its measured steps

    def sharing(self) -> int:
        """The rows sharing the pass now."""
        return self.rows

    def verify_ms(self, n: int, context: int | None = None) -> float:
        return self.model.pass_ms(self.rows * n, self.rows, context) / self.rows

    def draft_ms(self, block: int) -> float:
        return self.model.draft_ms(block)

    def rest_head_ms(self, k: int) -> float:
        return self.model.rest_head_ms(k)


@dataclass
class StepRate:
    """Running sums of committed tokens and step time (ms), forgotten at `decay` per step."""
    tokens: float = 0.0
    ms: float = 0.0

    def observe(self, tokens: int, ms: float, decay: float) -> None:
        self.tokens, self.ms = decay * self.tokens + tokens, decay * self.ms + ms

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


class SpeculationGate:
    """Whether a batch's rows propose at all this step, from what whole steps gave: committed
    tokens per ms of steps with proposals and of plain steps, per batch size (powers of two).
    Each row sizes its own proposals against its share of the pass (`BatchCost`), but every
    row's host work, draft passes and extra verified tokens lengthen the step all rows wait
    for; where that measures slower than plain steps the batch decodes plainly, trying the
    other way after `probe_every` steps, a wait that doubles with each probe that changes
    nothing (up to `max_probe_every`: a probe of 16 rows' proposals costs ~4 plain steps) and
    starts again when one does. A batch size not measured yet starts plainly where a smaller
    one measured plain steps faster, else measures both ways. One row alone always proposes
    (its proposer decides)."""

    def __init__(self, decay: float = 0.9, probe_every: int = 16, max_probe_every: int = 256):
        self.decay, self.probe_every, self.max_probe_every = decay, probe_every, max_probe_every
        self.rates: dict[tuple[int, bool], StepRate] = {}  # (batch bucket, speculated) -> its steps
        self.since_probe: dict[int, int] = {}  # batch bucket -> steps since the other way was tried
        self.wait: dict[int, ProbeWait] = {}  # batch bucket -> steps between probes
        self.probing: dict[int, bool] = {}  # batch bucket -> the way that was faster when its probe began

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (rows - 1).bit_length()

    def _wait(self, b: int) -> ProbeWait:
        return self.wait.setdefault(b, ProbeWait(self.probe_every, self.max_probe_every))

    def _smaller(self, b: int) -> list[int]:
        return [bucket for bucket, _ in self.rates if bucket < b]

    def _faster(self, b: int) -> bool | None:
        """Whether steps with proposals measure faster in bucket b (None: not both measured)."""
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        return None if spec is None or plain is None else spec.rate >= plain.rate

    def speculate(self, rows: int) -> bool:
        if rows <= 1:
            return True
        b = self.bucket(rows)
        better = self._faster(b)
        if better is None and any(self._faster(small) is False for small in self._smaller(b)):
            # a smaller batch measured plain steps faster: more rows only add proposals' work, so
            # this batch decodes plainly too until its first probe
            if (b, False) not in self.rates:
                return False
            better = False
        elif better is None:  # measure each way first
            return (b, True) not in self.rates
        self.since_probe[b] = self.since_probe.get(b, 0) + 1
        if self.since_probe[b] > self._wait(b).steps:
            self.since_probe[b] = 0
            self.probing[b] = better
            return not better
        return better

    def observe(self, rows: int, speculated: bool, tokens: int, ms: float) -> None:
        """A whole step of `rows` rows (their proposals, the pass, their commits)."""
        if rows <= 1:
            return
        b = self.bucket(rows)
        self.rates.setdefault((b, speculated), StepRate()).observe(tokens, ms, self.decay)
        before = self.probing.pop(b, None)
        if before is not None:  # the probe's step: did it change which way is faster?
            self._wait(b).grow() if self._faster(b) == before else self._wait(b).reset()


BATCH_LATENCY = 4.0  # a step of the default largest batch costs at most this many plain steps alone
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def batch_limit(model: CostModel, latency: float = BATCH_LATENCY) -> int:
    """The default largest batch of a server: the largest of BATCH_SIZES whose plain step (one
    token a row) costs at most `latency` plain steps of one row, where the target can share
    passes; else 1 (rows one after another give no more tokens per second)."""
    if model.row_ms is None:
        return 1
    one = model.pass_ms(1, 1)
    return max(b for b in BATCH_SIZES if model.pass_ms(b, b) <= latency * one)


def fill_cache(target, context: int, generator: torch.Generator):
    """A target cache holding `context` positions: the static cache's length moved (zeros in
    its K/V cost the attention the same), else a real prefill."""
    cache = target.new_cache()
    if isinstance(cache, StaticTargetCache):
        cache.kv.reserve(context + 64)
        cache.kv.length = context
    else:
        ids = torch.randint(0, target.info.vocab_size, (1, context), generator=generator).to(target.device)
        target.forward(ids, cache, None, logits_to_keep=1)
    return cache


@torch.inference_mode()
def measure_verify(target, ns: Sequence[int], context: int, reps: int = 2, layer_ids=None,
                   clock: Callable[[], float] = time.perf_counter, seed: int = 0) -> tuple[list[float], list[float]]:
    """The minimum over `reps` interleaved rounds of (verify pass ms, rest-head ms) for each
    n, after `context` cached tokens (a busy machine only ever adds time)."""
    g = torch.Generator().manual_seed(seed)
    cache = fill_cache(target, context, g)
    ver, rest = [float("inf")] * len(ns), [float("inf")] * len(ns)
    ids = torch.randint(0, target.info.vocab_size, (1, max(ns)), generator=g).to(target.device)
    target.forward_hidden(ids[:, :1], cache, layer_ids)  # warm-up
    cache.crop_to(context)
    for _ in range(reps):
        for j, n in enumerate(ns):
            t0 = clock()
            final, _ = target.forward_hidden(ids[:, :n], cache, layer_ids)
            target.logits(final[:, :1])
            t1 = clock()
            if n > 1:
                target.logits(final[:, 1:])
            t2 = clock()
            ver[j], rest[j] = min(ver[j], (t1 - t0) * 1e3), min(rest[j], (t2 - t1) * 1e3)
            cache.crop_to(context)
    return ver, rest


@torch.inference_mode()
def time_draft_step(draft, target, head, cache, ctx_hidden, block: int, mask_id: int, pos: int, layout=None) -> None:
    """One draft step as the loop runs it, greedy: noise embedding of [last, mask x (block-1)],
    the draft over [new context ; block] (with `layout`, the kernels the loop's proposer runs:
    `target.draft_layout(draft)`, built once by the caller), its lm_head on the proposals, argmax
    and their probabilities (what the adaptive policy reads); the block's K/V dropped after."""
    ids = torch.full((1, block), mask_id, dtype=torch.long, device=target.device)
    ids[:, 0] = 1
    noise = target.embed(ids, draft.config.input_embedding_scale)  # (1, S, H)
    positions = torch.arange(cache.length, pos + block, device=target.device)[None]  # (1, C+S)
    hidden = draft(positions, noise_embedding=noise, target_hidden=ctx_hidden, past_key_values=cache, use_cache=True,
                   layout=layout)  # (1, S, H)
    cache.crop_to(pos)  # the context only
    logits = head.logits(target, hidden[:, 1:])  # (1, S-1, V or K)
    logits.argmax(-1)
    torch.softmax(logits.float(), dim=-1).amax(-1)


@torch.inference_mode()
def measure_draft(draft, target, blocks: Sequence[int] = DRAFT_BLOCKS, context: int = 256, reps: int = 3,
                  clock: Callable[[], float] = time.perf_counter, seed: int = 0, head=None) -> list[float]:
    """Minimum ms over `reps` interleaved rounds of one draft step per block size, with
    `context` tokens in the draft's cache (random target features: the cost is the same)."""
    if head is None:
        from dflash.engine.loop import DraftHead

        head = DraftHead.build(draft, target)
    g = torch.Generator().manual_seed(seed)
    k_h = len(draft.config.target_layer_ids) * target.info.hidden_size
    cache = draft.new_cache()
    mask_id = draft.config.mask_token_id
    ctx = torch.randn(1, context, k_h, generator=g).to(target.device, target.dtype)
    layout = target.draft_layout(draft)
    time_draft_step(draft, target, head, cache, ctx, 2, mask_id, context, layout)  # fills the cache with the context
    one = torch.randn(1, 1, k_h, generator=g).to(target.device, target.dtype)
    out = [float("inf")] * len(blocks)
    for r in range(reps + 1):  # round 0 warms up
        for j, b in enumerate(blocks):
            t0 = clock()
            time_draft_step(draft, target, head, cache, one, b, mask_id, context + 1, layout)
            if r:
                out[j] = min(out[j], (clock() - t0) * 1e3)
            cache.crop_to(context)
    return out


ROWS = 8  # sequences in the shared pass that `measure_rows` times


@torch.inference_mode()
def measure_rows(target, context: int, rows: int = ROWS, reps: int = 3, layer_ids=None,
                 clock: Callable[[], float] = time.perf_counter, seed: int = 0) -> float | None:
    """What each more sequence adds to a shared pass (`static_decoder.forward_rows`): `rows`
    sequences of one token against one sequence of `rows` tokens, at `context`; 0 where the
    target cannot share passes (None)."""
    from dflash.engine import static_decoder

    if not static_decoder.supports_rows(target.linears):
        return None
    g = torch.Generator().manual_seed(seed)
    caches = [fill_cache(target, context, g) for _ in range(rows)]
    ids = torch.randint(0, target.info.vocab_size, (rows,), generator=g).to(target.device)
    positions = [torch.tensor([context], device=target.device)] * rows
    best_rows = best_one = float("inf")
    for _ in range(reps + 1):  # round 0 warms up
        t0 = clock()
        static_decoder.forward_rows(target.model, list(ids[:, None]), positions, [c.kv for c in caches],
                                    [None] * rows, layer_ids, target.linears)
        t1 = clock()
        target.forward_hidden(ids[None], caches[0], layer_ids)
        t2 = clock()
        best_rows, best_one = min(best_rows, t1 - t0), min(best_one, t2 - t1)
        for c in caches:
            c.crop_to(context)
    return max(best_rows - best_one, 0.0) * 1e3 / (rows - 1)


def measure(target, draft=None, ns: Sequence[int] = NS, contexts: Sequence[int] = CONTEXTS,
            second_ns: Sequence[int] = SECOND_NS, draft_blocks: Sequence[int] = DRAFT_BLOCKS, reps: int = 2,
            clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """Measure this machine's costs for `target` (and `draft`, if given)."""
    start = time.perf_counter()
    room = max(target.info.max_positions - max(ns) - max(draft_blocks, default=0) - 2, 1)
    contexts = list(dict.fromkeys(min(c, room) for c in contexts))  # within the target's context
    layer_ids = list(draft.config.target_layer_ids) if draft is not None else None
    ver, rest = measure_verify(target, ns, contexts[0], reps, layer_ids, clock)
    context_rows = [[ver[list(ns).index(n)] for n in second_ns]]
    for c in contexts[1:]:
        context_rows.append(measure_verify(target, second_ns, c, reps, layer_ids, clock)[0])
    rest_ns = [n - 1 for n in ns if n > 1]
    d_ms = measure_draft(draft, target, draft_blocks, contexts[0], reps + 1, clock) if draft is not None else []
    info = {"machine": machine.machine_key(), "kernels": getattr(target, "kernels", "torch"),
            "measure_s": round(time.perf_counter() - start, 2)}
    row_ms = measure_rows(target, contexts[0], layer_ids=layer_ids, clock=clock)
    return CostModel(list(ns), [round(x, 3) for x in ver], list(contexts), list(second_ns),
                     [[round(x, 3) for x in row] for row in context_rows], rest_ns,
                     [round(x, 3) for n, x in zip(ns, rest) if n > 1], list(draft_blocks) if draft is not None else [],
                     [round(x, 3) for x in d_ms], info, None if row_ms is None else round(row_ms, 4))


def model_signature(target, draft=None) -> str:
    """What the costs belong to besides the machine: the target's and draft's shapes and the
    kernels the target runs (a hash of their configs)."""
    tc = target.model.config
    sig = {"target": tc.to_dict() if hasattr(tc, "to_dict") else repr(tc), "kernels": getattr(target, "kernels", None),
           "kernel_choice": [(r["shape"], r["kernels"]) for r in target.kernel_info().get("shapes", [])]
           if hasattr(target, "kernel_info") else None, "static": getattr(target, "static", None),
           "dtype": str(target.dtype),
           "precision": target.precision_info() if hasattr(target, "precision_info") else None}
    if draft is not None:
        cfg = draft.config.to_dict()
        sig["draft"] = {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "intermediate_size",
                                                 "target_layer_ids")}
        sig["draft_vocab"] = len(draft.config.draft_vocab or ()) or None
    return hashlib.sha256(json.dumps(sig, sort_keys=True, default=str).encode()).hexdigest()[:16]


SPOT_NS = (1, 16)  # the verify lengths a cached model is re-timed at
SPOT_SLACK = 0.8  # re-timed under this share of the cached figure: the cache was measured busy


def measured_busy(model: CostModel, target, draft=None, clock: Callable[[], float] = time.perf_counter) -> bool:
    """Whether a quick re-timing of the verify pass (SPOT_NS tokens, two rounds, ~0.3 s on
    SmolLM2) beats the cached figures by over a fifth: a busy machine only ever adds time,
    so the cache was measured while something else ran (a load average under the core count
    does not show a job that ran for the last half minute only)."""
    ns = [n for n in SPOT_NS if model.ns[0] <= n <= model.ns[-1]]
    layer_ids = list(draft.config.target_layer_ids) if draft is not None else None
    now, _ = measure_verify(target, ns, model.contexts[0], 2, layer_ids, clock)
    return any(t < SPOT_SLACK * model.verify_ms(n) for n, t in zip(ns, now))


def load_or_measure(target, draft=None, refresh: bool = False, **kwargs) -> CostModel:
    """The cached cost model of this machine, target, kernels and draft; measured (and
    cached) when there is none, with `refresh`, or when the cached one was measured busy
    (`machine.stale`, `measured_busy`)."""
    key = {**machine.machine_key(), "models": model_signature(target, draft), "version": VERSION,
           "settings": {k: list(v) if isinstance(v, (tuple, list)) else v for k, v in sorted(kwargs.items())
                        if k != "clock"}}
    if not refresh:
        found = machine.read_cached("costmodel", key)
        if found is not None and not machine.stale(found.get("info")):
            cached = CostModel.from_dict(found)
            if not measured_busy(cached, target, draft, kwargs.get("clock", time.perf_counter)):
                return cached
    load = machine.load_average()
    model = measure(target, draft, **kwargs)
    model.info["measured_load"] = load
    machine.write_cached("costmodel", key, model.to_dict())
    return model
