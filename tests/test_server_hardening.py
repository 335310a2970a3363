"""``cadence serve`` exposed: one bad request never harms the others, numbers are finite,
tiny temperatures decode greedily, the event loop never tokenizes, bodies and budgets
have limits, an API key guards the routes, reused connections answer without Nagle's
delay, stalled readers and overdue requests leave, and the health route sees the
engine thread. Live servers on loopback ports with the tiny random model."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest
from server_support import (  # noqa: F401 - fixtures are used by name
    MODEL,
    PROMPTS,
    SPEC,
    N,
    SlowEngine,
    engine,
    greedy,
    serve,
    srv,
    until,
    vanilla,
)
from tiny import tiny_backbone

from cadence.batch.serial import SerialEngine
from cadence.decode.generation import GenerationConfig
from cadence.methods import make_engine
from cadence.server.metrics import Metrics
from cadence.server.worker import Failure, Worker

ERROR_KEYS = {"message", "type", "param", "code"}


def post(served, path: str, body, **kw) -> httpx.Response:
    kw.setdefault("timeout", 60)
    return httpx.post(served.url + path, json=body, **kw)


# ------------------------------------------------------------------ temperature floor


def test_temperatures_below_the_floor_decode_greedily(srv, engine):
    """``temperature`` 1e-30 (once: logits / T overflowed into garbage text) is greedy."""
    ref = greedy(engine, PROMPTS[0], chat=False)
    for t in (1e-30, 1e-45, 5e-6):
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": N, "temperature": t})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, t


# ------------------------------------------------------------------ row isolation


class PoisonBatch:
    """A ``BatchEngine`` whose requests with "POISON" in the prompt get settings that turn
    bad after validation (a drift of inf, as JSON's 1e999 once carried through)."""

    def __new__(cls, fast, poison_ids, **kw):
        from cadence.batch.engine import BatchEngine

        class Poisoned(BatchEngine):
            def add(self, prompt_ids, cfg, scheduler=None):
                rid = super().add(prompt_ids, cfg, scheduler)
                if list(prompt_ids) == poison_ids:
                    self.waiting[-1].req.cfg.drift = float("inf")
                return rid

        return Poisoned.from_engine(fast, **kw)


def test_a_poisoned_request_among_eight_streams_fails_alone():
    """Nine concurrent streams on the batched engine, one of them poisoned (it fails at its
    first verification): it alone gets an error event (status 400, its own input); the
    eight others complete with the output each gives alone, and the server stays healthy."""
    pytest.importorskip("cadence.batch.engine")
    from cadence.batch.narrow import NarrowConfig
    from cadence.backbone.load import make_fast

    fast = make_engine(make_fast(tiny_backbone("llama"), "fast"), SPEC)
    poison = "POISON " + PROMPTS[0]
    poison_ids = fast.backbone.encode_prompt(poison, chat=False)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(8)]
    multi = PoisonBatch(fast, poison_ids, max_batch=9, narrow=NarrowConfig(mode="none"))
    out: dict[int, object] = {}

    def ask(i, prompt):
        try:
            chunks = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                                 stream=True)
            out[i] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        except openai.APIError as exc:
            out[i] = exc

    with serve(fast, multi, max_queue=2) as s:
        threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts + [poison])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        assert s.app.state.worker.inflight == 0 and not multi.has_work()
        m = s.metrics()
        assert m[("cadence:request_success_total", (("finished_reason", "error"),))] == 1
        assert m[("cadence:request_success_total", (("finished_reason", "length"),))] == 8
        assert m[("cadence:batch_size_sum", ())] > m[("cadence:batch_size_count", ())]  # they ran together
    bad = out[8]
    assert isinstance(bad, openai.APIError) and "drift" in str(bad) and "400" in str(bad.body), bad
    assert {i: out[i] for i in range(8)} == {i: greedy(fast, p, chat=False) for i, p in enumerate(prompts)}


def test_a_request_error_is_400_and_an_engine_error_500_for_that_request_only(vanilla):
    """Serial engine: a request whose settings turn bad gets a 400, one whose step hits an
    engine fault a 500; a request running beside them is unharmed."""

    class Faulty(SerialEngine):
        def add(self, prompt_ids, cfg, scheduler=None):
            rid = super().add(prompt_ids, cfg, scheduler)
            if prompt_ids == self.bad_ids:
                cfg.drift = float("inf")
            if prompt_ids == self.fault_ids:
                self._queue[rid].step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
            return rid

    multi = Faulty(vanilla, max_batch=4)
    enc = lambda p: vanilla.backbone.encode_prompt(p, chat=False)
    multi.bad_ids, multi.fault_ids = enc("bad one"), enc("faulty one")
    with serve(vanilla, multi, spec=None) as s:
        body = lambda p, n=N: {"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0}
        r = post(s, "/v1/completions", body("bad one"))
        assert r.status_code == 400 and "drift" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = post(s, "/v1/completions", body("faulty one"))
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        ok = post(s, "/v1/completions", body(PROMPTS[1]))
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == greedy(vanilla, PROMPTS[1], False)


# ------------------------------------------------------------------ the event loop, bodies


def test_health_answers_while_a_prompt_is_tokenized(srv, monkeypatch):
    """Tokenizing runs off the event loop: while a prompt takes 1.5 s to tokenize, /health
    and another request's stream answer at once."""
    import cadence.server.app as app_module

    real = app_module.encode

    def slow_encode(bb, body):
        if body.prompt == "slow":
            time.sleep(1.5)
        return real(bb, body)

    monkeypatch.setattr(app_module, "encode", slow_encode)
    t = threading.Thread(target=post, args=(srv, "/v1/completions", {"model": MODEL, "prompt": "slow",
                                                                      "max_tokens": 2}))
    t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    waited = time.perf_counter() - t0
    t.join(30)
    assert waited < 0.5, waited


def test_a_body_over_the_limit_is_413_at_once(engine):
    """--max-body-bytes: a 4 MiB body is refused from its Content-Length before it is read
    (and a chunked one as soon as it passes the limit); /health meanwhile answers at once."""
    with serve(engine, SerialEngine(engine, max_batch=2), max_body_bytes=64 << 10) as s:
        big = json.dumps({"model": MODEL, "prompt": "a " * (2 << 20)}).encode()
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                       timeout=30)
        took = time.perf_counter() - t0
        assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS and took < 2, took
        assert r.json()["error"]["code"] == "request_too_large"

        def chunks():
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        t0 = time.perf_counter()
        assert httpx.get(s.url + "/health").status_code == 200
        assert time.perf_counter() - t0 < 0.05
        small = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}
        assert post(s, "/v1/completions", small).status_code == 200


# ------------------------------------------------------------------ connections


def test_a_reused_connection_answers_without_nagle_delay(srv):
    """The listening socket is TCP (``runner.listen``), so accepted connections get
    TCP_NODELAY: tiny GETs on one kept-alive connection take well under 10 ms (with
    Nagle's algorithm and delayed ACKs, about 40 ms each)."""
    port = int(srv.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    try:
        for _ in range(30):
            t0 = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += sock.recv(65536)
            times.append(time.perf_counter() - t0)
            assert head.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    assert statistics.median(times[5:]) < 0.010, times


# ------------------------------------------------------------------ request fields


def test_unknown_fields_are_refused_by_name_unless_lenient(srv, engine, caplog):
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": 0.1, "foo": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_p" and "min_p, foo" in err["message"]
    assert "--lenient" in err["message"] and err["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"repetition_penalty": 1.2})
    with serve(engine, SerialEngine(engine, max_batch=1), lenient=True) as s, caplog.at_level(logging.WARNING):
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": N, "temperature": 0,
                                        "min_p": 0.1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(engine, PROMPTS[2], False)
    assert "min_p" in caplog.text


def test_max_completion_tokens_and_message_names(srv, engine, llama):
    """``max_completion_tokens`` is honoured on /v1/completions too; a message's ``name``
    is refused where the chat template cannot show it, passed where it can."""
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_completion_tokens": 3,
                                      "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_completion_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    msg = {"role": "user", "content": "hi", "name": "ann"}
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": [msg], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.name"
    from cadence.server.options import encode
    from cadence.server.protocol import ChatCompletionRequest

    tok = llama.tokenizer
    old = tok.chat_template
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['name'] }}: {{ m['content'] }}{% endfor %}"
    try:
        ids = encode(llama, ChatCompletionRequest(model=MODEL, messages=[msg]))
    finally:
        tok.chat_template = old
    assert "ann: hi" in tok.decode(ids)


def test_any_integer_seed(srv):
    ask = lambda seed: post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": N,
                                                     "temperature": 0.9, "seed": seed})
    a, b, c = ask(-1), ask(2 ** 63 - 1), ask(2 ** 70)
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]  # -1 folds to 2**63 - 1


# ------------------------------------------------------------------ API key


def test_api_key(engine, monkeypatch):
    monkeypatch.setenv("CADENCE_API_KEY", "s3cret")
    from cadence.server.config import ServeConfig

    key = ServeConfig().api_key
    assert key == "s3cret" and ServeConfig(api_key="other").api_key == "other"
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    with serve(engine, SerialEngine(engine, max_batch=1), api_key=key) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = post(s, "/v1/completions", body, headers=headers)
            err = r.json()["error"]
            assert r.status_code == 401 and set(err) == ERROR_KEYS and err["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client.models.list()  # its key is "none"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        assert good.completions.create(**body).usage.completion_tokens == 2
        assert httpx.get(s.url + "/health").status_code == 200  # open by default
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert s.metrics()[("cadence:http_requests_total", (("endpoint", "/v1/completions"), ("status", "401")))] == 3
    with serve(engine, SerialEngine(engine, max_batch=1), api_key=key, public_health=False) as s:
        assert httpx.get(s.url + "/health").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health", headers={"Authorization": f"Bearer {key}"}).status_code == 200


# ------------------------------------------------------------------ limits


def test_max_tokens_limit(engine):
    with serve(engine, SerialEngine(engine, max_batch=1), max_tokens_limit=4) as s:
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "at most 4" in r.text
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4  # the default budget, capped


def test_request_timeout_ends_a_request_as_length(vanilla):
    """A request still decoding past --request-timeout ends with finish_reason "length"
    and the text so far (streamed and not)."""
    with serve(vanilla, SlowEngine(vanilla, max_batch=2), spec=None, request_timeout=0.6) as s:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 400, "temperature": 0}
        t0 = time.perf_counter()
        r = post(s, "/v1/completions", body)
        assert time.perf_counter() - t0 < 5
        got = r.json()
        assert r.status_code == 200 and got["choices"][0]["finish_reason"] == "length"
        n = got["usage"]["completion_tokens"]
        assert 0 < n < 400
        full = greedy(vanilla, "a", chat=False, n=400)
        assert full.startswith(got["choices"][0]["text"])
        chunks = list(s.client.completions.create(**body, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) < 400
        assert s.app.state.worker.inflight == 0


def test_a_reader_that_stalls_is_dropped(vanilla):
    """A request whose handler stops taking events (a streaming client that stopped
    reading) loses its slot after the stall timeout; its queue stays bounded."""
    multi = SlowEngine(vanilla, max_batch=1)
    multi.delay = 0.005
    worker = Worker(multi, Metrics(MODEL), max_queue=1, stream_buffer=4, stall_timeout=0.3)
    worker.start()

    async def main():
        ids = vanilla.backbone.encode_prompt("a", chat=False)
        stream = await worker.submit(ids, GenerationConfig(max_new_tokens=400))
        t0 = time.perf_counter()
        while worker.inflight and time.perf_counter() - t0 < 10:
            await asyncio.sleep(0.05)
        return stream, time.perf_counter() - t0

    try:
        stream, took = asyncio.run(main())
    finally:
        worker.stop(10)
    assert worker.inflight == 0 and took < 5 and not multi.has_work()
    items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert isinstance(items[-1], Failure) and "stopped reading" in items[-1].message
    assert 4 <= len(items) < 300  # about stream_buffer + what the stall timeout let through


def test_health_is_503_when_the_engine_thread_is_gone(vanilla):
    class Dies(BaseException):
        pass

    class Fatal(SerialEngine):
        def step(self):
            raise Dies()  # not an Exception: the worker's loop does not survive it

    with serve(vanilla, Fatal(vanilla, max_batch=1), spec=None) as s:
        assert httpx.get(s.url + "/health").status_code == 200
        threading.excepthook, hook = (lambda args: None), threading.excepthook
        try:
            with pytest.raises(httpx.ReadTimeout):
                post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=1)
            until(lambda: not s.app.state.worker.alive, 5)
        finally:
            threading.excepthook = hook
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "engine worker" in r.json()["error"]["message"]
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503


def test_streams_are_counted_in_the_metrics_when_they_end(vanilla):
    multi = SlowEngine(vanilla, max_batch=1)
    with serve(vanilla, multi, spec=None) as s:
        key = ("cadence:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "a", "max_tokens": 20, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            assert s.metrics().get(key, 0) == 0  # started, not ended
            rest = list(lines)
        assert "data: [DONE]" in rest
        until(lambda: s.metrics().get(key, 0) == 1, 5)
