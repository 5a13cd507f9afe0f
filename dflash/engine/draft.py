"""The DFlash draft: Qwen3-style decoder layers whose attention reads queries from the block
and keys/values from [projected target context ; block], with no causal mask (docs/METHOD.md §1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.engine import projections
from dflash.engine.cache import DraftCache
from dflash.engine.config import ConfigError, DFlashConfig
from dflash.engine.errors import CheckpointError
from dflash.engine.io import atomic_folder

class LayerKernels(NamedTuple):
    """One draft layer's products as measured kernels: q on the block; k and v on [context ;
    block], one projections.Group (x -> (k, v)); o; gate and up, a Group (x -> (gate, up)); down."""
    q: Callable
    kv: Callable
    o: Callable
    gate_up: Callable
    down: Callable


class DraftLayout(NamedTuple):
    """The draft's linears as measured kernels (engine/kernels.py, engine/projections.py), for
    inference: `fc` and per layer its LayerKernels. Built by `DFlashDraftModel.kernel_layout`;
    the modules' own weights are left as they are."""
    fc: Callable
    layers: tuple[LayerKernels, ...]

    @property
    def linears(self) -> list:
        """Every kernels.Linear held (a group's separate or stacked ones), for reports."""
        return [lin for part in (self.fc, *(p for layer in self.layers for p in layer))
                for lin in getattr(part, "linears", [part])]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the same bits in one op
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE at absolute positions, HF's half-rotation convention."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype):  # position_ids: (B, T)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, D)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.layer_idx = layer_idx
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.is_causal = sliding if config.is_causal is None else config.is_causal
        self.sliding_window = config.sliding_window if sliding else None

    def forward(self, x, ctx, cos, sin, mask=None, cache: DraftCache | None = None, proj=None):
        """`proj`: a DraftLayout's LayerKernels to run instead of the modules."""
        b, q_len, _ = x.shape  # x: (B, Q, H) block; ctx: (B, C, H) projected context
        kv_in = torch.cat([ctx, x], dim=1)  # (B, C+Q, H)
        if proj is None:
            q, (k, v), o_proj = self.q_proj(x), (self.k_proj(kv_in), self.v_proj(kv_in)), self.o_proj
        else:
            q, (k, v), o_proj = proj.q(x), proj.kv(kv_in), proj.o
        q = self.q_norm(q.view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)  # (B, nH, Q, D)
        k = self.k_norm(k.view(b, -1, self.n_kv, self.head_dim)).transpose(1, 2)  # (B, KV, C+Q, D)
        v = v.view(b, -1, self.n_kv, self.head_dim).transpose(1, 2)  # (B, KV, C+Q, D)
        q, k = _rotate(q, cos[..., -q_len:, :], sin[..., -q_len:, :]), _rotate(k, cos, sin)
        offset = 0
        if cache is not None:
            offset = cache.offset
            k, v = cache.update(self.layer_idx, k, v)  # (B, KV, T, D)
        if mask is None and (self.is_causal or self.sliding_window is not None):
            mask = self._positional_mask(q_len, k.shape[-2], offset, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)  # (B, nH, Q, D)
        return o_proj(out.transpose(1, 2).reshape(b, q_len, -1))  # (B, Q, H)

    def _positional_mask(self, q_len, k_len, offset, device):
        k_pos = offset + torch.arange(k_len, device=device)[None, :]
        q_pos = k_pos[:, -q_len:].T  # the block is the last q_len keys
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.is_causal:
            mask &= k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= (q_pos - k_pos).abs() < self.sliding_window
        return mask  # (Q, K)


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x, proj=None):
        """`proj`: a DraftLayout's LayerKernels to run instead of the modules."""
        if proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = proj.gate_up(x)
        return proj.down(F.silu(gate) * up)


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask=None, cache=None, proj=None):
        """`proj`: this layer's LayerKernels of a DraftLayout (None: the modules')."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, cache, proj)
        return x + self.mlp(self.post_attention_layernorm(x), proj)


class DFlashDraftModel(nn.Module):
    """The draft network. Embedding and lm_head are the target's and are not part of it."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DraftLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(config.num_context_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    # the reference's attribute names
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def new_cache(self, sliding_window: int | None = None) -> DraftCache:
        return DraftCache(len(self.layers), sliding_window)

    def kernel_layout(self, table) -> DraftLayout:
        """This draft's linears as `table`'s measured kernels (a kernels.KernelTable: the
        target adapter's, so shapes the target shares are measured once). A proposal only
        changes what the target verifies, so they may run approximate kernels (bf16) where
        the table allows them and they measure faster. k and v (and gate and up) read the same
        rows: each pair is a projections.Group, one stacked product where that measures faster."""
        def lin(mod, role):
            return table.linear(mod.weight, mod.bias, role=f"draft {role}", approximate=True)

        def pair(module, names):
            return projections.group(table, module, names, approximate=True, role_prefix="draft ")

        layers = tuple(LayerKernels(lin(layer.self_attn.q_proj, "q_proj"), pair(layer.self_attn, ("k_proj", "v_proj")),
                                    lin(layer.self_attn.o_proj, "o_proj"), pair(layer.mlp, ("gate_proj", "up_proj")),
                                    lin(layer.mlp.down_proj, "down_proj"))
                       for layer in self.layers)
        return DraftLayout(lin(self.fc, "fc"), layers)

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values: DraftCache | None = None, use_cache: bool = False,
                layout: DraftLayout | None = None, **kwargs):
        """position_ids: (B, C+Q) for [new context ; block]; noise_embedding: (B, Q, H);
        target_hidden: (B, C, k*H) the chosen target layers' outputs, concatenated;
        attention_mask: optional bool (B|1, 1|nH, Q, K), True = attend; `layout`: run the
        linears with its kernels (inference; None: the modules'). Returns (B, Q, H)."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        x = noise_embedding  # (B, Q, H)
        fc = self.fc if layout is None else layout.fc
        ctx = self.hidden_norm(fc(target_hidden.to(x.dtype)))  # (B, C, H)
        if position_ids.shape[-1] != ctx.shape[1] + x.shape[1]:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, expected context "
                             f"{ctx.shape[1]} + block {x.shape[1]}")
        cos, sin = self.rotary(position_ids.expand(x.shape[0], -1), x.dtype)  # (B, 1, C+Q, D)
        cache = past_key_values if use_cache else None
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, attention_mask, cache, None if layout is None else layout.layers[i])
        return self.norm(x)

    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0, **kwargs):
        from dflash.engine.loop import dflash_generate

        self.eval()
        return dflash_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature, **kwargs)

    # ---- checkpoint format (docs/METHOD.md §4) ----------------------------------------------
    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors atomically (engine/io.py: a temp folder, then rename)."""
        state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        with atomic_folder(path) as tmp:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> "DFlashDraftModel":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"draft checkpoint folder {path} does not exist")
        try:
            config = DFlashConfig.from_json(path / "config.json")
        except ConfigError as e:
            raise CheckpointError(f"bad draft checkpoint {path}: {e}") from None
        weights = path / "model.safetensors"
        if not weights.exists():
            raise CheckpointError(f"draft checkpoint {path} has no model.safetensors")
        try:
            state = load_file(str(weights), device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"draft checkpoint {weights} is corrupt: {e}") from None
        state = {k.removeprefix("model."): v for k, v in state.items()
                 if not k.endswith(("embed_tokens.weight",)) and k != "lm_head.weight"}
        model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong = [f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                 if k in state and state[k].shape != v.shape]
        if missing or unexpected or wrong:
            parts = [f"missing {missing[:6]}" if missing else "", f"unexpected {unexpected[:6]}" if unexpected else "",
                     f"wrong shapes {wrong[:6]}" if wrong else ""]
            raise CheckpointError(f"draft checkpoint {weights} does not match its config.json: "
                                  + "; ".join(p for p in parts if p))
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()


def find_draft_folder(path: str | Path) -> Path:
    """A draft folder, or a training output that holds one: a checkpoint (`draft/`) or a run
    folder (`best/`, then `final/`)."""
    path = Path(path)
    for candidate in (path, path / "draft", path / "best", path / "final", path / "best" / "draft"):
        if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
            return candidate
    raise CheckpointError(f"no draft checkpoint (config.json + model.safetensors) in {path} "
                          "or its draft/, best/ or final/ subfolder")
