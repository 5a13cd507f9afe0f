"""The training pipeline on the real target, from the responses committed in data/smollm2-b:
a shard rebuilt by prefill holds the target's own greedy responses and their features, and a
warm start from the shipped draft is scored on it at step 0 and trains."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.text.assets import load_target
from dflash.train.config import FitConfig
from dflash.train.data import DataConfig, load_sequences, run_data
from dflash.train.fit import run_fit
from dflash.train.report import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
RESPONSES = ROOT / "data" / "smollm2-b"
SHIPPED = ROOT / "dflash" / "drafts" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    torch.set_num_threads(2)
    kept = json.loads((RESPONSES / "data_config.json").read_text())
    first = kept["first_shard"]
    out = tmp_path_factory.mktemp("data")
    cfg = DataConfig(out=str(out), num_prompts=kept["num_prompts"], first_shard=first, max_shards=first + 1,
                     responses=str(RESPONSES), threads=2)
    run_data(cfg, log=lambda s: None)
    return cfg, out, first


def test_a_committed_shard_rebuilds_with_the_targets_greedy_responses_and_features(rebuilt):
    cfg, out, first = rebuilt
    name = f"shard-{first:05d}.jsonl"
    stored = [json.loads(line) for line in (RESPONSES / name).read_text().splitlines()]
    rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
    assert [(r["id"], r["prompt_ids"], r["response_ids"]) for r in rows] == \
           [(r["id"], r["prompt_ids"], r["response_ids"]) for r in stored]
    model, _ = load_target()
    seq = load_sequences(out)[0]
    with torch.no_grad():
        hs = model(input_ids=seq.tokens[None, :-1], output_hidden_states=True).hidden_states
        ref = torch.cat([hs[i + 1] for i in cfg.layer_ids], -1)[0]  # (L-1, k*H)
        prompt = seq.tokens[None, :seq.prompt_len]
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, seq.prompt_len:]
    assert torch.allclose(torch.from_numpy(seq.features.astype("float32")), ref, rtol=1e-2, atol=2e-2)
    n = min(16, len(seq.tokens) - seq.prompt_len)
    assert greedy[:n].tolist() == seq.tokens[seq.prompt_len:seq.prompt_len + n].tolist()  # the data is the target's


def test_a_warm_start_from_the_shipped_draft_scores_at_step_0_and_trains(rebuilt, tmp_path):
    """... on two data folders at once (`more_data`: here a copy of the first), whose shards the
    checkpoint records for a resume."""
    _, out, first = rebuilt
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    cfg = FitConfig(data=str(out), more_data=[str(copy)], out=str(tmp_path / "fit"), init_from=str(SHIPPED), num_layers=2,
                    loss_vocab="draft", draft_vocab=8192, batch_size=2, anchors_per_seq=8, max_steps=2,
                    heldout_frac=0.1, eval_every=2, eval_tau_prompts=0, ckpt_every=2, threads=2, lr=1e-5)
    said = []
    run_fit(cfg, log=said.append)
    assert any("from 2 shards of 2 folder(s)" in line for line in said), said
    state = torch.load(tmp_path / "fit" / "ckpt-0000002" / "trainer.pt", weights_only=False)
    assert state["data_shards"] == [first] and state["more_data_shards"] == {str(copy): [first]}
    rows = read_metrics(tmp_path / "fit")
    start = rows[0]
    assert start["step"] == 0 and "loss" not in start
    # on prompts it never saw, the shipped draft's proposals are accepted (a random draft: ~1.0)
    assert start["heldout_block_tau"] > 1.2, start
    assert rows[-1]["step"] == 2 and rows[-1]["loss"] > 0
    assert (tmp_path / "fit" / "best" / "model.safetensors").exists()
