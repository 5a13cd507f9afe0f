"""The target adapter: any HF causal LM seen through the few operations DFlash needs."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash.engine import kernels as kernel_choice
from dflash.engine import pages
from dflash.engine import precision as precisions
from dflash.engine import projections
from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache, TargetCache
from dflash.engine.config import DFlashConfig
from dflash.engine.request import TargetInfo, check_pair


HEAD_ROWS_KEPT = 4  # draft vocabularies whose head rows an adapter keeps built


@dataclass(frozen=True)
class HeadRows:
    """Some rows of the target's lm_head (a draft vocabulary's), in the adapter's layout:
    `weight` (K, H) and the kernel that runs them (`linear`; None: F.linear on `weight`)."""
    ids: tuple[int, ...]
    weight: torch.Tensor  # (K, H)
    linear: kernel_choice.Linear | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> (..., K); the differentiable product where autograd must see it
        (the measured kernels are inference kernels)."""
        if self.linear is None or (torch.is_grad_enabled() and hidden.requires_grad):
            return F.linear(hidden, self.weight)
        return self.linear(hidden)


class TargetModel:
    """Wraps an HF `*ForCausalLM`: embedding and lm_head for the draft, and forward passes
    that return logits plus the chosen layers' hidden states, on a cache that rolls back."""

    def __init__(self, model: nn.Module, static: bool | None = None, kernels: str = "auto",
                 time_fn: kernel_choice.TimeFn | None = None, stacking: bool = True,
                 precision: str = "auto", gguf: str | Path | None = None, fuse: bool = True):
        """`static`: run Llama-family targets through `static_decoder` on a preallocated KV
        buffer (same numbers, less per-step work); None = whenever the model supports it.
        `kernels`: "auto" times the matrix-product candidates of every linear shape and of the
        lm_head at load (on CPU; cached per machine, so once) and runs the fastest from the
        adapter's own weight layout (engine/kernels.py; the model is not changed; its weights
        are copied where a kernel wants another layout, so weights changed afterwards are seen
        by a new TargetModel only), and lets the draft's linears (and its lm_head rows) take an
        approximate kernel, bf16, where that measures faster (a proposal changes what is
        verified, not the output); "precise" measures the same but keeps every product at the
        weights' precision; "torch" runs the model's own modules, HF's numbers exactly.
        `time_fn`: the kernel timer (tests pass fake timings; nothing is cached then).
        `stacking`: a layer's q/k/v (and gate/up) may run as one product on their weights
        stacked where that measures faster (engine/projections.py; False: never, for A/B runs).
        `precision`: the numbers the target's step computes (engine/precision.py): "fp32" (HF's,
        on the kernels above), "bf16", "int8", "int4", or "auto", the precision the weights ship
        in: `gguf`'s own blocks when the model was loaded from that GGUF, else the model's dtype.
        `fuse`: below fp32, a Llama layer runs as one native call (False: op by op, for profiles)."""
        if kernels not in kernel_choice.MODES:
            raise ValueError(f"kernels must be one of {kernel_choice.MODES}, got {kernels!r}")
        if isinstance(model, TargetModel):
            raise TypeError("already a TargetModel")
        self.model = model.eval()
        cfg = model.config
        tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.embed_weight = model.get_input_embeddings().weight  # (V, H)
        self.head = model.get_output_embeddings()
        self.softcap = getattr(tc, "final_logit_softcapping", None)
        # the decoder stack without the lm_head: verification applies the head lazily
        self.decoder = model.get_decoder()
        self.static = static_decoder.supports(model) if static is None else static
        if self.static and not static_decoder.supports(model):
            raise ValueError(f"the static decoder does not support model_type {model.config.model_type!r} "
                             f"(it covers {', '.join(static_decoder.FAMILIES)} with full attention)")
        # transformers >= 5.2x names the cache argument `cache` (`past_key_values` before)
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.info = TargetInfo(
            num_layers=tc.num_hidden_layers,
            hidden_size=tc.hidden_size,
            vocab_size=self.embed_weight.shape[0],
            max_positions=getattr(tc, "max_position_embeddings", None) or 1 << 30,
            model_type=getattr(tc, "model_type", "?"),
        )
        self.gguf = Path(gguf) if gguf is not None else None  # the file the model was loaded from, if one
        self.precision = precisions.resolve(precision, model, self.gguf)
        precisions.check(self.precision, model, self.static)
        self.layout: precisions.PrecisionLayout | None = None  # the decoder and lm_head below fp32
        if self.precision != "fp32":
            self.layout = precisions.PrecisionLayout(model, self.precision, self.gguf, fuse)
        self._build_kernels(kernels, time_fn, stacking)

    def _build_kernels(self, kernels: str, time_fn, stacking: bool = True) -> None:
        """The adapter's weight layout: the decoder's projections (static decoder only) and the
        lm_head, each with its measured kernel per token-count bucket. On other devices than
        the CPU, "auto" is "torch" (their BLAS has no such small-M pitfall to measure)."""
        self.kernels = kernels if self.device.type == "cpu" else "torch"
        self.kernel_table: kernel_choice.KernelTable | None = None
        self.linears: projections.DecoderLinears | None = None  # static_decoder.forward(..., linears=)
        self._head: kernel_choice.Linear | None = None
        # draft vocabularies' head rows, built once per vocabulary (a request's proposer asks for
        # them again): the id list -> its HeadRows, the last HEAD_ROWS_KEPT vocabularies
        self.head_rows_built: dict[tuple[int, ...], HeadRows] = {}
        if self.layout is not None:  # the decoder and the head run the precision's layout
            self.linears, self._head = self.layout, self.layout.head
        if self.kernels == "torch":
            return
        self.kernel_table = kernel_choice.KernelTable(time_fn, approximate=self.kernels == "auto", stacking=stacking)
        if self.layout is not None:
            return  # the table serves the draft's linears and head rows
        if self.static and projections.supports_mlp(self.model):
            self.linears = projections.DecoderLinears(self.model, self.kernel_table)
        if isinstance(self.head, nn.Linear):
            self._head = self.kernel_table.linear(self.head.weight, self.head.bias, kernel_choice.HEAD_BUCKETS,
                                                  role="lm_head", max_copies=kernel_choice.HEAD_MAX_COPIES)

    def kernel_info(self, draft_layout=None) -> dict:
        """The kernel table for reports: mode, and per weight shape its roles, the kernel per
        bucket, the measured times, and the MB the adapter's copies cost (with a draft's layout,
        `draft_layout(draft)`, its weights counted too)."""
        if self.kernel_table is None:
            return {"mode": self.kernels, "precision": self.precision_info()}
        counts = dict(self.linears.counts) if isinstance(self.linears, projections.DecoderLinears) else {}
        drafts = list(draft_layout.linears) if draft_layout is not None else []
        for lin in [self._head] + [rows.linear for rows in self.head_rows_built.values()] + drafts:  # None: F.linear
            if lin is not None:
                counts[lin.key] = counts.get(lin.key, 0) + 1
        return {**self.kernel_table.to_dict(self.embed_weight.element_size(), counts),
                "precision": self.precision_info()}

    def precision_info(self) -> dict:
        """The precision the step runs at, where its weights came from and what they cost."""
        if self.layout is None:
            return {"precision": self.precision, "source": "the model's weights"}
        return self.layout.info()

    @property
    def device(self):
        return self.embed_weight.device

    @property
    def dtype(self):
        return self.embed_weight.dtype

    def embed(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Raw embedding rows (no model-specific scaling), as the draft's noise embedding."""
        out = F.embedding(ids, self.embed_weight)  # (B, T, H)
        return out * scale if scale != 1.0 else out

    def logits(self, hidden: torch.Tensor, head_rows: HeadRows | None = None) -> torch.Tensor:
        """hidden: (B, T, H) -> (B, T, V), or (B, T, K) over `head_rows` (`head_rows(ids)`).
        The measured kernels are inference kernels (oneDNN's has no backward): a call autograd
        must see (training a draft through the frozen head) runs the differentiable product."""
        grad = torch.is_grad_enabled() and hidden.requires_grad
        if head_rows is None:
            logits = self.head(hidden) if self._head is None or grad else self._head(hidden)
        else:
            logits = head_rows(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_rows(self, ids: torch.Tensor, measured: bool = True) -> HeadRows:
        """The lm_head rows of `ids` (K,), for the draft's proposals; with measured kernels (and
        `measured`), run by their measured kernel, which may be approximate as the draft's
        linears are. The same ids give the same HeadRows: built once, kept for the last
        HEAD_ROWS_KEPT vocabularies (`measured=False`: a few rows for one request, not kept)."""
        if getattr(self.head, "bias", None) is not None:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        key = tuple(ids.tolist())
        if key in self.head_rows_built:
            return self.head_rows_built[key]
        rows = self.head.weight.detach().index_select(0, ids.to(self.head.weight.device)).contiguous()  # (K, H)
        if not measured:  # a few rows: their pages may stay
            return HeadRows(key, rows)
        if self.layout is not None and self.layout.paged_out:  # a vocabulary's rows touch most of the fp32
            pages.page_out([self.head.weight])  # head, which the target's pass does not read: back to the file
        built = HeadRows(key, rows)
        if self.kernel_table is not None:
            lin = self.kernel_table.linear(rows, None, kernel_choice.HEAD_BUCKETS, role="draft lm_head",
                                           max_copies=kernel_choice.HEAD_MAX_COPIES, approximate=True)
            built = HeadRows(key, rows if lin.weight is None else lin.weight, lin)
        while len(self.head_rows_built) >= HEAD_ROWS_KEPT:
            self.head_rows_built.pop(next(iter(self.head_rows_built)))  # the oldest vocabulary
        self.head_rows_built[key] = built
        return built

    def draft_layout(self, draft: nn.Module):
        """A draft's linears as this adapter's measured kernels (`draft.kernel_layout`), built
        now from the draft's current weights (the caller keeps it: a Pipeline builds it once);
        None with kernels="torch" (the draft's own modules run)."""
        if self.kernel_table is None or not hasattr(draft, "kernel_layout"):
            return None
        return draft.kernel_layout(self.kernel_table)

    def new_cache(self, capacity: int | None = None) -> TargetCache | StaticTargetCache:
        """A cache for one sequence; `capacity`: the positions it will hold at most (the static
        buffer is allocated, zeroed, at that size, and grows past it; None: 1024)."""
        if not self.static:
            return TargetCache(self.model.config)
        return StaticTargetCache(self.model, 1024 if capacity is None else max(capacity, 1), self.kv_dtype)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The K/V cache's storage: float16 below fp32 (the engine's own attention reads it,
        half the bytes of a step's attention; as llama.cpp's default cache), else the model's
        dtype (None: HF's numbers at fp32)."""
        return torch.float16 if self.layout is not None else None

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None):
        """ids: (B, T) at positions cache.length .. cache.length+T-1. Returns the final
        (normed) hidden states (B, T, H), ready for `logits`, and the chosen layers' outputs
        (B, T, k*H) or None."""
        start = cache.length
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]  # (1, T)
        if isinstance(cache, StaticTargetCache):
            if ids.shape[0] != 1:
                raise ValueError("the static target cache holds one sequence")
            cache.kv.reserve(start + ids.shape[1])
            return static_decoder.forward(self.model, ids, positions, cache.kv, None, layer_ids, linears=self.linears)
        out = self.decoder(input_ids=ids, position_ids=positions, use_cache=True,
                           output_hidden_states=bool(layer_ids), **{self._cache_arg: cache.hf})
        hidden = None
        if layer_ids:
            hidden = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (B, T, k*H)
        return out.last_hidden_state, hidden

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None,
                logits_to_keep: int = 0):
        """As `forward_hidden`, with the logits (B, T or logits_to_keep, V) of the last rows."""
        final, hidden = self.forward_hidden(ids, cache, layer_ids)
        return self.logits(final[:, -logits_to_keep:]), hidden


def as_target(target) -> TargetModel:
    """`target` itself when it is a TargetModel; else an adapter of the bare HF model that runs
    its own modules (kernels="torch": nothing measured or copied, so a call costs nothing to
    set up). Wrap a model once in `TargetModel(model)` for the measured kernels and precisions."""
    if isinstance(target, TargetModel):
        return target
    return TargetModel(target, kernels="torch")


def check_compatible(config: DFlashConfig, target: TargetModel) -> None:
    """Raise IncompatibleDraftError naming every mismatch between draft and target."""
    check_pair(config, target.info)
