"""Draft initialisation: random (the draft's own init), copied from target decoder layers
where the shapes match (attention and MLP projections, layer norms, the final norm), or a
trained draft loaded, and deepened when the new draft has more layers."""

from __future__ import annotations

import torch

from dflash.engine.draft import DFlashDraftModel

_NAMES = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight"]


@torch.no_grad()
def init_from_target(draft: DFlashDraftModel, hf_model, layer_ids: list[int] | None = None) -> list[str]:
    """Copy target layers `layer_ids` (default: the last draft-many layers) into the draft's
    layers. Returns the names copied; tensors whose shapes differ keep their random init."""
    base = getattr(hf_model, "model", hf_model)
    tlayers = base.layers
    n = len(draft.layers)
    layer_ids = layer_ids if layer_ids is not None else list(range(len(tlayers) - n, len(tlayers)))
    copied = []
    for i, tid in enumerate(layer_ids):
        src = tlayers[tid].state_dict()
        dst = draft.layers[i].state_dict()
        for name in _NAMES:
            if name in src and name in dst and src[name].shape == dst[name].shape:
                dst[name].copy_(src[name])
                copied.append(f"layers.{i}.{name}<-{tid}")
    norm = getattr(base, "norm", None)
    if norm is not None and norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(norm.weight)
        copied.append("norm.weight")
    return copied


@torch.no_grad()
def init_from_draft(draft: DFlashDraftModel, source: DFlashDraftModel, name: str = "the start") -> list[str]:
    """Load the trained `source` into `draft`. A source with fewer layers deepens: its layers
    fill the first ones, and each further layer starts as the identity on the residual stream
    (its o_proj and down_proj zero, so attention and MLP add nothing): the deeper draft
    proposes exactly what the source does until training moves it. Returns the new layers."""
    have, want = len(source.layers), len(draft.layers)
    if have > want:
        raise ValueError(f"{name} has {have} layers, the draft {want}: a warm start can add layers, not drop "
                         f"them (--num-layers {have} or more)")
    src, dst = source.state_dict(), draft.state_dict()
    bad = [k for k in src if k not in dst or src[k].shape != dst[k].shape]
    if bad:
        raise ValueError(f"{name} does not fit this draft: {bad[0]} is {tuple(src[bad[0]].shape)} there, "
                         f"{tuple(dst[bad[0]].shape) if bad[0] in dst else 'absent'} here")
    draft.load_state_dict(src, strict=False)
    for layer in draft.layers[have:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return [f"layers.{i}" for i in range(have, want)]
