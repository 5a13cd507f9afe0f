"""Kernel choice by measurement: which matrix product runs each linear of the target fastest,
on the CPU it runs on, at each token count the loop uses.

Why: `F.linear(x, W)` (what `nn.Linear` runs) multiplies by W's transpose; at 2..32 rows some
CPUs' BLAS takes that path 3-10x slower than a product with a contiguous (in, out) copy of W, or
with oneDNN's prepacked W, while on others F.linear is as fast (docs/PERFORMANCE.md). So at load
the adapter times the candidates for each weight shape (one representative weight per shape) at
each token-count bucket and keeps the fastest, in its OWN weight layout: the user's HF model is
never changed. The choice is cached per machine (engine/machine.py), so a second start times
nothing.

Candidates (`IMPLS`, each only where it runs and agrees with F.linear):
- `linear`: F.linear on the model's own weight; no copy; HF's numbers exactly.
- `wx`: (W x^T)^T on the model's own weight (a tall-skinny product instead); no copy.
- `transposed`: F.linear on the (out, in) view of a contiguous (in, out) copy, i.e. x @ W^T
  with no transposed operand; one copy.
- `onednn`: oneDNN's linear on its prepacked weight (torch.ops.mkldnn); one copy.
- `onednn_bf16`: oneDNN's linear on a bf16 copy of an fp32 weight, the input cast to bf16 and
  the output back (half the bytes to read; AMX or AVX512-BF16 where the CPU has them). Its
  products differ from F.linear's in the third digit, so it is **approximate**: only a weight
  whose caller allows that may get it (the draft's: a proposal changes what is verified, never
  what is output), and only from a table built with `approximate=True` (kernels="auto").
- `q8_0`: the engine's own int8 block kernel (engine/lowbit.py; a quarter of the bytes, the
  input quantised to int8 per 32 values), approximate as bf16 is.

Products that read the same input (a layer's q, k, v; its gate and up) are also measured as one
product on their weights stacked, a weight shape of its own (`stacked`: every layout of it is a
copy); engine/projections.py decides per group which runs.

Memory: a copying layout costs one copy of the weight. A weight holds at most the copies its
buckets need: the smallest set of layouts within `tolerance` (5%) of the fastest at every
bucket, so where one layout serves all buckets no second copy is made.

The products of the copying layouts can differ from F.linear's in the last bits (as F.linear's
own 1-row and 16-row paths differ); greedy output is still checked equal to HF `generate`'s by
the tests on both settings (`kernels="auto"` and `"torch"`)."""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash.engine import machine

BUCKETS = (1, 2, 4, 8, 16, 32, 128)  # 1: decode; 2..32: verify; 128: a prefill chunk
HEAD_BUCKETS = (1, 2, 4, 8, 16, 32)  # the lm_head never sees a prefill (only its last row)
TOLERANCE = 0.05
MAX_COPIES = 1  # copies of one decoder weight the adapter may hold (a 135M-parameter fp32 target: ~0.4 GB)
HEAD_MAX_COPIES = 2  # the lm_head runs on one row every step: a second copy of it may pay
VERSION = 2  # bump when the candidates or the measurement change: cached choices measure again
MODES = ("auto", "precise", "torch")  # precise: measured kernels, none approximate

TimeFn = Callable[..., float]  # time_fn(fn, x, *, impl, shape, n) -> seconds per call of fn(x)


def bucket_of(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (the largest for longer inputs)."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


# ---- the candidates --------------------------------------------------------------------------
def _linear(w, b):
    return functools.partial(F.linear, weight=w, bias=b)


def _wx(w, b):
    out_f, in_f = w.shape

    def fn(x):
        y = torch.mm(w, x.reshape(-1, in_f).t()) if b is None else torch.addmm(b[:, None], w, x.reshape(-1, in_f).t())
        return y.t().reshape(*x.shape[:-1], out_f)  # (N, out): a copy unless N = 1

    return fn


def _transposed(w, b):
    return functools.partial(F.linear, weight=w.t().contiguous().t(), bias=b)  # storage (in, out)


def _onednn(w, b):
    # packed from the detached weight: packed from a Parameter, the op records autograd and runs
    # 100x slower wherever grad mode is on (these are inference kernels: no backward)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    b = None if b is None else b.detach()
    op = torch.ops.mkldnn._linear_pointwise

    def fn(x):
        return op(x, packed, b, "none", [], "")

    return fn


def _onednn_bf16(w, b):
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16), None)  # as in _onednn
    bias = None if b is None else b.detach().to(torch.bfloat16)
    op = torch.ops.mkldnn._linear_pointwise

    def fn(x):
        return op(x.to(torch.bfloat16), packed, bias, "none", [], "").to(x.dtype)

    return fn


def _q8_0(w, b):
    from dflash.engine import lowbit

    if b is not None:
        raise TypeError("the block kernel has no bias")
    return lowbit.QLinear(lowbit.quantize(w, "q8_0"))


def _q8_0_available(w) -> bool:
    """The engine's own int8 block kernel (engine/lowbit.py) where it is built."""
    from dflash.engine import native

    return w.device.type == "cpu" and w.dtype == torch.float32 and w.shape[1] % 32 == 0 and native.available()


def _onednn_available(w) -> bool:
    return (w.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and w.dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _onednn_bf16_available(w) -> bool:
    """oneDNN's bf16 products need AVX512 (BW, VL, DQ), AVX-NE-CONVERT or AMX; torch refuses them elsewhere."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return w.dtype == torch.float32 and _onednn_available(w) and supported is not None and bool(supported())


class Impl(NamedTuple):
    build: Callable  # (weight (out, in), bias or None) -> fn(x (..., in)) -> (..., out)
    copies: bool  # holds its own copy of the weight
    available: Callable = lambda w: True
    exact: bool = True  # agrees with F.linear to the weight's precision (False: approximate, see above)
    copy_dtype: torch.dtype | None = None  # its copy's dtype when not the weight's


IMPLS: dict[str, Impl] = {
    "linear": Impl(_linear, False),
    "wx": Impl(_wx, False),
    "transposed": Impl(_transposed, True),
    "onednn": Impl(_onednn, True, _onednn_available),
    "onednn_bf16": Impl(_onednn_bf16, True, _onednn_bf16_available, exact=False, copy_dtype=torch.bfloat16),
    "q8_0": Impl(_q8_0, True, _q8_0_available, exact=False, copy_dtype=torch.int8),
}


def copy_bytes(name: str, numel: int, itemsize: int, stacked: bool = False) -> int:
    """The bytes candidate `name`'s copy of a weight of `numel` elements (`itemsize` each) takes;
    `stacked`: a weight made by stacking others (projections.py), itself a copy, so that every
    candidate holds one."""
    impl = IMPLS[name]
    if not impl.copies and not stacked:
        return 0
    return numel * (itemsize if impl.copy_dtype is None else impl.copy_dtype.itemsize)


def wall_time(fn, x, *, impl=None, shape=None, n=None, budget: float = 2e-3, max_calls: int = 200) -> float:
    """Seconds per call of fn(x) (already warm): calls timed one by one until `budget` seconds
    are spent; the fastest call. A busy machine only ever adds time, so the minimum is the
    product's own cost (with several threads on a loaded machine even that fails: a preempted
    thread stalls the others at their barrier for a whole time slice)."""
    best, spent, calls = float("inf"), 0.0, 0
    while spent < budget and calls < max_calls:
        start = time.perf_counter()
        fn(x)
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


# ---- the choice --------------------------------------------------------------------------------
@dataclass
class ShapeChoice:
    """What one weight shape runs on this machine: the kernel per bucket, the copying layouts
    held, and the measured microseconds per product (None: the candidate did not run here)."""
    shape: tuple[int, int]  # (out, in)
    buckets: tuple[int, ...]
    impls: dict[int, str]  # bucket -> implementation
    times_us: dict[str, list[float | None]] = field(default_factory=dict)  # impl -> per bucket
    stacked: bool = False  # the weight is a stack of others (projections.py): every layout is a copy

    @property
    def copies(self) -> list[str]:
        return sorted({i for i in self.impls.values() if IMPLS[i].copies or self.stacked})

    def extra_bytes(self, itemsize: int = 4) -> int:
        return sum(copy_bytes(c, self.shape[0] * self.shape[1], itemsize, self.stacked) for c in self.copies)

    def extra_mb(self, itemsize: int = 4) -> float:
        return self.extra_bytes(itemsize) / 2**20

    def time_us(self, bucket: int) -> float:
        """The measured microseconds of one product of `bucket` rows on its chosen kernel."""
        return self.times_us[self.impls[bucket]][self.buckets.index(bucket)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["impls"] = {str(b): i for b, i in self.impls.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ShapeChoice":
        return cls(tuple(d["shape"]), tuple(d["buckets"]), {int(b): i for b, i in d["impls"].items()},
                   {k: list(v) for k, v in d["times_us"].items()}, bool(d.get("stacked", False)))


def choose(times: dict[str, list[float | None]], buckets: Sequence[int], tolerance: float = TOLERANCE,
           shape: tuple[int, int] = (0, 0), max_copies: int = MAX_COPIES, stacked: bool = False) -> ShapeChoice:
    """Pick the kernel per bucket from measured times (impl -> seconds per bucket, None: not
    available). The set of copying layouts held is the smallest (then the fastest overall) whose
    kernels come within `tolerance` of the fastest candidate at every bucket; when no set of
    at most `max_copies` does, the fastest overall of those (sum over buckets of the time over
    the best). Within the set a bucket takes `linear` (HF's own numbers) when it is within
    `tolerance` of the set's fastest, else the set's fastest. `stacked`: the weight is itself a
    copy (a stack of others), so every candidate is a copying layout."""
    names = [n for n in times if n in IMPLS and any(t is not None for t in times[n])]
    if "linear" not in names:
        raise ValueError("the F.linear candidate must have been timed")
    inf = float("inf")
    t = {n: [inf if x is None else x for x in times[n]] for n in names}
    best = [min(t[n][j] for n in names) for j in range(len(buckets))]
    free = [n for n in names if not IMPLS[n].copies and not stacked]
    copying = [n for n in names if IMPLS[n].copies or stacked]

    def served(layouts):
        pool = free + list(layouts)
        return [min(t[n][j] for n in pool) for j in range(len(buckets))]

    def overall(layouts):
        s = served(layouts)
        return sum(s[j] / best[j] for j in range(len(buckets)))

    chosen = None
    most = min(len(copying), max_copies)
    sizes = range(0, most + 1) if free else range(1, max(most, 1) + 1)  # a stack holds one layout at least
    for size in sizes:
        options = [(overall(layouts), layouts) for layouts in itertools.combinations(copying, size)
                   if all(x <= b * (1 + tolerance) for x, b in zip(served(layouts), best))]
        if options:
            chosen = min(options)[1]
            break
    if chosen is None:  # no set within the cap serves every bucket: the fastest overall
        chosen = min((overall(ls), ls) for size in sizes for ls in itertools.combinations(copying, size))[1]
    pool = free + list(chosen)
    impls = {}
    for j, b in enumerate(buckets):
        fastest = min(pool, key=lambda n: t[n][j])
        own = "linear" in pool and t["linear"][j] <= t[fastest][j] * (1 + tolerance)
        impls[b] = "linear" if own else fastest
    us = {n: [None if x is None else round(x * 1e6, 2) for x in times[n]] for n in times}
    return ShapeChoice(tuple(shape), tuple(buckets), impls, us, stacked)


def _agrees(y: torch.Tensor, ref: torch.Tensor, exact: bool = True) -> bool:
    """y is F.linear's product `ref`, to the weight's precision (bf16's where not `exact`)."""
    if y.shape != ref.shape or not torch.isfinite(y).all():
        return False
    tol = 1e-4 if ref.dtype == torch.float32 and exact else 2e-2
    return bool((y.float() - ref.float()).abs().max() <= tol * (ref.float().abs().max() + 1e-6))


@torch.inference_mode()
def measure(weight: torch.Tensor, bias: torch.Tensor | None, buckets: Sequence[int] = BUCKETS,
            time_fn: TimeFn = wall_time, reps: int = 3, impls: Sequence[str] | None = None,
            approximate: bool = False) -> dict[str, list]:
    """Seconds per product of each candidate at each bucket (the minimum over `reps`
    interleaved rounds: a busy machine slows every candidate of a round alike). A candidate
    that does not build or run here, or disagrees with F.linear, gets None throughout; the
    approximate ones are candidates only with `approximate`."""
    shape = tuple(weight.shape)
    g = torch.Generator(device="cpu").manual_seed(0)
    xs = {n: torch.randn(1, n, shape[1], generator=g).to(weight.device, weight.dtype) for n in buckets}
    names = [n for n in (impls or IMPLS) if IMPLS[n].exact or approximate]
    fns = {}
    for name in names:
        impl = IMPLS[name]
        try:
            if not impl.available(weight):
                continue
            fn = impl.build(weight, bias)
            if all(_agrees(fn(x), F.linear(x, weight, bias), impl.exact) for x in (xs[buckets[0]], xs[buckets[-1]])):
                fns[name] = fn
        except (RuntimeError, TypeError, AttributeError, NotImplementedError):
            continue
    times = {name: [None] * len(buckets) for name in names}
    for n in buckets:  # warm-up: each candidate's first call at each size (allocations, packing)
        for fn in fns.values():
            fn(xs[n])
    for _ in range(reps):
        for j, n in enumerate(buckets):
            for name, fn in fns.items():
                s = time_fn(fn, xs[n], impl=name, shape=shape, n=n)
                times[name][j] = s if times[name][j] is None else min(times[name][j], s)
    return times


def cache_key(shape, dtype, buckets, reps: int, approximate: bool = False, stacked: bool = False) -> dict:
    return {**machine.machine_key(), "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "buckets": list(buckets), "impls": list(IMPLS), "reps": reps, "version": VERSION,
            "approximate": approximate, "stacked": stacked}


class KernelTable:
    """The choices of one adapter, measured (or read from the cache) one shape at a time."""

    def __init__(self, time_fn: TimeFn | None = None, use_cache: bool | None = None, reps: int = 3,
                 tolerance: float = TOLERANCE, max_copies: int = MAX_COPIES, approximate: bool = False,
                 stacking: bool = True):
        """`time_fn`: the timer (default: wall clock; a test passes fake timings). The disk
        cache is used by default with the real timer only. `approximate`: a weight whose caller
        allows it (`approximate=True`: the draft's) may get an approximate kernel. `stacking`:
        products of one input may run stacked where that measures faster (projections.py)."""
        self.time_fn = time_fn or wall_time
        self.use_cache = time_fn is None if use_cache is None else use_cache
        self.reps, self.tolerance, self.max_copies = reps, tolerance, max_copies
        self.approximate, self.stacking = approximate, stacking
        self.choices: dict[str, ShapeChoice] = {}
        self.roles: dict[str, list[str]] = {}
        self.measure_s = 0.0  # time spent measuring (0 when everything came from the cache)
        self.cached: list[str] = []  # shapes read from the cache

    def key_name(self, weight: torch.Tensor, approximate: bool = False, stacked: bool = False) -> str:
        """The table's name of a weight shape's choice: "576x1536", "576x1536 approx" when the
        weight may take approximate kernels (a choice apart from the exact one of that shape),
        "960x576 stacked" for a stack of weights (every layout of it is a copy: a choice apart)."""
        return (f"{weight.shape[0]}x{weight.shape[1]}" + (" stacked" if stacked else "")
                + (" approx" if approximate and self.approximate else ""))

    def choice(self, weight: torch.Tensor, bias: torch.Tensor | None = None, buckets: Sequence[int] = BUCKETS,
               role: str | None = None, max_copies: int | None = None, approximate: bool = False,
               stacked: bool = False) -> ShapeChoice:
        """`stacked`: `weight` is a stack of the caller's weights (projections.py)."""
        approximate = approximate and self.approximate
        key_name = self.key_name(weight, approximate, stacked)
        if role is not None and role not in self.roles.setdefault(key_name, []):
            self.roles[key_name].append(role)
        found = self.choices.get(key_name)
        if found is not None and tuple(found.buckets) == tuple(buckets):
            return found
        max_copies = self.max_copies if max_copies is None else max_copies
        key = {**cache_key(weight.shape, weight.dtype, buckets, self.reps, approximate, stacked),
               "max_copies": max_copies}
        cached = machine.read_cached("kernels", key) if self.use_cache else None
        if machine.stale(cached):
            cached = None
        if cached is not None:
            found = ShapeChoice.from_dict(cached)
            self.cached.append(key_name)
        else:
            start, load = time.perf_counter(), machine.load_average()
            times = measure(weight, bias, buckets, self.time_fn, self.reps, approximate=approximate)
            found = choose(times, buckets, self.tolerance, tuple(weight.shape), max_copies, stacked)
            self.measure_s += time.perf_counter() - start
            if self.use_cache:
                machine.write_cached("kernels", key, {**found.to_dict(), "measured_load": load})
        self.choices[key_name] = found
        return found

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, buckets: Sequence[int] = BUCKETS,
               role: str | None = None, max_copies: int | None = None, approximate: bool = False,
               stacked: bool = False) -> "Linear":
        """`weight` in this table's layout; `approximate`: its caller allows approximate kernels;
        `stacked`: `weight` is a stack of the caller's weights."""
        choice = self.choice(weight, bias, buckets, role, max_copies, approximate, stacked)
        return Linear(weight, bias, choice, self.key_name(weight, approximate, stacked))

    def to_dict(self, itemsize: int = 4, counts: dict[str, int] | None = None) -> dict:
        """The table for reports: per shape its roles, kernel per bucket, times, and the MB
        its copies cost (times the number of weights of that shape in `counts`, by key name:
        the approximate choice of a shape is a row apart)."""
        rows = []
        for name, c in self.choices.items():
            k = 1 if counts is None else counts.get(name, 0)  # weights of that shape held now
            rows.append({"shape": name, "roles": self.roles.get(name, []), "weights": k,
                         "buckets": list(c.buckets), "kernels": [c.impls[b] for b in c.buckets],
                         "copies": c.copies, "extra_mb": round(k * c.extra_mb(itemsize), 1), "times_us": c.times_us})
        return {"mode": "auto" if self.approximate else "precise", "shapes": rows,
                "extra_mb": round(sum(r["extra_mb"] for r in rows), 1),
                "measure_s": round(self.measure_s, 2), "cached": list(self.cached)}


class Linear:
    """One weight in the adapter's layout: the chosen kernel per bucket, built once. Holds only
    the copies its buckets use; `linear`/`wx` run on the model's own weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: ShapeChoice, key: str | None = None):
        """`key`: the table's name of the choice (default: the shape's). A stacked choice's
        Linear does not hold `weight` (the stack) beyond what its kernels hold."""
        built = {name: IMPLS[name].build(weight, bias) for name in dict.fromkeys(choice.impls.values())}
        self.buckets = tuple(choice.buckets)
        self.fns = tuple(built[choice.impls[b]] for b in self.buckets)
        self.names = tuple(choice.impls[b] for b in self.buckets)
        self.key = key or f"{weight.shape[0]}x{weight.shape[1]}"
        self.extra_bytes = choice.extra_bytes(weight.element_size())
        self.weight = None if choice.stacked else weight
        if "transposed" in built and "linear" not in built and "wx" not in built:
            self.weight = built["transposed"].keywords["weight"]  # the same values, on the copy

    def fn(self, n: int) -> Callable:
        """The kernel for products of n rows."""
        return self.fns[self.buckets.index(bucket_of(n, self.buckets))]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x.numel() // x.shape[-1])(x)
