"""``cadence serve`` under pressure: limits (429), client disconnects at every point,
shutdown with requests in flight, and the batched engine behind the same server."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest
from server_support import (  # noqa: F401 - fixtures are used by name
    MODEL,
    PROMPTS,
    SPEC,
    N,
    Served,
    SlowEngine,
    Spec24,
    engine,
    greedy,
    serve,
    slow,
    until,
    vanilla,
)
from tiny import tiny_backbone

from cadence.methods import make_engine

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
    from cadence.backbone.load import make_fast

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
