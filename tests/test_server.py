"""``cadence serve`` (cadence.server): the official openai client against a live server on a
loopback port with a tiny random model; bad input, limits, disconnects and shutdown over
plain HTTP. Greedy output through the server must equal ``Engine.generate``; streamed
output must equal non-streamed output."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tiny import OracleDrafter, tiny_backbone

from cadence.batch.serial import SerialEngine
from cadence.engine import Engine, GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers import StaticScheduler
from cadence.server.app import AppSettings, create_app
from cadence.server.runner import make_server

MODEL = "tiny"
N = 10  # new tokens per request
PROMPTS = ("Write a poem about the sea.", "Count to ten.", "abc abc abc abc", "Hello", "x y z", "Why?")
SPEC = MethodSpec(method=Method.HYDRA, heads="random", num_heads=3, tree="chain")
DEFAULTS = GenerationConfig(temperature=1.0, max_new_tokens=N)


class SlowEngine(SerialEngine):
    """SerialEngine whose steps take at least ``delay`` seconds (requests that last)."""

    delay = 0.03
    steps = 0  # steps taken so far

    def step(self):
        time.sleep(self.delay)
        self.steps += 1
        return super().step()


class Served:
    def __init__(self, app, server, port):
        self.app, self.server, self.url = app, server, f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    @property
    def multi(self):
        return self.app.state.engine

    def metrics(self) -> dict[tuple, float]:
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


class Spec24:
    """The app as an ASGI server of spec 2.4 sees it: Starlette then stops listening for
    disconnects while it streams, and uvicorn drops writes to a closed connection silently."""

    def __init__(self, app):
        self.app, self.state = app, app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}
        await self.app(scope, receive, send)


@contextlib.contextmanager
def serve(engine, multi, shutdown_timeout: float = 5.0, max_queue: int = 8, spec=SPEC, wrap=None):
    app = create_app(engine, multi, AppSettings(MODEL, max_queue, DEFAULTS, spec))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(wrap(app) if wrap else app, "127.0.0.1", sock.getsockname()[1], shutdown_timeout,
                         log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: server.started, 20)
    served = Served(app, server, sock.getsockname()[1])
    served.thread = thread
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(30)


def until(cond, timeout: float) -> float:
    """Wait for ``cond()``; the seconds it took (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def engine(llama):
    return make_engine(llama, SPEC)


@pytest.fixture(scope="module")
def srv(engine):
    with serve(engine, SerialEngine(engine, max_batch=4)) as s:
        yield s


@pytest.fixture(scope="module")
def vanilla(llama):
    return Engine(llama)


@pytest.fixture(scope="module")
def slow(vanilla):
    """Plain decoding, max 1 decoding + 1 waiting, each step >= 30 ms (greedy from the
    prompts "a", "b" and "hi" runs 400 tokens without EOS: >= 12 s)."""
    with serve(vanilla, SlowEngine(vanilla, max_batch=1), max_queue=1, spec=None) as s:
        yield s


def greedy(engine, prompt: str, chat: bool, **kw) -> str:
    ids = engine.backbone.encode_prompt(prompt, chat=chat)
    return engine.generate(ids, GenerationConfig(max_new_tokens=kw.pop("n", N), **kw)).text


# ------------------------------------------------------------------ openai client


def test_greedy_completion_and_chat_equal_engine_generate(srv, engine, llama):
    c = srv.client
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0)
    assert r.choices[0].text == greedy(engine, PROMPTS[0], chat=False)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(llama.encode_prompt(PROMPTS[0], chat=False))
    assert r.usage.completion_tokens == N and r.usage.total_tokens == r.usage.prompt_tokens + N
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                  max_tokens=N, temperature=0)
    assert r.choices[0].message.content == greedy(engine, PROMPTS[1], chat=True)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(llama.encode_prompt(PROMPTS[1], chat=True))
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=0)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream(srv, chat):
    c = srv.client
    kw = {"model": MODEL, "max_tokens": N, "temperature": 0}
    if chat:
        kw["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[2]}]
        whole = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        ref = whole.choices[0].message.content
    else:
        kw["prompt"] = PROMPTS[2]
        whole = c.completions.create(**kw)
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        ref = whole.choices[0].text
    assert len(chunks) > 3 and text == ref
    assert len({ch.id for ch in chunks}) == 1
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_stop_seed_and_max_tokens(srv, engine):
    c = srv.client
    full = greedy(engine, PROMPTS[0], chat=False, n=24)
    stop = full[6:8]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "\x00zz"])
    assert r.choices[0].text == full[:full.index(stop)] == greedy(engine, PROMPTS[0], False, n=24, stop=(stop,))
    assert r.choices[0].finish_reason == "stop"
    ask = lambda seed: c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=N,
                                            temperature=0.9, top_p=0.95, seed=seed).choices[0].text
    a, b = ask(5), ask(5)
    assert a == b == greedy(engine, PROMPTS[3], False, temperature=0.9, top_p=0.95, seed=5)
    assert ask(6) != a
    for n in (1, 3):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=n, temperature=0)
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_concurrent_requests_equal_single(srv, engine):
    """Six requests at once on 4 slots (two wait): each equals its single-request output."""
    out: dict[int, str] = {}

    def ask(i):
        r = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                               max_tokens=N, temperature=0)
        out[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {i: greedy(engine, p, chat=True) for i, p in enumerate(PROMPTS)}


def test_per_request_speculation_options(srv, engine):
    ref = greedy(engine, PROMPTS[2], chat=False)

    def ask(opts):
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[2], "max_tokens": N, "temperature": 0, "cadence": opts})
        assert r.status_code == 200, r.text
        return r.json()

    root = ask({"scheduler": "static", "tree": "root"})
    assert root["cadence"]["mean_nodes"] == 1.0 and root["choices"][0]["text"] == ref
    chain = ask({"tree": "chain-2", "rule": "greedy"})
    assert chain["cadence"]["mean_nodes"] > 1.0 and chain["choices"][0]["text"] == ref
    assert ask({})["cadence"]["tree"] == "chain+copy"  # the server's own tree


def test_models_health_and_metrics(srv):
    assert [m.id for m in srv.client.models.list().data] == [MODEL]
    assert srv.client.models.retrieve(MODEL).id == MODEL
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    before = srv.metrics()
    srv.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=N, temperature=0)
    httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": 5})
    m = srv.metrics()
    delta = lambda name, **lab: m.get((name, tuple(sorted(lab.items()))), 0) - before.get(
        (name, tuple(sorted(lab.items()))), 0)
    assert delta("cadence:http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("cadence:http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("cadence:generation_tokens_total") == N
    assert delta("cadence:request_success_total", finished_reason="length") == 1
    assert delta("cadence:spec_decode_num_draft_tokens_total") > 0  # the chain ran (random heads)
    assert delta("cadence:spec_decode_num_drafts_total") > 0
    assert ("cadence:spec_decode_num_accepted_tokens_total", ()) in m
    assert delta("cadence:batch_size_count") >= N - 1
    assert m[("cadence:num_requests_running", ())] == 0 and m[("cadence:num_requests_waiting", ())] == 0


def test_accepted_tokens_are_counted_with_heads_that_accept_everything(llama):
    """Oracle drafts: the server's output is still the greedy output, tau > 1, and the
    accepted-token counters (total and per position) add up to what the response reports."""
    ids = llama.encode_prompt(PROMPTS[0], chat=True)
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=N))
    eng = Engine(llama, OracleDrafter(ref.tokens, len(ids), 3, llama.vocab_size), StaticScheduler.from_preset("chain", 3))
    app = create_app(eng, SerialEngine(eng), AppSettings(MODEL, defaults=DEFAULTS))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": N, "temperature": 0,
                                                 "messages": [{"role": "user", "content": PROMPTS[0]}]}).json()
        assert r["choices"][0]["message"]["content"] == ref.text
        assert r["cadence"]["tau"] > 2
        text = c.get("/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    depth = r["cadence"]["accepted_at_depth"]
    assert samples[("cadence:spec_decode_num_accepted_tokens_total", None)] == sum(depth) > 0
    for pos, count in enumerate(depth):
        assert samples[("cadence:spec_decode_num_accepted_tokens_per_pos_total", str(pos))] == count


# ------------------------------------------------------------------ bad input

LONG = "a" * 600  # the tiny model has 512 positions
BAD = [  # (path, raw body, status, param)
    ("c", '{"model": "tiny", "prompt": ', 400, None),  # malformed JSON
    ("c", "[1, 2]", 400, None),
    ("c", '{"model": "tiny"}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    ("c", '{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("c", '{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("c", '{"model": "tiny", "prompt": ""}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": "   "}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": [999999]}', 400, "prompt"),
    ("c", f'{{"model": "tiny", "prompt": "{LONG}"}}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("c", '{"model": "tiny", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    ("c", '{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
    ("c", '{"model": "tiny", "prompt": "hi", "temperature": 3}', 400, "temperature"),
    ("c", '{"model": "tiny", "prompt": "hi", "top_p": 0}', 400, "top_p"),
    ("c", '{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n"),
    ("c", '{"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
    ("c", '{"model": "tiny", "prompt": "hi", "seed": -1}', 400, "seed"),
    ("c", '{"model": "nope", "prompt": "hi"}', 404, "model"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"scheduler": "nope"}}', 400, "cadence.scheduler"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"tree": "nope"}}', 400, "cadence.tree"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"tree": "auto-100000"}}', 400, "cadence.tree"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"rule": "nope"}}', 400, "cadence.rule"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"depth": 3}}', 400, "cadence.depth"),
    ("c", '{"model": "tiny", "prompt": "hi", "temperature": 1, "cadence": {"rule": "greedy"}}', 400, "cadence.rule"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"scheduler": "confidence"}}', 400, "cadence.scheduler"),
    ("m", '{"model": "tiny", "messages": []}', 400, "messages"),
    ("m", '{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": ""}]}', 400, "messages"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', 400, "messages.0.content"),
    ("m", '{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    ("m", '{"model": "tiny", "messages": [{"content": "hi"}]}', 400, "messages.0.role"),
    ("m", f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{LONG}"}}]}}', 400, "messages"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}', 400, "logprobs"),
    ("m", '{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    # fields cadence cannot honour are refused, never silently dropped
    ("c", '{"model": "tiny", "prompt": "hi", "logprobs": 0}', 400, "logprobs"),
    ("c", '{"model": "tiny", "prompt": "hi", "logprobs": 2}', 400, "logprobs"),
    ("c", '{"model": "tiny", "prompt": "hi", "logit_bias": {"5": -100}}', 400, "logit_bias"),
    ("c", '{"model": "tiny", "prompt": "hi", "echo": true}', 400, "echo"),
    ("c", '{"model": "tiny", "prompt": "hi", "best_of": 2}', 400, "best_of"),
    ("c", '{"model": "tiny", "prompt": "hi", "presence_penalty": 0.5}', 400, "presence_penalty"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}', 400,
     "logit_bias"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', 400,
     "top_logprobs"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}',
     400, "functions"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}',
     400, "tool_choice"),
    ("m", ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
           '"response_format": {"type": "json_object"}}'), 400, "response_format"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     400, "messages.0.content.0.type"),
]


def test_every_bad_input_is_a_4xx_and_the_server_goes_on(srv, engine):
    failures = []
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for path, body, status, param in BAD:
            url = "/v1/completions" if path == "c" else "/v1/chat/completions"
            r = h.post(url, content=body, headers={"content-type": "application/json"})
            err = r.json().get("error") if r.headers["content-type"].startswith("application/json") else None
            if (r.status_code, err and set(err), err and err["param"]) != (status, {"message", "type", "param", "code"}, param):
                failures.append((body[:70], r.status_code, r.text[:200]))
            elif not err["message"] or err["type"] not in ("invalid_request_error", "not_found_error"):
                failures.append((body[:70], "bad error object", err))
        for method, url, status in (("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405)):
            r = h.request(method, url)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert not failures, failures
        assert h.get("/health").status_code == 200
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(engine, PROMPTS[1], chat=False)
    assert srv.app.state.worker.inflight == 0 and srv.multi.running == 0


def test_engine_failures_are_500s_and_the_server_goes_on(llama):
    class Flaky(SerialEngine):
        fail_next = True

        def step(self):
            if Flaky.fail_next:
                Flaky.fail_next = False
                raise RuntimeError("device lost")
            return super().step()

    eng = Engine(llama)
    app = create_app(eng, Flaky(eng), AppSettings(MODEL, defaults=DEFAULTS))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=body).status_code == 200
        assert app.state.worker.inflight == 0


# ------------------------------------------------------------------ limits, disconnects, shutdown


def _open_stream(served, max_tokens=400):
    """A streaming request left open; (client, response, its lines) once its first text chunk
    came (the line iterator must stay referenced: collecting it closes the response)."""
    h = httpx.Client(base_url=served.url, timeout=30)
    req = h.build_request("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "a", "max_tokens": max_tokens, "temperature": 0, "stream": True})
    r = h.send(req, stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    next(line for line in lines if line.startswith("data: {"))
    return h, r, lines


def test_client_disconnect_mid_stream_frees_the_slot(slow):
    before = slow.metrics().get(("cadence:request_success_total", (("finished_reason", "abort"),)), 0)
    h, r, _lines = _open_stream(slow)
    assert slow.multi.running == 1
    r.close()
    h.close()
    waited = until(lambda: slow.multi.running == 0 and slow.app.state.worker.inflight == 0, 5)
    assert waited < 2  # 400 tokens at >= 30 ms per step would take 12 s
    after = slow.metrics()[("cadence:request_success_total", (("finished_reason", "abort"),))]
    assert after == before + 1


def test_client_gone_before_a_non_streamed_answer_frees_the_slot(slow):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/completions", timeout=0.5, json={
            "model": MODEL, "prompt": "b", "max_tokens": 400, "temperature": 0})
    assert until(lambda: slow.multi.running == 0 and slow.app.state.worker.inflight == 0, 5) < 2


def test_beyond_the_limits_is_429(slow):
    """1 decoding + 1 waiting: a third request is refused with 429 at once; once the
    others leave, requests are served again."""
    opened = [_open_stream(slow)]
    h2 = httpx.Client(base_url=slow.url, timeout=30)
    second = h2.send(h2.build_request("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 400, "temperature": 0, "stream": True}), stream=True)
    until(lambda: slow.app.state.worker.inflight == 2, 5)
    assert (slow.multi.running, slow.multi.queued) == (1, 1)
    r = httpx.post(slow.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        slow.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(slow.url + "/health").status_code == 200
    for h, resp, *_ in opened + [(h2, second)]:
        resp.close()
        h.close()
    until(lambda: slow.app.state.worker.inflight == 0, 5)
    r = slow.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_shutdown_finishes_short_requests_and_cancels_long_ones_cleanly(vanilla):
    """Shutdown with three requests in flight: the short one finishes, the long streamed
    one ends with an error event and [DONE], the long plain one gets a 503; the worker
    thread ends and nothing is left in the engine."""
    multi = SlowEngine(vanilla, max_batch=4)
    with serve(vanilla, multi, shutdown_timeout=1.0, spec=None) as s:
        results: dict[str, object] = {}

        def stream_long():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                    "model": MODEL, "prompt": "a", "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                results["stream"] = [line for line in r.iter_lines() if line]

        def plain(name, n):
            r = httpx.post(s.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "b", "max_tokens": n, "temperature": 0})
            results[name] = (r.status_code, r.json())

        threads = [threading.Thread(target=stream_long), threading.Thread(target=plain, args=("long", 400)),
                   threading.Thread(target=plain, args=("short", 8))]
        for t in threads:
            t.start()
        until(lambda: s.app.state.worker.inflight == 3, 10)
        s.server.should_exit = True
        for t in threads:
            t.join(30)
        s.thread.join(30)
        assert not s.thread.is_alive()
    assert results["short"][0] == 200 and results["short"][1]["usage"]["completion_tokens"] == 8
    assert results["long"][0] == 503 and "shutting down" in results["long"][1]["error"]["message"]
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][len("data: "):])
    assert not s.app.state.worker._thread.is_alive() and not multi.has_work() and s.app.state.worker.inflight == 0


def test_batched_engine_behind_the_same_server():
    """The server over ``BatchEngine`` (one forward for all rows): concurrent streamed and
    plain requests each equal their single-request output."""
    batch = pytest.importorskip("cadence.batch.engine")
    from cadence.batch.narrow import NarrowConfig
    from cadence.fast import make_fast

    fast = make_engine(make_fast(tiny_backbone("llama"), "fast"), SPEC)  # make_fast repacks the model's weights
    multi = batch.BatchEngine.from_engine(fast, max_batch=4, narrow=NarrowConfig(mode="none"))
    out: dict[int, str] = {}

    def ask(i):
        kw = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": N,
              "temperature": 0}
        if i % 2:
            out[i] = s.client.chat.completions.create(**kw).choices[0].message.content
        else:
            chunks = s.client.chat.completions.create(**kw, stream=True)
            out[i] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    with serve(fast, multi) as s:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert s.metrics()[("cadence:batch_size_sum", ())] > s.metrics()[("cadence:batch_size_count", ())]
    assert out == {i: greedy(fast, p, chat=True) for i, p in enumerate(PROMPTS)}


# ------------------------------------------------------------------ engine choice, command line


def test_engine_choice(engine, monkeypatch):
    from cadence.server.command import multi_engine

    assert isinstance(multi_engine(engine, "auto", 3), SerialEngine)  # transformers backbone: no batched forward
    if importlib.util.find_spec("cadence.batch.engine") is not None:
        with pytest.raises(CadenceError, match="SerialEngine"):
            multi_engine(engine, "batched", 3)
    monkeypatch.setitem(sys.modules, "cadence.batch.engine", None)  # not importable
    assert isinstance(multi_engine(engine, "serial", 3), SerialEngine)
    assert isinstance(multi_engine(engine, "auto", 3), SerialEngine)
    with pytest.raises(CadenceError, match="--batching serial"):
        multi_engine(engine, "batched", 3)


def test_serve_flags_and_missing_extra(monkeypatch):
    from cadence.cli import build_parser
    from cadence.server import command

    args = build_parser().parse_args(["serve", "--port", "0", "--max-batch", "2", "--temperature", "0",
                                      "--scheduler", "static", "--tree", "chain-2"])
    assert (args.port, args.max_batch, args.temperature, args.tree) == (0, 2, 0.0, "chain-2")
    assert args.batching.value == "auto" and not hasattr(args, "seed")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    with pytest.raises(CadenceError, match="cannot listen"):  # before any model is loaded
        command.run(build_parser().parse_args(["serve", "--port", str(busy.getsockname()[1])]))
    busy.close()
    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CadenceError, match=r"cadence\[serve\]"):
        command.build(args)


def test_narrowing_flags_reach_the_batched_engine(capsys):
    """--narrow-* flags (derived from NarrowConfig) become the BatchEngine's NarrowConfig;
    on a serial engine they are reported as ignored."""
    batch = pytest.importorskip("cadence.batch.engine")
    from cadence.batch.narrow import NarrowConfig
    from cadence.cli import build_parser
    from cadence.cliargs import from_args
    from cadence.fast import make_fast
    from cadence.server.command import multi_engine
    from cadence.server.config import NarrowFlags

    args = build_parser().parse_args(["serve", "--narrow-mode", "root", "--narrow-min-batch", "3",
                                      "--narrow-max-nodes", "4", "--narrow-margin", "0.2"])
    flags = from_args(NarrowFlags, args)
    want = NarrowConfig(mode="root", min_batch=3, max_nodes=4, margin=0.2)
    assert flags.config() == want
    assert from_args(NarrowFlags, build_parser().parse_args(["serve"])).config() == NarrowConfig()
    assert [f.name for f in dataclasses.fields(NarrowFlags)] == [  # a new NarrowConfig field needs a flag
        "narrow_" + f.name for f in dataclasses.fields(NarrowConfig)]
    fast = make_engine(make_fast(tiny_backbone("llama"), "fast"), SPEC)
    multi = multi_engine(fast, "batched", 4, flags)
    assert isinstance(multi, batch.BatchEngine) and multi.narrow_cfg == want
    assert multi.narrowing.cap(3, None, 3) == 1 and multi.narrowing.cap(2, None, 3) == 4
    capsys.readouterr()
    assert isinstance(multi_engine(fast, "serial", 4, flags), SerialEngine)
    assert "ignored" in capsys.readouterr().err
    multi_engine(fast, "serial", 4)
    assert capsys.readouterr().err == ""


def test_serve_build_passes_the_narrowing_flags(monkeypatch):
    """``cadence serve --batching batched --narrow-*``: the app's engine is a BatchEngine
    with those settings (the model loader is replaced by the tiny fast model)."""
    pytest.importorskip("cadence.batch.engine")
    import cadence.backbone
    from cadence.cli import build_parser
    from cadence.fast import make_fast
    from cadence.server import command

    monkeypatch.setattr(cadence.backbone, "load_backbone", lambda *a, **k: make_fast(tiny_backbone("llama"), "fast"))
    args = build_parser().parse_args(["serve", "--heads", "random", "--batching", "batched", "--max-batch", "3",
                                      "--narrow-mode", "root", "--narrow-min-batch", "2", "--narrow-max-nodes", "5"])
    app, conf = command.build(args)
    multi = app.state.engine
    assert type(multi).__name__ == "BatchEngine" and multi.max_batch == conf.max_batch == 3
    assert (multi.narrow_cfg.mode, multi.narrow_cfg.min_batch, multi.narrow_cfg.max_nodes) == ("root", 2, 5)


@pytest.mark.parametrize("flags, message", [
    (["--narrow-mode", "wide"], "argument --narrow-mode: invalid"),
    (["--narrow-min-batch", "0"], "--narrow-min-batch must be >= 1"),
    (["--narrow-min-batch", "two"], "argument --narrow-min-batch: invalid int value"),
    (["--narrow-max-nodes", "-1"], "--narrow-max-nodes must be >= 0"),
    (["--narrow-margin", "-0.5"], "--narrow-margin must be a finite number >= 0"),
    (["--narrow-margin", "nan"], "--narrow-margin must be a finite number >= 0"),
])
def test_bad_narrowing_flags_exit_2_before_loading(flags, message, capsys, monkeypatch):
    from cadence.cli import main
    from cadence.server import command

    monkeypatch.setattr(command, "build", lambda args: pytest.fail("the model was loaded"))
    try:
        code = main(["serve", "--port", "0", *flags])
    except SystemExit as exc:  # argparse: a bad type or choice
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_real_server_streams_what_generate_prints(tmp_path):
    """`cadence serve` on the default model with shipped heads, in a subprocess: the openai
    client's streamed chat at T=0 equals `cadence generate`'s text."""
    from default_model import load_default_backbone

    bb = load_default_backbone()
    prompt, n = "Write a short story about a robot who learns to paint.", 64
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        until(lambda: proc.poll() is not None or _healthy(port), 300)
        assert proc.poll() is None, proc.stdout.read()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=n, temperature=0, stream=True)
        served = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        out = subprocess.run([sys.executable, "-m", "cadence.cli", "generate", "--prompt", prompt,
                              "--max-new-tokens", str(n), "--json", "--dtype", "float32", "--device", "cpu"],
                             check=False, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert served == json.loads(out.stdout.strip().splitlines()[-1])["text"]
        assert bb.name == model
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down, then re-raises the signal
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in log, log


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------ disconnect at any point


class MuteEngine(SlowEngine):
    """SlowEngine whose events carry no text but the last: a completion stream sends no
    chunk before its end (a client can leave before the first chunk)."""

    def step(self):
        events = super().step()
        for ev in events:
            if not ev.finished:
                ev.text = ""
        return events


@pytest.fixture(scope="module", params=["spec-2.3", "spec-2.4"])
def mute(vanilla, request):
    """Served as uvicorn serves it (ASGI spec 2.3), and as a spec-2.4 server would."""
    wrap = Spec24 if request.param == "spec-2.4" else None
    with serve(vanilla, MuteEngine(vanilla, max_batch=1), max_queue=1, spec=None, wrap=wrap) as s:
        yield s


@pytest.fixture(scope="module")
def slow24(vanilla):
    with serve(vanilla, SlowEngine(vanilla, max_batch=1), max_queue=1, spec=None, wrap=Spec24) as s:
        yield s


def test_disconnect_mid_stream_frees_the_slot_under_asgi_spec_2_4(slow24):
    """Spec 2.4: nothing tells the stream's generator that its client left (writes to the
    closed connection are dropped); the request must still leave within about one step."""
    h, r, _lines = _open_stream(slow24)
    steps = slow24.multi.steps
    r.close()
    h.close()
    until(lambda: slow24.multi.running == 0 and slow24.app.state.worker.inflight == 0, 3)
    assert slow24.multi.steps - steps <= 3


def _raw_request(served, stream: bool, chat: bool = False, prompt: str = "a", wait: bool = True) -> socket.socket:
    """A long request (400 tokens) sent over a plain socket, which the caller closes to leave;
    streamed and ``wait``: returns once the response's headers came (no chunk read)."""
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    data = json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    sock = socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if stream and wait:
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _leave(served, sock, left) -> int:
    """Close the client's socket; the engine steps taken until ``left()`` (at most 3 s)."""
    steps = served.multi.steps
    sock.close()
    until(left, 3)
    return served.multi.steps - steps


@pytest.mark.parametrize("chat", [False, True])
def test_disconnect_before_the_first_chunk_frees_the_slot(mute, chat):
    """The stream's headers came, no text chunk yet (chat: the role chunk only), the client
    leaves: the request leaves the engine within about one step (it would run 400)."""
    before = mute.multi.steps
    sock = _raw_request(mute, stream=True, chat=chat)
    until(lambda: mute.multi.running == 1 and mute.multi.steps > before + 2, 5)
    assert _leave(mute, sock, lambda: mute.multi.running == 0 and mute.app.state.worker.inflight == 0) <= 3


@pytest.mark.parametrize("server, stream", [("slow", True), ("slow", False), ("slow24", True)])
def test_disconnect_while_queued_frees_the_queue_place(server, stream, request):
    """One request decodes, a second waits for the slot; the waiting one's client leaves:
    it leaves the queue within about one step, and the first goes on decoding."""
    slow = request.getfixturevalue(server)
    h1, r1, _lines = _open_stream(slow)
    sock = _raw_request(slow, stream=stream, prompt="hi")
    until(lambda: slow.multi.queued == 1 and slow.app.state.worker.inflight == 2, 5)
    assert _leave(slow, sock, lambda: slow.multi.queued == 0 and slow.app.state.worker.inflight == 1) <= 3
    assert slow.multi.running == 1
    r1.close()
    h1.close()
    until(lambda: slow.multi.running == 0 and slow.app.state.worker.inflight == 0, 5)


def test_disconnect_of_a_running_plain_request_frees_the_slot_within_a_step(slow):
    """A non-streamed request decoding; its client leaves: gone within about one step."""
    before = slow.multi.steps
    sock = _raw_request(slow, stream=False, prompt="b")
    until(lambda: slow.multi.running == 1 and slow.multi.steps > before + 2, 5)
    assert _leave(slow, sock, lambda: slow.multi.running == 0 and slow.app.state.worker.inflight == 0) <= 3


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_the_answer_starts_frees_the_slot(slow, stream):
    """The client leaves while its request is still being admitted (the worker is busy with
    a long step): the request must not stay in the engine once admitted."""
    h1, r1, _lines = _open_stream(slow)
    slow.multi.delay = 1.0  # the next step keeps the worker busy: the add waits behind it
    try:
        sock = _raw_request(slow, stream=stream, prompt="hi", wait=False)
        until(lambda: slow.app.state.worker.inflight == 2, 5)
    finally:
        slow.multi.delay = SlowEngine.delay
    assert _leave(slow, sock, lambda: slow.multi.queued == 0 and slow.app.state.worker.inflight == 1) <= 4
    assert slow.multi.running == 1
    r1.close()
    h1.close()
    until(lambda: slow.multi.running == 0 and slow.app.state.worker.inflight == 0, 5)
