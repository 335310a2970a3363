"""Load test of ``cadence serve`` on loopback: throughput and latency at 1, 4 and 8 clients.

For each method (``vanilla`` = no speculation, ``hydra`` = shipped heads, adaptive
scheduler) a server is started on a free loopback port, warmed up, and the same fixed set
of held-out prompts (``benchmarks/prompts/categories.jsonl``, never used to train or tune)
is sent as streamed chat completions at T = 0 by C concurrent clients (the official
``openai`` client, one thread each). Reported per (method, C): total completion tokens /
wall seconds, the ratio to C = 1 of the same method, time to first token and gaps between
streamed chunks (p50 / p95), and whether every response is complete and equal to the
C = 1 response of the same prompt (no request lost or corrupted). The server must exit
cleanly on SIGTERM.

Usage:  python benchmarks/e2e/serve_load.py [--methods vanilla hydra] [--clients 1 4 8]
        [--requests 16] [--max-tokens 96] [--out runs/serve-load.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(method: str, port: int, max_batch: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--method", method, "--port", str(port),
           "--temperature", "0", "--max-batch", str(max_batch), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {method} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server for {method} did not become healthy in 600 s")


def one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, text, usage, finish = [], [], None, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                times.append(time.perf_counter())
                text.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"text": "".join(text), "tokens": usage.completion_tokens if usage else 0, "finish": finish,
            "ttft": (times[0] - t0) if times else None, "gaps": gaps}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_level(port: int, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                           timeout=600)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {"clients": clients, "wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(tokens / wall, 2),
            "ttft_p50": round(pct(ttft, 0.5), 4), "ttft_p95": round(pct(ttft, 0.95), 4),
            "gap_p50": round(pct(gaps, 0.5), 4), "gap_p95": round(pct(gaps, 0.95), 4),
            "complete": sum(r["finish"] in ("stop", "length") for r in results),
            "texts": [r["text"] for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["vanilla", "hydra"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(common.RUNS / "serve-load.json"))
    args = ap.parse_args()
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [it["prompt"] for it in items[:args.requests]]
    rows = []
    for method in args.methods:
        port = free_port()
        proc = start_server(method, port, max(args.clients))
        try:
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
            run_level(port, model, prompts[:2], 2, 16)  # warm-up, not reported
            base = None
            for c in args.clients:
                r = run_level(port, model, prompts, c, args.max_tokens)
                base = base or r
                r["method"] = method
                r["vs_one_client"] = round(r["tok_s"] / base["tok_s"], 3)
                r["identical_to_one_client"] = sum(a == b for a, b in zip(r["texts"], base["texts"]))
                rows.append(r)
                print(f"{method} C={c}: {r['tok_s']} tok/s ({r['vs_one_client']}x of C=1), TTFT p50 "
                      f"{r['ttft_p50']} s, complete {r['complete']}/{len(prompts)}, identical "
                      f"{r['identical_to_one_client']}/{len(prompts)}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed after 60 s"
            print(f"{method} server exit: {code}", flush=True)
    for r in rows:
        r.pop("texts")
    print("\n| method | clients | tok/s | vs 1 client | TTFT p50 / p95 (s) | chunk gap p50 / p95 (ms) "
          "| complete | identical to 1 client |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['clients']} | {r['tok_s']} | {r['vs_one_client']}x | {r['ttft_p50']} / "
              f"{r['ttft_p95']} | {r['gap_p50'] * 1e3:.1f} / {r['gap_p95'] * 1e3:.1f} | {r['complete']}/"
              f"{args.requests} | {r['identical_to_one_client']}/{args.requests} |")
    result = {"machine": common.machine(), "requests": args.requests, "max_tokens": args.max_tokens, "rows": rows}
    common.write_json(args.out, result, quiet=True)
    print(f"\n{common.machine_line(result['machine'])}; wrote {args.out}")


if __name__ == "__main__":
    main()
