"""Building a native extension so that a killed build never blocks the next run.

Knows: ``torch.utils.cpp_extension.load`` guards a build with a lock *file* (``lock`` in the
build directory) that outlives a process killed mid-build, after which every later build
waits on it forever. Here each build first takes ``cadence.lock`` in the same directory, an
``flock`` the kernel releases when its holder dies (``cadence.system.locks``). So:
- holding ``cadence.lock``, a torch ``lock`` file there has no live holder: it is removed
  with a one-line notice, and so is what the dead build left half-written (objects, ninja
  state, library) so the build starts clean;
- ``cadence.incomplete`` marks a build under way: found on entry, the last build in this
  directory never finished (killed, even without a torch lock left), so it is cleaned too;
- while another live process builds, this one says which process and since when, waits up
  to ``CADENCE_BUILD_WAIT`` seconds (default 240) and then gives up (``BuildBusy``): the
  caller falls back to the Python loop, it never hangs;
- a failed build leaves its reason in ``cadence-failed.txt`` for ``cadence env``.
Does not know: what the extension computes or which sources it has (``cadence.fast.native``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch.utils import cpp_extension

from cadence.system.locks import exclusive, holder

LOCK = "cadence.lock"  # the flock every cadence build takes first
MARKER = "cadence.incomplete"  # present while a build runs; left behind by a killed one
FAILED = "cadence-failed.txt"  # the last failed build's reason
DEFAULT_WAIT_S = 240.0


class BuildBusy(RuntimeError):
    """Another live process held the build lock for longer than the wait allows."""


def wait_s() -> float:
    """How long to wait for another process's build: ``CADENCE_BUILD_WAIT`` seconds."""
    try:
        return max(0.0, float(os.environ.get("CADENCE_BUILD_WAIT", DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


def build_dir(name: str) -> Path:
    path = Path(cpp_extension._get_build_directory(name, verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_built(name: str) -> bool:
    return any(build_dir(name).glob(f"{name}*.so"))


def state(name: str) -> dict:
    """What is known of ``name``'s build here without building: ``built``, ``building``
    (another process, with its pid and since when), ``failed`` (with the reason), ``not built``."""
    d = build_dir(name)
    other = holder(d / LOCK)
    if other is not None:
        return {"state": "building", "by": other.describe(), "dir": str(d)}
    if any(d.glob(f"{name}*.so")) and not (d / MARKER).exists():
        return {"state": "built", "dir": str(d)}
    if (d / FAILED).is_file():
        return {"state": "failed", "reason": (d / FAILED).read_text().strip(), "dir": str(d)}
    return {"state": "not built", "dir": str(d)}


def load(name: str, sources: list[str], cflags: list[str], ldflags: list[str], what: str, announce: str = ""):
    """``cpp_extension.load`` under ``cadence.lock``; ``announce`` is printed when it compiles.
    Raises ``BuildBusy`` when another live build outlasts ``wait_s()``; any build error as is
    (its reason recorded for ``cadence env``)."""
    d = build_dir(name)
    with exclusive(d / LOCK, what=what, timeout_s=wait_s()) as held:
        if not held:
            other = holder(d / LOCK)
            raise BuildBusy(f"{other.describe() if other else 'another process'} "
                            f"is still {what} after {wait_s():.0f} s (CADENCE_BUILD_WAIT)")
        _clean_after_dead_build(d, name)
        if announce and not any(d.glob(f"{name}*.so")):
            print(announce, file=sys.stderr, flush=True)
        (d / MARKER).touch()
        try:
            mod = cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=ldflags,
                                     build_directory=str(d), verbose=False)
        except Exception as exc:
            (d / FAILED).write_text(f"{type(exc).__name__}: {_last_line(exc)}\n")
            raise
        finally:
            (d / MARKER).unlink(missing_ok=True)
        (d / FAILED).unlink(missing_ok=True)
        return mod


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""


def _clean_after_dead_build(d: Path, name: str) -> None:
    """Holding ``cadence.lock``: remove what a dead build left (see the module docstring)."""
    stale_lock, unfinished = (d / "lock").exists(), (d / MARKER).exists()
    if not (stale_lock or unfinished):
        return
    why = "a stale build lock" if stale_lock else "an unfinished build"
    print(f"cadence: removed {why} left by a killed build in {d}; building from scratch",
          file=sys.stderr, flush=True)
    for p in d.iterdir():
        if p.name in (LOCK, FAILED) or p.suffix in (".cpp", ".h"):
            continue
        if p.name in ("lock", MARKER, ".ninja_log", ".ninja_deps", "build.ninja") or p.suffix in (".o", ".so"):
            p.unlink(missing_ok=True)
