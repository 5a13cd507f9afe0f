"""Kernel choice by measurement (engine/kernels.py): the selector with fake timings, the
layout's memory rule, the cache, and greedy output on both settings equal to HF generate's."""

import pytest
import torch
from dflash.testing import fake_timer as fake
from dflash.testing import tiny_draft, tiny_target

from dflash.engine import kernels as K
from dflash.engine import machine
from dflash.engine.loop import dflash_generate
from dflash.engine.target import TargetModel, as_target

B = K.BUCKETS


def test_choose_picks_what_the_timer_says_is_fastest_per_bucket():
    times = {"linear": [9.0] * 7, "wx": [8.0] * 7, "transposed": [1.0, 5, 5, 5, 5, 5, 5],
             "onednn": [5.0, 1, 1, 1, 1, 1, 1]}
    c = K.choose(times, B, max_copies=2)
    assert c.impls == {1: "transposed", **{b: "onednn" for b in B[1:]}}
    assert c.copies == ["onednn", "transposed"]  # no single copying layout is within 5% everywhere
    capped = K.choose(times, B)  # by default one copy at most: the one that is fastest overall
    assert capped.copies == ["onednn"] and capped.impls == {b: "onednn" for b in B}


def test_one_layout_that_serves_every_bucket_avoids_the_second_copy():
    # transposed is best at n=1 by 2%, onednn best elsewhere: onednn alone serves within 5%
    times = {"linear": [9.0] * 7, "wx": [9.0] * 7, "transposed": [0.98, 5, 5, 5, 5, 5, 5], "onednn": [1.0] * 7}
    c = K.choose(times, B)
    assert c.copies == ["onednn"] and set(c.impls.values()) == {"onednn"}
    assert c.extra_mb() == 0.0 and K.ShapeChoice((10, 10), B, c.impls).extra_mb() == pytest.approx(400 / 2**20)


def test_no_copy_when_the_models_own_weight_is_within_tolerance():
    times = {"linear": [1.04] * 7, "wx": [2.0] * 7, "transposed": [1.0] * 7, "onednn": [None] * 7}
    c = K.choose(times, B)
    assert c.copies == [] and set(c.impls.values()) == {"linear"}
    times["linear"] = [1.2] * 7  # now the copy pays
    assert K.choose(times, B).copies == ["transposed"]


def test_choose_with_a_free_layout_that_wins_some_buckets():
    times = {"linear": [1.0, 3, 3, 3, 3, 3, 3], "wx": [3.0, 3, 3, 3, 3, 3, 1], "transposed": [3.0, 1, 1, 1, 1, 1, 3],
             "onednn": [2.0] * 7}
    c = K.choose(times, B)
    assert c.impls == {1: "linear", 2: "transposed", 4: "transposed", 8: "transposed", 16: "transposed",
                       32: "transposed", 128: "wx"} and c.copies == ["transposed"]


def test_measure_times_every_available_candidate_at_every_bucket_interleaved():
    w = torch.randn(24, 16)
    t = fake({"linear": 1.0, "wx": 1.0, "transposed": 1.0, "onednn": 1.0})
    times = K.measure(w, None, B, t, reps=2)
    timed = {impl for impl, _, _ in t.calls}
    assert {"linear", "wx", "transposed"} <= timed
    assert len(t.calls) == 2 * len(B) * len(timed)
    assert t.calls[0][2] == t.calls[1][2] == 1  # one round runs all candidates at a bucket together
    assert all(v == [pytest.approx(24 * 16 / 1000)] * len(B) for k, v in times.items() if k in timed)


def test_every_candidate_computes_the_same_product():
    w, b = torch.randn(40, 24), torch.randn(40)
    for n in (1, 3, 16):
        x = torch.randn(1, n, 24)
        ref = torch.nn.functional.linear(x, w, b)
        for name, impl in K.IMPLS.items():
            if impl.available(w):
                tol = 1e-5 if impl.exact else 3e-2 * ref.abs().max().item()  # bf16: about 3 digits
                assert torch.allclose(impl.build(w, b)(x), ref, atol=tol), (name, n)


def test_kernels_built_from_a_models_parameters_record_no_autograd_outside_inference_mode():
    """A model's weights are Parameters. A kernel is an inference kernel: called in grad mode
    (a user's script, a notebook) it must neither record autograd through its copy of the
    weight (oneDNN's packed weight then runs ~100x slower) nor change the product."""
    w, b = torch.nn.Parameter(torch.randn(40, 24)), torch.nn.Parameter(torch.randn(40))
    x = torch.randn(1, 3, 24)
    ref = torch.nn.functional.linear(x, w, b).detach()
    copying = [name for name, impl in K.IMPLS.items() if impl.available(w) and name.startswith("onednn")]
    for name in copying:
        out = K.IMPLS[name].build(w, b)(x)
        tol = 1e-5 if K.IMPLS[name].exact else 3e-2 * ref.abs().max().item()
        assert not out.requires_grad and torch.allclose(out, ref, atol=tol), name


def test_linear_holds_only_the_copies_it_uses_and_dispatches_by_rows():
    w = torch.randn(32, 16)
    c = K.ShapeChoice((32, 16), B, {b: ("linear" if b == 1 else "transposed") for b in B})
    lin = K.Linear(w, None, c)
    assert lin.names[0] == "linear" and lin.names[1:] == ("transposed",) * 6
    assert lin.extra_bytes == w.numel() * 4 and lin.weight is w
    x = torch.randn(1, 3, 16)
    assert lin.fn(3) is lin.fns[B.index(4)] and torch.allclose(lin(x), x @ w.T, atol=1e-6)
    only = K.Linear(w, None, K.ShapeChoice((32, 16), B, {b: "transposed" for b in B}))
    assert only.weight is not w and only.weight.stride() == (1, 32) and torch.equal(only.weight, w)


def test_target_adapter_uses_the_fake_timers_choice_and_leaves_the_model_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    before = {k: (v.data_ptr(), v.stride()) for k, v in model.state_dict().items()}
    t = TargetModel(model, time_fn=fake({"linear": 5.0, "wx": 9.0, "transposed": 1.0, "onednn": 9.0}))
    info = t.kernel_info()
    assert info["mode"] == "auto" and all(r["kernels"] == ["transposed"] * len(r["buckets"]) for r in info["shapes"])
    held = {r["shape"] for r in info["shapes"] if r["weights"]}
    assert held == {"64x64", "32x64", "128x64", "64x128", "96x64"}
    # q+k+v and gate+up stacked were measured; at the same time as the separate products they do not pay
    assert {r["shape"] for r in info["shapes"]} - held == {"128x64 stacked", "256x64 stacked"}
    q = next(r for r in info["shapes"] if r["shape"] == "64x64")
    assert q["roles"] == ["q_proj", "o_proj"] and q["weights"] == 8
    assert q["extra_mb"] == pytest.approx(8 * 64 * 64 * 4 / 2**20, abs=0.05)
    assert {k: (v.data_ptr(), v.stride()) for k, v in model.state_dict().items()} == before
    assert not list(tmp_path.iterdir())  # fake timings are never cached
    assert TargetModel(model, kernels="torch").kernel_info() == {
        "mode": "torch", "precision": {"precision": "fp32", "source": "the model's weights"}}
    with pytest.raises(ValueError):
        TargetModel(model, kernels="fast")
    from dflash.cli.commands import KERNEL_MODES
    assert KERNEL_MODES == K.MODES  # the CLI's copy (it parses without importing torch)


def test_the_choice_is_cached_per_machine_so_a_second_start_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    w = torch.randn(48, 16)
    first = K.KernelTable()
    c1 = first.choice(w)
    assert first.measure_s > 0 and not first.cached
    assert list((tmp_path / "kernels").glob("*.json"))
    second = K.KernelTable()
    second.time_fn = None  # would fail if called
    assert second.choice(w) == c1 and second.cached == ["48x16"] and second.measure_s == 0
    key = K.cache_key(w.shape, w.dtype, B, 3)
    assert machine.read_cached("kernels", {**key, "threads": key["threads"] + 1}) is None  # another thread count


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_greedy_equals_hf_generate_on_both_settings(family, kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target(family)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, kernels=kernels)
    for seed in range(3):
        torch.manual_seed(seed)
        ids = torch.randint(0, 96, (1, 6 + seed))
        ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
        for block in (1, 4, 8):
            assert torch.equal(dflash_generate(draft, target, ids, 30, None, 0.0, block_size=block), ref), (seed, block)


def test_forced_copying_kernels_keep_greedy_output_exact(tmp_path, monkeypatch):
    """Every bucket on a copying layout (the numbers differ from F.linear's in the last bits)."""
    for impl in ("transposed", "onednn", "wx"):
        model = tiny_target("llama")
        if impl == "onednn" and not K.IMPLS["onednn"].available(model.lm_head.weight):
            continue
        times = {"linear": 9.0, "wx": 9.0, "transposed": 9.0, "onednn": 9.0, impl: 1.0}
        target = TargetModel(model, time_fn=fake(times))
        assert {k for r in target.kernel_info()["shapes"] for k in r["kernels"]} == {impl}
        draft = tiny_draft(model, block_size=8)
        draft.config.draft_vocab = list(range(0, 96, 2))  # the draft's lm_head runs on rows of its own
        ids = torch.tensor([[3, 5, 7, 9, 11]])
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
        for block in (1, 8):
            assert torch.equal(dflash_generate(draft, target, ids, 40, None, 0.0, block_size=block), ref), (impl, block)


def test_a_choice_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    w = torch.randn(40, 16)
    monkeypatch.setattr(machine, "load_average", lambda: 2.0 * (os.cpu_count() or 1))  # busy
    K.KernelTable().choice(w)
    busy_again = K.KernelTable()
    busy_again.choice(w)
    assert busy_again.cached == ["40x16"]  # still busy: nothing better to be had, the cache serves
    monkeypatch.setattr(machine, "load_average", lambda: 0.0)  # quiet now
    quiet = K.KernelTable()
    quiet.choice(w)
    assert quiet.cached == [] and quiet.measure_s > 0
    again = K.KernelTable()
    again.choice(w)
    assert again.cached == ["40x16"]  # measured quiet: kept


SMOLLM2_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples are left?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
]


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate_on_both_kernel_settings():
    """The real target on this machine's measured kernels (block sizes 1, 4, 16: the verify
    pass's token counts land in different kernel buckets) and on torch's: greedy output token
    for token HF generate's (a kernel that changed a token would show here)."""
    from dflash.text.pipeline import Pipeline

    torch.set_num_threads(2)
    pipe = Pipeline.load(None, None, quiet=True, precision="fp32")
    assert pipe.target.kernel_info()["mode"] == "auto"
    runs = [(pipe.target, block) for block in (1, 4, 16)]
    runs.append((TargetModel(pipe.target.model, kernels="torch"), 16))
    for prompt in SMOLLM2_PROMPTS:
        ids = pipe.encode_chat([{"role": "user", "content": prompt}])
        ref = pipe.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                         eos_token_id=pipe.stop_token_ids, pad_token_id=pipe.tokenizer.pad_token_id)
        for target, block in runs:
            out = dflash_generate(pipe.draft, target, ids, 48, pipe.stop_token_ids, block_size=block)
            assert torch.equal(out, ref), (prompt, target.kernels, block)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_adapters_own_path_with_linear_kernels_gives_hfs_bits(family):
    """F.linear on the model's weights and F.rms_norm for its RMSNorms, without the modules'
    calls: the static decoder's hidden states bit for bit those of the model's own modules."""
    model = tiny_target(family)
    own = TargetModel(model, time_fn=fake({"linear": 1.0, "wx": 9.0, "transposed": 9.0, "onednn": 9.0}))
    ref = TargetModel(model, kernels="torch")
    assert own.linears is not None and own.linears.extra_bytes == 0
    assert own.linears.for_tokens(1)[0].norm1 is not model.model.layers[0].input_layernorm  # the fused norm
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    ca, cb = own.new_cache(), ref.new_cache()
    for chunk in (ids[:, :13], ids[:, 13:14], ids[:, 14:]):
        (fa, ha), (fb, hb) = own.forward_hidden(chunk, ca, [1, 2]), ref.forward_hidden(chunk, cb, [1, 2])
        assert torch.equal(fa, fb) and torch.equal(ha, hb)
        with torch.inference_mode():
            assert torch.equal(own.logits(fa), ref.logits(fb))


def test_a_bare_hf_target_runs_its_own_modules_and_the_draft_holds_no_adapter(tmp_path, monkeypatch):
    """`dflash_generate(draft, hf_model)`: an adapter of the model's own modules, nothing measured
    or copied (so each call costs nothing to set up); the draft keeps no target state."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    draft = tiny_draft(model, block_size=4)
    a = as_target(model)
    assert a.kernels == "torch" and a.linears is None and a.model is model and as_target(a) is a
    assert not any(isinstance(v, TargetModel) for v in vars(draft).values())
    ids = torch.tensor([[1, 5, 9, 2]])
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0)
    assert torch.equal(dflash_generate(draft, model, ids, max_new_tokens=6), ref)
    assert not list(tmp_path.iterdir())  # nothing was measured
    assert TargetModel(model, kernels="torch").linears is None


def test_the_drafts_linears_run_the_measured_kernels_and_output_stays_exact(tmp_path, monkeypatch):
    """The draft's linears go through the adapter's kernel table (its layout, not the draft's
    modules), rebuilt when the draft's weights change; greedy output still equals HF's."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    target = TargetModel(model, time_fn=fake({"linear": 5.0, "wx": 9.0, "transposed": 1.0, "onednn": 9.0}))
    draft = tiny_draft(model, block_size=8)
    before = {k: v.data_ptr() for k, v in draft.state_dict().items()}
    layout = target.draft_layout(draft)
    assert layout.fc.names == ("transposed",) * len(B) and len(layout.layers) == len(draft.layers)
    assert all(lin.names[0] == "transposed" for lin in layout.linears) and len(layout.linears) == 15
    again = target.draft_layout(draft)  # a new build of the same weights: the same kernels, no new measuring
    assert again is not layout and again.fc.names == layout.fc.names and target.kernel_table.measure_s >= 0
    roles = {role for r in target.kernel_info()["shapes"] for role in r["roles"]}
    assert {"draft fc", "draft q_proj", "draft down_proj"} <= roles
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 8, 64, generator=g), torch.randn(1, 5, draft.fc.in_features, generator=g)
    pos = torch.arange(13)[None]
    with torch.inference_mode():
        own = draft(pos, noise_embedding=noise, target_hidden=ctx)
        laid = draft(pos, noise_embedding=noise, target_hidden=ctx, layout=layout)
    assert torch.allclose(own, laid, atol=1e-5) and not torch.equal(laid, torch.zeros_like(laid))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    assert torch.equal(dflash_generate(draft, target, ids, 20, None, block_size=8), ref)
    assert {k: v.data_ptr() for k, v in draft.state_dict().items()} == before  # the draft is not changed
    with torch.no_grad():  # a step of training, as it were (fc feeds an RMSNorm: a scaling would not show)
        draft.fc.weight.add_(0.5 * torch.randn(draft.fc.weight.shape, generator=g))
    with torch.inference_mode():  # a layout built after training sees the new weights
        trained = draft(pos, noise_embedding=noise, target_hidden=ctx, layout=target.draft_layout(draft))
        assert torch.allclose(trained, draft(pos, noise_embedding=noise, target_hidden=ctx), atol=1e-5)
        assert not torch.allclose(trained, laid, atol=1e-5)
    assert TargetModel(model, kernels="torch").draft_layout(draft) is None


def _rounded(w, b):
    """A stand-in approximate candidate that runs on every CPU: the product of bf16-rounded operands."""
    wr = w.to(torch.bfloat16).float()
    return lambda x: torch.nn.functional.linear(x.to(torch.bfloat16).float(), wr, b)


def test_an_approximate_kernel_serves_only_weights_that_allow_it_in_a_table_that_allows_it(monkeypatch):
    monkeypatch.setitem(K.IMPLS, "rounded", K.Impl(_rounded, True, exact=False, copy_dtype=torch.bfloat16))
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    t = fake({"linear": 5.0, "wx": 9.0, "transposed": 4.0, "onednn": 4.0, "rounded": 1.0})
    table = K.KernelTable(t, approximate=True)
    exact = table.choice(w, role="q_proj")
    approx = table.choice(w, role="draft q_proj", approximate=True)
    assert "rounded" not in exact.impls.values() and set(approx.impls.values()) == {"rounded"}
    assert table.key_name(w) == "48x32" and table.key_name(w, approximate=True) == "48x32 approx"
    assert set(table.choices) == {"48x32", "48x32 approx"}  # two choices of one shape, kept apart
    assert approx.extra_mb() == pytest.approx(48 * 32 * 2 / 2**20)  # a bf16 copy: half an fp32 one
    lin = table.linear(w, None, role="draft q_proj", approximate=True)
    assert lin.key == "48x32 approx" and lin.extra_bytes == w.numel() * 2
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    ref = x @ w.T
    assert torch.allclose(lin(x), ref, atol=2e-2 * ref.abs().max().item()) and not torch.equal(lin(x), ref)
    precise = K.KernelTable(t)  # approximate=False (kernels="precise"): the draft asks, and is refused
    assert "rounded" not in precise.choice(w, approximate=True).impls.values()
    assert set(precise.choices) == {"48x32"}
    rows = {r["shape"]: r for r in table.to_dict()["shapes"]}
    assert rows["48x32 approx"]["roles"] == ["draft q_proj"] and table.to_dict()["mode"] == "auto"
    assert precise.to_dict()["mode"] == "precise"
    wrong = K.Impl(lambda w, b: (lambda x: torch.nn.functional.linear(x, w, b) * 1.5), True, exact=False)
    monkeypatch.setitem(K.IMPLS, "wrong", wrong)  # approximate is not wrong: a far product is never a candidate
    assert K.measure(w, None, B, t, reps=1, approximate=True)["wrong"] == [None] * len(B)


@pytest.mark.parametrize("kernels", ["auto", "precise"])
def test_a_draft_on_bf16_kernels_proposes_and_the_output_stays_the_targets(kernels, tmp_path, monkeypatch):
    """kernels="auto" lets the draft's linears and its lm_head rows take the bf16 kernel where
    it measures fastest (here the fake timer says so); the target's own linears never do, and
    greedy output still equals HF's; "precise" keeps the draft at the weights' precision."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    target = TargetModel(model, kernels=kernels,
                         time_fn=fake({"linear": 5.0, "wx": 9.0, "transposed": 4.0, "onednn": 6.0, "onednn_bf16": 1.0}))
    draft = tiny_draft(model, block_size=8)
    layout = target.draft_layout(draft)
    rows = target.head_rows(torch.arange(40))
    info = target.kernel_info()
    bf16 = K.IMPLS["onednn_bf16"].available(draft.fc.weight)  # False on a CPU without bf16 products
    draft_kernels = {k for lin in layout.linears for k in lin.names}
    assert draft_kernels == ({"onednn_bf16"} if kernels == "auto" and bf16 else {"transposed"})
    assert all("onednn_bf16" not in r["kernels"] for r in info["shapes"] if not r["shape"].endswith(" approx"))
    assert all(any(role.startswith("draft") for role in r["roles"]) for r in info["shapes"]
               if r["shape"].endswith(" approx"))
    assert info["mode"] == kernels
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    assert torch.equal(dflash_generate(draft, target, ids, 20, None, block_size=8), ref)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 7, 64, generator=g)
    with torch.inference_mode():
        ref = hidden @ model.lm_head.weight[:40].T
        assert torch.allclose(target.logits(hidden, rows), ref, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_draft_vocabularys_head_rows_are_built_once_however_many_requests(kernels, tmp_path, monkeypatch):
    """Every request's proposer asks for its draft vocabulary's head rows: the adapter builds
    them once (a server must not hold a new copy per request) and keeps a few vocabularies."""
    from dflash.engine import target as T

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    target = TargetModel(model, kernels=kernels, time_fn=fake({"linear": 1.0}) if kernels == "auto" else None)
    draft = tiny_draft(model, block_size=8)
    draft.config.draft_vocab = list(range(0, 96, 2))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    for _ in range(6):
        assert torch.equal(dflash_generate(draft, target, ids, 12, None, block_size=8), ref)
    vocab = torch.tensor(draft.config.draft_vocab)
    assert target.head_rows(vocab) is target.head_rows(vocab.clone()) and len(target.head_rows_built) == 1
    if kernels == "auto":
        rows = [r for r in target.kernel_info()["shapes"] if "draft lm_head" in r["roles"]]
        assert [r["weights"] for r in rows] == [1]
    for k in range(2, 2 + 2 * T.HEAD_ROWS_KEPT):
        target.head_rows(torch.arange(k))
    assert len(target.head_rows_built) == T.HEAD_ROWS_KEPT  # the oldest vocabularies go
