"""Torch work on a thread other than the main one (the server's engine worker).

Knows: one fact of GNU OpenMP (libgomp, the runtime of torch's CPU wheels). Each thread
that starts a parallel region gets its own pool of OpenMP threads, kept afterwards. Once the
main thread has one (loading a model makes it) and a worker thread makes another, libgomp
manages more threads than there are CPUs and stops spinning between regions: every region
then waits for its threads to wake. On 2 cores, small bf16 GEMMs on the server's worker
kept 1.2 of 2 cores busy (``tests/test_threads.py``) and `cadence serve` decoded plain at
25 tok/s against 46 in process (``benchmarks/e2e/serve_load.py``, ``batch_sweep.py``).
Releasing the main thread's pool (``omp_pause_resource_all``, OpenMP 5.0) before the
worker starts restores it (2.0 cores). The main thread can still start regions later; it
just makes a new pool.

Does not know torch's API for this (it has none); runtimes without the call (Intel's or
LLVM's OpenMP, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_RUNTIMES = ("libgomp", "libiomp", "libomp")


def loaded_openmp() -> str | None:
    """Path of the OpenMP runtime mapped into this process (Linux), else None."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rsplit(" ", 1)[-1].strip()
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/") and name.startswith(_RUNTIMES) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (``omp_pause_resource_all(omp_pause_soft)``),
    so a worker thread's parallel regions run at full speed. Call it on the main thread
    right before handing torch work to another thread. True when the runtime did it."""
    path = loaded_openmp()
    if path is None:
        return False
    try:
        fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
    except OSError:
        return False
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    ok = fn(1) == 0  # 1 = omp_pause_soft: threads are freed, state kept
    if not ok:
        log.warning("omp_pause_resource_all failed: torch work off the main thread may run slower")
    return ok
