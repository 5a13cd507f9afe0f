"""`dflash generate` end to end on a tiny target folder and draft checkpoint."""

import json

import pytest
import torch
from server_support import tiny_pipeline

from dflash.cli.commands import build_parser, main, spec_from_args
from dflash.engine.loop import dflash_generate
from dflash.text.pipeline import Pipeline, SpecSettings


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    pipe = tiny_pipeline(block_size=4)
    pipe.target.model.save_pretrained(root / "target")
    pipe.tokenizer.save_pretrained(root / "target")
    pipe.draft.save_pretrained(root / "draft")
    return root, pipe


def test_generate_json_equals_library(folders, capsys):
    root, pipe = folders
    rc = main(["generate", "hello world", "--target", str(root / "target"), "--draft", str(root / "draft"),
               "--max-new-tokens", "12", "--json", "--compare"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    loaded = Pipeline.load(str(root / "target"), str(root / "draft"), quiet=True)
    ids = loaded.encode_chat([{"role": "user", "content": "hello world"}])
    out = dflash_generate(loaded.draft, loaded.target, ids, 12, loaded.stop_token_ids)
    assert report["text"] == loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert report["num_output_tokens"] == out.shape[1] - ids.shape[1]
    assert report["tau"] >= 1 and report["speedup"] > 0 and report["target_alone_tokens_per_s"] > 0
    assert report["identical_to_target_alone"] is True  # --compare checks the tokens, not only the time


def test_generate_streams_text_and_reports(folders, capsys):
    root, _ = folders
    rc = main(["generate", "hello", "--target", str(root / "target"), "--draft", str(root / "draft"),
               "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3"])
    out = capsys.readouterr()
    assert rc == 0 and "tau" in out.err and "tokens/s" in out.err


def test_random_draft_says_so(folders, capsys):
    root, _ = folders
    assert main(["generate", "hi", "--target", str(root / "target"), "--draft", "random", "--max-new-tokens", "3"]) == 0
    assert "UNTRAINED" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--draft", "/nonexistent/draft"], "does not exist"),
    (["--block-size", "0"], "block_size must be an integer >= 1"),
    (["--messages", "[]"], "message list is empty"),
    (["--messages", "{bad"], "not valid JSON"),
])
def test_bad_input_is_a_clear_error(folders, capsys, args, message):
    root, _ = folders
    argv = ["generate", "hi", "--target", str(root / "target"), "--max-new-tokens", "3"]
    if "--draft" not in args:
        argv += ["--draft", str(root / "draft")]
    try:
        rc = main(argv + args)
    except SystemExit as e:  # argument errors exit with their message
        rc, err = 2, str(e)
    else:
        err = capsys.readouterr().err
    assert rc == 2 and message in err


def test_mismatched_draft_is_named(folders, tmp_path, capsys):
    root, pipe = folders
    from dflash.engine.config import DFlashConfig
    from dflash.engine.draft import DFlashDraftModel
    cfg = DFlashConfig.for_target(pipe.target.model.config, num_hidden_layers=1)
    torch.manual_seed(0)
    DFlashDraftModel(DFlashConfig(**{**cfg.__dict__, "hidden_size": 32, "head_dim": 8})).save_pretrained(tmp_path / "d")
    rc = main(["generate", "hi", "--target", str(root / "target"), "--draft", str(tmp_path / "d")])
    assert rc == 2 and "hidden_size 32 != target hidden_size 64" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["chat"]])
def test_the_default_speculation_is_hybrid_and_a_threshold_asks_for_the_fixed_chain(command):
    """No flags: the hybrid tree (the measured default); --draft-threshold keeps its meaning (the
    draft's chain, cut at that probability); --policy adaptive cuts the chain by the cost model."""
    def spec(*flags):
        return spec_from_args(build_parser().parse_args([*command, *flags]))
    assert spec() == SpecSettings() == SpecSettings(None, 0.0, "hybrid", "adaptive")
    assert spec("--draft-threshold", "0.3") == SpecSettings(draft_threshold=0.3, proposer="draft", policy="fixed")
    assert spec("--proposer", "draft").adaptive_chain and not spec("--proposer", "draft", "--policy", "fixed").adaptive_chain
    assert spec("--block-size", "4", "--proposer", "suffix") == SpecSettings(4, proposer="suffix")


@pytest.mark.parametrize("command", [["serve"], ["chat"]])
def test_the_prompt_cache_size_is_checked_before_anything_loads(command, capsys):
    assert build_parser().parse_args([*command, "--prompt-cache-mb", "64"]).prompt_cache_mb == 64.0
    assert build_parser().parse_args(command).prompt_cache_mb == 256.0
    for bad in ("-1", "nan", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--prompt-cache-mb", bad])
        assert "--prompt-cache-mb: must be a number of MiB >= 0" in capsys.readouterr().err
