"""dflash profile on a tiny random target: step parts through the loop's timer seam (checked
exactly with a fake clock), overhead ratio, cost curves, the op split, the report."""

import pytest
import torch
from dflash.testing import fake_timer, tiny_draft, tiny_target

from dflash.bench import profile as bp
from dflash.bench.report import comparison_markdown, kernel_markdown, plot_cost_curve, profile_markdown
from dflash.engine.target import TargetModel
from dflash.engine.timing import PARTS


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    return TargetModel(target, kernels="torch"), tiny_draft(target, block_size=8)


class TickClock:
    """A fake clock that advances one millisecond per reading."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self):
        self.now += 1e-3
        self.reads += 1
        return self.now


class HeadRowClock:
    """A fake clock that reads one millisecond per lm_head row computed so far, through `watch`:
    a span's time is the head rows inside it, so a cost curve is exact on any CPU."""

    def __init__(self):
        self.rows = 0

    def __call__(self):
        return self.rows * 1e-3

    def watch(self, target):
        clock = self

        class Watched:  # the target, its `logits` counting rows (nothing patched on the target)
            def __getattr__(self, name):
                return getattr(target, name)

            def logits(self, hidden):
                clock.rows += hidden.shape[1]
                return target.logits(hidden)
        return Watched()


def test_step_parts_are_the_timer_spans_a_fake_clock_measures(models):
    """Each span reads the clock twice (one tick inside it), so a part's time per step is the
    number of its spans in ms; the step's own time is every reading between two yields."""
    target, draft = models
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    s = bp.profile_steps(draft, target, ids, 8, 20, clock=TickClock())
    assert s.steps > 0 and s.tokens_per_step >= 1
    p = s.parts_ms
    assert p["draft_forward"] == p["draft_head"] == p["verify_forward"] == 1.0  # one span each per step
    assert p["verify_head"] in (1.0, 1.5, 2.0)  # row 0, and the other rows when proposal 1 is accepted
    spans = sum(p[k] for k in PARTS)
    assert p["host"] == pytest.approx(spans + 1.0)  # step = 2 readings per span + the yield's own
    assert s.step_ms == pytest.approx(2 * spans + 1.0)
    plain = bp.profile_steps(None, target, ids, 1, 10, clock=TickClock())
    assert plain.parts_ms["draft_forward"] == 0 and plain.tokens_per_step == 1
    assert plain.parts_ms["verify_forward"] == plain.parts_ms["verify_head"] == 1.0 and plain.step_ms == 5.0
    assert not {"forward_hidden", "logits"} & set(vars(target)) and "forward" not in vars(draft)  # nothing patched


def test_the_clock_is_an_argument_and_the_cpu_clock_runs(models):
    target, draft = models
    ids = torch.tensor([[3, 5, 7]])
    tick = TickClock()
    bp.target_cost_curve(target, (1, 2), (8,), repeats=1, clock=tick)
    assert tick.reads == 2 * 2 * 3  # (warm-up + 1 repeat) x 2 token counts x 3 readings
    cpu = bp.profile_steps(draft, target, ids, 4, 6, clock=bp.CLOCKS["cpu"])
    assert cpu.step_ms > 0 and cpu.parts_ms["verify_forward"] > 0


def test_overhead_curves_ops_and_report(models, tmp_path):
    target, draft = models
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    o = bp.overhead_ratio(bp.random_like(draft), target, ids, 8, 12, rounds=1)
    assert o["ratio"] > 0 and o["bare_forward_ratio"] > 0 and o["block_size"] == 8
    heads = HeadRowClock()
    curve = bp.target_cost_curve(heads.watch(target), (1, 4, 8), (16, 32), repeats=1, clock=heads)
    assert curve["ns"] == [1, 4, 8] and [r["context"] for r in curve["rows"]] == [16, 32]
    # `ms`: the layers and row 0's head (one row); `rest_head_ms`: the other n - 1 rows (n=1: none left)
    assert all(r["ms"] == [1.0, 1.0, 1.0] and r["rest_head_ms"] == [0.0, 3.0, 7.0] for r in curve["rows"])
    real = bp.target_cost_curve(target, (1, 4), (16,), repeats=1)  # the real clock runs too
    assert len(real["rows"][0]["ms"]) == 2 and min(real["rows"][0]["ms"]) > 0
    d = bp.draft_cost_curve(draft, target, (2, 4, 8), context=16, repeats=1)
    assert len(d["ms"]) == 3 and d["draft_layers"] == 2 and min(d["ms"]) > 0
    h = bp.head_cost(target, 7, (None, 32), repeats=1)
    assert h["vocab"] == [96, 32]
    ops = bp.decode_op_profile(target, context=16, steps=2)
    assert ops["ops"] and ops["groups_ms"]["matmul"] > 0 and ops["ops_per_step"] > 10
    cm = bp.cost_model_summary(target, draft, clock=TickClock(), blocks=(2, 4))
    # every timed span is one tick: (draft + verify(B) + rest of the head) / verify(1) = 3 for each B
    assert cm["blocks"] == [2, 4] and cm["break_even_tau"] == [3.0, 3.0] and cm["verify_ratio"] == [1.0, 1.0]
    by = {"torch": {"kernels": target.kernel_info(), "overhead": o, "decode_ops": ops, "target_curve": curve,
                    "cost_model": cm}}
    result = {"machine": {"cpu": "Fake CPU", "cpus": 2, "threads": 1, "load_average": [1.0, 1.0, 1.0],
                          "kernels": {"mode": "torch"}},
              "draft": "random", "overhead": o, "steps": [bp.profile_steps(draft, target, ids, 4, 8).to_dict()],
              "target_curve": curve, "draft_curve": d, "head_cost": h, "by_kernels": by}
    md = profile_markdown(result)
    assert "Engine overhead" in md and "| 16 |" in md and "| 32 |" in md and "Fake CPU (2 cores)" in md
    assert "break-even tau, block 4" in md and "kernels=torch" in md and "aten::" in md
    assert plot_cost_curve(result, tmp_path / "c.png").stat().st_size > 0
    assert comparison_markdown({}) == ""


def test_kernel_markdown_shows_the_fake_timers_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))

    time_fn = fake_timer({"linear": 2.0, "wx": 3.0, "transposed": [2.01] + [1.0] * 6, "onednn": 5.0})
    t = TargetModel(tiny_target("llama"), time_fn=time_fn)
    md = kernel_markdown(t.kernel_info())
    assert "| 64x64 | q_proj, o_proj | 8 | linear | transposed |" in md and "| transposed |" in md
    assert kernel_markdown({"mode": "torch"}).startswith("Kernels: torch")


def test_profile_command_end_to_end_with_both_kernel_settings(tmp_path, monkeypatch, capsys):
    import json

    from dflash.cli.commands import main
    from dflash.testing import tiny_pipeline
    from dflash.text.pipeline import Pipeline

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    pipe = tiny_pipeline(block_size=4)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    out = tmp_path / "prof"
    assert main(["profile", "--block-size", "4", "--profile-blocks", "4", "--contexts", "16", "--repeats", "1",
                 "--rounds", "1", "--max-new-tokens", "6", "--out", str(out)]) == 0
    result = json.loads((out / "profile.json").read_text())
    assert set(result["by_kernels"]) == {"auto", "torch"} and result["kernels"] == "auto"
    assert result["machine"]["cpu"] and result["machine"]["kernels"]["mode"] == "auto"
    assert result["by_kernels"]["torch"]["kernels"]["mode"] == "torch"
    assert result["by_kernels"]["torch"]["kernels"]["precision"]["precision"] == "fp32"
    cm = result["by_kernels"]["auto"]["cost_model"]
    assert cm["blocks"] == list(bp.BREAK_EVEN_BLOCKS) and len(cm["model"]["ns"]) == 13
    md = (out / "profile.md").read_text()
    assert "Kernel settings side by side" in md and "| shape (out x in) |" in md and "break-even tau, block 16" in md
    assert "Kernel settings side by side" in capsys.readouterr().out


def test_the_drafts_linear_shapes_are_timed_for_the_table(tmp_path, monkeypatch):
    """The draft's linears are in the kernel table: with kernels="auto" as choices of their own
    (they may take approximate kernels, the target's never do), with "precise" sharing the
    target's choice of the same shape."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    model = tiny_target("llama")
    target = TargetModel(model, time_fn=fake_timer({"linear": 1.0}))
    draft = tiny_draft(model)
    shapes = bp.time_draft_kernels(target, draft)
    fc = f"{draft.fc.weight.shape[0]}x{draft.fc.weight.shape[1]}"
    assert f"{fc} approx" in shapes and "64x64 approx" in shapes
    rows = {r["shape"]: r for r in target.kernel_info(target.draft_layout(draft))["shapes"]}
    roles = rows[f"{fc} approx"]["roles"]  # apart from the target's down_proj of that shape
    assert "draft fc" in roles and all(r.startswith("draft ") for r in roles)
    assert rows["64x64 approx"]["roles"] == ["draft q_proj", "draft o_proj"]
    assert rows["64x64"]["weights"] == 8 and rows["64x64 approx"]["weights"] == 2 * len(draft.layers)
    precise = TargetModel(model, kernels="precise", time_fn=fake_timer({"linear": 1.0}))
    assert "64x64" in bp.time_draft_kernels(precise, draft)
    rows = {r["shape"]: r for r in precise.kernel_info(precise.draft_layout(draft))["shapes"]}
    assert "draft fc" in rows[fc]["roles"]  # its shape may be a target shape too (down_proj here)
    assert rows["64x64"]["weights"] == 8 + 2 * len(draft.layers)  # the target's q, o and the draft's, applied
    assert bp.time_draft_kernels(TargetModel(model, kernels="torch"), draft) == []


def test_summaries_separate_the_speedup_over_hf_generate_from_the_one_over_our_loop():
    from dflash.bench.methods import BASELINE
    from dflash.bench.report import COLUMNS, summary_row
    from dflash.bench.stats import Record, summarize

    times = {BASELINE: 4.0, "loop-b1": 2.0, "dflash-b8": 1.0}  # seconds for the same 10 tokens
    recs = [Record(m, [1] * 10, 3, t, 0.1, prompt_id="p", dataset="d") for m, t in times.items()]
    s = summarize(recs, "d", "dflash-b8", BASELINE, 8)
    assert s.speedup == pytest.approx(4.0) and s.speedup_vs_loop == pytest.approx(2.0)
    loop = summarize(recs, "d", "loop-b1", BASELINE, 1)
    assert loop.speedup == pytest.approx(2.0) and loop.speedup_vs_loop == pytest.approx(1.0)
    assert summarize(recs, "d", BASELINE, BASELINE, 1).speedup_vs_loop is None
    row = dict(zip(COLUMNS, summary_row(s)))
    assert row["speedup"] == "4.00x" and row["vs loop-b1"] == "2.00x"


def test_tokens_per_pass_counts_plain_passes_that_tau_leaves_out():
    """tau (vLLM's) skips passes without proposals, so a proposer that often has none looks
    better by tau than by tokens per pass; the report gives both, and the sources' shares."""
    from dflash.bench.report import markdown_sources
    from dflash.bench.stats import Record, summarize

    steps = [(0, 0, 1), (4, 3, 4), (0, 0, 1), (6, 1, 2)]  # two plain passes, two with proposals
    rec = Record("suffix-b8", [1] * 9, 3, 1.0, 0.1, steps, prompt_id="p", dataset="d",
                 extra={"accepted_per_source": {"suffix": 3, "draft": 1}, "draft_passes": 1})
    s = summarize([rec], "d", "suffix-b8", "target", 8)
    assert s.tau == pytest.approx(3.0) and s.tokens_per_pass == pytest.approx(2.0) and s.plain_share == 0.5
    assert s.verified_per_step == pytest.approx(6.0) and s.source_share == {"draft": 0.25, "suffix": 0.75}
    assert s.draft_share == 0.25  # the draft ran for one pass of four
    assert "| d | suffix-b8 | 6.0 | 0.50 | 0.25 | 0.25 | 0.75 |" in markdown_sources([s])
    old = Record("suffix-b8", [1] * 9, 3, 1.0, 0.1, steps, prompt_id="p", dataset="d")  # a record without the count
    assert summarize([old], "d", "suffix-b8", "target", 8).draft_share is None
