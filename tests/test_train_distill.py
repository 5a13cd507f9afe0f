"""Soft labels (the target's top-k distribution over every response token), kept beside the
features by the generator and by the prefill rebuild, and the distillation loss on them."""

import json
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch

from dflash.testing import tiny_target
from dflash.train.data import DataConfig, DataError, load_sequences, write_shard
from dflash.train.generator import SoftLabels, generate_batch, prefill_features

LAYERS = [0, 2]
K = 5


def reference_soft(model, prompt: list[int], response: list[int]) -> SoftLabels:
    """The top-k of a plain HF forward's distribution over each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0]  # (L-1, V)
    return SoftLabels.from_logits(logits[len(prompt) - 1:], K)


def assert_same_soft(got: SoftLabels, ref: SoftLabels) -> None:
    assert got.ids.dtype == torch.int32 and got.logprobs.dtype == torch.float16 and got.rest.dtype == torch.float16
    assert got.ids.shape == ref.ids.shape and got.rest.shape == ref.rest.shape
    assert torch.equal(got.ids[:, 0], ref.ids[:, 0])  # the argmax (ties below it may swap on rounding)
    assert torch.allclose(got.logprobs.float(), ref.logprobs.float(), atol=2e-2)
    assert torch.allclose(got.rest.float(), ref.rest.float(), atol=2e-2)
    mass = got.logprobs.float().exp().sum(-1) + got.rest.float().exp()  # (R,)
    assert torch.allclose(mass, torch.ones_like(mass), atol=1e-2)


@pytest.mark.parametrize("kind,static", [("llama", True), ("llama", False), ("gemma3", None)])
def test_generator_and_rebuild_keep_the_targets_top_k_over_every_response_token(kind, static):
    target = tiny_target(kind, seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (4, 11, 6)]
    probe = generate_batch(target, prompts, LAYERS, 12, stop_ids=[], pad_id=0, static=static)
    stop = [probe[1].response_ids[3]]  # one row stops early
    got = generate_batch(target, prompts, LAYERS, 12, stop_ids=stop, pad_id=0, static=static, topk=K)
    assert len(got[1].response_ids) <= 4
    for p, r in zip(prompts, got):
        assert len(r.soft) == len(r.response_ids)
        assert_same_soft(r.soft, reference_soft(target, p, r.response_ids))
    feats, soft = prefill_features(target, [r.prompt_ids + r.response_ids for r in got], LAYERS, static=static,
                                   prompt_lens=[len(p) for p in prompts], topk=K)
    for r, f, s in zip(got, feats, soft):
        assert torch.allclose(f.float(), r.features.float(), atol=2e-2)
        assert_same_soft(s, r.soft)
    with pytest.raises(ValueError, match="prompt length"):
        prefill_features(target, [prompts[0] + [1, 2]], LAYERS, topk=K)


def _rows_and_soft(target):
    gen = generate_batch(target, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], LAYERS, 6, stop_ids=[], pad_id=0, topk=K)
    rows = [{"id": f"p{i}", "dataset": "math", "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
             "finished": r.finished} for i, r in enumerate(gen)]
    return gen, rows


def test_a_rebuilt_shard_gains_soft_labels_and_an_old_shard_still_loads(tmp_path):
    from dflash.train.data import _rebuild_shard

    target = tiny_target("llama", seed=3)
    gen, rows = _rows_and_soft(target)
    (tmp_path / "data_config.json").write_text(json.dumps(asdict(DataConfig(layer_ids=LAYERS))))
    write_shard(tmp_path, 0, [dict(r) for r in rows], [g.features for g in gen])  # an old shard: hard labels only
    new_rows, feats, soft = _rebuild_shard(target, rows, LAYERS, topk=K)  # the kept responses, by prefill
    write_shard(tmp_path, 1, new_rows, feats, soft)
    assert not (tmp_path / "shard-00000.topk.npz").exists() and (tmp_path / "shard-00001.topk.npz").exists()
    with np.load(tmp_path / "shard-00001.topk.npz") as z:
        assert z["ids"].dtype == np.int32 and z["logprobs"].dtype == np.float16 and z["rest"].dtype == np.float16
        assert z["ids"].shape == (18, K) and z["rest"].shape == (18,)  # 3 responses of 6 tokens
    old, new = load_sequences(tmp_path, shards=[0]), load_sequences(tmp_path, shards=[1])
    assert all(s.soft is None for s in old)
    for s, g in zip(new, gen):
        assert s.tokens.tolist() == g.prompt_ids + g.response_ids
        assert_same_soft(s.soft, g.soft)
    with pytest.raises(DataError, match="soft labels do not match"):
        write_shard(tmp_path, 2, new_rows, feats, soft[:2])
    (tmp_path / "shard-00000.topk.npz").write_bytes((tmp_path / "shard-00001.topk.npz").read_bytes())
    bad = [dict(r, response_ids=r["response_ids"][:-1]) for r in rows]  # shorter responses than its soft rows
    write_shard(tmp_path, 3, bad, [f[:-1] for f in feats])
    (tmp_path / "shard-00003.topk.npz").write_bytes((tmp_path / "shard-00001.topk.npz").read_bytes())
    with pytest.raises(DataError, match="has 18 rows, the shard's responses 15 tokens"):
        load_sequences(tmp_path, shards=[3])


# ---- the distillation loss --------------------------------------------------------------

def _blocks(target, n_seqs=3, length=30, prompt=6, seed=0, block=8):
    """A batch of blocks over random sequences, the draft hidden states and a draft vocabulary."""
    from dflash.engine.target import TargetModel
    from dflash.testing import tiny_draft
    from dflash.train.blocks import VocabSubset, build_batch, draft_hidden, sample_anchors

    g = torch.Generator().manual_seed(seed)
    tm = TargetModel(target)
    draft = tiny_draft(target, block_size=block)
    items = []
    for _ in range(n_seqs):
        toks = torch.randint(0, 60, (length,), generator=g)
        with torch.no_grad():
            hs = target(input_ids=toks[None, :-1], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in draft.config.target_layer_ids], -1)[0]  # (L-1, k*H)
        items.append((toks, feats, sample_anchors(prompt, length, 3, g)))
    subset = VocabSubset(torch.arange(0, 64), tm.info.vocab_size, drop_missing=True)
    batch = build_batch(items, block, draft.config.mask_token_id, 4.0)
    return tm, draft, items, subset, batch, lambda b: draft_hidden(draft, tm, b)


def _with_soft(items, prompt, soft_of):
    """items with soft labels soft_of(tokens) -> SoftLabels over positions prompt.. ."""
    return [(t, f, a, None, (prompt, soft_of(t))) for t, f, a in items]


def test_the_kl_is_zero_when_the_draft_equals_the_target_on_the_stored_support(llama):
    from dflash.train.blocks import SoftBlock, chunked_loss_backward

    tm, _, _, subset, batch, hidden_of = _blocks(llama)
    with torch.no_grad():
        h = hidden_of(batch)  # (N, Q, H)
        logq = torch.log_softmax(subset.logits(tm, h), -1)  # (N, Q, S): the draft's own distribution
    # soft labels = the draft's own top-k at each query position, in vocabulary ids
    top, cols = logq.topk(K, -1)  # (N, Q, k)
    rest = torch.log1p(-top.exp().sum(-1))  # (N, Q)
    assert batch.soft is None  # no soft labels given to build_batch
    soft = SoftBlock(subset.ids[cols], top, rest)
    sel = subset.keep(batch.labels)
    assert int(sel.sum()) > 10
    kl, _ = chunked_loss_backward(h, tm, batch.labels, batch.weights, 1.0, 7, backward=False, subset=subset,
                                  soft=soft, distill_weight=1.0)
    ce, _ = chunked_loss_backward(h, tm, batch.labels, batch.weights, 1.0, 7, backward=False, subset=subset)
    assert abs(kl) < 1e-4 and ce > 1.0  # the CE of the same draft is far from zero
    shifted = SoftBlock(soft.ids, torch.log_softmax(top * 0.5, -1) + torch.log1p(-rest.exp())[..., None], rest)
    off, _ = chunked_loss_backward(h, tm, batch.labels, batch.weights, 1.0, 7, backward=False, subset=subset,
                                   soft=shifted, distill_weight=1.0)
    assert off > 1e-3  # a different target distribution on the same support: positive


def test_a_one_hot_target_gives_the_hard_ce_value_and_gradient(llama):
    from dflash.train.blocks import build_batch, chunked_loss_backward

    tm, draft, items, subset, _, hidden_of = _blocks(llama)

    def one_hot(t):  # all the mass on the token itself: top-1 = the label, nothing left
        r = len(t) - 6
        ids = torch.stack([t[6:]] + [torch.full((r,), 70 + j) for j in range(K - 1)], -1).int()  # (R, k)
        lp = torch.full((r, K), -torch.inf)
        lp[:, 0] = 0.0
        return SoftLabels(ids, lp.half(), torch.full((r,), -torch.inf).half())

    batch = build_batch(_with_soft(items, 6, one_hot), 8, draft.config.mask_token_id, 4.0)
    grads = []
    for d in (0.0, 1.0):
        draft.zero_grad(set_to_none=True)
        h = hidden_of(batch)
        val, _ = chunked_loss_backward(h, tm, batch.labels, batch.weights, 0.1, 7, subset=subset, soft=batch.soft,
                                        distill_weight=d)
        grads.append((val, torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None])))
    (ce, g_ce), (kl, g_kl) = grads
    assert ce > 0.5 and abs(kl - ce) < 1e-4 * ce
    assert torch.allclose(g_kl, g_ce, atol=1e-6, rtol=1e-4)


def test_distillation_trains_only_the_draft_and_needs_soft_labels():
    from dflash.train.blocks import chunked_loss_backward
    from dflash.train.config import FitConfig
    from dflash.train.data import Sequence
    from dflash.train.fit import Trainer

    llama = tiny_target("llama", seed=3)  # a fresh target: no gradient left on it by another test
    gen, _ = _rows_and_soft(llama)
    seqs = []
    for i, g in enumerate(gen * 2):
        toks = torch.tensor(g.prompt_ids + g.response_ids)
        seqs.append(Sequence(f"s{i}", "test", toks, len(g.prompt_ids), g.features.numpy(), None, g.soft))
    cfg = FitConfig(block_size=4, gamma=4.0, anchors_per_seq=3, batch_size=2, max_steps=2, heldout_frac=0.0,
                    eval_tau_prompts=0, device="cpu", intermediate_size=64, loss_vocab="draft", draft_vocab=40,
                    distill_weight=0.5)
    t = Trainer(cfg, llama, seqs, 95, LAYERS)
    before = [p.detach().clone() for p in t.draft.parameters()]
    rec = t.train_step()
    assert rec["loss"] > 0
    assert all(not p.requires_grad and p.grad is None for p in t.target.model.parameters())  # embedding, lm_head too
    assert any(not torch.equal(a, p) for a, p in zip(before, t.draft.parameters()))
    hard = [Sequence(s.id, s.dataset, s.tokens, s.prompt_len, s.features) for s in seqs]
    with pytest.raises(ValueError, match="needs soft labels, which 6 training sequences lack"):
        Trainer(cfg, llama, hard, 95, LAYERS)
    with pytest.raises(ValueError, match="needs soft labels"):
        chunked_loss_backward(torch.zeros(1, 4, 64), t.target, torch.zeros(1, 4, dtype=torch.long),
                              torch.ones(1, 4), 1.0, 8, distill_weight=0.3)


def test_the_data_keeps_its_stop_set_through_the_one_stop_id_helper():
    from dflash.testing import tiny_tokenizer
    from dflash.text.pipeline import stop_token_ids
    from dflash.train.data import data_stop_ids

    tok = tiny_tokenizer()
    tok.eos_token = "<|unused|>"  # an eos apart from the end-of-turn token
    eos, im_end = tok.convert_tokens_to_ids("<|unused|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok, ()) == [eos]
    assert data_stop_ids(tok) == sorted({eos, im_end}) == stop_token_ids(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    assert tok.convert_tokens_to_ids("<|eot_id|>") in stop_token_ids(tok)  # the serving set grows...
    assert data_stop_ids(tok) == sorted({eos, im_end})  # ...the data's does not


# ---- HumanEval-shaped prompts and per-source response limits ------------------------------

@pytest.fixture(scope="module")
def stub_pools():
    """The standard library's function and method stubs and the libraries' stubs, parsed once
    for the tests below (each parse reads thousands of source files)."""
    from dflash.train.code_prompts import docstring_functions, library_functions

    return {"functions": docstring_functions(), "methods": docstring_functions(methods=True),
            "libraries": library_functions()}


def test_standard_library_stubs_are_humaneval_shaped_and_never_humaneval(tmp_path, stub_pools):
    from dflash.text import prompts as P
    from dflash.train.code_prompts import docstring_functions, docstring_prompts
    from dflash.train.data import check_no_leaks

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        'def keep(a, b=2) -> int:\n    """Add two numbers, the second one two by default, and return it."""\n'
        '    c = a + b\n    return c\n\n'
        'def no_doc(a):\n    return a\n\n'
        'def _private(a):\n    """A private helper that is documented at some length here."""\n    return a\n\n'
        'def long_body(a):\n    """A function with a body far longer than a short task has."""\n' + "    a += 1\n" * 20 +
        'class Box(object):\n    size = 3\n\n    def grow(self, by=1):\n        """Grow the box by `by`, one by default,\n'
        '        and return the new size."""\n        self.size += by\n        return self.size\n\n'
        '    def _hidden(self):\n        """A private method is skipped, however well documented."""\n        return 1\n\n'
        'class _Private:\n    def open(self):\n        """A method of a private class is skipped as well."""\n        return 1\n')
    (tmp_path / "test_mod.py").write_text('def keep2(a):\n    """A function in a test module is skipped too."""\n    return a\n')
    assert docstring_functions(tmp_path) == [
        ("stdlib/pkg.mod.keep", ('def keep(a, b=2) -> int:\n    """Add two numbers, the second one two by default, '
                                 'and return it."""\n'))]  # the body is never shown
    assert docstring_functions(tmp_path, methods=True) == [  # in a bare class line, indented as written
        ("stdlib/pkg.mod.Box.grow", 'class Box:\n\n    def grow(self, by=1):\n        """Grow the box by `by`, one by '
                                    'default,\n        and return the new size."""\n')]
    rows = docstring_prompts(400)  # the default pool: the standard library's functions, in a seeded order
    assert len(rows) == 400 and rows == docstring_prompts(400, pool=stub_pools["functions"])
    assert len({t for _, t in rows}) == 400
    he = P.humaneval()
    head = he[0].content[: he[0].content.index("```python")]  # the benchmark's own instruction
    assert all(t.startswith(head + "```python\ndef ") and t.endswith('"""\n```') for _, t in rows)
    check_no_leaks([{"id": i, "dataset": "docstring", "content": t} for i, t in rows])  # raises on a leak
    docs = [P.normalize(t.split('"""')[1]) for _, t in rows]
    codes = [P.normalize(p.meta["code"]) for p in he]
    assert not any(d in c for d in docs for c in codes)  # no docstring of a stub is in a HumanEval task
    with pytest.raises(DataError, match="evaluation prompts in the training set"):
        check_no_leaks([{"id": "stdlib/x", "dataset": "docstring", "content": he[3].content}])
    methods = docstring_prompts(400, pool=stub_pools["methods"])
    assert len({t for _, t in methods}) == 400 and not {t for _, t in methods} & {t for _, t in rows}
    assert all(t.startswith(head + "```python\nclass ") and t.endswith('"""\n```') for _, t in methods)
    check_no_leaks([{"id": i, "dataset": "method", "content": t} for i, t in methods])
    docs = [P.normalize(t.split('"""')[1]) for _, t in methods]
    assert not any(d in c for d in docs for c in codes)


def test_library_stubs_are_a_new_pool_of_the_same_shape(tmp_path, stub_pools, monkeypatch):
    from dflash.train import code_prompts
    from dflash.text import prompts as P
    from dflash.train.code_prompts import LIBRARIES, docstring_functions, docstring_prompts, library_functions
    from dflash.train.data import check_no_leaks

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        'def keep(a, b=2) -> int:\n    """Add two numbers, the second one two by default, and return it."""\n'
        '    return a + b\n')
    assert docstring_functions(tmp_path, prefix="lib/x.") == [
        ("lib/x.pkg.mod.keep", 'def keep(a, b=2) -> int:\n    """Add two numbers, the second one two by default, '
                               'and return it."""\n')]
    stubs = list(stub_pools["libraries"])
    assert len(stubs) > 3000 and len({t for _, t in stubs}) == len(stubs)
    assert {i.split("/")[1].split(".")[0] for i, _ in stubs} == set(LIBRARIES)  # each library gives stubs
    assert library_functions(("no_such_package_here",)) == []
    rows = docstring_prompts(3000, seed=5, pool=stubs)  # the pool in a seeded order, as the lists take it
    random.Random(5).shuffle(stubs)
    assert [i for i, _ in rows] == [i for i, _ in stubs[:3000]]
    asked = []
    monkeypatch.setattr(code_prompts, "library_functions", lambda libs: asked.append(libs) or list(stubs_in_order))
    stubs_in_order = list(stub_pools["libraries"])
    assert docstring_prompts(3000, seed=5, libraries=LIBRARIES) == rows  # `libraries` draws from that pool
    assert asked == [LIBRARIES]
    stdlib = {t for _, t in docstring_prompts(5000, pool=stub_pools["functions"])}
    stdlib |= {t for _, t in docstring_prompts(5000, pool=stub_pools["methods"])}
    assert not {t for _, t in rows} & stdlib  # a pool apart from the standard library's
    head = P.humaneval()[0].content
    head = head[: head.index("```python")]
    assert all(t.startswith(head + "```python\n") and t.endswith('"""\n```') for _, t in rows)
    check_no_leaks([{"id": i, "dataset": "library", "content": t} for i, t in rows])
    codes = [P.normalize(p.meta["code"]) for p in P.humaneval()]
    docs = [P.normalize(t.split('"""')[1]) for _, t in rows]
    assert not any(d in c for d in docs for c in codes)  # no docstring of a stub is in a HumanEval task


def test_package_stubs_are_a_third_pool_apart_from_the_libraries_and_the_standard_library(stub_pools, monkeypatch):
    """The `package` source: the same shape from the packages dflash's install brings. Parsed
    here for a few small ones (all of PACKAGES takes a minute; the data command's leak check
    reads every prompt it draws)."""
    from dflash.text import prompts as P
    from dflash.train.code_prompts import LIBRARIES, PACKAGES, docstring_prompts, library_functions
    from dflash.train.data import build_prompts, check_no_leaks

    assert not set(PACKAGES) & set(LIBRARIES)
    few = ("click", "packaging", "rich")
    assert set(few) <= set(PACKAGES)
    stubs = library_functions(few)
    assert len(stubs) > 200 and {i.split("/")[1].split(".")[0] for i, _ in stubs} == set(few)
    rows = docstring_prompts(200, seed=3, libraries=few)
    assert len({t for _, t in rows}) == 200
    older = {t for _, t in docstring_prompts(10_000, pool=stub_pools["libraries"])}
    older |= {t for _, t in docstring_prompts(10_000, pool=stub_pools["functions"])}
    older |= {t for _, t in docstring_prompts(10_000, pool=stub_pools["methods"])}
    assert not {t for _, t in rows} & older  # nothing an earlier pool could have drawn
    head = P.humaneval()[0].content
    head = head[: head.index("```python")]
    assert all(t.startswith(head + "```python\n") and t.endswith('"""\n```') for _, t in rows)
    check_no_leaks([{"id": i, "dataset": "package", "content": t} for i, t in rows])
    codes = [P.normalize(p.meta["code"]) for p in P.humaneval()]
    assert not any(P.normalize(t.split('"""')[1]) in c for _, t in rows for c in codes)
    from dflash.train import code_prompts
    monkeypatch.setattr(code_prompts, "PACKAGES", few)  # the data command's `package` source reads PACKAGES
    listed = build_prompts(DataConfig(num_prompts=20, mix={"package": 0.5, "math": 0.5}, seed=3))
    assert [r["dataset"] for r in listed].count("package") == 10
    assert [r["content"] for r in listed if r["dataset"] == "package"] == [t for _, t in rows[:10]]
    with pytest.raises(DataError, match="unknown sources in mix"):
        build_prompts(DataConfig(num_prompts=4, mix={"packages": 1.0}))


def test_package2_stubs_read_private_modules_cap_repeated_names_and_stay_apart(tmp_path, stub_pools, monkeypatch):
    """The `package2` source: MORE_PACKAGES (transformers, scipy, ...) with their `_name` modules
    read, at most MAX_PER_NAME stubs per name. Parsed here for a fake package and two small real
    ones (all of MORE_PACKAGES takes two minutes)."""
    from dflash.text import prompts as P
    from dflash.train import code_prompts
    from dflash.train.code_prompts import (LIBRARIES, MORE_PACKAGES, PACKAGES, docstring_prompts,
                                           library_functions, more_package_functions)
    from dflash.train.data import build_prompts, check_no_leaks

    assert not set(MORE_PACKAGES) & (set(PACKAGES) | set(LIBRARIES))
    pkg = tmp_path / "fakepkg_s25"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    doc = '        """Run the model {} on the inputs and return its outputs unchanged."""\n        return x\n'
    (pkg / "_impl.py").write_text(
        'def keep(a, b=2) -> int:\n    """Add two numbers, the second one two by default, and return it."""\n'
        '    return a + b\n\n' + "".join(f"class M{i}:\n    def forward(self, x):\n{doc.format(i)}\n" for i in range(5)))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert library_functions(("fakepkg_s25",)) == []  # the older pools skip private modules
    got = more_package_functions(("fakepkg_s25",), max_per_name=3)
    assert [i for i, _ in got] == ["lib/fakepkg_s25._impl.keep"] + [f"lib/fakepkg_s25._impl.M{i}.forward"
                                                                     for i in range(3)]
    real = more_package_functions(("httpx", "pluggy"))
    assert len(real) > 50 and all("._" in i for i, _ in real)  # both keep their code in `_name` modules
    names = [i.rsplit(".", 1)[-1] for i, _ in real]
    assert max(names.count(n) for n in names) <= code_prompts.MAX_PER_NAME
    older = {t for _, t in stub_pools["libraries"]} | {t for _, t in stub_pools["functions"]}
    older |= {t for _, t in stub_pools["methods"]} | {t for _, t in library_functions(("click", "packaging", "rich"))}
    assert not {t for _, t in real} & older  # nothing an earlier pool could have drawn
    rows = docstring_prompts(50, seed=3, pool=real)
    head = P.humaneval()[0].content
    head = head[: head.index("```python")]
    assert all(t.startswith(head + "```python\n") and t.endswith('"""\n```') for _, t in rows)
    check_no_leaks([{"id": i, "dataset": "package2", "content": t} for i, t in rows])
    monkeypatch.setattr(code_prompts, "more_package_functions", lambda: list(real))  # the data command's source
    listed = build_prompts(DataConfig(num_prompts=20, mix={"package2": 0.5, "math": 0.5}, seed=3))
    assert [r["content"] for r in listed if r["dataset"] == "package2"] == [t for _, t in rows[:10]]


def test_writing_requests_are_distinct_seeded_prefix_stable_and_share_no_phrase_with_evaluation():
    """The `writing` source: templated requests, none equal to an evaluation prompt and none
    sharing a run of eight words with one (MT-Bench's writing questions included)."""
    from dflash.text import prompts as P
    from dflash.train.data import build_prompts, check_no_leaks
    from dflash.train.writing_prompts import writing_prompts

    rows = writing_prompts(6000, seed=4)
    assert len({t for _, t in rows}) == 6000 and rows[:500] == writing_prompts(500, seed=4)
    assert rows != writing_prompts(6000, seed=5)
    assert sum(t.startswith(("Act as", "You are", "Play the part")) for _, t in rows) > 300  # role play too
    check_no_leaks([{"id": i, "dataset": "writing", "content": t} for i, t in rows])

    def grams(text):
        words = P.normalize(text).split()
        return {tuple(words[i:i + 8]) for i in range(len(words) - 7)}

    evals = set().union(*(grams(t) for t in P.eval_texts()))
    assert evals and not any(grams(t) & evals for _, t in writing_prompts(30_000))
    listed = build_prompts(DataConfig(num_prompts=20, mix={"writing": 0.5, "math": 0.5}, seed=4))
    assert [r["content"] for r in listed if r["dataset"] == "writing"] == [t for _, t in rows[:10]]


def test_a_source_gets_its_own_response_limit(tmp_path):
    from dflash.testing import tiny_pipeline
    from dflash.train.data import _shards, run_data

    pipe = tiny_pipeline()
    cfg = DataConfig(layer_ids=[0, 1], max_new_tokens=3, max_new_tokens_by_source={"math": 7}, topk=K)
    chunk = [{"id": f"{d}/{i}", "dataset": d, "content": f"the quick fox {i}"} for i, d in
             enumerate(["math", "code", "math", "sharegpt", "code"])]
    [(index, rows, _, soft)] = _shards(pipe.target.model, pipe.tokenizer, chunk, [0], cfg, [], 0, torch.Generator())
    assert index == 0
    assert {r["id"]: len(r["response_ids"]) for r in rows} == {"math/0": 7, "code/1": 3, "math/2": 7,
                                                               "sharegpt/3": 3, "code/4": 3}
    assert [len(s) for s in soft] == [len(r["response_ids"]) for r in rows]
    with pytest.raises(DataError, match=r"unknown sources in max_new_tokens_by_source: \['poetry'\]"):
        run_data(DataConfig(out=str(tmp_path), max_new_tokens_by_source={"poetry": 9}))


def test_the_prefill_source_labels_existing_replies_with_the_targets_argmax_in_batches_of_one_limit():
    """Existing replies, cut to their source's limit and closed by a stop token, one forward
    each batch: every position's label is the target's own argmax there, the features and top-k
    a plain forward's, and the rows come out shortest limit first."""
    from dflash.testing import tiny_pipeline
    from dflash.train.data import _shards

    pipe = tiny_pipeline()
    model, tok = pipe.target.model, pipe.tokenizer
    cfg = DataConfig(layer_ids=[0, 1], max_new_tokens=4, max_new_tokens_by_source={"math": 9}, topk=K,
                     source="prefill", batch_size=2)
    chunk = [{"id": f"{d}/{i}", "dataset": d, "content": f"the quick fox {i}", "reply": "jumps over the lazy dog " * 3}
             for i, d in enumerate(["math", "sharegpt", "math", "sharegpt", "math"])]
    [(index, rows, feats, soft)] = _shards(model, tok, chunk, [0], cfg, [7], 0, torch.Generator())
    assert index == 0 and [r["id"][:4] for r in rows] == ["shar"] * 2 + ["math"] * 3
    for r, f, s in zip(rows, feats, soft):
        limit = 9 if r["dataset"] == "math" else 4
        assert len(r["response_ids"]) == limit and r["response_ids"][-1] == 7
        toks = torch.tensor(r["prompt_ids"] + r["response_ids"])
        with torch.no_grad():
            out = model(input_ids=toks[None, :-1], output_hidden_states=True)
        assert r["label_ids"][1:] == out.logits[0].argmax(-1).tolist()  # the target's token after each position
        ref = torch.cat([out.hidden_states[i + 1] for i in cfg.layer_ids], -1)[0]  # (L-1, k*H)
        assert torch.allclose(f.float(), ref, atol=2e-2)
        assert_same_soft(s, SoftLabels.from_logits(out.logits[0, len(r["prompt_ids"]) - 1:], K))
