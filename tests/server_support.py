"""Shared pieces of the server tests: a live ``cadence serve`` app on a loopback port with a
tiny random model, engines that step slowly, and the fixtures built on them."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cadence.batch.serial import SerialEngine
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.methods import Method, MethodSpec, make_engine
from cadence.server.app import AppSettings, create_app
from cadence.server.runner import listen, make_server

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
def serve(engine, multi, shutdown_timeout: float = 5.0, max_queue: int = 8, spec=SPEC, wrap=None, **settings):
    """A live server on a free loopback port, its socket made as ``cadence serve`` makes it
    (``runner.listen``); ``settings``: more ``AppSettings`` fields."""
    app = create_app(engine, multi, AppSettings(MODEL, max_queue, DEFAULTS, spec, **settings))
    sock = listen("127.0.0.1", 0)
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
