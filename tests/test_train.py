"""Training: the block mask, loss weights, anchors, data leaks, resume, DDP and an overfit gate."""

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from train_support import LAYERS, MASK, features, fit_cfg, make_seqs  # noqa: E402
from train_support import grads as _grads
from train_support import params as _params

from dflash.engine.draft import DFlashDraftModel
from dflash.engine.kernels import IMPLS
from dflash.engine.target import TargetModel
from dflash.testing import tiny_draft, tiny_target
from dflash.train.blocks import (
    IGNORE,
    anchor_bounds,
    build_batch,
    chunked_loss_backward,
    draft_hidden,
    loss_weights,
    sample_anchors,
)
from dflash.train.data import DataError, Sequence, check_no_leaks
from dflash.train.evaluate import block_scores
from dflash.train.fit import Trainer

# ---- mask, weights, anchors -------------------------------------------------------------

def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def test_anchor_bounds_and_sampling():
    g = torch.Generator().manual_seed(0)
    for prompt, length, n in [(5, 40, 8), (5, 10, 100), (3, 5, 2)]:
        a = sample_anchors(prompt, length, n, g)
        lo, hi = anchor_bounds(prompt, length)
        assert len(a) == min(n, hi - lo + 1) and len(set(a.tolist())) == len(a)
        assert int(a.min()) >= prompt and int(a.max()) <= length - 2
    assert len(sample_anchors(9, 10, 4, g)) == 0  # no response token with a label


def test_batch_labels_stop_at_sequence_end():
    toks = torch.arange(20)
    feats = torch.zeros(19, 4)
    b = build_batch([(toks, feats, torch.tensor([5, 17]))], block_size=8, mask_token_id=99, gamma=4.0)
    assert b.block_ids[0, 0] == 5 and (b.block_ids[0, 1:8] == 99).all()
    assert b.labels[0, 1:8].tolist() == list(range(6, 13)) and b.labels[0, 0] == IGNORE
    assert b.labels[0, 9:].tolist() == [18, 19] + [IGNORE] * 5  # block at 17: labels 18, 19 then the end
    assert (b.weights[b.labels == IGNORE] == 0).all()
    assert b.position_ids[0, 19 + 8:].tolist() == list(range(17, 25))


def test_block_mask_sees_only_its_context_and_itself():
    target = tiny_target("llama")
    tm = TargetModel(target)
    draft = tiny_draft(target, layers=2, block_size=8, target_layer_ids=LAYERS, mask_token_id=MASK)
    toks = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(3))
    feats = features(target, toks)
    anchors = torch.tensor([10, 20, 30])

    def block_out(f, t, j=1):
        b = build_batch([(t, f, anchors)], 8, MASK, 4.0)
        with torch.no_grad():
            return tm.logits(draft_hidden(draft, tm, b))[0, j * 8:(j + 1) * 8]  # (B, V)

    ref = block_out(feats, toks)
    f2 = feats.clone()
    f2[20:] += torch.randn_like(f2[20:])  # context at and after block 1's anchor (20)
    t2 = toks.clone()
    t2[10], t2[30] = (t2[10] + 1) % 90, (t2[30] + 1) % 90  # the other blocks' anchor tokens
    assert torch.allclose(block_out(f2, t2), ref, atol=1e-5)
    f3 = feats.clone()
    f3[19] += torch.randn_like(f3[19])  # the context just before the anchor: visible
    assert not torch.allclose(block_out(f3, toks), ref, atol=1e-3)
    t3 = toks.clone()
    t3[20] = (t3[20] + 1) % 90  # the block's own anchor token
    assert not torch.allclose(block_out(feats, t3), ref, atol=1e-3)


@pytest.mark.parametrize("kernel", [k for k in ("linear", "onednn") if IMPLS[k].available(torch.zeros(1))])
def test_chunked_loss_matches_full(kernel):
    """... whichever kernel the adapter measured fastest for the lm_head (oneDNN's has no
    backward: the gradient still reaches the draft's hidden states)."""
    target = tiny_target("llama")
    fastest = {name: (1.0 if name == kernel else 9.0) for name in IMPLS}
    tm = TargetModel(target, time_fn=lambda fn, x, *, impl, shape, n: fastest[impl])
    assert set(tm._head.names) == {kernel}
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    labels = torch.randint(0, 96, (2, 16))
    labels[:, ::8] = IGNORE
    w = torch.rand(2, 16) * (labels != IGNORE)
    val, _ = chunked_loss_backward(hidden, tm, labels, w, 0.5, chunk=5)
    g1 = hidden.grad.clone()
    hidden.grad = None
    sel = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(tm.logits(hidden[sel]), labels[sel], reduction="none")
    full = (ce * w[sel]).sum() * 0.5
    full.backward()
    assert math.isclose(val, float(full.detach()), rel_tol=1e-5)
    assert torch.allclose(g1, hidden.grad, atol=1e-6)


def test_block_scores():
    labels = torch.zeros(1, 8, dtype=torch.long)
    labels[0, 0] = labels[0, 4] = IGNORE
    correct = torch.tensor([[False, True, True, False, False, True, False, True]])
    acc, cnt, tau = block_scores(correct, labels, 4)
    assert acc.tolist() == [1.0, 0.5, 0.5] and tau == 2.5  # runs of 2 and 1, +1 each: (3+2)/2


# ---- data --------------------------------------------------------------------------------

def test_a_longer_code_prompt_list_keeps_the_shorter_one_as_its_prefix():
    """Kept responses (data/smollm2-b) name their prompts by position in the list: growing the
    task list must not reorder the prompts an earlier, shorter list had."""
    from dflash.train.code_prompts import MORE_TASKS, TASKS, code_prompts

    short, long = code_prompts(1958), code_prompts(3000)
    assert long[:1958] == short and len({t for _, t in long}) == len(long)
    assert not any(task in text for task in MORE_TASKS for _, text in short)  # the new tasks come only after
    assert any(task in long[2500][1] for task in MORE_TASKS) and not set(TASKS) & set(MORE_TASKS)


def test_a_prompt_list_leaves_out_the_lists_of_earlier_data(tmp_path):
    """New data must not repeat prompts an earlier draft trained on: with exclude_lists, the
    prompts of those folders' lists (rebuilt from their data_config.json, or read from their
    prompts.jsonl) are skipped and the list still has its size."""
    import json
    from collections import Counter
    from dataclasses import asdict

    from dflash.text import prompts as P
    from dflash.train.data import DataConfig, build_prompts

    old = DataConfig(num_prompts=40, mix={"code": 1.0})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "data_config.json").write_text(json.dumps(asdict(old)))
    first = build_prompts(old)
    mix = {"code": 0.5, "docstring": 0.5}
    again = build_prompts(DataConfig(num_prompts=40, mix=mix, exclude_lists=[str(tmp_path / "b")]))
    texts = lambda rows: {P.normalize(r["content"]) for r in rows}  # noqa: E731
    # the mix holds among the prompts left: the excluded code prompts do not hand their share to the others
    assert Counter(r["dataset"] for r in again) == {"code": 20, "docstring": 20}
    assert not texts(first) & texts(again)
    (tmp_path / "c").mkdir()  # a folder with its frozen list: that list is what is left out
    (tmp_path / "c" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again[:5]))
    third = build_prompts(DataConfig(num_prompts=40, mix=mix, exclude_lists=[str(tmp_path / "c")]))
    assert len(third) == 40 and not texts(again[:5]) & texts(third) and texts(first) & texts(third)
    with pytest.raises(DataError, match="nowhere"):
        build_prompts(DataConfig(num_prompts=4, mix=mix, exclude_lists=[str(tmp_path / "nowhere")]))


def test_a_run_takes_the_prompt_list_kept_beside_its_responses(tmp_path):
    """Kept responses carry their frozen prompts.jsonl, so a rebuild on another machine (another
    Python's standard library, other earlier lists to exclude) uses the very list they were
    written for instead of building one; the run folder gets its own copy."""
    import json

    from dflash.train.data import DataConfig, load_or_build_prompts

    kept = tmp_path / "kept"
    kept.mkdir()
    rows = [{"id": f"code-{i}", "dataset": "code", "content": f"task {i}"} for i in range(3)]
    (kept / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    out.mkdir()
    cfg = DataConfig(num_prompts=3, mix={"code": 1.0}, responses=str(kept))
    assert load_or_build_prompts(cfg, out) == rows
    assert (out / "prompts.jsonl").read_text() == (kept / "prompts.jsonl").read_text()
    built = load_or_build_prompts(DataConfig(num_prompts=3, mix={"code": 1.0}), tmp_path)  # no kept list: built
    assert len(built) == 3 and built != rows


def test_followup_prompts_carry_their_chat_into_the_list_and_the_prompt_tokens(monkeypatch):
    """A follow-up row keeps its three messages: the generator renders all of them, the list
    dedupes on their joined text, and the leak check reads every message, not only the last."""
    from transformers import AutoTokenizer

    from dflash.text import assets
    from dflash.text import prompts as P
    from dflash.train.data import DataConfig, build_prompts, encode_prompts

    def chat(i):
        return P.Prompt(id=f"sharegpt/c{i}/2", dataset="followup", messages=[
            {"role": "user", "content": f"tell me about topic {i}"},
            {"role": "assistant", "content": f"topic {i} is a reply from the conversation"},
            {"role": "user", "content": "and why?"}])

    monkeypatch.setattr(P, "sharegpt_followups", lambda: [chat(0), chat(1), chat(0), chat(2)])
    rows = build_prompts(DataConfig(num_prompts=6, mix={"followup": 1.0}))  # more than the pool holds
    follow = sorted(rows, key=lambda r: r["id"])
    assert [r["id"] for r in follow] == ["sharegpt/c0/2", "sharegpt/c1/2", "sharegpt/c2/2"]  # the repeat left out
    assert all(r["messages"] == chat(int(r["id"][10])).messages for r in follow)
    tok = AutoTokenizer.from_pretrained(assets.default_target_dir(progress=False))
    (row, ids), = encode_prompts(tok, follow[:1], DataConfig())
    text = tok.decode(ids)
    assert text.index("tell me about topic 0") < text.index("is a reply from the conversation") < text.index("and why?")
    assert text.count("<|im_start|>user") == 2 and text.rstrip().endswith("<|im_start|>assistant")
    leak = dict(follow[0], messages=[*follow[0]["messages"][:2], {"role": "user", "content": P.mtbench(limit=1)[0].content}])
    with pytest.raises(DataError, match="evaluation prompts"):
        check_no_leaks(rows + [leak])


@pytest.mark.slow
def test_no_evaluation_prompt_leaks_into_training():
    from dflash.text import prompts as P
    from dflash.train.data import DataConfig, build_prompts

    rows = build_prompts(DataConfig(num_prompts=60, mix={"math": 0.4, "code": 0.2, "docstring": 0.1, "method": 0.1,
                                                             "sharegpt": 0.2}))
    evals = P.eval_texts()
    assert rows and not any(P.normalize(r["content"]) in evals for r in rows)
    assert len({P.normalize(r["content"]) for r in rows}) == len(rows)  # deduplicated
    assert {r["dataset"] for r in rows} == {"math", "code", "docstring", "method", "sharegpt"}
    assert all(int(r["id"].split("/")[1]) not in P.EVAL_MATH_SEEDS for r in rows if r["dataset"] == "math")
    leak = P.mtbench(limit=1)[0]
    with pytest.raises(DataError):
        check_no_leaks(rows + [{"id": "x", "dataset": "sharegpt", "content": "  " + leak.content.upper()}])
    with pytest.raises(DataError):
        check_no_leaks([{"id": "math/5", "dataset": "math", "content": "a reserved seed"}])


# ---- training state ------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["adamw", "radam"])
def test_resume_gives_the_same_state(tmp_path, optimizer):
    target = tiny_target("llama")
    seqs = make_seqs(target)
    cfg = fit_cfg(max_steps=6, optimizer=optimizer)
    full = Trainer(cfg, target, seqs, MASK, LAYERS)
    for _ in range(6):
        full.train_step()
    part = Trainer(cfg, target, seqs, MASK, LAYERS)
    for _ in range(3):
        part.train_step()
    ck = part.save(tmp_path)
    del part  # as if killed: only the checkpoint survives
    resumed = Trainer(cfg, target, seqs, MASK, LAYERS)
    resumed.load(ck)
    assert resumed.step == 3
    for _ in range(3):
        resumed.train_step()
    assert torch.equal(_params(resumed.draft), _params(full.draft))
    s1, s2 = resumed.opt.state_dict()["state"], full.opt.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    assert resumed.sched.get_last_lr() == full.sched.get_last_lr()


def test_radam_starts_with_small_steps_where_adamw_moves_every_weight_by_lr():
    """AdamW's first update is sign-like: about lr on every weight whatever its gradient, the
    suspected cause of a warm start's early loss of tau; RAdam's first steps are plain momentum
    steps, as large as the gradient. An unknown optimizer is named."""
    target = tiny_target("llama")
    seqs = make_seqs(target)
    moved = {}
    for optimizer in ("adamw", "radam"):
        trainer = Trainer(fit_cfg(max_steps=4, optimizer=optimizer, lr=1e-3, warmup_frac=0.0), target, seqs, MASK,
                          LAYERS)
        before = _params(trainer.draft)
        trainer.train_step()
        moved[optimizer] = (_params(trainer.draft) - before).abs()
    assert moved["adamw"].median() > 0.5e-3  # most weights moved by about lr
    assert moved["radam"].median() < 0.1 * moved["adamw"].median()
    assert isinstance(Trainer(fit_cfg(optimizer="radam"), target, seqs, MASK, LAYERS).opt, torch.optim.RAdam)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        Trainer(fit_cfg(optimizer="sgd"), target, seqs, MASK, LAYERS)


def test_fit_names_every_bad_setting_before_loading_anything(tmp_path, capsys):
    """A typo in `dflash train fit` fails at once with every problem named (exit 2), before the
    target or minutes of features load: the data folder here does not even exist."""
    from dflash.cli.commands import main
    from dflash.train.config import FitConfig

    rc = main(["train", "fit", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"),
               "--optimizer", "sgd", "--loss-vocab", "draft", "--gamma", "0", "--block-size", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "run").exists()
    for message in ("unknown optimizer 'sgd'", "loss_vocab 'draft' needs draft_vocab", "gamma must be > 0",
                    "block_size must be >= 2"):
        assert message in err
    FitConfig().check()  # the defaults are valid
    with pytest.raises(ValueError, match="distill_weight must be in"):
        FitConfig(distill_weight=1.5).check()


def test_grad_accumulation_equals_the_combined_batch():
    target = tiny_target("llama")
    seqs = make_seqs(target, n=8)
    a = Trainer(fit_cfg(batch_size=4, grad_accum=1, max_steps=1), target, seqs, MASK, LAYERS)
    b = Trainer(fit_cfg(batch_size=2, grad_accum=2, max_steps=1), target, seqs, MASK, LAYERS)
    ra, rb = a.train_step(), b.train_step()
    assert math.isclose(ra["loss"], rb["loss"], rel_tol=1e-5)
    assert torch.allclose(_grads(a.draft), _grads(b.draft), rtol=1e-4, atol=1e-7)


DDP_SCRIPT = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(1)
    from train_support import fit_cfg, make_seqs, LAYERS, MASK, params as _params, grads as _grads
    from dflash.testing import tiny_target
    from dflash.train.fit import Trainer
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    target = tiny_target("llama")
    seqs = make_seqs(target, n=8)
    t = Trainer(fit_cfg(batch_size=4 // world, max_steps=2), target, seqs, MASK, LAYERS)
    rec = t.train_step()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"grads": _grads(t.draft), "params": _params(t.draft), "loss": rec["loss"]}, sys.argv[2])
    if world > 1:
        dist.destroy_process_group()
''')


def test_ddp_two_processes_equal_one_process(tmp_path):
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_SCRIPT)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    subprocess.run([sys.executable, str(script), tests, str(tmp_path / "one.pt")], check=True, env=env, timeout=120)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                    str(script), tests, str(tmp_path / "two.pt")], check=True, env=env, timeout=120)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert math.isclose(one["loss"], two["loss"], rel_tol=1e-5)
    assert torch.allclose(one["grads"], two["grads"], rtol=1e-4, atol=1e-7)
    assert torch.allclose(one["params"], two["params"], atol=2e-3)  # one Adam step of lr 1e-3


# ---- overfit gate ----------------------------------------------------------------------------

@pytest.mark.slow
def test_overfit_one_sequence_reaches_block_size_tau():
    from dflash.engine.loop import dflash_generate
    from dflash.train.generator import generate_batch

    target = tiny_target("llama", seed=5)
    prompt = torch.randint(0, 90, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    g = generate_batch(target, [prompt], LAYERS, 48, stop_ids=[], pad_id=0)[0]
    toks = torch.tensor(g.prompt_ids + g.response_ids)
    seq = Sequence("one", "test", toks, len(prompt), g.features.numpy())
    cfg = fit_cfg(anchors_per_seq=64, batch_size=1, max_steps=300, lr=3e-3, warmup_frac=0.05, gamma=8.0)
    t = Trainer(cfg, target, [seq], MASK, LAYERS)
    for _ in range(cfg.max_steps):
        rec = t.train_step()
    assert rec["acc"] > 0.95
    t.draft.eval()
    r = dflash_generate(t.draft, t.target, torch.tensor([prompt]), 40, [], 0.0, return_stats=True)
    assert r.output_ids[0, len(prompt):].tolist() == g.response_ids[:40]  # lossless all the same
    assert r.tau >= 6.5, r.acceptance_lengths  # block 8: tau near the block size


@pytest.mark.parametrize("kind,static", [("llama", True), ("llama", False), ("qwen3", None), ("gemma3", None)])
def test_batched_generator_equals_greedy_generate_row_by_row(kind, static):
    """Left padding, rows leaving the batch at their stop token (the static buffer waits for
    a quarter of the rows before it compacts): every row's response equals HF greedy
    `generate` on that prompt alone, and its features equal a plain forward."""
    from dflash.train.generator import generate_batch

    target = tiny_target(kind, seed=3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (3, 9, 6, 14, 5, 11, 7, 2)]
    singles = []
    for p in prompts:
        out = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        singles.append(out)
    stop = sorted({singles[0][4], singles[2][11], singles[5][7]})  # rows stop early, at different steps
    got = generate_batch(target, prompts, LAYERS, 20, stop_ids=stop, pad_id=0, static=static)
    for p, ref, r in zip(prompts, singles, got):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
        assert r.response_ids == ref[:cut]
        assert r.finished == (cut < len(ref) or ref[-1] in stop)
        toks = torch.tensor(p + r.response_ids)
        assert r.features.shape == (len(toks) - 1, 2 * 64)
        assert torch.allclose(r.features.float(), features(target, toks), atol=2e-2)
    assert any(r.finished for r in got) and not all(r.finished for r in got)


@pytest.mark.parametrize("kind,static", [("llama", True), ("llama", False), ("gemma3", None)])
def test_prefill_features_rebuild_what_the_generator_captured(kind, static):
    """Stored responses give back their features by one prefill each, as the generator had them."""
    from dflash.train.generator import generate_batch, prefill_features

    target = tiny_target(kind, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (4, 12, 7)]
    got = generate_batch(target, prompts, LAYERS, 15, stop_ids=[], pad_id=0, static=static)
    rebuilt, soft = prefill_features(target, [r.prompt_ids + r.response_ids for r in got], LAYERS, static=static)
    assert soft is None  # no topk asked
    for r, f in zip(got, rebuilt):
        assert f.dtype == torch.float16 and f.shape == r.features.shape
        assert torch.allclose(f.float(), r.features.float(), atol=2e-2)


def test_stored_responses_rebuild_a_shard_and_refuse_a_different_run(tmp_path):
    import json
    from dataclasses import asdict

    from dflash.train.data import (
        DataConfig,
        _check_responses,
        _rebuild_shard,
        _stored_shard,
        load_sequences,
        write_shard,
    )
    from dflash.train.generator import generate_batch

    target = tiny_target("llama", seed=3)
    cfg = DataConfig(out=str(tmp_path / "new"), responses=str(tmp_path / "kept"), layer_ids=LAYERS)
    chunk = [{"id": f"p{i}", "dataset": "math", "content": "x"} for i in range(3)]
    gen = generate_batch(target, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], LAYERS, 6, stop_ids=[], pad_id=0)
    rows = [{"id": c["id"], "dataset": "math", "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
             "finished": r.finished} for c, r in zip(chunk, gen)]
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data_config.json").write_text(json.dumps(asdict(cfg)))
    write_shard(kept, 2, rows, [r.features for r in gen])
    assert [r["offset"] for r in rows] == [0, 8, 15]  # feature rows before each: 3+6-1, then 2+6-1
    (kept / "shard-00002.feat.npy").unlink()  # only the responses are kept
    _check_responses(cfg)
    assert _stored_shard(cfg, 1, chunk) is None  # not kept: regenerate
    stored = _stored_shard(cfg, 2, chunk)
    new_rows, feats, _ = _rebuild_shard(target, stored, LAYERS)
    assert new_rows == rows
    new = tmp_path / "new"
    new.mkdir()
    write_shard(new, 2, new_rows, feats)
    for seq, r in zip(load_sequences(new), gen):  # the rebuilt shard reads back as the generated one
        assert seq.tokens.tolist() == r.prompt_ids + r.response_ids
        assert torch.allclose(torch.from_numpy(seq.features.astype("float32")), r.features.float(), atol=2e-2)
    with pytest.raises(DataError, match="not this run's shard 2"):
        _stored_shard(cfg, 2, chunk[1:])
    with pytest.raises(DataError, match="written with max_new_tokens=192, now 50"):
        _check_responses(replace(cfg, max_new_tokens=50))


def test_static_decoder_covers_llama_and_qwen3_only():
    from dflash.engine import static_decoder

    assert static_decoder.supports(tiny_target("llama")) and static_decoder.supports(tiny_target("qwen3"))
    assert not static_decoder.supports(tiny_target("gemma3"))  # sliding layers, scaled embeddings: HF's path


def test_prefill_labels_replace_tokens_as_targets():
    toks = torch.arange(20)
    labels = toks + 100  # the target's own predictions differ from the text
    b = build_batch([(toks, torch.zeros(19, 4), torch.tensor([5]), labels)], 8, 99, 4.0)
    assert b.block_ids[0, 0] == 5  # the anchor is the real token
    assert b.labels[0, 1:8].tolist() == list(range(106, 113))


def test_vocab_subset_loss_equals_full_loss_over_all_rows():
    from dflash.train.blocks import VocabSubset

    tm = TargetModel(tiny_target("llama"))
    hidden = torch.randn(1, 8, 64)
    labels = torch.randint(0, 96, (1, 8))
    w = torch.ones(1, 8)
    full, _ = chunked_loss_backward(hidden, tm, labels, w, 1.0, 4, backward=False)
    sub, _ = chunked_loss_backward(hidden, tm, labels, w, 1.0, 4, backward=False,
                                   subset=VocabSubset(torch.arange(96), 96))
    assert math.isclose(full, sub, rel_tol=1e-5)
    small, _ = chunked_loss_backward(hidden, tm, labels, w, 1.0, 4, backward=False,
                                     subset=VocabSubset(labels.flatten(), 96))
    assert small < full  # a softmax over fewer rows


def test_draft_vocab_loss_is_the_softmax_of_the_proposing_head():
    """loss_vocab 'draft': the draft vocabulary is the K most frequent label tokens, the loss is
    the exact softmax over those rows, labels outside it carry no loss, and the held-out
    proposals come from those rows only."""
    from dflash.engine.loop import DraftHead
    from dflash.train.blocks import VocabSubset
    from dflash.train.evaluate import Evaluator
    from dflash.train.fit import frequent_labels

    assert frequent_labels([torch.tensor([5, 5, 5, 2, 2, 9])], 2) == [2, 5]
    assert frequent_labels([torch.tensor([5, 5, 2])], 2, always=[7]) == [5, 7]
    tm = TargetModel(tiny_target("llama"))
    hidden = torch.randn(1, 8, 64)
    labels = torch.tensor([[IGNORE, 3, 4, 50, 3, 60, 4, 3]])
    w = torch.ones(1, 8)
    sub = VocabSubset(torch.tensor([3, 4, 10]), 96, drop_missing=True)
    val, ok = chunked_loss_backward(hidden, tm, labels, w, 1.0, 4, backward=False, subset=sub)
    keep = torch.tensor([1, 2, 4, 6, 7])  # 50 and 60 are outside the draft vocabulary
    logits = tm.logits(hidden[0, keep])[:, [3, 4, 10]].detach()
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 0, 1, 0]), reduction="sum")
    assert math.isclose(val, float(ref), rel_tol=1e-5) and ok.numel() == 5
    with pytest.raises(ValueError, match="outside the loss vocabulary"):
        chunked_loss_backward(hidden, tm, labels, w, 1.0, 4, backward=False, subset=VocabSubset(torch.tensor([3, 4]), 96))

    target = tiny_target("llama")
    seqs = make_seqs(target, n=4)
    t = Trainer(fit_cfg(loss_vocab="draft", draft_vocab=12, heldout_frac=0.0), target, seqs, MASK, LAYERS)
    vocab = t.draft.config.draft_vocab
    assert len(vocab) == 12
    rec = t.train_step()
    assert math.isfinite(rec["loss"]) and rec["loss"] > 0
    props = Evaluator(t, None)._propose(torch.randn(50, 64), DraftHead.build(t.draft, t.target))
    assert set(props.tolist()) <= set(vocab)
    with pytest.raises(ValueError, match="needs draft_vocab"):
        Trainer(fit_cfg(loss_vocab="draft"), target, seqs, MASK, LAYERS)


def test_a_warm_start_is_scored_at_step_0_and_kept_unless_beaten(tmp_path):
    """A warm start logs its starting draft's held-out score as step 0 and keeps that draft as
    `best`, so a run whose training never beats its start ships the start."""
    import json

    from dflash.train.evaluate import Evaluator
    from dflash.train.fit import _score_warm_start

    target = tiny_target("llama")
    seqs = make_seqs(target, n=12)  # ids s8-s11 fall in a held-out fraction of 0.5
    t = Trainer(fit_cfg(heldout_frac=0.5), target, seqs, MASK, LAYERS)
    assert t.heldout
    metrics = tmp_path / "metrics.jsonl"
    best = _score_warm_start(t, Evaluator(t, None), tmp_path, metrics, float("-inf"), lambda s: None)
    (row,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert row["step"] == 0 and row["tokens"] == 0 and best == row["heldout_block_tau"] >= 1.0
    assert json.loads((tmp_path / "best.json").read_text())["score"] == best
    saved = DFlashDraftModel.from_pretrained(tmp_path / "best").state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in t.draft.state_dict().items())
    (tmp_path / "best.json").unlink()
    assert _score_warm_start(t, Evaluator(t, None), tmp_path, metrics, best + 1, lambda s: None) == best + 1
    assert not (tmp_path / "best.json").exists()  # an earlier, better score stays best


def test_the_heldout_sample_spans_every_folder_of_the_pool():
    """The held-out sequences come folder by folder; the evaluator's fixed sample is spread from
    the first to the last of them, not the first folder's prefix (stages 6-18 scored only the
    first 32, all from their first folder)."""
    from dflash.train.evaluate import Evaluator, spread

    assert spread(1063, 32)[:3] == [0, 34, 69] and spread(1063, 32)[-1] == 1062
    assert len(set(spread(40, 32))) == 32 and spread(5, 32) == [0, 1, 2, 3, 4] and spread(9, 1) == [0]
    assert spread(9, 0) == [] and spread(0, 4) == []
    target = tiny_target("llama")
    t = Trainer(fit_cfg(heldout_frac=0.5), target, make_seqs(target, n=12), MASK, LAYERS)
    assert len(t.heldout) >= 3
    ids = [t.heldout[i].id for i in Evaluator(t, None, max_heldout=2).heldout_idx]
    assert ids == [t.heldout[0].id, t.heldout[-1].id]


def test_a_chained_learning_curve_continues_each_stage_where_the_last_ended(tmp_path):
    """`train plot --chain`: a warm-started stage's tokens and CPU-seconds start where the stage
    before it ended; without --chain each run starts at 0; a run without metrics is named."""
    import json

    from dflash.cli.commands import main
    from dflash.train.report import chained_metrics

    for name, rows in {"a": [(0, 0.0, 1.5), (100, 10.0, 1.7)], "b": [(0, 0.0, 1.6), (50, 4.0, 1.9)]}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": t, "tokens": t, "cpu_s": c, "loss": 3.0, "heldout_block_tau": tau}) + "\n"
            for t, c, tau in rows))
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    a, b = chained_metrics(runs, chain=True)
    assert [(r["tokens"], r["cpu_s"]) for r in b] == [(100, 10.0), (150, 14.0)] and a[1]["tokens"] == 100
    assert [r["tokens"] for r in chained_metrics(runs)[1]] == [0, 50]
    out = tmp_path / "curve.png"
    assert main(["train", "plot", *runs, "--chain", "--labels", "a", "b", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="missing"):
        chained_metrics([*runs, str(tmp_path / "missing")])


def test_a_data_folder_from_before_a_new_setting_continues(tmp_path):
    """A data_config.json written before a setting existed reads it as its default."""
    import json
    from dataclasses import asdict

    from dflash.train.data import DataConfig, run_data

    old = asdict(DataConfig(out=str(tmp_path)))
    del old["source"]
    (tmp_path / "data_config.json").write_text(json.dumps(old))
    with pytest.raises(DataError, match="max_new_tokens=192, now 7"):
        run_data(DataConfig(out=str(tmp_path), max_new_tokens=7))


def test_a_shard_counts_only_once_its_jsonl_is_in_place(tmp_path):
    from dflash.train.data import finished_shards, load_sequences, write_shard

    (tmp_path / "data_config.json").write_text('{"layer_ids": [0, 2]}')
    rows = [{"id": "a", "dataset": "math", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "offset": 0}]
    write_shard(tmp_path, 0, rows, [torch.ones(4, 6)])
    np.save(tmp_path / "shard-00001.feat.npy", np.zeros((4, 6), np.float16))  # killed before its .jsonl
    assert finished_shards(tmp_path) == [0]
    (seq,) = load_sequences(tmp_path)
    assert seq.tokens.tolist() == [1, 2, 3, 4, 5] and seq.prompt_len == 2 and seq.features.shape == (4, 6)


def test_several_data_folders_train_as_one_pool_with_distinct_ids(tmp_path):
    """`--more-data`: a second folder joins the pool; an id it shares with the first ("a") gets
    the folder's name in front (the first folder's ids, and so its held-out split, stay as
    stored), its soft labels stay attached, and folders of other target layers or a folder
    listed twice are refused by name."""
    import json

    from dflash.train.config import FitConfig
    from dflash.train.data import load_pool, write_shard
    from dflash.train.generator import SoftLabels

    def folder(name, layers, soft):
        f = tmp_path / name
        f.mkdir()
        (f / "data_config.json").write_text(json.dumps({"layer_ids": layers}))
        rows = [{"id": "a", "dataset": "math", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}]
        labels = [SoftLabels(torch.full((3, 2), 7, dtype=torch.int32), torch.zeros(3, 2).half(),
                             torch.zeros(3).half())] if soft else None
        write_shard(f, 0, rows, [torch.ones(4, 6)], labels)
        return str(f)

    first, second, other = folder("d", [0, 2], False), folder("e", [0, 2], True), folder("x", [1, 2], False)
    seqs, layers = load_pool([first, second], {})
    assert layers == [0, 2] and [s.id for s in seqs] == ["a", f"{second}/a"]
    assert seqs[0].soft is None and seqs[1].soft.ids.tolist() == [[7, 7]] * 3
    with pytest.raises(DataError, match=r"x holds features of target layers \[1, 2\]"):
        load_pool([first, other], {})
    with pytest.raises(DataError, match="nowhere is not a data folder"):
        load_pool([first, str(tmp_path / "nowhere")], {})
    with pytest.raises(ValueError, match="listed twice"):
        FitConfig(data=first, more_data=[second, first + "/"]).check()


def test_skip_shards_leaves_out_what_an_earlier_stage_trained_on_and_a_resume_keeps_its_choice(tmp_path):
    """`--skip-shards {folder: N}` drops a folder's first N finished shards (for `data` before
    `--data-shards` takes the first of the rest); a resumed run trains on the shards it recorded,
    even after more shards finished; a skip that leaves nothing, or names a folder not trained
    on, is refused by name."""
    import json

    from dflash.train.config import FitConfig
    from dflash.train.data import write_shard
    from dflash.train.fit import training_shards

    def folder(name, n):
        f = tmp_path / name
        f.mkdir()
        (f / "data_config.json").write_text(json.dumps({"layer_ids": [0, 2]}))
        for i in range(n):
            write_shard(f, i, [{"id": f"{name}{i}", "dataset": "math", "prompt_ids": [1], "response_ids": [3, 4]}],
                        [torch.ones(2, 6)])
        return str(f)

    d, m = folder("d", 6), folder("m", 4)
    cfg = FitConfig(data=d, more_data=[m], skip_shards={d: 2, m + "/": 3}, data_shards=3)
    cfg.check()
    assert training_shards(cfg, {}) == {d: [2, 3, 4], m: [3]}
    assert training_shards(FitConfig(data=d, more_data=[m]), {}) == {d: list(range(6)), m: [0, 1, 2, 3]}
    write_shard(Path(m), 4, [{"id": "m4", "dataset": "math", "prompt_ids": [1], "response_ids": [3]}], [torch.ones(1, 6)])
    assert training_shards(cfg, {})[m] == [3, 4]  # a fresh run takes the new shard
    assert training_shards(cfg, {"data_shards": [2, 3, 4], "more_data_shards": {m: [3]}}) == {d: [2, 3, 4], m: [3]}
    with pytest.raises(DataError, match="leaves none of its 5 finished shards"):
        training_shards(replace(cfg, skip_shards={m: 5}), {})
    with pytest.raises(ValueError, match="skip_shards names 'elsewhere'"):
        FitConfig(data=d, skip_shards={"elsewhere": 1}).check()
    with pytest.raises(ValueError, match=r"skip_shards\['d'\] must be an integer >= 0"):
        FitConfig(data="d", skip_shards={"d": -1}).check()


def test_a_warm_start_can_deepen_a_draft_and_proposes_what_the_start_does(tmp_path):
    """--init-from a 1-layer draft with --num-layers 3: the two new layers start as the identity,
    so the deeper draft's hidden states equal the start's; training then moves them. A start
    with more layers than the draft is refused by name."""
    target = tiny_target("llama")
    seqs = make_seqs(target)
    start = Trainer(fit_cfg(), target, seqs, MASK, LAYERS)
    for _ in range(2):
        start.train_step()
    start.draft.save_pretrained(tmp_path / "start")
    said = []
    deep = Trainer(fit_cfg(num_layers=3, init_from=str(tmp_path / "start")), target, seqs, MASK, LAYERS,
                   log=said.append)
    assert len(deep.draft.layers) == 3 and "deepened by layers.1, layers.2" in said[0]
    batch = start.make_batch([0, 1], 0)
    start.draft.eval()
    deep.draft.eval()
    with torch.no_grad():
        ref, got = draft_hidden(start.draft, start.target, batch), draft_hidden(deep.draft, deep.target, batch)
    assert torch.allclose(got, ref, atol=1e-6)
    deep.draft.train()
    deep.train_step()
    assert int(deep.draft.layers[2].self_attn.o_proj.weight.detach().count_nonzero()) > 0
    deep.draft.save_pretrained(tmp_path / "deep")
    with pytest.raises(ValueError, match="has 3 layers, the draft 1"):
        Trainer(fit_cfg(init_from=str(tmp_path / "deep")), target, seqs, MASK, LAYERS)


def test_a_warm_start_keeps_every_id_its_start_could_propose(tmp_path):
    """--draft-vocab K with --init-from: the vocabulary is the new data's K most frequent labels
    joined with the start's, so new data that lacks some of the start's tokens (a pool of the
    newest lists only) does not take them from the draft."""
    import json

    target = tiny_target("llama")
    seqs = make_seqs(target)
    start = Trainer(fit_cfg(draft_vocab=12, loss_vocab="draft"), target, seqs, MASK, LAYERS)
    start.draft.save_pretrained(tmp_path / "start")
    data_top = set(start.draft.config.draft_vocab)
    unseen = [i for i in range(target.config.vocab_size) if i not in data_top][-3:]  # ids the data never makes top-12
    cfg_path = tmp_path / "start" / "config.json"
    config = json.loads(cfg_path.read_text())
    config["dflash_config"]["draft_vocab"] = sorted(data_top - {min(data_top)}) + unseen
    cfg_path.write_text(json.dumps(config))
    warm = Trainer(fit_cfg(draft_vocab=12, loss_vocab="draft", init_from=str(tmp_path / "start")), target, seqs,
                   MASK, LAYERS)
    assert warm.draft.config.draft_vocab == sorted(data_top | set(unseen))
    warm.train_step()  # the loss runs over the joined vocabulary (its unseen ids have no labels)
    cold = Trainer(fit_cfg(draft_vocab=12, loss_vocab="draft"), target, seqs, MASK, LAYERS)
    assert set(cold.draft.config.draft_vocab) == data_top  # no start: the data's own K, as before


KILL_SCRIPT = textwrap.dedent('''
    import sys, time, torch
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(1)
    from pathlib import Path
    from train_support import fit_cfg, make_seqs, LAYERS, MASK
    from dflash.testing import tiny_target
    from dflash.train.fit import Trainer
    target = tiny_target("llama")
    t = Trainer(fit_cfg(max_steps=100), target, make_seqs(target), MASK, LAYERS)
    while True:  # checkpoint after every step until killed
        t.train_step()
        t.save(Path(sys.argv[2]))
''')


@pytest.mark.slow
def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path):
    import signal
    import time

    from dflash.train.fit import latest_checkpoint

    script = tmp_path / "killme.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), str(Path(__file__).parent), str(tmp_path / "run")], env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            ck = latest_checkpoint(tmp_path / "run")
            if ck is not None and int(ck.name.split("-")[1]) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # possibly in the middle of writing a checkpoint
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    ck = latest_checkpoint(tmp_path / "run")
    assert ck is not None
    target = tiny_target("llama")
    seqs = make_seqs(target)
    resumed = Trainer(fit_cfg(max_steps=100), target, seqs, MASK, LAYERS)
    resumed.load(ck)
    start = resumed.step
    total = start + 3
    for _ in range(3):
        resumed.train_step()
    full = Trainer(fit_cfg(max_steps=100), target, seqs, MASK, LAYERS)
    for _ in range(total):
        full.train_step()
    assert start >= 3 and resumed.step == full.step == total
    assert torch.equal(_params(resumed.draft), _params(full.draft))


def test_the_committed_prompt_lists_hold_no_evaluation_prompt():
    """Every kept prompt list in data/ (the lists new drafts train on) passes the leak check:
    no prompt equals an evaluation prompt, no math seed is an evaluation seed."""
    import json
    from pathlib import Path

    from dflash.train.data import check_no_leaks

    lists = sorted((Path(__file__).resolve().parents[1] / "data").glob("*/prompts.jsonl"))
    assert len(lists) >= 3  # smollm2-d, -e, -f
    for path in lists:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows, path
        check_no_leaks(rows)  # raises DataError naming the leaked ids


def test_a_base_model_without_a_chat_template_reads_its_prompts_as_plain_text_with_bos():
    """A base target (Gemma-3-270M's GGUF has no chat template): training data, the tau
    evaluation and generation all read the message contents joined by newlines, with the
    tokenizer's own special tokens (its <bos>), one rule for all three."""
    from tokenizers import processors

    from dflash.testing import tiny_pipeline
    from dflash.text import prompts as P
    from dflash.train.data import DataConfig, encode_prompts

    pipe = tiny_pipeline()
    tok = pipe.tokenizer
    tok.chat_template = None
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    messages = [{"role": "user", "content": "add 2 and 3"}, {"role": "user", "content": "then double it"}]
    want = tok("add 2 and 3\nthen double it").input_ids
    assert want[0] == bos and want[1:] == tok("add 2 and 3\nthen double it", add_special_tokens=False).input_ids
    (_, ids), = encode_prompts(tok, [{"id": "m/1", "dataset": "math", "content": "x", "messages": messages}],
                               DataConfig())
    assert ids == want
    assert P.Prompt(id="m/1", dataset="math", messages=messages).ids(tok) == want
    assert pipe.encode_chat(messages)[0].tolist() == want


def test_layer_ids_past_the_targets_depth_are_refused_by_name():
    from dflash.train.data import check_layer_ids

    check_layer_ids([1, 4, 8, 11, 15], 18)
    with pytest.raises(DataError, match=r"has 18 layers \(0-17\).*from layer 1 to 15"):
        check_layer_ids([1, 8, 14, 20, 27], 18)  # the SmolLM2 default on Gemma-3-270M


def test_features_past_fp16s_range_are_clamped_when_stored_and_when_read():
    """Gemma 3's residual stream reaches ~1e5 at <bos>: a plain fp16 cast stored inf and every
    loss of Gemma-3-270M's first run was NaN. Stored features are clamped to fp16's finite range,
    and shards written before that (with inf) train to a finite loss."""
    from dflash.train.generator import FP16_MAX, fp16_features

    x = fp16_features(torch.tensor([1e5, -3e5, 1.5]))
    assert x.dtype == torch.float16 and x.tolist() == [FP16_MAX, -FP16_MAX, 1.5]
    target = tiny_target("llama")
    seqs = make_seqs(target)
    for s in seqs:
        s.features = s.features.copy()
        s.features[0, :3] = np.inf  # the <bos> row of a shard written with a plain cast
    rec = Trainer(fit_cfg(max_steps=2), target, seqs, MASK, LAYERS).train_step()
    assert math.isfinite(rec["loss"])
