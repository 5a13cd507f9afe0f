"""The draft's typed configuration, read and written at the boundary as a Qwen3 `config.json`
plus the DFlash keys (docs/METHOD.md §4)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash.engine.errors import ConfigError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: one draft layer reads the middle target layer; otherwise `n` ids
    spread evenly from layer 1 to layer L-3 (e.g. [1, 9, 17, 25, 33] for L=36, n=5)."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ConfigError("num_target_layers and num_draft_layers must be >= 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = max(num_target_layers - 4, 0)
    # Python's round (half to even), as the reference computes it
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40_960
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    # optional draft vocabulary: the token ids the draft may propose (its lm_head uses only
    # these rows, which makes the draft step cheaper; verification stays exact)
    draft_vocab: list[int] | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept for round trips

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        problems = []
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r} (only 'silu' is supported)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if any(t not in ("full_attention", "sliding_attention") for t in self.layer_types):
            problems.append(f"unknown layer_types {sorted(set(self.layer_types))}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need sliding_window")
        if self.draft_vocab is not None and (not self.draft_vocab or min(self.draft_vocab) < 0
                                             or max(self.draft_vocab) >= self.vocab_size):
            problems.append("dflash_config.draft_vocab must hold ids inside the vocabulary")
        if not self.target_layer_ids:
            problems.append("dflash_config.target_layer_ids is empty")
        if self.block_size < 1:
            problems.append(f"block_size={self.block_size} (must be >= 1)")
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) not in (None, "default", "linear"):
            problems.append(f"rope_scaling {self.rope_scaling} (supported: default, linear)")
        if problems:
            raise ConfigError("invalid draft config: " + "; ".join(problems))

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    # ---- HF config.json boundary -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        known = {f.name for f in fields(cls)} - {"extra", "target_layer_ids", "mask_token_id", "draft_vocab"}
        kwargs: dict[str, Any] = {}
        for key in list(d):
            if key in known:
                kwargs[key] = d.pop(key)
        # transformers 5 writes rope settings as rope_parameters
        rope = d.get("rope_parameters")
        if isinstance(rope, dict):
            kwargs.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
            if rope.get("rope_type") not in (None, "default"):
                kwargs.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        for key in ("target_layer_ids", "mask_token_id"):
            value = dflash.get(key, d.pop(key, None))
            if value is None:
                raise ConfigError(f"draft config.json has no dflash_config.{key}")
            kwargs[key] = value
        if dflash.get("draft_vocab") is not None:
            kwargs["draft_vocab"] = [int(i) for i in dflash["draft_vocab"]]
        if "is_causal" in dflash or "causal" in dflash:
            kwargs["is_causal"] = bool(dflash.get("is_causal", dflash.get("causal")))
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size") if k not in kwargs]
        if missing:
            raise ConfigError(f"draft config.json lacks {', '.join(missing)}")
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        if kwargs.get("head_dim") is None:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        kwargs.setdefault("num_target_layers", max(kwargs["target_layer_ids"]) + 1)
        kwargs["extra"] = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "auto_map", "dtype", "tie_word_embeddings", "use_sliding_window")}
        return cls(**kwargs)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        target_layer_ids, mask_token_id = d.pop("target_layer_ids"), d.pop("mask_token_id")
        is_causal, draft_vocab = d.pop("is_causal"), d.pop("draft_vocab")
        out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **extra, **d}
        out["dflash_config"] = {"target_layer_ids": list(target_layer_ids), "mask_token_id": int(mask_token_id)}
        if is_causal is not None:
            out["dflash_config"]["is_causal"] = is_causal
        if draft_vocab is not None:
            out["dflash_config"]["draft_vocab"] = list(draft_vocab)
        out["tie_word_embeddings"] = False
        out["use_sliding_window"] = "sliding_attention" in self.layer_types
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_dict(data)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    # ---- a draft shaped for a given target ----------------------------------------------
    @classmethod
    def for_target(cls, target_config, num_hidden_layers: int = 1, mask_token_id: int | None = None,
                   block_size: int = 16, target_layer_ids: list[int] | None = None,
                   intermediate_size: int | None = None, num_attention_heads: int | None = None,
                   num_key_value_heads: int | None = None, head_dim: int | None = None) -> "DFlashConfig":
        """A draft config matching an HF target config (hidden size, vocab, rope)."""
        tc = getattr(target_config, "text_config", target_config)
        n_target = tc.num_hidden_layers
        heads = num_attention_heads or tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10_000.0)) if isinstance(rope, dict) else 10_000.0
        if mask_token_id is None:
            mask_token_id = tc.vocab_size - 1
        return cls(
            hidden_size=tc.hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=num_key_value_heads or getattr(tc, "num_key_value_heads", heads) or heads,
            head_dim=head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            intermediate_size=intermediate_size or tc.intermediate_size,
            vocab_size=tc.vocab_size,
            target_layer_ids=target_layer_ids or default_target_layer_ids(n_target, num_hidden_layers),
            mask_token_id=mask_token_id,
            num_target_layers=n_target,
            block_size=block_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
        )
