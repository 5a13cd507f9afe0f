"""The target adapter: any HF causal LM seen through the few operations DFlash needs."""

from __future__ import annotations

import inspect
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash.engine import kernels as kernel_choice
from dflash.engine import precision as precisions
from dflash.engine import projections
from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache, TargetCache
from dflash.engine.config import DFlashConfig
from dflash.engine.request import TargetInfo, check_pair


HEAD_ROWS_KEPT = 4  # draft vocabularies whose head rows an adapter keeps built


class TargetModel:
    """Wraps an HF `*ForCausalLM`: embedding and lm_head for the draft, and forward passes
    that return logits plus the chosen layers' hidden states, on a cache that rolls back."""

    def __init__(self, model: nn.Module, static: bool | None = None, kernels: str = "auto",
                 time_fn: kernel_choice.TimeFn | None = None, stacking: bool = True,
                 precision: str = "auto", gguf: str | Path | None = None):
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
        in: `gguf`'s own blocks when the model was loaded from that GGUF, else the model's dtype."""
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
            self.layout = precisions.PrecisionLayout(model, self.precision, self.gguf)
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
        # them again): ids -> (rows, their Linear or None), the last HEAD_ROWS_KEPT vocabularies
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, kernel_choice.Linear | None]] = {}
        self._drafts: dict[int, tuple] = {}  # id(draft) -> (weakref to it, its weights' version, its DraftLayout)
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

    def kernel_info(self) -> dict:
        """The kernel table for reports: mode, and per weight shape its roles, the kernel per
        bucket, the measured times, and the MB the adapter's copies cost."""
        if self.kernel_table is None:
            return {"mode": self.kernels, "precision": self.precision_info()}
        counts = dict(self.linears.counts) if isinstance(self.linears, projections.DecoderLinears) else {}
        drafts = [lin for ref, _, layout in self._drafts.values() if ref() is not None for lin in layout.linears]
        for lin in [self._head] + [lin for _, lin in self._rows.values()] + drafts:
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

    def logits(self, hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: (B, T, H) -> (B, T, V), or (B, T, K) over `head_rows` (K, H) of the lm_head.
        The measured kernels are inference kernels (oneDNN's has no backward): a call autograd
        must see (training a draft through the frozen head) runs the differentiable product."""
        grad = torch.is_grad_enabled() and hidden.requires_grad
        if head_rows is None:
            logits = self.head(hidden) if self._head is None or grad else self._head(hidden)
        else:
            lin = next((lin for rows, lin in self._rows.values() if rows is head_rows), None) if not grad else None
            logits = F.linear(hidden, head_rows) if lin is None else lin(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The lm_head rows of `ids` (K,) as one (K, H) matrix, for the draft's proposals; with
        measured kernels, in the layout its kernel wants (`logits(hidden, rows)` then runs
        that kernel, which may be approximate as the draft's linears are). The same ids give
        the same tensor: built once, kept for the last HEAD_ROWS_KEPT vocabularies."""
        if getattr(self.head, "bias", None) is not None:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        key = tuple(ids.tolist())
        if key in self._rows:
            return self._rows[key][0]
        rows = self.head.weight.detach().index_select(0, ids.to(self.head.weight.device)).contiguous()  # (K, H)
        lin = None
        if self.kernel_table is not None:
            lin = self.kernel_table.linear(rows, None, kernel_choice.HEAD_BUCKETS, role="draft lm_head",
                                           max_copies=kernel_choice.HEAD_MAX_COPIES, approximate=True)
            rows = lin.weight  # the copy itself when its kernel needs no other layout
        while len(self._rows) >= HEAD_ROWS_KEPT:
            self._rows.pop(next(iter(self._rows)))  # the oldest vocabulary
        self._rows[key] = (rows, lin)
        return rows

    def draft_layout(self, draft: nn.Module):
        """A draft's linears as this adapter's measured kernels (`draft.kernel_layout`), built
        once per draft and rebuilt when its weights change (training); None with
        kernels="torch" (the draft's own modules run)."""
        if self.kernel_table is None or not hasattr(draft, "kernel_layout"):
            return None
        version = _weight_versions(draft)
        entry = self._drafts.get(id(draft))
        if entry is not None and entry[0]() is draft and entry[1] == version:
            return entry[2]
        layout = draft.kernel_layout(self.kernel_table)
        self._drafts = {k: v for k, v in self._drafts.items() if v[0]() is not None}
        self._drafts[id(draft)] = (weakref.ref(draft), version, layout)
        return layout

    def new_cache(self) -> TargetCache | StaticTargetCache:
        return StaticTargetCache(self.model) if self.static else TargetCache(self.model.config)

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


def _weight_versions(model: nn.Module) -> int:
    """Changes when any parameter is modified in place (torch counts every in-place write), or
    replaced; an inference-mode tensor has no counter, its storage stands in for it."""
    out = []
    for p in model.parameters():
        try:
            out.append((p.data_ptr(), p._version))
        except RuntimeError:
            out.append((p.data_ptr(), -1))
    return hash(tuple(out))


class AdapterSlot:
    """The adapter last built for a bare HF model, kept by its owner (a draft keeps one), so
    that calls passing the same model again (`dflash_generate(draft, hf_model, ...)` in a loop)
    reuse its weight layout instead of copying the weights each call. Rebuilt when another
    model comes, a weight of it changed in place, or the thread count changed (the measured
    kernels depend on it). It keeps that model alive while its owner lives."""

    def __init__(self):
        self._adapter: TargetModel | None = None
        self._key: tuple | None = None

    def get(self, model: nn.Module) -> TargetModel:
        key = (torch.get_num_threads(), _weight_versions(model))
        if self._adapter is None or self._adapter.model is not model or self._key != key:
            self._adapter, self._key = TargetModel(model), key
        return self._adapter


def as_target(target, slot: AdapterSlot | None = None) -> TargetModel:
    """`target` itself when it is a TargetModel; else the adapter of the HF model, from `slot`
    when one is given (reused while the model and its weights stay the same), else a new one."""
    if isinstance(target, TargetModel):
        return target
    return slot.get(target) if slot is not None else TargetModel(target)


def check_compatible(config: DFlashConfig, target: TargetModel) -> None:
    """Raise IncompatibleDraftError naming every mismatch between draft and target."""
    check_pair(config, target.info)
