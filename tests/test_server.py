"""`dflash serve` against a live server on 127.0.0.1, with the official openai client:
answers equal offline decoding, streaming chunks, stop strings, seeds, acceptance stats,
bad requests, the API key, /metrics, client disconnects, the bounded queue, shutdown."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_support import (  # noqa: F401  (pipe, server: the shared fixtures)
    CHAIN,
    MODEL,
    LiveServer,
    client,
    metrics,
    offline_chat,
    offline_text,
    pipe,
    server,
    slow_pipeline,
    tiny_pipeline,
    wait_for,
)

from dflash.engine import native
from dflash.engine.loop import dflash_generate
from dflash.engine.target import TargetModel
from dflash.text.pipeline import Pipeline, SpecSettings

# -- answers -----------------------------------------------------------------------------

def test_models_and_health(server):
    models = client(server.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(server.url).models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_equals_offline_greedy(server, pipe):
    out = client(server.url).completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=30,
                                                temperature=0)
    assert out.choices[0].text == offline_text(pipe, "the quick brown fox", 30)
    assert out.choices[0].finish_reason == "length"
    assert out.object == "text_completion"
    u = out.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        pipe.encode_text("the quick brown fox").shape[1], 30, u.prompt_tokens + 30)
    spec = u.spec_decode
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"],
                                                           abs=1e-3)
    assert u.tokens_per_second > 0


def test_completion_stream_equals_offline_greedy(server, pipe):
    chunks = list(client(server.url).completions.create(model=MODEL, prompt="hello world", max_tokens=25,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(pipe, "hello world", 25)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    assert "spec_decode" in chunks[-1].usage.model_extra


def test_chat_equals_offline_greedy(server, pipe):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you today?"}]
    out = client(server.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline_chat(pipe, messages, 20)
    assert out.usage.completion_tokens == 20 and out.usage.spec_decode["num_drafts"] > 0


def test_chat_stream_equals_offline_greedy(server, pipe):
    messages = [{"role": "user", "content": [{"type": "text", "text": "the target verifies"}]}]
    stream = client(server.url).chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                        temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == offline_chat(pipe, [{"role": "user", "content": "the target verifies"}], 24)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_end_generation(server, pipe):
    full = offline_text(pipe, "speculative decoding", 40)
    stop = full[6:8]
    expected = full[:full.find(stop)]
    c = client(server.url)
    out = c.completions.create(model=MODEL, prompt="speculative decoding", max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    chunks = list(c.completions.create(model=MODEL, prompt="speculative decoding", max_tokens=40, temperature=0,
                                       stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(server, pipe):
    c = client(server.url)
    kw = dict(model=MODEL, prompt="hello", max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    a, b = c.completions.create(**kw).choices[0].text, c.completions.create(**kw).choices[0].text
    assert a == b == offline_text(pipe, "hello", 20, temperature=0.9, top_p=0.95, seed=1234)


def test_token_id_prompt(server, pipe):
    ids = pipe.encode_text("lazy dog")[0].tolist()
    out = client(server.url).completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert out.choices[0].text == offline_text(pipe, "lazy dog", 10)


def test_one_token_and_top_k(server, pipe):
    c = client(server.url)
    out = c.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0)
    assert out.choices[0].text == offline_text(pipe, "hello", 1) and out.usage.completion_tokens == 1
    out = c.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0.7, seed=3,
                               extra_body={"top_k": 5})
    assert out.choices[0].text == offline_text(pipe, "hello", 12, temperature=0.7, seed=3, top_k=5)


def test_acceptance_stats_in_usage_and_metrics(pipe):
    perfect = tiny_pipeline(perfect=True)  # every draft token is accepted: tau = block size
    with LiveServer(perfect, model_name=MODEL, spec=CHAIN) as s:  # the chain's counters, as dflash_generate's
        before = metrics(s.url)
        out = client(s.url).completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=0)
        ref = dflash_generate(perfect.draft, perfect.target, perfect.encode_text("hello"), 20,
                              perfect.stop_token_ids, 0.0, return_stats=True)
        spec = out.usage.spec_decode
        assert spec["num_accepted_tokens_per_pos"] == ref.acceptance_counts == [5, 5, 4]
        assert spec["num_drafts"] == ref.draft_steps == 5
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] == 14
        assert spec["mean_acceptance_length"] == pytest.approx(1 + 14 / 5)
        after = metrics(s.url)
        p = "dflash:spec_decode_"
        assert after[(p + "num_drafts_total", ())] - before[(p + "num_drafts_total", ())] == 5
        assert after[(p + "num_draft_tokens_total", ())] == 14
        assert after[(p + "num_accepted_tokens_total", ())] == 14
        assert [after[(p + "num_accepted_tokens_per_pos_total", (("position", str(k)),))] for k in range(3)] == [5, 5, 4]
        assert after[("dflash:generation_tokens_total", ())] == 20


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.problem()}")
def test_a_chats_next_turn_reuses_the_cached_conversation():
    """On a low-bit target the second turn's prompt (the first turn and its reply) comes from the
    prompt cache: the usage and /metrics say how many tokens, and the answer is the uncached one."""
    base = tiny_pipeline()
    pipe = Pipeline(TargetModel(base.target.model, precision="int4"), base.draft, base.tokenizer, False)
    turn = [{"role": "user", "content": "the quick brown fox"}]
    with LiveServer(pipe, model_name=MODEL) as s:
        c = client(s.url)
        first = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=20, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        turn += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the lazy dog"}]
        second = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=20, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens
        assert metrics(s.url)[("dflash:prompt_tokens_cached_total", ())] == cached
    assert second.choices[0].message.content == offline_chat(pipe.with_prompt_cache(0), turn, 20)


def test_metrics_are_prometheus_text(server):
    client(server.url).completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    m = metrics(server.url)
    names = {name for name, _ in m}
    for name in ("dflash:spec_decode_num_drafts_total", "dflash:spec_decode_num_draft_tokens_total",
                 "dflash:spec_decode_num_accepted_tokens_total", "dflash:spec_decode_num_accepted_tokens_per_pos_total",
                 "dflash:e2e_request_latency_seconds_bucket", "dflash:time_to_first_token_seconds_count",
                 "dflash:request_generation_tokens_per_second_count", "dflash:num_requests_waiting",
                 "dflash:num_requests_running", "dflash:generation_tokens_total"):
        assert name in names, name
    assert m[("dflash:e2e_request_latency_seconds_count", ())] >= 1
    assert m[("dflash:request_success_total", (("finished_reason", "length"),))] >= 1
    assert m[("dflash:request_generation_tokens_per_second_sum", ())] > 0


# -- bad requests ------------------------------------------------------------------------

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # > 256 tokens

BAD = [
    ("completions", b'{"model": "tiny", "prompt": "hi",', 400, None),
    ("completions", b'[1, 2]', 400, None),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, None),
    ("completions", {"prompt": "hi", "max_tokens": 5.5}, 400, None),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, None),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, None),
    ("completions", {"prompt": 42}, 400, None),
    ("completions", {"max_tokens": 5}, 400, None),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, None),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("completions", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "context_length_exceeded"),
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 5}, 400, "context_length_exceeded"),
    ("completions", {"prompt": ""}, 400, None),
    ("completions", {"prompt": ["a", "b"]}, 400, None),
    ("completions", {"prompt": [1, 10 ** 6]}, 400, None),
    ("completions", {"prompt": "hi", "n": 2}, 400, None),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, None),
    ("completions", {"prompt": "hi", "temperature": 5}, 400, None),
    ("completions", {"prompt": "hi", "stop": ["x"] * 100}, 400, None),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, None),
    ("chat/completions", {"messages": "hello"}, 400, None),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, None),
    ("nonsense", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,code", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, path, body, status, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code


def test_server_keeps_serving_after_bad_requests(server, pipe):
    c = client(server.url)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=MODEL, messages=[])
    out = c.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0)
    assert out.choices[0].text == offline_text(pipe, "hello", 8)
    m = metrics(server.url)
    assert m[("dflash:request_errors_total", (("code", "model_not_found"),))] >= 1
    assert m[("dflash:request_errors_total", (("code", "400"),))] >= 2


def test_api_key(pipe):
    with LiveServer(pipe, model_name=MODEL, api_key="sekret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(s.url, "wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        out = client(s.url, "sekret").completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
        assert out.choices[0].text == offline_text(pipe, "hi", 4)
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open


# -- disconnects, the queue, shutdown: on a target that takes 15 ms a forward ---------------

@pytest.fixture(scope="module")
def slow_pipe(pipe):
    return slow_pipeline(pipe, 0.015)


def aborted(url: str) -> float:
    return metrics(url).get(("dflash:request_success_total", (("finished_reason", "abort"),)), 0.0)


def test_client_disconnect_stops_generation(slow_pipe):
    with LiveServer(slow_pipe, model_name=MODEL) as s:
        body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generation has started; now hang up
        wait_for(lambda: aborted(s.url) == 1)
        assert metrics(s.url)[("dflash:generation_tokens_total", ())] < 200
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        wait_for(lambda: aborted(s.url) == 2)
        assert s.worker.alive


def test_client_that_leaves_while_queued_is_skipped(slow_pipe):
    with LiveServer(slow_pipe, start_worker=False, model_name=MODEL) as s:
        body = {"prompt": "hello", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
        wait_for(lambda: metrics(s.url)[("dflash:num_requests_waiting", ())] == 1)
        time.sleep(0.3)  # let the server notice the disconnect
        s.worker.start()
        wait_for(lambda: aborted(s.url) == 1)
        assert metrics(s.url)[("dflash:generation_tokens_total", ())] == 0  # the model never ran for it


def test_full_queue_gets_503_and_queued_requests_complete(slow_pipe, pipe):
    with LiveServer(slow_pipe, start_worker=False, model_name=MODEL, max_queue=2) as s:
        results = {}

        def ask(i):
            results[i] = client(s.url).completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=6,
                                                          temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: metrics(s.url)[("dflash:num_requests_waiting", ())] == 2)
        with pytest.raises(openai.InternalServerError) as e:
            client(s.url).completions.create(model=MODEL, prompt="one too many", max_tokens=6)
        assert e.value.status_code == 503 and "busy" in e.value.message
        assert e.value.body["code"] == "queue_full"
        s.worker.start()
        for t in threads:
            t.join(30)
        assert results == {i: offline_text(pipe, f"hello {i}", 6) for i in range(2)}


def test_shutdown_finishes_in_flight_requests(slow_pipe, pipe):
    s = LiveServer(slow_pipe, model_name=MODEL, shutdown_grace=30).__enter__()
    stream = client(s.url).completions.create(model=MODEL, prompt="hello", max_tokens=30, temperature=0, stream=True)
    first = next(iter(stream))
    s.server.should_exit = True  # what Ctrl-C / SIGTERM does
    rest = list(stream)
    text = "".join(c.choices[0].text for c in [first, *rest])
    assert text == offline_text(pipe, "hello", 30) and rest[-1].choices[0].finish_reason == "length"
    s.thread.join(20)
    assert not s.thread.is_alive() and not s.worker.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")


def test_shutdown_past_the_grace_ends_requests_cleanly(slow_pipe):
    s = LiveServer(slow_pipe, model_name=MODEL, shutdown_grace=0.2).__enter__()
    stream = client(s.url).completions.create(model=MODEL, prompt="hello", max_tokens=200, temperature=0,
                                              stream=True)
    next(iter(stream))
    s.server.should_exit = True
    with pytest.raises(openai.APIError, match="shutting down"):
        list(stream)
    s.thread.join(20)
    assert not s.thread.is_alive()


def test_draft_threshold_is_served_exactly(pipe):
    """--draft-threshold 1 verifies no proposal at all (plain decoding through the loop); the
    text still equals offline greedy. A threshold outside [0, 1] is refused at start."""
    with LiveServer(pipe, model_name=MODEL, spec=SpecSettings(draft_threshold=1.0)) as s:
        out = client(s.url).completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=30,
                                               temperature=0)
        assert out.choices[0].text == offline_text(pipe, "the quick brown fox", 30)
        assert out.usage.spec_decode["num_draft_tokens"] == 0
    from dflash.serve.server import ServerOptions, build_server

    with pytest.raises(ValueError, match="draft_threshold"):
        build_server(pipe, ServerOptions(spec=SpecSettings(draft_threshold=1.5)), start_worker=False)


def test_hybrid_proposer_is_served_exactly_and_reports_its_sources(pipe):
    """The n-gram + draft tree, sharing earlier responses across requests: answers equal offline
    greedy; usage and /metrics count the accepted tokens per source."""
    spec = SpecSettings(proposer="hybrid", shared_suffix=True)
    with LiveServer(pipe, model_name=MODEL, spec=spec) as s:
        for _ in range(2):  # the second answer can copy the first from the shared index
            out = client(s.url).completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=30,
                                                   temperature=0)
            assert out.choices[0].text == offline_text(pipe, "the quick brown fox", 30)
        per_source = out.usage.spec_decode["num_accepted_tokens_per_source"]
        assert set(per_source) <= {"draft", "suffix", "global"}
        served = {labels[0][1]: v for (name, labels), v in metrics(s.url).items()
                  if name == "dflash:spec_decode_num_accepted_tokens_per_source_total"}
        assert served.keys() >= per_source.keys()
        assert sum(per_source.values()) >= out.usage.spec_decode["num_accepted_tokens"]  # two sources can share one
    assert pipe.spec == SpecSettings()  # the server ran on a copy of the pipeline
