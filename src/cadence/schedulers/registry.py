"""Schedulers by name (``--scheduler NAME``): how each is built for an engine, and
whether it is lossy.

A scheduler module registers a builder with ``@register(name, lossy=..., help=...)``;
``make_engine`` calls ``build(ctx)`` once per engine and gets a ``SchedulerFactory``
(``factory(sampling) -> Scheduler``, one scheduler per request). A lossy scheduler
(one that may plan ``verify=False`` steps) is the user's opt-in to lossy decoding: the
engine refuses unverified plans from every other scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cadence.errors import CadenceError
from cadence.schedulers.base import SchedulerFactory


@dataclass
class SchedulerContext:
    """What a scheduler builder may use."""

    backbone: object  # the Backbone
    heads: object  # the draft heads (``heads.cfg`` holds calibration tables)
    drafter: object  # the HeadDrafter
    policy: object  # tree_policy.TreePolicy for ``--tree`` (latency curve, draft cost, tables)
    spec: object  # the MethodSpec (scheduler options live there)


@dataclass(frozen=True)
class SchedulerEntry:
    build: Callable[[SchedulerContext], SchedulerFactory]
    lossy: bool  # may commit drafts without verification
    help: str  # one line for --help and reports


SCHEDULERS: dict[str, SchedulerEntry] = {}


def register(name: str, lossy: bool, help: str):
    def deco(build):
        SCHEDULERS[name] = SchedulerEntry(build, lossy, help)
        return build
    return deco


def entry(name: str) -> SchedulerEntry:
    _load_all()
    if name not in SCHEDULERS:
        raise CadenceError(f"unknown scheduler {name!r}; choose one of {', '.join(sorted(SCHEDULERS))}")
    return SCHEDULERS[name]


def names() -> list[str]:
    _load_all()
    return sorted(SCHEDULERS)


def _load_all() -> None:
    """Import every scheduler module (each registers itself)."""
    from cadence.schedulers import adaptive, dynamic, entmtp, entmtp_adaptive, static  # noqa: F401
    from cadence.schedulers import clp, confidence  # noqa: F401  (CLP and confidence heads)
