"""dflash bench on a tiny random target: records, statistics, the equality check, outputs."""

import argparse
import json

import pytest
import torch

from dflash.bench import methods as bench_methods
from dflash.bench import runner as bench
from dflash.bench.methods import BASELINE, Settings, build_methods
from dflash.bench.stats import (
    Record,
    first_mismatch,
    histogram,
    paired_speedups,
    per_position_acceptance,
    summarize,
    tau,
)
from dflash.cli.bench import add_bench
from dflash.engine.errors import IncompatibleDraftError
from dflash.engine.target import TargetModel
from dflash.testing import tiny_draft, tiny_target
from dflash.text.pipeline import Pipeline
from dflash.text.prompts import Prompt, PromptFileError


class ByteTokenizer:
    """Enough of a tokenizer for the bench: text <-> ids (bytes folded into the vocabulary)."""
    eos_token_id, pad_token_id, unk_token_id, chat_template = 95, 0, None, None

    def __call__(self, text, return_tensors="pt", add_special_tokens=True):
        class Out:
            input_ids = torch.tensor([[1 + b % 90 for b in text.encode()]])
        return Out()

    def convert_tokens_to_ids(self, tok):
        return None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def pipe():
    target = tiny_target("llama")
    return Pipeline(TargetModel(target), tiny_draft(target, block_size=8), ByteTokenizer(), False)


PROMPTS = [Prompt(id=str(i), dataset=ds, messages=[{"role": "user", "content": text}])
           for i, (ds, text) in enumerate([("code", "def f(x): return x"), ("code", "print hello hello hello"),
                                           ("chat", "a b c d e f")])]


def test_records_complete_and_consistent(pipe):
    methods = build_methods(Settings(block_sizes=(4, 8)))
    names = [n for n, _ in methods]
    assert names == [BASELINE, "prompt-lookup-10", "loop-b1", "dflash-b4", "dflash-b8"]
    records = bench.run_bench(pipe, PROMPTS, methods, 12, warmup=False)
    assert len(records) == len(PROMPTS) * len(methods)
    assert {(r.dataset, r.prompt_id, r.method) for r in records} == {(p.dataset, p.id, n) for p in PROMPTS for n in names}
    for r in records:
        assert 0 < r.num_output_tokens <= 12 and r.total_time > 0 and 0 < r.time_to_first_token <= r.total_time
        assert r.num_input_tokens > 0
        if r.method.startswith(("dflash", "loop")):  # prefill token + every step's commits
            assert 1 + sum(c for _, _, c in r.steps) == r.num_output_tokens
            assert all(0 <= a <= p and c <= a + 1 for p, a, c in r.steps)
        if r.method.startswith("dflash"):
            assert r.acceptance_lengths == [c for _, _, c in r.steps] and r.steps[0][0] > 0
        if r.method.startswith("prompt-lookup"):  # one streamer push per step after the first token
            assert 1 + sum(c for _, _, c in r.steps) == r.num_output_tokens
        d = r.to_dict()
        assert d["output_ids"] == r.output_ids and d["text"] == r.text and "acceptance_lengths" in d
    assert bench.check_equal(records) == []  # greedy: every method equals the target alone


def test_tau_histogram_and_positions_from_known_steps():
    steps = [(7, 7, 8), (7, 2, 3), (7, 0, 1), (3, 3, 4)]  # the last block was cut to 4 by max_new_tokens
    lengths = [c for _, _, c in steps]
    assert tau(steps) == pytest.approx(1 + (7 + 2 + 0 + 3) / 4)  # the last step committed all it verified
    assert tau([]) is None and tau([(0, 0, 1)]) is None  # plain steps do not make a tau
    assert tau(steps + [(0, 0, 1)]) == pytest.approx(4.0)  # ... nor change one
    assert histogram(lengths, 8) == [1, 0, 1, 1, 0, 0, 0, 1]
    rates = per_position_acceptance(steps, 8)
    assert rates[0] == pytest.approx(3 / 4)  # accepted in steps 1, 2, 4
    assert rates[1] == pytest.approx(3 / 4)
    assert rates[2] == pytest.approx(2 / 4)  # step 4 accepted its 3rd and last proposal
    assert rates[3] == pytest.approx(1 / 3)  # step 4 did not propose position 4
    assert rates[6] == pytest.approx(1 / 3)
    r = Record("dflash-b8", list(range(1 + sum(lengths))), 5, 2.0, 0.1, steps, prompt_id="p", dataset="d")
    d = r.to_dict()
    assert d["tau"] == pytest.approx(4.0) and d["tau_histogram"] == [1, 0, 1, 1, 0, 0, 0, 1]
    assert d["position_acceptance"] == pytest.approx(rates)
    s = summarize([r], "d", "dflash-b8", BASELINE, 8)
    assert s.tau == pytest.approx(4.0) and s.tau_histogram == [1, 0, 1, 1, 0, 0, 0, 1]
    assert s.speedup is None  # no baseline record


def test_speedup_is_paired_by_prompt():
    recs = [Record(BASELINE, [1] * 10, 3, t, 0.1, prompt_id=p, dataset="d") for p, t in (("a", 1.0), ("b", 4.0))]
    recs += [Record("m", [1] * 10, 3, t, 0.1, prompt_id=p, dataset="d") for p, t in (("a", 0.5), ("b", 1.0))]
    assert paired_speedups(recs, "m", BASELINE) == {("d", "a"): 2.0, ("d", "b"): 4.0}
    s = summarize(recs, "d", "m", BASELINE, 1)
    assert s.speedup == pytest.approx(median_tps([20, 10]) / median_tps([10, 2.5]))
    assert s.speedup_paired_median == pytest.approx(3.0)


def median_tps(xs):
    return sorted(xs)[len(xs) // 2 - 1] / 2 + sorted(xs)[len(xs) // 2] / 2


def test_equality_check_fires_on_a_planted_mismatch(pipe, capsys):
    def corrupt(p, ids, n):
        rec = bench_methods.loop_method(8, Settings())(p, ids, n)
        rec.output_ids[3] = (rec.output_ids[3] + 1) % 96
        return rec

    methods = build_methods(Settings(block_sizes=(8,), prompt_lookup=0)) + [("planted", corrupt)]
    records = bench.run_bench(pipe, PROMPTS[:2], methods, 10, warmup=False)
    found = bench.check_equal(records)
    assert [(m.method, m.position) for m in found] == [("planted", 3), ("planted", 3)]
    assert first_mismatch([1, 2, 3], [1, 2]) == 2 and first_mismatch([1, 2], [1, 2]) is None
    from rich.console import Console

    console = Console(record=True, width=200)
    assert bench._report_mismatches(found, console) == 1  # the command's exit status
    assert "MISMATCH: 2 greedy output(s) differ" in console.export_text()


def main(argv):
    """`dflash bench ...` through its own parser (the other subcommands stay out of it)."""
    parser = argparse.ArgumentParser(prog="dflash")
    add_bench(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _prompt_file(tmp_path, lines):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_prompts_file_names_the_line(tmp_path, capsys):
    path = _prompt_file(tmp_path, ['{"prompt": "fine"}', '{"prompt": 3}', "not json"])
    with pytest.raises(PromptFileError, match=r"mine.jsonl, line 2: .*string"):
        main(["bench", "--prompts", str(path)])


def test_command_writes_json_markdown_plots(pipe, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    path = _prompt_file(tmp_path, ['{"prompt": "def add(a, b):"}', '{"messages": [{"role": "user", "content": "hi"}]}'])
    out = tmp_path / "r.json"
    rc = main(["bench", "--prompts", str(path), "--max-new-tokens", "10", "--block-size", "4", "8",
               "--output", str(out), "--markdown", str(tmp_path / "r.md"), "--plots", str(tmp_path / "plots")])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["records"]) == 2 * 5 and data["mismatches"] == []
    rec = data["records"][0]
    assert {"prompt", "output_ids", "text", "acceptance_lengths", "total_time", "time_to_first_token"} <= set(rec)
    assert any("vLLM" in n for n in data["notes"]) or data["notes"] == []
    assert "dflash-b8" in (tmp_path / "r.md").read_text()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "acceptance_histogram.png", "position_acceptance.png", "speedup.png"]
    assert "dflash bench" in capsys.readouterr().err


def test_block_choice_from_acceptance_and_cost_curve():
    from dflash.bench.report import markdown_block_choice
    from dflash.bench.stats import Summary, expected_commits, predicted_speedup

    rates = [0.8, 0.6, 0.4, 0.2, 0.1, 0.0, 0.0]
    assert expected_commits(rates, 1) == 1.0 and expected_commits(rates, 4) == pytest.approx(2.8)
    target_ms, draft_ms = {1: 10.0, 4: 15.0, 8: 20.0}, {4: 5.0, 8: 6.0}
    assert predicted_speedup(rates, 4, target_ms, draft_ms) == pytest.approx(2.8 * 10 / 20)
    assert predicted_speedup(rates, 1, target_ms, draft_ms) == pytest.approx(1.0)
    assert predicted_speedup(rates, 2, target_ms, draft_ms) is None  # no cost measured at 2
    # the other rows' lm_head (5 ms at block 4) is paid in the 80% of steps that accept proposal 1
    assert predicted_speedup(rates, 4, target_ms, draft_ms, {4: 5.0}) == pytest.approx(2.8 * 10 / 24)
    s = Summary("code", "dflash-b8", 1, 10, 2.0, [], rates, 1.0, 1.0, 1.0, 1.0, 1.0)
    profile = {"target_curve": {"ns": [1, 4, 8], "rows": [{"context": 512, "ms": [10.0, 15.0, 20.0]}]},
               "draft_curve": {"blocks": [4, 8], "ms": [5.0, 6.0]}}
    md = markdown_block_choice([s], profile)
    assert "| code | 1.00x (tau 1.00) | 1.40x (tau 2.80) |" in md


def test_draft_vocabulary_what_if_stays_exact(pipe):
    settings = Settings(block_sizes=(8,), prompt_lookup=0, draft_vocabs=(48,),
                        vocab_source=lambda p, k: list(range(k)))
    methods = build_methods(settings)
    assert [n for n, _ in methods] == [BASELINE, "loop-b1", "dflash-b8", "dflash-b8-v48"]
    records = bench.run_bench(pipe, PROMPTS[:2], methods, 12, warmup=False)
    assert bench.check_equal(records) == []
    assert {r.method for r in records} == {n for n, _ in methods}
    assert pipe.draft.config.draft_vocab is None  # the what-if builds its own head: the draft is not changed


def test_the_plain_vocabulary_arm_runs_the_shipped_draft_vocabulary_unwidened(monkeypatch):
    """--plain-vocab: the chain once more with the draft vocabulary as shipped; the default
    chain widens it by the prompt's and the answer's ids; both stay exact."""
    from dflash.engine.proposers import DraftProposer

    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=8)
    draft.config.draft_vocab = list(range(20))
    small = Pipeline(TargetModel(target), draft, ByteTokenizer(), False)
    proposed = {True: set(), False: set()}  # context_vocab -> the ids the chain proposed
    real = DraftProposer.propose

    def spied(self, *a, **k):  # our own class: recording what each arm proposes
        out = real(self, *a, **k)
        proposed[self.context_vocab] |= set(out.tokens.flatten().tolist())
        return out
    monkeypatch.setattr(DraftProposer, "propose", spied)
    methods = build_methods(Settings(block_sizes=(8,), prompt_lookup=0, loop_baseline=False, plain_vocab=True))
    assert [n for n, _ in methods] == [BASELINE, "dflash-b8", "dflash-b8-plainvocab"]
    records = bench.run_bench(small, PROMPTS, methods, 16, warmup=False)
    assert bench.check_equal(records) == []
    assert proposed[False] and max(proposed[False]) < 20  # only the shipped vocabulary
    assert max(proposed[True]) >= 20  # the widened head proposed ids of the text too


def test_draft_threshold_methods_stay_exact_and_propose_less(pipe):
    settings = Settings(block_sizes=(8,), prompt_lookup=0, loop_baseline=False, draft_thresholds=(0.02, 1.0))
    methods = build_methods(settings)
    assert [n for n, _ in methods] == [BASELINE, "dflash-b8", "dflash-b8-t0.02", "dflash-b8-t1"]
    records = bench.run_bench(pipe, PROMPTS[:2], methods, 12, warmup=False)
    assert bench.check_equal(records) == []
    by = {m: [p for r in records if r.method == m for p, _, _ in r.steps] for m in ("dflash-b8", "dflash-b8-t1")}
    assert max(by["dflash-b8"]) == 7 and set(by["dflash-b8-t1"]) == {0}  # threshold 1: plain decoding steps


def test_time_budget_stops_between_prompts(pipe):
    import time

    methods = build_methods(Settings(block_sizes=(8,), prompt_lookup=0, loop_baseline=False))
    assert bench.run_bench(pipe, PROMPTS, methods, 4, warmup=False, deadline=time.monotonic() - 1) == []
    records = bench.run_bench(pipe, PROMPTS, methods, 4, warmup=False, deadline=time.monotonic() + 60)
    assert len(records) == len(PROMPTS) * len(methods)


def test_prompts_round_robin_across_sets(monkeypatch):
    import dflash.text.prompts as prompts

    fake = {n: [Prompt(id=f"{n}/{i}", dataset=n, messages=[{"role": "user", "content": "x"}]) for i in range(k)]
            for n, k in (("a", 2), ("b", 1), ("c", 2))}
    monkeypatch.setattr(prompts, "load_dataset", lambda name, limit: fake[name][:limit])
    got = [p.id for p in bench.load_prompts(["a", "b", "c"], None, 2)]
    assert got == ["a/0", "b/0", "c/0", "a/1", "c/1"]


def test_sampled_run_records_every_method(pipe, tmp_path, monkeypatch):
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    path = _prompt_file(tmp_path, ['{"prompt": "def add(a, b):"}'])
    out = tmp_path / "r.json"
    assert main(["bench", "--prompts", str(path), "--max-new-tokens", "8", "--temperature", "0.8",
                 "--block-size", "4", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["records"]} == {BASELINE, "dflash-b4", "loop-b1", "prompt-lookup-10"}
    assert all(r["num_output_tokens"] > 0 for r in data["records"])


def test_proposer_methods_stay_exact_and_report_their_sources(pipe):
    from dflash.engine.costmodel import CostModel

    flat = CostModel(ns=[1, 32], verify=[10.0, 10.0], contexts=[256], context_ns=[1], context_verify=[[10.0]],
                     rest_ns=[1], rest=[0.0])  # verifying is free here: every tree keeps its whole budget
    settings = Settings(block_sizes=(8,), prompt_lookup=0, loop_baseline=False, proposers=("tree", "suffix", "hybrid"),
                        cost_source=lambda p: flat, adaptive=True)
    methods = build_methods(settings)
    assert [n for n, _ in methods] == [BASELINE, "dflash-b8", "dflash-b8-adaptive", "dflash-tree-b8", "suffix-b8",
                                       "hybrid-b8"]
    records = bench.run_bench(pipe, PROMPTS[:2], methods, 16, warmup=False)
    assert bench.check_equal(records) == []
    sums = {s.method: s for s in bench.summaries(records, bench.method_block_sizes(records))}  # one dataset
    assert sums["dflash-tree-b8"].verified_per_step > sums["dflash-b8"].verified_per_step  # a tree checks more nodes
    for name in ("dflash-tree-b8", "suffix-b8", "hybrid-b8"):
        share = sums[name].source_share
        assert not share or abs(sum(share.values()) - 1) < 0.01
        assert set(share) <= ({"draft"} if name.startswith("dflash") else {"suffix"} if name.startswith("suffix")
                              else {"draft", "suffix"})


def test_a_compared_draft_runs_beside_the_main_one_on_the_same_target(pipe, tmp_path, monkeypatch):
    """--compare-draft: each method that runs the draft once more with the other checkpoint,
    on the same target and prompts, interleaved; exact like the others; one view per checkpoint
    (its trees learn across prompts); a checkpoint that does not fit the target is refused."""
    other = tiny_draft(pipe.target.model, seed=7, layers=1, block_size=8)
    other.save_pretrained(tmp_path / "other")
    calls = {"views": 0, "forwards": 0}
    real = Pipeline.with_draft

    def counted(self, path):  # our own class: counting the views and their draft's passes
        view = real(self, path)
        calls["views"] += 1
        view.draft.register_forward_hook(lambda *a: calls.__setitem__("forwards", calls["forwards"] + 1))
        return view
    monkeypatch.setattr(Pipeline, "with_draft", counted)
    tag = str(tmp_path / "other")
    settings = Settings(block_sizes=(8,), prompt_lookup=0, proposers=("suffix", "hybrid"), compare_drafts=(tag,),
                        cost_source=lambda p: _FlatCost())
    names = [n for n, _ in build_methods(settings)]
    assert names[:5] == [BASELINE, "loop-b1", "dflash-b8", "suffix-b8", "hybrid-b8"]
    assert names[5:7] == [f"dflash-b8@{tag}", f"hybrid-b8@{tag}"]  # loop-b1 and suffix run no draft
    assert any(tag in note for note in settings.notes)  # the results file says which draft that is
    records = bench.run_bench(pipe, PROMPTS, build_methods(settings), 12, warmup=False)
    assert bench.check_equal(records) == []  # exact with either draft
    assert {r.method for r in records} >= {f"dflash-b8@{tag}", f"hybrid-b8@{tag}"}
    assert calls["views"] == 1 and calls["forwards"] > 0  # one view per checkpoint, for its methods and every prompt
    other.save_pretrained(tmp_path / "wrong")
    cfg = json.loads((tmp_path / "wrong" / "config.json").read_text())
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**cfg, "num_target_layers": 99}))
    with pytest.raises(IncompatibleDraftError, match="built for a 99-layer target"):
        pipe.with_draft(str(tmp_path / "wrong"))


def test_a_compared_kernel_setting_runs_on_its_own_adapter_of_the_same_model(pipe):
    """--compare-kernels: each draft method once more on a second adapter of the same loaded
    model with the other kernel setting (one view for all its methods), exact like the others."""
    views = []
    settings = Settings(block_sizes=(8,), prompt_lookup=0, proposers=("hybrid",), compare_kernels=("torch",),
                        cost_source=lambda p: _FlatCost())
    methods = build_methods(settings)
    assert [n for n, _ in methods][4:] == ["dflash-b8@kernels=torch", "hybrid-b8@kernels=torch"]
    assert any("kernels=torch" in note for note in settings.notes)
    real = Pipeline.with_kernels

    def counted(self, mode):
        views.append(real(self, mode))
        return views[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Pipeline, "with_kernels", counted)
        records = bench.run_bench(pipe, PROMPTS, methods, 12, warmup=False)
    assert bench.check_equal(records) == []
    assert len(views) == 1 and views[0].target.kernels == "torch" and views[0].target.model is pipe.target.model
    assert views[0].draft is pipe.draft and pipe.target.kernels == "auto"


class _FlatCost:
    """A cost model where every verify pass and draft pass costs the same."""
    def verify_ms(self, n):
        return 10.0

    def draft_ms(self, block):
        return 1.0


def test_a_compared_precision_runs_every_loop_method_exact_against_its_own_plain_decoding(pipe):
    """--compare-precision int4: every loop method once more on an int4 adapter of the same
    model, the plain loop included; each int4 speculative output is checked against the int4
    plain loop's (they differ from fp32's), so the run is exact."""
    from dflash.engine import native

    if not native.available():
        pytest.skip(f"native kernels: {native.problem()}")
    settings = Settings(block_sizes=(8,), prompt_lookup=0, proposers=("hybrid",), compare_precisions=("int4",),
                        cost_source=lambda p: _FlatCost())
    methods = build_methods(settings)
    assert [n for n, _ in methods][4:] == ["loop-b1@precision=int4", "dflash-b8@precision=int4",
                                           "hybrid-b8@precision=int4"]
    records = bench.run_bench(pipe, PROMPTS, methods, 12, warmup=False)
    assert bench.check_equal(records) == []
    int4 = [r for r in records if r.method == "hybrid-b8@precision=int4"]
    assert int4 and all(r.extra["exact_against"] == "loop-b1@precision=int4" for r in int4)
