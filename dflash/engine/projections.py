"""A decoder layer's projections in the adapter's weight layout (engine/kernels.py measures each
product), with the products that read the same input stacked into one where that pays.

Why stack: a layer's q, k and v products (and its gate and up) read the same rows. At the
token counts of decoding and verifying (1..32 rows) a product's cost is mostly reading its
weight plus a fixed cost per call, so one product on the weights stacked ((q+k+v) x H) does
the same reading in one call: 0.6-0.8x the time of the three at 1-8 rows on a 2-core AMD EPYC
(docs/PERFORMANCE.md), about even at 16-32. Whether it pays is measured like any kernel
(the stack is one more weight shape of the table, "960x576 stacked"), per token-count bucket,
and `plan` decides per group under the same memory rule as a single weight: at most one copy
of the group's weights (the stack is a copy). Its products can differ from the separate ones
in the last bits, as any copying kernel's do; greedy output is checked equal to HF's."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash.engine.kernels import BUCKETS, TOLERANCE, KernelTable, ShapeChoice, bucket_of


def plan(separate: Sequence[ShapeChoice], stacked: ShapeChoice, budget_bytes: int, itemsize: int = 4,
         tolerance: float = TOLERANCE) -> dict[int, bool]:
    """Per bucket, True where a group runs as its stacked product. Three plans: the separate
    products everywhere, the stacked one everywhere, or each bucket's faster one (holding both
    layouts' copies); of those within `budget_bytes` of copies, the one with the fewest bytes
    whose time is within `tolerance` of the best at every bucket, else the fastest overall."""
    buckets = stacked.buckets
    sep = [sum(c.time_us(b) for c in separate) for b in buckets]
    stk = [stacked.time_us(b) for b in buckets]
    best = [min(a, b) for a, b in zip(sep, stk)]
    sep_bytes = sum(c.extra_bytes(itemsize) for c in separate)
    stk_bytes = stacked.extra_bytes(itemsize)
    options = [({b: False for b in buckets}, sep_bytes), ({b: True for b in buckets}, stk_bytes),
               ({b: s < a / (1 + tolerance) for b, a, s in zip(buckets, sep, stk)}, sep_bytes + stk_bytes)]

    def times(use):
        return [stk[j] if use[b] else sep[j] for j, b in enumerate(buckets)]

    def overall(use):
        return sum(t / m for t, m in zip(times(use), best))

    allowed = options[:1] + [(use, size) for use, size in options[1:] if size <= budget_bytes]  # separate: always
    close = [(size, overall(use), k) for k, (use, size) in enumerate(allowed)
             if all(t <= m * (1 + tolerance) for t, m in zip(times(use), best))]
    if close:
        return allowed[min(close)[2]][0]
    return allowed[min((overall(use), k) for k, (use, _) in enumerate(allowed))[1]][0]


def _separate(fns):
    def run(x):
        return tuple(f(x) for f in fns)

    return run


def split_outputs(fn, sizes):
    """x -> fn(x) split along its last dimension into `sizes` (a stacked product's parts)."""
    def run(x):
        return fn(x).split(sizes, dim=-1)

    return run


class Group:
    """Products of one input (a layer's q, k, v; its gate and up) in the table's layout, each
    bucket run separately or as one stacked product (`plan`). `fn(n)(x)` and `group(x)` give
    the products' outputs, a tuple in the order of `weights`."""

    def __init__(self, table: KernelTable, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                 roles: Sequence[str], buckets: Sequence[int] = BUCKETS, approximate: bool = False):
        self.buckets = tuple(buckets)
        self.sizes = [w.shape[0] for w in weights]
        separate = [table.choice(w, b, buckets, role=r, approximate=approximate)
                    for w, b, r in zip(weights, biases, roles)]
        itemsize = weights[0].element_size()
        self.use_stacked = {b: False for b in self.buckets}
        stack = bias = None
        same_input = len({(w.shape[1], w.dtype, w.device) for w in weights}) == 1
        if table.stacking and same_input and len({b is None for b in biases}) == 1:
            stack = torch.cat(list(weights))  # (sum out, in)
            bias = None if biases[0] is None else torch.cat(list(biases))
            stacked = table.choice(stack, bias, buckets, role="+".join(roles), approximate=approximate, stacked=True)
            budget = table.max_copies * stack.numel() * itemsize  # the one-copy rule, for the group
            self.use_stacked = plan(separate, stacked, budget, itemsize, table.tolerance)
        self.parts = ([table.linear(w, b, buckets, role=r, approximate=approximate)
                       for w, b, r in zip(weights, biases, roles)] if not all(self.use_stacked.values()) else [])
        self.stacked = (table.linear(stack, bias, buckets, approximate=approximate, stacked=True)
                        if any(self.use_stacked.values()) else None)
        self.fns = tuple(split_outputs(self.stacked.fn(b), self.sizes) if self.use_stacked[b]
                         else _separate([p.fn(b) for p in self.parts]) for b in self.buckets)

    @property
    def linears(self) -> list:
        """The kernels.Linear objects held (for reports: their keys and copies)."""
        return self.parts + ([self.stacked] if self.stacked is not None else [])

    @property
    def extra_bytes(self) -> int:
        return sum(lin.extra_bytes for lin in self.linears)

    def fn(self, n: int) -> Callable:
        return self.fns[self.buckets.index(bucket_of(n, self.buckets))]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(x.numel() // x.shape[-1])(x)


# ---- the decoder's projections ----------------------------------------------------------------
class Projections(NamedTuple):
    """One decoder layer's projections for one token-count bucket (static_decoder calls these)."""
    qkv: Callable  # h -> (q, k, v)
    o: Callable
    mlp: Callable  # h -> down(act(gate(h)) * up(h))
    norm1: Callable  # the layer's input RMSNorm
    norm2: Callable  # its post-attention RMSNorm
    attend: Callable | None = None  # (q (T, NH, D), keys, values (KV, S, D), past, tree) -> (T, NH, D); None: SDPA


# RMSNorms whose forward is Llama's (x * rsqrt(mean(x^2) + eps), times the weight): in fp32,
# F.rms_norm gives the same bits (checked) in one op instead of seven and a module call
FUSED_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def norm_fn(norm) -> Callable:
    """F.rms_norm with the module's weight and epsilon where that is exactly its forward, else the module."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if type(norm).__name__ not in FUSED_NORMS or w is None or eps is None or w.dtype != torch.float32:
        return norm
    return functools.partial(F.rms_norm, normalized_shape=(w.shape[0],), weight=w, eps=eps)


def mlp_fn(gate_up: Callable, down: Callable, act: Callable) -> Callable:
    """h -> down(act(gate(h)) * up(h)), with `gate_up(h)` giving (gate(h), up(h))."""
    def mlp(h):
        gate, up = gate_up(h)
        return down(act(gate) * up)

    return mlp


def group(table: KernelTable, module, names: Sequence[str], buckets: Sequence[int] = BUCKETS,
          approximate: bool = False, role_prefix: str = "") -> Group:
    """The `names` linears of `module` (e.g. a layer's self_attn and ("q_proj", "k_proj", "v_proj")) as a Group."""
    mods = [getattr(module, n) for n in names]
    return Group(table, [m.weight for m in mods], [m.bias for m in mods], [role_prefix + n for n in names],
                 buckets, approximate)


class DecoderLinears:
    """A Llama-family decoder's projections in the adapter's layout: `for_tokens(n)` gives the
    per-layer `Projections` of n's bucket, precomputed, so a forward looks nothing up per call."""

    def __init__(self, model, table: KernelTable, buckets: Sequence[int] = BUCKETS):
        self.buckets = tuple(buckets)
        layers = model.model.layers
        self.rows = []  # per layer: (qkv Group, o Linear, gate/up Group, down Linear)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.rows.append((group(table, attn, ("q_proj", "k_proj", "v_proj"), buckets),
                              table.linear(attn.o_proj.weight, attn.o_proj.bias, buckets, role="o_proj"),
                              group(table, mlp, ("gate_proj", "up_proj"), buckets),
                              table.linear(mlp.down_proj.weight, mlp.down_proj.bias, buckets, role="down_proj")))
        acts = [layer.mlp.act_fn for layer in layers]
        norms = [(norm_fn(layer.input_layernorm), norm_fn(layer.post_attention_layernorm)) for layer in layers]
        self._by_bucket = {b: [Projections(qkv.fn(b), o.fn(b), mlp_fn(gu.fn(b), down.fn(b), act), *norm)
                               for (qkv, o, gu, down), act, norm in zip(self.rows, acts, norms)]
                           for b in self.buckets}

    def for_tokens(self, n: int) -> list[Projections]:
        return self._by_bucket[bucket_of(n, self.buckets)]

    @property
    def linears(self) -> list:
        """Every kernels.Linear held (a group's separate or stacked ones)."""
        return [lin for row in self.rows for part in row for lin in getattr(part, "linears", [part])]

    @property
    def counts(self) -> dict[str, int]:
        """How many weights of each table entry (key name) are held."""
        out: dict[str, int] = {}
        for lin in self.linears:
            out[lin.key] = out.get(lin.key, 0) + 1
        return out

    @property
    def extra_bytes(self) -> int:
        return sum(lin.extra_bytes for lin in self.linears)


def supports_mlp(model) -> bool:
    """The decoder's MLP is gate/up/down with an elementwise activation (Llama's)."""
    try:
        mlp = model.model.layers[0].mlp
    except (AttributeError, IndexError):
        return False
    return all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
