"""The target's precision: which numbers its step computes, and the weight layout that computes
them (owned by the adapter, engine/target.py).

| precision | the decoder's products | the lm_head | activations into a product |
|---|---|---|---|
| `fp32` | fp32, measured kernels (engine/kernels.py); HF's numbers | fp32 | fp32 |
| `bf16` | bf16 weights | bf16 | rounded to bf16 |
| `int8` | GGUF Q8_0 blocks | Q8_0 | int8 per 32 values |
| `int4` | GGUF Q4_1 blocks | Q8_0 (as llama.cpp's Q4_1 files ship it) | int8 per 32 values |
| `auto` | what the weights ship in: a GGUF's own blocks (SmolLM2's Q4_1 file: `int4`, no round trip through fp32), else the checkpoint's dtype | | |

Every precision but fp32 runs the engine's own attention (engine/native.py) over a K/V cache
stored in fp16 (`TargetModel.kv_dtype`; as llama.cpp's default cache: half the bytes a step's
attention reads), and keeps norms, rotary, residuals and the attention's arithmetic in fp32. Each gives a row the same bits whatever the number of rows in the
pass (tests/test_precision.py), so speculative output equals plain decoding at that precision
token for token. How far each is from fp32: docs/PERFORMANCE.md, "Precision"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dflash.engine import lowbit, native, pages
from dflash.engine.projections import Projections, mlp_fn, norm_fn, split_outputs

PRECISIONS = ("auto", "fp32", "bf16", "int8", "int4")
FORMATS = {"int8": ("q8_0", "q8_0"), "int4": ("q4_1", "q8_0")}  # precision -> (layers, lm_head)
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


class PrecisionError(ValueError):
    """A precision this target or machine cannot run, with the reason."""


def resolve(precision: str, model, gguf: Path | None = None) -> str:
    """The precision `precision` means for `model` (loaded from `gguf` when given): `auto` is
    the GGUF's own formats where the engine reads them and its kernels have their fast code on
    this CPU (AVX-512 VNNI or AVX2), else the checkpoint's dtype."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    if gguf is not None and native.fast_path():
        found = gguf_formats(gguf)
        for name, (layers, head) in FORMATS.items():
            if found == {layers, head} or found == {layers}:
                return name
    dtype = model.get_input_embeddings().weight.dtype
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def gguf_formats(path: Path) -> set[str]:
    """The block formats of a GGUF's 2-D weights (names as lowbit.FORMATS; others as ggml names)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {lowbit.GGUF_BLOCK.get(t.tensor_type.name, (t.tensor_type.name,))[0]
            for t in reader.tensors if len(t.shape) == 2}


def check(precision: str, model, static: bool) -> None:
    """Raise PrecisionError when `precision` (resolved) cannot run on this target here."""
    if precision == "fp32":
        return
    if not static:
        raise PrecisionError(f"precision {precision} runs on the static decoder's Llama-family targets; "
                             f"{model.config.model_type!r} runs at fp32 (--precision fp32)")
    if not native.available():
        raise PrecisionError(f"precision {precision} needs the engine's native kernels, which are not "
                             f"available here: {native.problem()} (--precision fp32 runs without them)")


# ---- the layouts ---------------------------------------------------------------------------
class Bf16Linear:
    """A bf16 copy of a weight; the input rounded to bf16, the product back to fp32. Used only
    where the machine's bf16 product gives each row the same bits at every row count (checked
    per shape at load); elsewhere one product per row."""

    buckets = (1,)

    def __init__(self, weight: torch.Tensor, invariant: dict[tuple, bool]):
        self.w = weight.detach().to(torch.bfloat16).contiguous()
        self.n, self.k = self.w.shape
        self.key = f"{self.n}x{self.k} bf16"
        self.extra_bytes = self.w.numel() * 2
        shape = tuple(self.w.shape)
        if shape not in invariant:
            invariant[shape] = _rows_invariant(self._product, self.k)
        self.per_row = not invariant[shape]
        self.names = ("bf16 by row",) if self.per_row else ("bf16",)

    def _product(self, x):
        return F.linear(x.to(torch.bfloat16), self.w).float()

    def fn(self, n: int):
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.k)
        if not self.per_row or rows.shape[0] == 1:
            return self._product(x)
        return torch.cat([self._product(r[None]) for r in rows]).reshape(*x.shape[:-1], self.n)


def _rows_invariant(product: Callable, k: int) -> bool:
    """The product's rows at 1, 5, 16 and 32 rows in one call are the bits of one-row calls."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, k, generator=gen)
    one = torch.cat([product(x[i:i + 1]) for i in range(32)])
    return all(torch.equal(product(x[:m]), one[:m]) for m in (5, 16, 32))


@dataclass
class LayerWeights:
    """One decoder layer's products in a precision's layout (q/k/v and gate/up stacked)."""
    qkv: Callable
    o: Callable
    gate_up: Callable
    down: Callable
    sizes: tuple[list[int], list[int]]  # the q/k/v and gate/up output sizes, to split the stacks


class PrecisionLayout:
    """A Llama-family target's decoder and lm_head at one precision other than fp32, in the
    adapter's own layout (the model is not changed): `for_tokens(n)` gives the per-layer
    `Projections` static_decoder runs (the same at every n: no per-bucket kernels, so no row
    depends on the bucket), `head(hidden)` the logits."""

    def __init__(self, model, precision: str, gguf: Path | None = None, fuse: bool = True):
        """`fuse`: run a Llama layer as one native call where it can (False: op by op, as the
        profile's split of a step into products, attention and the rest)."""
        self.precision = precision
        self.source = "fp32 weights"
        self.paged_out = 0  # bytes of the model's fp32 weights handed back to the file (pages.py)
        blocks = None
        if precision in FORMATS and gguf is not None:
            blocks = GGUFBlocks(model, gguf, FORMATS[precision])
            self.source = f"{Path(gguf).name} (its own blocks)" if blocks.usable else self.source
            blocks = blocks if blocks.usable else None
        invariant: dict[tuple, bool] = {}

        def make(weights: list[torch.Tensor], names: list[str], layer: int | None, fmt: str):
            if precision == "bf16":
                return Bf16Linear(torch.cat(weights), invariant)
            parts = [(blocks.get(layer, n, fmt) if blocks is not None else None) or lowbit.quantize(w, fmt)
                     for w, n in zip(weights, names)]
            return lowbit.QLinear(lowbit.Blocks.stack(parts) if len(parts) > 1 else parts[0])

        layer_fmt, head_fmt = FORMATS.get(precision, ("", ""))
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            gu = [mlp.gate_proj, mlp.up_proj]
            if any(m.bias is not None for m in qkv + gu + [attn.o_proj, mlp.down_proj]):
                raise PrecisionError(f"precision {precision} runs projections without bias; this target's have one "
                                     "(--precision fp32 runs it)")
            self.layers.append(LayerWeights(
                make([m.weight for m in qkv], ["q_proj", "k_proj", "v_proj"], i, layer_fmt),
                make([attn.o_proj.weight], ["o_proj"], i, layer_fmt),
                make([m.weight for m in gu], ["gate_proj", "up_proj"], i, layer_fmt),
                make([mlp.down_proj.weight], ["down_proj"], i, layer_fmt),
                ([m.weight.shape[0] for m in qkv], [m.weight.shape[0] for m in gu])))
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise PrecisionError(f"precision {precision} runs an lm_head without bias; this target's has one "
                                 "(--precision fp32 runs it)")
        self.head = make([head.weight], ["lm_head"], None, head_fmt)
        scale = model.model.layers[0].self_attn.scaling
        fused = fuse and _fusable(model, self.layers)
        self._projections = [
            Projections(split_outputs(w.qkv, w.sizes[0]), w.o,
                        mlp_fn(split_outputs(w.gate_up, w.sizes[1]), w.down, layer.mlp.act_fn),
                        norm_fn(layer.input_layernorm), norm_fn(layer.post_attention_layernorm), _attend(scale))
            for w, layer in zip(self.layers, model.model.layers)]
        self.fused = fused
        self.whole = _whole_model(model, self.layers, scale) if fused else None  # every layer in one call
        if blocks is not None:  # checked against the GGUF and not read again here: back to the file
            self.paged_out = pages.page_out(blocks.checked)

    def for_tokens(self, n: int) -> list[Projections]:
        return self._projections

    @property
    def linears(self) -> list:
        return [lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [self.head]

    @property
    def extra_bytes(self) -> int:
        return sum(lin.extra_bytes for lin in self.linears)

    def info(self) -> dict:
        kinds: dict[str, int] = {}
        for lin in self.linears:
            kinds[lin.key] = kinds.get(lin.key, 0) + 1
        return {"precision": self.precision, "source": self.source, "weights": kinds,
                "mb": round(self.extra_bytes / 2**20, 1),
                "fp32_paged_out_mb": round(self.paged_out / 2**20, 1),
                "kernels": sorted({n for lin in self.linears for n in getattr(lin, "names", ())}),
                "native": f"{native.SIMD_NAMES[native.simd()]} ({native.build_dir().name})"}


def _fusable(model, layers: list[LayerWeights]) -> bool:
    """The layers can run as one native call (csrc/layer.cpp): Llama layers (RMSNorm,
    SiLU, no q/k norms) whose products are all block weights with no padded rows."""
    first = model.model.layers[0]
    return (type(first.input_layernorm).__name__ in ("LlamaRMSNorm", "MistralRMSNorm")
            and getattr(model.config, "hidden_act", None) == "silu" and not hasattr(first.self_attn, "q_norm")
            and all(isinstance(lin, lowbit.QLinear) and lin.padded == lin.n
                    for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)))


NO_MASK = torch.empty(0, dtype=torch.bool)  # a causal segment of llama_forward


def _whole_model(model, layers: list[LayerWeights], scale: float):
    op = torch.ops.dflash_lowbit.llama_forward
    lins = [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
    weights = [t for lin in lins for t in (lin.u, lin.d, lin.m)]
    bits = [lin.bits for lin in lins]
    norms = torch.stack([torch.stack([layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()])
                         for layer in model.model.layers]).float().contiguous()  # (L, 2, H)
    first = model.model.layers[0].input_layernorm
    eps, heads = float(first.variance_epsilon), model.config.num_attention_heads

    def run(x, cos, sin, kvs, counts: list[int], trees, keep: list[int]):
        """x (1, T, H): the new rows of one or more sequences, `counts` (one per sequence) of them
        in order, each sequence's K/V in its KVBuffer of `kvs`, written at its length.., its rows
        masked by its tree of `trees` ((count, count) bool; None: causal) -> (x after the last
        layer, [x after each layer of `keep`]), each (1, T, H)."""
        t = x.shape[1]
        masks = [NO_MASK if tree is None else tree for tree in trees]
        out = op(x.reshape(t, -1).contiguous(), weights, bits, norms, eps, cos.contiguous(), sin.contiguous(),
                 [kv.k for kv in kvs], [kv.v for kv in kvs], [kv.length for kv in kvs], counts, masks, scale, heads,
                 keep)
        return out[0].view(1, t, -1), [f.view(1, t, -1) for f in out[1:]]

    return run



def _attend(scale: float):
    op = torch.ops.dflash_lowbit.attend

    def attend(q, keys, values, past, tree):
        """q (T, NH, D); keys, values (KV, S, D): the layer's buffer -> (T, NH, D)."""
        return op(q, keys, values, past, tree, scale)

    return attend


class GGUFBlocks:
    """The blocks of a GGUF whose dequantised weights the model holds, by layer and projection,
    checked against the model's weights at load (the same numbers, or not used)."""

    def __init__(self, model, path: Path, formats: tuple[str, str]):
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.model, self.formats = model, formats
        self.checked: list[torch.Tensor] = []  # the model's weights these blocks replace (read once, for the check)
        cfg = model.config
        self.heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        self.usable = all(self._fmt(name) in formats for name in self.tensors
                          if name.startswith("blk.") and len(self.tensors[name].shape) == 2)

    def _fmt(self, name: str) -> str | None:
        t = self.tensors.get(name)
        return None if t is None else lowbit.GGUF_BLOCK.get(t.tensor_type.name, (None,))[0]

    def get(self, layer: int | None, proj: str, fmt: str) -> lowbit.Blocks | None:
        """The blocks of `proj` of `layer` (None: the lm_head) when the GGUF stores it as `fmt`."""
        if layer is None:
            name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
            weight = self.model.get_output_embeddings().weight
        else:
            short = GGUF_NAMES[proj]
            name = f"blk.{layer}.{short}.weight"
            module = self.model.model.layers[layer]
            weight = getattr(module.self_attn if short.startswith("attn") else module.mlp, proj).weight
        if self._fmt(name) != fmt:
            return None
        blocks = lowbit.gguf_blocks(self.tensors[name])
        if layer is not None and short in self.heads:  # q and k rows as HF orders them
            blocks = blocks.rows(lowbit.unpermute_rows(blocks.shape[0], self.heads[short]))
        if not torch.equal(blocks.dequantize(), weight.detach().float().cpu()):
            raise PrecisionError(f"{name} of the GGUF does not dequantise to the model's {proj} weight: "
                                 "the model was not loaded from this GGUF")
        self.checked.append(weight.detach())
        return blocks
