"""`dflash export`: write a draft folder that vLLM's and SGLang's `dflash` methods load as it is.

The folder is the published DFlash format (docs/METHOD.md §4): `config.json` (a Qwen3 config with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and
`dflash_config: {target_layer_ids, mask_token_id}`) and `model.safetensors` (tensor names
without a `model.` prefix, no `embed_tokens` / `lm_head`). On top of what
`DFlashDraftModel.save_pretrained` writes, an export

- casts the tensors to the serving dtype and states it as both `dtype` (transformers 5) and
  `torch_dtype` (transformers 4 and older readers);
- writes the rope settings also as `rope_parameters` (what transformers 5, and so vLLM, reads);
- mirrors an explicit attention causality into `dflash_config.causal`, the key vLLM reads
  (ours is `dflash_config.is_causal`; both are read back by `DFlashConfig.from_dict`);
- checks the draft against what vLLM can run (`vllm_problems`) and, given the target,
  against the target (hidden size, vocabulary, layer ids, mask token);
- re-reads the folder with our loader and compares every tensor, and writes a README with
  the serving commands.

Every added key is one the reference format ignores, so `DFlashDraftModel.from_pretrained`
and the reference loader read an exported folder unchanged (docs/VLLM.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel, find_draft_folder  # noqa: F401 - re-exported
from dflash.engine.errors import CheckpointError
from dflash.engine.io import atomic_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(RuntimeError):
    """The draft cannot be exported for vLLM as it is (the message says what to change)."""


@dataclass
class ExportReport:
    path: Path
    dtype: str
    num_tensors: int
    num_parameters: int
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "dtype": self.dtype, "num_tensors": self.num_tensors,
                "num_parameters": self.num_parameters, "warnings": list(self.warnings)}


def vllm_problems(config: DFlashConfig, target_config=None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for serving this draft with vLLM's `dflash` method (0.32): errors
    are settings vLLM would run differently from this package (silently lower acceptance or
    a refusal); warnings are worth knowing but harmless."""
    errors, warnings = [], []
    if config.input_embedding_scale != 1.0:
        errors.append(f"input_embedding_scale={config.input_embedding_scale}: vLLM feeds the draft the raw "
                      "embedding rows of the target and has no such scale")
    if config.attention_bias:
        warnings.append("attention_bias: vLLM adds a bias to q/k/v and o_proj; the weights must carry all four")
    kinds = set(config.layer_types)
    if kinds == {"full_attention", "sliding_attention"}:
        warnings.append("mixed sliding/full draft layers need vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
    if config.rope_scaling and config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) not in (None, "default"):
        warnings.append(f"rope_scaling {config.rope_scaling}: written as rope_parameters; check vLLM's rope for it")
    if config.draft_vocab is not None:
        warnings.append(f"draft_vocab ({len(config.draft_vocab)} ids) is not exported: vLLM proposes from the full "
                        "vocabulary (exact all the same; its acceptance can differ from this package's)")
    if len(set(config.target_layer_ids)) != len(config.target_layer_ids):
        warnings.append(f"target_layer_ids {config.target_layer_ids} repeat a layer")
    if target_config is not None:
        tc = getattr(target_config, "text_config", target_config)
        n, h, v = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size
        if config.hidden_size != h:
            errors.append(f"draft hidden_size {config.hidden_size} != target hidden_size {h}")
        if config.vocab_size != v:
            errors.append(f"draft vocab_size {config.vocab_size} != target vocab_size {v}")
        bad = [i for i in config.target_layer_ids if not 0 <= i < n]
        if bad:
            errors.append(f"target_layer_ids {bad} outside the target's {n} layers")
        elif n - 1 in config.target_layer_ids:
            # HF's hidden_states[L] is after the final norm; vLLM captures the stream before it
            errors.append(f"target layer {n - 1} (the last): vLLM reads it before the final norm, "
                          "HF (and so this package) after it")
        if not 0 <= config.mask_token_id < v:
            errors.append(f"mask_token_id {config.mask_token_id} outside the target vocabulary of {v}")
        if config.num_target_layers != n:
            warnings.append(f"num_target_layers {config.num_target_layers} != the target's {n} (informational in vLLM)")
    return errors, warnings


def vllm_config_dict(config: DFlashConfig, dtype: str) -> dict:
    """`DFlashConfig.to_dict()` plus the keys vLLM and transformers 5 read (see module doc)."""
    d = config.to_dict()
    d["dflash_config"].pop("draft_vocab", None)  # vLLM's own form is EAGLE-3's d2t + lm_head rows
    d["dtype"] = d["torch_dtype"] = dtype
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)
    d["rope_parameters"] = rope
    if config.is_causal is not None:
        d["dflash_config"]["causal"] = bool(config.is_causal)
    return d


def export_draft(draft: DFlashDraftModel | str | Path, out: str | Path, dtype: str | None = None,
                 target_config=None, force: bool = False, strict: bool = True,
                 readme: bool = True) -> ExportReport:
    """Write `draft` (a model, or a folder / training output holding one) to `out` for vLLM.
    `dtype`: float32, bfloat16 or float16 (default: the draft's). `target_config`: the target's
    HF config, to check the pair. `strict`: refuse on vLLM errors (else they become warnings)."""
    source = None
    if not isinstance(draft, DFlashDraftModel):
        source = find_draft_folder(draft)
        draft = DFlashDraftModel.from_pretrained(source, dtype=_folder_dtype(source))
    out = Path(out)
    if source is not None and out.resolve() == source.resolve():
        raise ExportError(f"export target {out} is the source folder; choose another")
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (use --force to replace it)")
    state = draft.state_dict()
    src_dtype = next(iter(state.values())).dtype
    name = dtype or str(src_dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ExportError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    errors, warnings = vllm_problems(draft.config, target_config)
    if errors and strict:
        raise ExportError("the draft would not run the same in vLLM: " + "; ".join(errors))
    warnings = errors + warnings

    with atomic_folder(out) as tmp:
        draft.save_pretrained(tmp, dtype=DTYPES[name])
        cfg = vllm_config_dict(draft.config, name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        _verify(tmp, state, DTYPES[name])
        if readme:
            (tmp / "README.md").write_text(model_card(draft.config, name, out))
    n_params = sum(v.numel() for v in state.values())
    return ExportReport(out, name, len(state), n_params, warnings)


def _folder_dtype(folder: Path) -> torch.dtype:
    """The dtype a draft folder was saved in (so an export without --dtype keeps it)."""
    try:
        d = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return torch.float32
    return DTYPES.get(d.get("dtype") or d.get("torch_dtype") or "float32", torch.float32)


def _verify(folder: Path, state: dict, dtype: torch.dtype) -> None:
    """Read the folder back with our loader and as a transformers Qwen3 config (vLLM's
    first step); every tensor must equal the source's cast to `dtype`."""
    from safetensors import safe_open

    back = DFlashDraftModel.from_pretrained(folder, dtype=dtype).state_dict()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    bad = [n for n in names if n.startswith("model.") or "embed_tokens" in n or n.startswith("lm_head")]
    if bad:
        raise ExportError(f"exported tensor names vLLM would misread: {bad[:4]}")
    for k, v in state.items():
        if not torch.equal(back[k], v.to(dtype)):
            raise ExportError(f"tensor {k} changed in the export")
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - any failure here means vLLM cannot read it either
        raise ExportError(f"transformers cannot read the exported config.json: {e}") from None
    if hf.model_type != "qwen3" or not isinstance(getattr(hf, "dflash_config", None), dict):
        raise ExportError("the exported config does not read back as a Qwen3 config with dflash_config")


def serve_commands(draft_dir: str | Path, config: DFlashConfig, target: str = "<target>",
                   block_size: int | None = None) -> dict[str, str]:
    """The command lines that serve this draft (the block is 1 + num_speculative_tokens)."""
    k = (block_size or config.block_size) - 1
    spec = json.dumps({"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": k})
    return {
        "vllm": f"vllm serve {target} --speculative-config '{spec}'",
        "vllm_python": f"LLM(model={target!r}, speculative_config={spec})",
        "sglang": (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {k + 1}"),
    }


def model_card(config: DFlashConfig, dtype: str, out: Path) -> str:
    cmds = serve_commands(out, config)
    return f"""# DFlash draft (exported by `dflash export`)

Block-diffusion speculative draft: {config.num_hidden_layers} layer(s), hidden size {config.hidden_size},
block size {config.block_size}, reads target layers {config.target_layer_ids} of a
{config.num_target_layers}-layer target; mask token id {config.mask_token_id}; tensors in {dtype}.
Embedding and lm_head come from the target.

```
{cmds['vllm']}
{cmds['sglang']}
```

Load it in Python with `dflash.draft.DFlashDraftModel.from_pretrained(path)`.
"""
