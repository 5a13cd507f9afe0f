"""What a probe of `dflash serve` found, each reproduced against a live server on
127.0.0.1: D1 tiny temperatures (engine and server), D2 body and prompt limits and input
handled off the event loop, D3 Host/Origin/content-type checks, D5 server-side token and time
limits, and the minor ones (no trailing U+FFFD, the key checked before routing, stream failures
counted). D4 (draining) runs a real process: test_server_drain.py."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest
import torch
from server_support import (  # noqa: F401  (pipe, server: the shared fixtures)
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
)

from dflash.engine.loop import dflash_generate
from dflash.engine.params import TEMPERATURE_FLOOR
from dflash.engine.sampling import SamplingParams, probabilities
from dflash.engine.target import TargetModel
from dflash.serve.limits import Limits
from dflash.text.detok import REPLACEMENT
from dflash.text.pipeline import Pipeline

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # > 256 tokens, < the character limit
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def loud_pipe():
    """A tiny pipeline whose logits are in the thousands, as a real model's can be in the tens:
    divided by 1e-38 they overflow float32."""
    pipe = tiny_pipeline(seed=7)
    pipe.target.model.lm_head.weight.data.mul_(1000.0)
    return pipe


@pytest.fixture(scope="module")
def slow_pipe(pipe):
    return slow_pipeline(pipe, 0.015)


def post(url: str, path: str, body, headers=JSON, **kw) -> httpx.Response:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}/v1/{path}", content=raw, headers=headers, timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    return err


def sse_events(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


# -- D1: a temperature below the floor is greedy, never inf/nan ---------------------------------

@pytest.mark.parametrize("temperature", [1e-38, 5e-324])
def test_tiny_temperatures_are_greedy_in_the_engine(loud_pipe, temperature):
    prompt = loud_pipe.encode_text("the quick brown fox")
    greedy = dflash_generate(loud_pipe.draft, loud_pipe.target, prompt, 16, None, 0.0)
    out = dflash_generate(loud_pipe.draft, loud_pipe.target, prompt, 16, None, temperature,
                          generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, greedy)


def test_sampling_is_finite_for_every_accepted_temperature():
    assert SamplingParams(TEMPERATURE_FLOOR / 2).greedy and SamplingParams(5e-324).greedy
    assert not SamplingParams(TEMPERATURE_FLOOR).greedy
    logits = torch.tensor([[3e38, -3e38, 0.0, 1e30, 1e30 + 1e25]])  # float32 extremes
    for t in (TEMPERATURE_FLOOR, 1e-3, 1.0, 2.0, 1e30):
        for kw in ({}, {"top_p": 0.9}, {"top_k": 2}):
            p = probabilities(logits, SamplingParams(t, **kw))
            assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0), (t, kw)
    assert probabilities(logits, SamplingParams(TEMPERATURE_FLOOR)).argmax() == 0


@pytest.mark.parametrize("temperature", [1e-38, 5e-324])
def test_tiny_temperatures_are_greedy_in_the_server(loud_pipe, temperature):
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": temperature}
    want = offline_text(loud_pipe, "the quick brown fox", 12)
    with LiveServer(loud_pipe, model_name=MODEL) as s:
        r = post(s.url, "completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = list(sse_events(r))
    assert all("error" not in e for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == want


# -- D2: body and prompt limits; input handled off the event loop -------------------------------

def test_a_body_over_the_limit_gets_413_before_it_is_parsed(server, pipe):
    big = json.dumps({"prompt": "x" * (Limits.max_body_bytes + 1)})
    err = error_of(post(server.url, "completions", big), 413)
    assert err["code"] == "request_too_large" and str(Limits.max_body_bytes) in err["message"]
    assert post(server.url, "completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0}).json()[
        "choices"][0]["text"] == offline_text(pipe, "hello", 4)


def test_a_chunked_body_over_the_limit_gets_413(pipe):
    with LiveServer(pipe, model_name=MODEL, limits=Limits(max_body_bytes=1000)) as s:
        chunks = (b'{"prompt": "' + b"x" * 400 for _ in range(4))  # no Content-Length: counted as read
        err = error_of(httpx.post(s.url + "/v1/completions", content=chunks, headers=JSON, timeout=60), 413)
        assert err["code"] == "request_too_large"
        assert metrics(s.url)[("dflash:request_errors_total", (("code", "request_too_large"),))] == 1
        out = client(s.url).completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].text == offline_text(pipe, "hello", 4)


def test_a_prompt_over_the_character_limit_is_refused_before_tokenising(server):
    limit = 32 * 256  # the default: 32 characters per context token
    err = error_of(post(server.url, "completions", {"prompt": "y" * (limit + 1)}), 400)
    assert err["param"] == "prompt" and f"at most {limit}" in err["message"] and "characters" in err["message"]
    chat = {"messages": [{"role": "user", "content": "y" * limit}, {"role": "user", "content": "yy"}]}
    err = error_of(post(server.url, "chat/completions", chat), 400)
    assert err["param"] == "messages" and "--max-prompt-chars" in err["message"]


@pytest.mark.parametrize("path,prompt", [("completions", {"prompt": LONG_PROMPT}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]})])
def test_cheap_checks_come_before_tokenising(server, path, prompt):
    """A prompt too long for the context is only found by tokenising it; a bad stop list or a
    max_tokens beyond the whole context are found first."""
    assert error_of(post(server.url, path, {**prompt, "stop": ["x"] * 17}), 400)["param"] == "stop"
    err = error_of(post(server.url, path, {**prompt, "max_tokens": 10 ** 12}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert error_of(post(server.url, path, prompt), 400)["code"] == "context_length_exceeded"


@dataclasses.dataclass
class GatedPipeline(Pipeline):
    """Encoding a text that starts with GATE waits until `release` is set: a tokenisation that
    lasts as long as the test wants. `log` records what happened, in order."""
    entered: threading.Event = dataclasses.field(default_factory=threading.Event)
    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    log: list = dataclasses.field(default_factory=list)

    def encode_text(self, text: str, special: bool = True):
        if text.startswith("GATE"):
            self.entered.set()
            self.log.append("gate opened" if self.release.wait(30) else "gate timed out")
        return super().encode_text(text, special)


def test_a_long_tokenisation_delays_neither_health_nor_other_streams(slow_pipe):
    gated = GatedPipeline(slow_pipe.target, slow_pipe.draft, slow_pipe.tokenizer, False)
    with LiveServer(gated, model_name=MODEL) as s:
        body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            events = sse_events(r)
            next(events)  # the stream runs; now a request whose tokenisation takes long

            def big():
                r = post(s.url, "completions", {"prompt": "GATE " + LONG_PROMPT * 4, "max_tokens": 2})
                gated.log.append(("big", r.status_code))

            thread = threading.Thread(target=big)
            thread.start()
            assert gated.entered.wait(30)
            gated.log.append(("health", httpx.get(s.url + "/health", timeout=60).status_code))
            for _ in range(3):
                next(events)
            gated.log.append("the stream went on")
            gated.release.set()
            thread.join(60)
        assert gated.log == [("health", 200), "the stream went on", "gate opened", ("big", 400)]


# -- D3: no drive-by requests from web pages ----------------------------------------------------

def test_a_foreign_host_is_refused_without_a_key(server):
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        err = error_of(post(server.url, "completions", {"prompt": "hi"}, {**JSON, "host": host}), 403)
        assert err["code"] == "host_not_allowed"
    assert httpx.get(server.url + "/health", headers={"host": "rebound.example"}).status_code == 403
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:8000"):
        r = post(server.url, "completions", {"prompt": "hi", "max_tokens": 2}, {**JSON, "host": host})
        assert r.status_code == 200, (host, r.text)


def test_a_foreign_origin_is_refused_without_a_key(server):
    """A web page's 'simple' request (text/plain, no preflight) and a JSON one alike."""
    for ctype in ("text/plain", "application/json"):
        r = post(server.url, "completions", {"prompt": "hi"}, {"content-type": ctype, "origin": "http://evil.example"})
        assert error_of(r, 403)["code"] == "origin_not_allowed"
    own = {**JSON, "origin": f"http://localhost:{server.port}"}
    assert post(server.url, "completions", {"prompt": "hi", "max_tokens": 2}, own).status_code == 200


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                                     {}])
def test_a_post_body_must_be_json(server, headers):
    err = error_of(post(server.url, "completions", {"prompt": "hi"}, headers), 415)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_allow_origin_lets_a_browser_client_in(pipe):
    app = "http://app.example:3000"
    with LiveServer(pipe, model_name=MODEL, allow_origins=(app,)) as s:
        pre = httpx.options(s.url + "/v1/chat/completions", headers={
            "origin": app, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == app
        r = post(s.url, "completions", {"prompt": "hi", "max_tokens": 2}, {**JSON, "origin": app})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
        r = post(s.url, "completions", {"prompt": "hi"}, {**JSON, "origin": "http://other.example"})
        assert error_of(r, 403)["code"] == "origin_not_allowed"


def test_with_a_key_host_and_origin_are_not_checked(pipe):
    with LiveServer(pipe, model_name=MODEL, api_key="k") as s:
        foreign = {**JSON, "host": "api.example", "origin": "http://evil.example"}
        assert error_of(post(s.url, "completions", {"prompt": "hi"}, foreign), 401)["code"] == "invalid_api_key"
        r = post(s.url, "completions", {"prompt": "hi", "max_tokens": 2}, {**foreign, "authorization": "Bearer k"})
        assert r.status_code == 200


# -- D5: the server's default and maximum for max_tokens; a time limit --------------------------

def test_a_chat_without_max_tokens_gets_the_server_default():
    """Before: the rest of the context (here ~1000 tokens); now --max-tokens-default (512)."""
    perfect = tiny_pipeline(perfect=True, max_positions=1024)  # never stops by itself
    with LiveServer(perfect, model_name=MODEL) as s:
        out = client(s.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    temperature=0)
        assert out.usage.completion_tokens == Limits.max_tokens_default
        assert out.choices[0].finish_reason == "length"


def test_max_tokens_default_and_limit(pipe):
    prompt = "the quick brown fox"
    with LiveServer(pipe, model_name=MODEL, limits=Limits(max_tokens_default=5, max_tokens_limit=9)) as s:
        c = client(s.url)
        out = c.completions.create(model=MODEL, prompt=prompt, temperature=0)
        assert out.usage.completion_tokens == 5 and out.choices[0].text == offline_text(pipe, prompt, 5)
        messages = [{"role": "user", "content": prompt}]
        assert c.chat.completions.create(model=MODEL, messages=messages, temperature=0).usage.completion_tokens == 5
        out = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=50)
        assert out.usage.completion_tokens == 9 and out.choices[0].finish_reason == "length"
        assert out.choices[0].text == offline_text(pipe, prompt, 9)
        out = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=50)
        assert out.usage.completion_tokens == 9 and out.choices[0].message.content == offline_chat(pipe, messages, 9)


def test_request_timeout_ends_the_generation_with_length(slow_pipe, pipe):
    """200 tokens take at least 200 x 15 ms = 3 s here; the limit is 0.2 s of generation."""
    with LiveServer(slow_pipe, model_name=MODEL, limits=Limits(request_timeout=0.2)) as s:
        c = client(s.url)
        out = c.completions.create(model=MODEL, prompt="hello", max_tokens=200, temperature=0)
        n = out.usage.completion_tokens
        assert out.choices[0].finish_reason == "length" and 0 < n < 200
        assert out.choices[0].text == offline_text(pipe, "hello", n)
        chunks = list(c.completions.create(model=MODEL, prompt="hello", max_tokens=200, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens < 200


def test_bad_limits_are_refused_at_start(pipe):
    from dflash.serve.server import ServerOptions, build_server

    for limits, word in ((Limits(max_tokens_limit=0), "--max-tokens-limit"), (Limits(max_body_bytes=-1), "--max-body"),
                         (Limits(request_timeout=0), "--request-timeout")):
        with pytest.raises(ValueError, match=word):
            build_server(pipe, ServerOptions(limits=limits), start_worker=False)


def test_the_serve_parser_takes_the_new_options():
    from dflash.cli.commands import build_parser

    args = build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--max-prompt-chars", "50",
                                      "--max-tokens-default", "7", "--max-tokens-limit", "9", "--request-timeout",
                                      "2.5", "--allow-origin", "http://a.example", "--allow-origin", "http://b.example"])
    assert (args.max_body_bytes, args.max_prompt_chars, args.max_tokens_default, args.max_tokens_limit,
            args.request_timeout) == (1000, 50, 7, 9, 2.5)
    assert args.allow_origin == ["http://a.example", "http://b.example"]


# -- the minor ones ---------------------------------------------------------------------------

def _cut_mid_character(pipe):
    """A prompt and a max_tokens at which the plain decode of the greedy output ends in U+FFFD."""
    for prompt in ("hello", "the quick brown fox", "caf\u00e9 \U0001f600", "lazy dog", "speculative decoding"):
        ids = pipe.encode_text(prompt)
        out = dflash_generate(pipe.draft, pipe.target, ids, 60, pipe.stop_token_ids, 0.0)[0, ids.shape[1]:].tolist()
        for n in range(1, len(out) + 1):
            if pipe.tokenizer.decode(out[:n], skip_special_tokens=True).endswith(REPLACEMENT):
                return prompt, n
    raise AssertionError("no greedy output of the tiny model ends mid-character")


def test_text_cut_by_max_tokens_never_ends_in_a_replacement_character(server, pipe):
    prompt, n = _cut_mid_character(pipe)
    c = client(server.url)
    text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True))
    assert text == streamed == offline_text(pipe, prompt, n)
    assert not text.endswith(REPLACEMENT)


def test_the_key_is_checked_before_routing(pipe):
    with LiveServer(pipe, model_name=MODEL, api_key="k") as s:
        for method, path in (("POST", "/v1/nonsense"), ("GET", "/v1/nope"), ("GET", "/v1")):
            r = httpx.request(method, s.url + path, headers=JSON)
            assert error_of(r, 401)["code"] == "invalid_api_key", path
        r = httpx.post(s.url + "/v1/nonsense", headers={**JSON, "authorization": "Bearer k"})
        assert error_of(r, 404)["code"] == "not_found"


class FailingTarget(TargetModel):
    def forward_hidden(self, *args, **kwargs):
        raise RuntimeError("a secret internal detail")


def test_a_failed_generation_is_counted_and_hides_its_internals(pipe):
    with LiveServer(dataclasses.replace(pipe, target=FailingTarget(pipe.target.model)), model_name=MODEL) as s:
        body = {"prompt": "hello", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            events = list(sse_events(r))
        assert events[-1]["error"]["type"] == "server_error"
        assert metrics(s.url)[("dflash:request_errors_total", (("code", "500"),))] == 1  # the stream's, counted
        err = error_of(post(s.url, "completions", {**body, "stream": False}), 500)
        assert metrics(s.url)[("dflash:request_errors_total", (("code", "500"),))] == 2
        for message in (events[-1]["error"]["message"], err["message"]):
            assert "internal error" in message and "secret" not in message
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
