"""Torch work on the server's engine thread runs on every core (``cadence.system.threads``)."""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest
import torch

from cadence.system.machine import onednn_available
from cadence.system.threads import loaded_openmp, release_openmp_pool

needs_gomp = pytest.mark.skipif(loaded_openmp() is None or "gomp" not in (loaded_openmp() or ""),
                                reason="GNU OpenMP not loaded (another runtime or platform)")


def _cores_used_in_a_thread(release: bool, seconds: float = 0.4) -> float:
    """CPU seconds per wall second of small bf16 oneDNN GEMMs (the fast path's decoding
    shape: 2 rows, SmolLM2's gate/up projection) run in a fresh thread."""
    from cadence.fast.kernels import Linear

    lin = Linear(torch.randn(3072, 576).to(torch.bfloat16), None, "onednn")
    x = torch.randn(2, 576).to(torch.bfloat16)
    lin(x)  # the main thread's pool exists, as after loading a model
    out = {"released": release_openmp_pool() if release else False}

    def job():
        for _ in range(20):
            lin(x)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            lin(x)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out["cores"] = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (time.perf_counter() - t0)

    th = threading.Thread(target=job)
    th.start()
    th.join()
    assert out["released"] == release
    return out["cores"]


@needs_gomp
@pytest.mark.skipif((os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2, reason="needs 2 threads")
@pytest.mark.skipif(not onednn_available(), reason="oneDNN kernels only")
def test_a_worker_thread_uses_every_core_once_the_main_pool_is_released():
    """Before the fix the engine thread's small GEMMs used 1.2 of 2 cores (libgomp stops
    spinning when the main thread's pool is also alive), and `cadence serve` decoded at 25
    tok/s against 46 in process."""
    assert _cores_used_in_a_thread(release=True) > 1.7


@needs_gomp
def test_results_are_unchanged_after_the_release():
    a, b = torch.randn(64, 300), torch.randn(300, 70)
    want = a @ b
    assert release_openmp_pool()
    assert torch.equal(a @ b, want)  # the main thread makes a new pool
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", a @ b))
    th.start()
    th.join()
    assert torch.equal(out["r"], want)


def test_the_server_worker_releases_the_pool_before_its_thread_starts(monkeypatch):
    from cadence.server import worker as W

    calls = []
    monkeypatch.setattr(W, "release_openmp_pool", lambda: calls.append(threading.current_thread().name) or True)

    class Idle:
        max_batch, running, queued = 1, 0, 0

        def has_work(self):
            return False

    from cadence.server.metrics import Metrics

    w = W.Worker(Idle(), Metrics("m"), max_queue=0)
    w.start()
    w.stop(timeout=5)
    assert calls == [threading.main_thread().name]
