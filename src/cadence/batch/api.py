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

from cadence.engine import GenerationConfig, Stats
from cadence.schedulers.base import SchedulerFactory


@dataclass
class Event:
    """What one request produced in one ``step()``."""

    rid: int  # the id ``add`` returned
    tokens: list[int]  # token ids committed this step (nothing past a stop string)
    text: str  # text that became safe to show this step (see ``cadence.detok``)
    finished: bool = False  # the request is done and has left the engine
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort" or "error"
    drafted: int = 0  # draft tokens verified this step (tree nodes without the root)
    accepted: int = 0  # of those, accepted (bonus / root token not counted)
    accepted_at: list[int] = field(default_factory=list)  # 1 per accepted depth: [1, 1] = depths 1 and 2
    stats: Stats | None = None  # the request's statistics, set when finished
    error: str | None = None  # finish_reason "error": what failed (this request only; the others go on)


class MultiEngine(Protocol):
    """Many requests in flight; the caller drives ``step()`` from one thread."""

    max_batch: int  # at most this many requests decode at once; more wait in the queue

    def add(self, prompt_ids: list[int], cfg: GenerationConfig,
            scheduler: SchedulerFactory | None = None) -> int:
        """Queue a request (validated now: raises ``CadenceError`` on bad input); its id.
        ``scheduler`` overrides the engine's scheduler for this request."""

    def abort(self, rid: int) -> None:
        """Drop a request (queued or running) and free its slot now; unknown ids are ignored."""

    def step(self) -> list[Event]:
        """Admit queued requests into free slots, advance every running one by one step."""

    def has_work(self) -> bool:
        """Anything queued or running."""

    @property
    def running(self) -> int:
        """Requests decoding now (the batch size of the next step)."""

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
