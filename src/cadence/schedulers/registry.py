"""Schedulers by name (``--scheduler NAME``): how each is built for an engine, and
whether it is lossy.

A scheduler module registers a builder with ``@register(name, lossy=..., help=...)``
(``schedulers.base``); this module imports every one of them (``MODULES``), so the table is full;
``make_engine`` calls ``build(ctx)`` once per engine and gets a ``SchedulerFactory``
(``factory(sampling) -> Scheduler``, one scheduler per request). A lossy scheduler
(one that may plan ``verify=False`` steps) is the user's opt-in to lossy decoding: the
engine refuses unverified plans from every other scheduler.
"""

from __future__ import annotations

from cadence.errors import CadenceError
from cadence.schedulers import adaptive, clp, confidence, dynamic, entmtp, entmtp_adaptive, static
from cadence.schedulers.base import SCHEDULERS, SchedulerEntry

MODULES = (static, adaptive, dynamic, entmtp, entmtp_adaptive, clp, confidence)  # each registers its schedulers


def entry(name: str) -> SchedulerEntry:
    if name not in SCHEDULERS:
        raise CadenceError(f"unknown scheduler {name!r}; choose one of {', '.join(sorted(SCHEDULERS))}")
    return SCHEDULERS[name]


def names() -> list[str]:
    return sorted(SCHEDULERS)
