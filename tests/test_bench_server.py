"""The serving benchmark's pure parts (benchmarks/server/bench_server.py): percentiles, the
parsing of streamed chunks, the /metrics reading, the exactness check across configurations,
the tables, argument parsing; and one small level against the in-process tiny server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_server", ROOT / "benchmarks" / "server" / "bench_server.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_server"] = bs
_spec.loader.exec_module(bs)


def test_percentile():
    assert bs.percentile([], 0.5) is None
    assert bs.percentile([3.0], 0.99) == 3.0
    assert bs.percentile([4, 1, 3, 2], 0.5) == 2.5
    assert bs.percentile(list(range(101)), 0.99) == pytest.approx(99.0)
    assert bs.percentile([1, 2], 1.0) == 2


def test_requests_per_level():
    assert [bs.requests_for(c, None) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert bs.requests_for(64, 4) == 4


def test_parse_args_defaults_and_overrides():
    a = bs.parse_args(["--out-dir", "x"])
    assert a.configs == ["max1", "plain", "spec", "llamacpp", "vllm"]
    assert a.concurrency == [1, 4, 16, 64] and a.max_batch == 64 and a.max_tokens == 64 and a.threads == 2
    assert not a.alone
    a = bs.parse_args(["--out-dir", "x", "--configs", "max1", "plain", "max1", "--concurrency", "1", "4",
                       "--max-tokens", "16", "--requests-per-level", "4", "--alone", "--precision", "fp32"])
    assert a.configs == ["max1", "plain"] and a.max_batch == 4 and a.requests_per_level == 4
    assert a.alone and a.precision == "fp32"
    with pytest.raises(SystemExit):
        bs.parse_args(["--out-dir", "x", "--configs", "nope"])


def test_dflash_commands():
    a = bs.parse_args(["--out-dir", "x", "--concurrency", "1", "16", "--draft", "D",
                       "--serve-args", "--proposer draft"])
    max1 = bs.dflash_config("max1", a, 9000, True)
    plain = bs.dflash_config("plain", a, 9001, True)
    spec = bs.dflash_config("spec", a, 9002, True)
    assert max1.label.startswith("dflash serve --max-batch 1 ") and "--block-size" not in max1.label
    assert plain.label.startswith("dflash serve --max-batch 16 --block-size 1 ")
    assert spec.label.startswith("dflash serve --max-batch 16 ") and "--block-size" not in spec.label
    for cfg in (max1, plain, spec):
        assert cfg.command[cfg.command.index("--port") + 1] in ("9000", "9001", "9002")
        assert "--draft" in cfg.command and "--threads" in cfg.command and cfg.command[-2:] == ["--proposer", "draft"]
    old = bs.dflash_config("spec", a, 9003, False)  # a server without --max-batch
    assert "--max-batch" not in old.command and old.note


def test_llamacpp_command(monkeypatch, tmp_path):
    import dflash.backends.llamacpp.build as build

    a = bs.parse_args(["--out-dir", "x", "--concurrency", "4", "--llamacpp-gguf", "m.gguf",
                       "--llamacpp-args", "--poll 0"])
    monkeypatch.setattr(build, "server_path", lambda: None)
    reason = bs.llamacpp_config(a, 9000)
    assert isinstance(reason, str) and "make llama-server" in reason and "\n" not in reason
    monkeypatch.setattr(build, "server_path", lambda: tmp_path / "llama-server")
    cfg = bs.llamacpp_config(a, 9000)
    cmd = cfg.command
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == "4096"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-m") + 1] == "m.gguf"
    assert cfg.extra_body == {"cache_prompt": False} and cmd[-2:] == ["--poll", "0"]


def test_parse_chunk_dflash_and_llamacpp():
    s = {"text": "", "usage": None, "error": None}
    bs.parse_chunk({"choices": [{"delta": {"role": "assistant"}}]}, s)
    assert "first" not in s
    bs.parse_chunk({"choices": [{"delta": {"content": "Hel"}}]}, s)
    first = s["first"]
    bs.parse_chunk({"choices": [{"delta": {"content": "lo"}}]}, s)
    bs.parse_chunk({"choices": [], "usage": {"completion_tokens": 2}}, s)  # dflash / OpenAI: usage apart
    assert s["text"] == "Hello" and s["first"] == first and s["usage"]["completion_tokens"] == 2
    t = {"text": "", "usage": None, "error": None}  # llama-server: usage and timings in the last chunk
    bs.parse_chunk({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, t)
    bs.parse_chunk({"choices": [{"delta": {}, "finish_reason": "length"}], "usage": {"completion_tokens": 7},
                    "timings": {"predicted_n": 7}}, t)
    assert t["text"] == "Hi" and t["usage"]["completion_tokens"] == 7 and t["timings"]["predicted_n"] == 7
    bs.parse_chunk({"error": {"message": "boom"}}, t)
    assert t["error"] == "boom"


PAGE = """# TYPE dflash:num_requests_running gauge
dflash:num_requests_running 3.0
# TYPE dflash:running_batch_size gauge
dflash:running_batch_size 3.0
# TYPE dflash:batch_tokens_per_step gauge
dflash:batch_tokens_per_step 5.5
# TYPE dflash:generation_tokens counter
dflash:generation_tokens_total 10.0
# TYPE dflash:spec_decode_num_accepted_tokens_per_pos counter
dflash:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0
dflash:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0
# TYPE dflash:e2e_request_latency_seconds histogram
dflash:e2e_request_latency_seconds_bucket{le="1.0"} 2.0
dflash:e2e_request_latency_seconds_bucket{le="+Inf"} 2.0
dflash:e2e_request_latency_seconds_count 2.0
dflash:e2e_request_latency_seconds_sum 1.5
"""


def test_metrics_page_and_batch_columns():
    page = bs.parse_metrics(PAGE)
    assert page["dflash:running_batch_size"] == 3.0 and page["dflash:generation_tokens_total"] == 10.0
    assert page["dflash:spec_decode_num_accepted_tokens_per_pos_total"] == 4.0  # summed over labels
    assert not any(k.endswith("_bucket") for k in page) and page["dflash:e2e_request_latency_seconds_count"] == 2.0
    idle = {**page, "dflash:num_requests_running": 0.0, "dflash:running_batch_size": 0.0}
    busy2 = {**page, "dflash:running_batch_size": 1.0, "dflash:batch_tokens_per_step": 2.5}
    m = bs.engine_metrics({}, page, [idle, page, busy2])
    assert m["dflash:running_batch_size"] == 2.0  # idle samples left out
    assert m["dflash:batch_tokens_per_step"] == 4.0
    assert "dflash:generation_tokens_total" not in m  # neither batch nor step
    assert bs.batch_columns(m, "dflash") == (2.0, 4.0)
    assert bs.batch_columns({}, "dflash") == (None, None)  # the server has no such metrics


def test_engine_metrics_counters_and_histograms():
    before = {"dflash:batch_steps_total": 10.0, "dflash:step_tokens_sum": 100.0, "dflash:step_tokens_count": 50.0}
    after = {"dflash:batch_steps_total": 30.0, "dflash:step_tokens_sum": 160.0, "dflash:step_tokens_count": 70.0}
    m = bs.engine_metrics(before, after, [])
    assert m == {"dflash:batch_steps_total": 20.0, "dflash:step_tokens": 3.0}
    llama = bs.engine_metrics({}, {}, [{"llamacpp:requests_processing": 4.0}, {"llamacpp:requests_processing": 2.0}])
    assert bs.batch_columns(llama, "llamacpp") == (3.0, None)
    page = bs.parse_metrics('# TYPE vllm:num_requests_running gauge\n'
                            'vllm:num_requests_running{engine="0",model_name="target"} 2.0\n')
    assert bs.batch_columns(bs.engine_metrics({}, {}, [page]), "vllm") == (2.0, None)
    assert bs.batch_columns({"dflash:num_requests_running": 3.0}, "dflash") == (None, None)


def level(texts: dict, tok_s: float = 10.0) -> dict:
    return {"requests": len(texts), "ok": len(texts), "failed": 0, "output_tokens_per_s": tok_s, "ttft_p50_s": 0.1,
            "ttft_p99_s": 0.2, "latency_p50_s": 1.0, "latency_p99_s": 2.0, "tau": None, "mean_running_batch": None,
            "tokens_per_step": None, "texts": {str(i): t for i, t in texts.items()}}


def record() -> dict:
    return {"machine": {"cpu": "Test CPU", "cores": 2, "date": "2026-01-01 00:00 UTC",
                        "load_average_at_start": [0.1, 0.2, 0.3]},
            "settings": {"requests_per_level": None, "max_tokens": 16, "datasets": ["math"], "threads": 2,
                         "max_batch": 4, "alone": False},
            "configs": {
                "max1": {"kind": "dflash", "label": "dflash serve --max-batch 1", "note": "",
                         "levels": {"1": level({0: "a", 1: "b"}), "4": level({0: "a", 1: "b", 2: "c"})}},
                "plain": {"kind": "dflash", "label": "dflash serve --max-batch 4 --block-size 1", "note": "",
                          "levels": {"1": level({0: "a", 1: "b"}, 20.0), "4": level({0: "a", 1: "X", 2: "c"}, 30.0)}},
                "llamacpp": {"kind": "llamacpp", "label": "llama-server -np 4", "note": "",
                             "levels": {"4": level({0: "z", 1: "b", 2: "c", 3: "d"})}}},
            "skipped": {"vllm": "vLLM not found; skipping vllm"}}


def test_exactness_against_max1():
    assert bs.differing({"0": "a", "1": "b", "5": "q"}, {"0": "a", "1": "c"}) == ["1"]
    r = record()
    totals = bs.check_exactness(r)
    plain4 = r["configs"]["plain"]["levels"]["4"]
    assert (plain4["compared"], plain4["differ"], plain4["differ_ids"]) == (3, 1, ["1"])
    assert r["configs"]["max1"]["levels"]["1"]["compared"] == 2  # against its other level
    # max1 at 4 compares its indices 0, 1 with its level 1
    assert totals["dflash"] == {"compared": 2 + 2 + 2 + 3, "differ": 1}
    assert totals["other"] == {"llamacpp": {"compared": 3, "differ": 1}}  # index 3: no reference


def test_exactness_falls_back_to_other_levels():
    r = record()
    del r["configs"]["max1"]["levels"]["4"]
    bs.check_exactness(r)
    plain4 = r["configs"]["plain"]["levels"]["4"]
    assert (plain4["compared"], plain4["differ"]) == (2, 1)
    assert r["configs"]["max1"]["levels"]["1"]["compared"] == 0


def test_markdown_and_files(tmp_path):
    r = record()
    bs.write_outputs(tmp_path, r)
    md = (tmp_path / "results.md").read_text()
    assert "Test CPU, 2 cores" in md and bs.NOT_ALONE in md and bs.ALONE not in md
    assert "## Concurrency 1 (2 requests)" in md and "## Concurrency 4 (3 requests)" in md
    assert "| `plain` | 3/0 | 30.0 | 3.00x | 0.100 | 0.200 | 1.000 | 2.000 | — | — | — | 1 of 3 |" in md
    assert "| `max1` | 3/0 | 10.0 | 1.00x |" in md
    assert "**1 of 9**" in md and "`llamacpp` (information" in md and "skipped: vLLM not found" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["configs"]["plain"]["levels"]["4"]["texts"]["1"] == "X"
    r["settings"]["alone"] = True
    assert bs.ALONE in bs.markdown(r)


def test_prompt_list_cycles_sets():
    prompts = bs.load_prompt_list(6, ("math", "mtbench"))
    assert len(prompts) == 6 and all(p[0]["role"] == "user" for p in prompts)
    assert prompts[0] != prompts[1]  # the sets in turn
    assert bs.load_prompt_list(6, ("math", "mtbench")) == prompts  # the same list every time


def test_level_against_tiny_server():
    msgs = [[{"role": "user", "content": f"Count to {k}."}] for k in range(3)]
    with bs.tiny_server() as url:
        one = bs.summarize(asyncio.run(bs.run_level(url, msgs, 3, 1, 6, {}, interval=0.05)))
        three = bs.summarize(asyncio.run(bs.run_level(url, msgs, 3, 3, 6, {}, interval=0.05)))
    for lv in (one, three):
        assert lv["ok"] == 3 and lv["failed"] == 0 and lv["output_tokens"] > 0
        assert lv["ttft_p50_s"] is not None and lv["latency_p99_s"] >= lv["ttft_p50_s"]
    assert one["texts"] == three["texts"]  # greedy: the same text at any concurrency
