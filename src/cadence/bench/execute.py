"""Run an untrusted Python program in a child process with a time limit (HumanEval scoring).

Knows: temp dirs, process groups, resource limits. Does not know: HumanEval.

The program is written to a fresh temporary directory and run there with
``python -I`` (isolated: no user site, no PYTHON* variables, no cwd on sys.path),
stdin from /dev/null, HOME/TMPDIR pointing into the directory, a memory cap and a
wall-clock limit after which its whole process group is killed. The directory is
removed afterwards. This keeps honest mistakes (infinite loops, stray files,
memory blow-ups) from leaking out; it is not a security sandbox against
malicious code: model output is run as the current user.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MEMORY_LIMIT_BYTES = 2 * 1024 ** 3


@dataclass
class ExecResult:
    passed: bool  # exit status 0 within the time limit
    status: str  # "passed" | "failed" | "timeout"
    returncode: int | None  # None on timeout
    seconds: float  # wall time of the child
    output: str  # last 2000 characters of stdout + stderr


def _limits() -> None:  # runs in the child before exec
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def run_python(code: str, timeout: float = 10.0) -> ExecResult:
    """Run ``code`` as a script; passed iff it exits with status 0 within ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="cadence-exec-") as tmp:
        script = os.path.join(tmp, "program.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(code)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp,
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", script], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_limits if os.name == "posix" else None)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            return ExecResult(False, "timeout", None, time.perf_counter() - t0,
                              out.decode("utf-8", "replace")[-2000:])
        finally:
            _kill_group(proc)  # leftovers the program may have spawned
        seconds = time.perf_counter() - t0
        text = out.decode("utf-8", "replace")[-2000:]
        ok = proc.returncode == 0
        return ExecResult(ok, "passed" if ok else "failed", proc.returncode, seconds, text)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
