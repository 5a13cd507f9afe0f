"""The target adapter: any HF causal LM seen through the few operations DFlash needs."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from dflash.engine import static_decoder
from dflash.engine.cache import StaticTargetCache, TargetCache
from dflash.engine.config import DFlashConfig
from dflash.engine.request import TargetInfo, check_pair


class TargetModel:
    """Wraps an HF `*ForCausalLM`: embedding and lm_head for the draft, and forward passes
    that return logits plus the chosen layers' hidden states, on a cache that rolls back."""

    def __init__(self, model: nn.Module, static: bool | None = None):
        """`static`: run Llama-family targets through `static_decoder` on a preallocated KV
        buffer (same numbers, less per-step work); None = whenever the model supports it."""
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
        """hidden: (B, T, H) -> (B, T, V), or (B, T, K) over `head_rows` (K, H) of the lm_head."""
        logits = self.head(hidden) if head_rows is None else F.linear(hidden, head_rows)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The lm_head rows of `ids` (K,) as one contiguous (K, H) matrix."""
        if getattr(self.head, "bias", None) is not None:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        return self.head.weight.index_select(0, ids.to(self.head.weight.device)).contiguous()

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
            return static_decoder.forward(self.model, ids, positions, cache.kv, None, layer_ids)
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
    return target if isinstance(target, TargetModel) else TargetModel(target)


def check_compatible(config: DFlashConfig, target: TargetModel) -> None:
    """Raise IncompatibleDraftError naming every mismatch between draft and target."""
    check_pair(config, target.info)
