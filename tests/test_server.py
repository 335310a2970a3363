"""``cadence serve`` (cadence.server): the official openai client against a live server on a
loopback port with a tiny random model; bad input, limits, disconnects and shutdown over
plain HTTP. Greedy output through the server must equal ``Engine.generate``; streamed
output must equal non-streamed output."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_support import (  # noqa: F401 - fixtures are used by name
    DEFAULTS,
    MODEL,
    PROMPTS,
    SPEC,
    N,
    engine,
    greedy,
    serve,
    slow,
    srv,
    until,
)
from tiny import OracleDrafter, tiny_backbone

from cadence.batch.serial import SerialEngine
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import make_engine
from cadence.schedulers.static import StaticScheduler
from cadence.server.app import AppSettings, create_app
from cadence.server.config import ServeConfig

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
    named = ask({"method": "hydra:root+static"})  # a method name, read as `cadence generate --method` reads it
    assert named["cadence"]["mean_nodes"] == 1.0 and named["choices"][0]["text"] == ref


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
    ("c", '{"model": "tiny", "prompt": "hi", "seed": 1.5}', 400, "seed"),
    ("c", '{"model": "tiny", "prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"drift": 1e999}}', 400, "cadence.drift"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"drift": NaN}}', 400, "cadence.drift"),
    ("c", '{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": ["a\\udfff"]}', 400, "prompt"),
    ("c", '{"model": "tiny", "prompt": "hi", "stop": "\\ud800"}', 400, "stop"),
    ("c", '{"model": "tiny", "prompt": "hi", "stop": "%s"}' % ("x" * 257), 400, "stop"),
    ("c", '{"model": "tiny", "prompt": "hi", "repetition_penalty": 1.1}', 400, "repetition_penalty"),
    ("c", '{"model": "tiny", "prompt": "hi", "min_p": 0.1, "foo": 1}', 400, "min_p"),
    ("c", '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "max_completion_tokens": 3}', 400, None),
    ("c", '{"model": "tiny", "prompt": "hi", "store": true}', 400, "store"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages.0.content"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "bob"}]}', 400,
     "messages.0.name"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "foo": 1}]}', 400, "messages.0.foo"),
    ("m", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"x": 1}, '
          '"stream": true}', 400, "stream_options.x"),
    ("c", '{"model": "nope", "prompt": "hi"}', 404, "model"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"scheduler": "nope"}}', 400, "cadence.scheduler"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"tree": "nope"}}', 400, "cadence.tree"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"tree": "auto-100000"}}', 400, "cadence.tree"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"rule": "nope"}}', 400, "cadence.rule"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"depth": 3}}', 400, "cadence.depth"),
    ("c", '{"model": "tiny", "prompt": "hi", "temperature": 1, "cadence": {"rule": "greedy"}}', 400, "cadence.rule"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"scheduler": "confidence"}}', 400, "cadence.scheduler"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"method": "vanilla"}}', 400, "cadence.method"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"method": "hydra,nodes=3"}}', 400, "cadence.method"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"method": "hydra,datastore=/etc"}}', 400, "cadence.method"),
    ("c", '{"model": "tiny", "prompt": "hi", "cadence": {"method": "hydra,online_store=9"}}', 400, "cadence.method"),
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
            assert status != 405 or r.headers["allow"] == "GET"
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
    from cadence.backbone.load import make_fast
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
    import cadence.backbone.load
    from cadence.cli import build_parser
    from cadence.backbone.load import make_fast
    from cadence.server import command

    tiny = lambda *a, **k: make_fast(tiny_backbone("llama"), "fast")  # noqa: E731
    monkeypatch.setattr(cadence.backbone.load, "load_backbone", tiny)
    monkeypatch.setattr(command, "load_backbone", tiny)  # command holds its own name for it
    args = build_parser().parse_args(["serve", "--heads", "random", "--batching", "batched", "--max-batch", "3",
                                      "--narrow-mode", "root", "--narrow-min-batch", "2", "--narrow-max-nodes", "5"])
    app, conf = command.build(args)
    multi = app.state.engine
    assert type(multi).__name__ == "BatchEngine" and multi.max_batch == conf.max_batch == 3
    assert (multi.narrow_cfg.mode, multi.narrow_cfg.min_batch, multi.narrow_cfg.max_nodes) == ("root", 2, 5)
    assert multi.prefill_chunk == conf.prefill_chunk == ServeConfig.prefill_chunk > 0  # chunked by default
    assert app.state.backbone_path == "float32"  # the start-up line names the path (the tiny model: no GGUF)
    args = build_parser().parse_args(["serve", "--heads", "random", "--batching", "batched", "--prefill-chunk", "0"])
    assert command.build(args)[0].state.engine.prefill_chunk == 0


@pytest.mark.parametrize("flags, message", [
    (["--narrow-mode", "wide"], "argument --narrow-mode: invalid"),
    (["--narrow-min-batch", "0"], "--narrow-min-batch must be >= 1"),
    (["--narrow-min-batch", "two"], "argument --narrow-min-batch: invalid int value"),
    (["--narrow-max-nodes", "-1"], "--narrow-max-nodes must be >= 0"),
    (["--narrow-margin", "-0.5"], "--narrow-margin must be a finite number >= 0"),
    (["--narrow-margin", "nan"], "--narrow-margin must be a finite number >= 0"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
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
    assert f"serving {bb.name} (float32" in log, log  # the start-up line names the backbone path


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
