"""What a server needs from an engine that decodes many requests at once.

Knows: the contract between a front end (``cadence serve``) and a multi-request
engine: requests are added and aborted by id, ``step()`` advances every active request
by one engine step and returns what each produced. Does not know: how the step is done
(one batched backbone forward over every row, or one request after another), HTTP, or
metrics.

Two implementations share it:
- ``cadence.batch.serial.SerialEngine``: round-robin over ``engine.Request`` objects,
  one backbone forward per request per step (works with any backbone);
- ``cadence.batch.engine.BatchEngine``: one backbone forward verifies every active
  row's tree (continuous batching; needs a backbone that takes a batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cadence.decode.generation import GenerationConfig, Stats
from cadence.errors import CadenceError
from cadence.schedulers.base import SchedulerFactory


@dataclass
class Event:
    """What one request produced in one ``step()``."""

    rid: int  # the id ``add`` returned
    tokens: list[int]  # token ids committed this step (nothing past a stop string)
    text: str  # text that became safe to show this step (see ``cadence.decode.detok``)
    finished: bool = False  # the request is done and has left the engine
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort" or "error"
    drafted: int = 0  # draft tokens verified this step (tree nodes without the root)
    accepted: int = 0  # of those, accepted (bonus / root token not counted)
    accepted_at: list[int] = field(default_factory=list)  # 1 per accepted depth: [1, 1] = depths 1 and 2
    stats: Stats | None = None  # the request's statistics, set when finished
    error: str | None = None  # finish_reason "error": what failed (this request only; the others go on)
    error_status: int = 500  # finish_reason "error": 400 when the request's own input caused it, else 500


def failed(rid: int, exc: BaseException, stats: Stats | None = None) -> Event:
    """The event that ends request ``rid`` whose step raised ``exc``: status 400 for a
    ``CadenceError`` (the request's own input, e.g. a drift of inf), else 500."""
    return Event(rid, [], "", finished=True, finish_reason="error", stats=stats,
                 error=f"{type(exc).__name__}: {exc}", error_status=400 if isinstance(exc, CadenceError) else 500)


class MultiEngine(Protocol):
    """Many requests in flight; the caller drives ``step()`` from one thread."""

    max_batch: int  # at most this many requests decode at once; more wait in the queue

    def add(self, prompt_ids: list[int], cfg: GenerationConfig,
            scheduler: SchedulerFactory | None = None) -> int:
        """Queue a request (validated now: raises ``CadenceError`` on bad input); its id.
        ``scheduler`` overrides the engine's scheduler for this request."""

    def abort(self, rid: int) -> None:
        """Drop a request (queued or running) and free its slot now; unknown ids are ignored."""

    def cut(self, rid: int) -> Event | None:
        """End a request now as if its token budget ran out (a deadline passed): it leaves
        the engine and its final event is returned (the text held back so far, finish_reason
        "length"); None for an unknown id."""

    def step(self) -> list[Event]:
        """Admit queued requests into free slots, advance every running one by one step.
        A request that fails ends alone (finish_reason "error"); the step goes on for the
        others, whose output is what it would have been without it."""

    def has_work(self) -> bool:
        """Anything queued or running."""

    @property
    def running(self) -> int:
        """Requests decoding now (the batch size of the next step)."""

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
