"""An exclusive lock on a file that the operating system releases when its holder dies.

Knows: ``fcntl.flock`` on an open file (released by the kernel when the process exits, however
it exits: SIGKILL included), who holds a lock (pid, since when, doing what: written into the
lock file by its holder), and how long to wait for one before giving up.
Does not know: what the lock protects (a native build, a model conversion); callers decide
what to do when the wait runs out.

Why not a lock *file* (``O_EXCL``, as ``torch.utils.file_baton`` does): a file outlives a
process that dies without running its ``finally`` blocks, and the next run waits on it
forever. A ``flock`` cannot outlive its holder.

Example::

    with exclusive(build_dir / "cadence.lock", what="building the native layer loop",
                   timeout_s=240) as held:
        if held:
            ...  # build
        else:
            ...  # another live process is still at it: fall back
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


@dataclass(frozen=True)
class Holder:
    pid: int  # the process that holds the lock
    since: float  # time.time() when it took it
    what: str  # what it is doing, e.g. "building the native layer loop"

    def describe(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"process {self.pid} ({self.what}, since {when}, {time.time() - self.since:.0f} s ago)"


def _notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def holder(path: str | Path) -> Holder | None:
    """Who holds the lock at ``path`` now; None when nobody does (or the file is missing).
    A holder that died holds nothing: its lock was released with it."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(path) or Holder(pid=-1, since=time.time(), what="unknown")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(path: Path) -> Holder | None:
    try:
        info = json.loads(path.read_text() or "{}")
        return Holder(pid=int(info["pid"]), since=float(info["since"]), what=str(info.get("what", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def exclusive(path: str | Path, *, what: str, timeout_s: float, poll_s: float = 0.2,
              notice: Callable[[str], None] = _notice) -> Iterator[bool]:
    """Hold the lock at ``path`` for the ``with`` block; yields True when held, False when a
    live process still held it after ``timeout_s`` seconds (then nothing is held). While it
    waits it says once who holds the lock and for how long it will wait."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        held = _wait_for(fd, path, what, timeout_s, poll_s, notice)
        if held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.time(), "what": what}).encode(), 0)
        yield held
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _wait_for(fd: int, path: Path, what: str, timeout_s: float, poll_s: float,
              notice: Callable[[str], None]) -> bool:
    """Try to take the lock until ``timeout_s`` has passed; True once taken."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if not told:
            other = _read_holder(path)
            who = other.describe() if other else "another process"
            notice(f"cadence: waiting for {who} before {what} (up to {timeout_s:.0f} s; lock {path})")
            told = True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
