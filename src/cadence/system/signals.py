"""SIGTERM and SIGHUP end a command the way Ctrl-C does.

Knows: that ``timeout``, a CI time limit, ``kill`` and a closed terminal stop a process with
SIGTERM or SIGHUP, whose default action ends it on the spot: no ``finally`` block runs, so
locks, temporary files and half-written outputs stay behind. ``install()`` turns both into a
``Terminated`` exception (a ``KeyboardInterrupt``) raised in the main thread, so every
``finally`` and ``except KeyboardInterrupt`` path that handles Ctrl-C handles them too.
Does not know: the server, which drains its requests on SIGTERM through uvicorn's own
handlers (``cadence serve`` does not call ``install``).
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM or SIGHUP arrives after ``install()``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 129 for SIGHUP


def _raise(signum, frame) -> None:
    raise Terminated(signum)


def install() -> None:
    """Route SIGTERM and SIGHUP to ``Terminated``; a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, _raise)
