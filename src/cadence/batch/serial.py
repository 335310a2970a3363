"""``MultiEngine`` over one ``Engine``: requests take turns, one backbone forward each.

Knows: the ``engine.Request`` life cycle (``start`` validates, ``step`` advances one
engine step, ``take_text`` hands out safe text, ``done`` / ``stats`` at the end), a FIFO
queue of waiting requests and a round-robin over at most ``max_batch`` running ones.
Does not know: batching (every request runs its own forward; see
``cadence.batch.engine`` for one forward over all rows), HTTP, threads or metrics.

It works with any backbone the single-request engine supports, and each request's
output is exactly its single-request output (the same ``Request`` code runs it), so it
is the fallback behind ``cadence serve`` and the reference for the batched engine.

Example, ``max_batch=2``, requests a, b, c added: step 1 admits a and b (c waits) and
advances a then b; when a finishes in step k, step k+1 admits c and advances b then c.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from cadence.batch.api import Event, failed
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.decode.request import Request
from cadence.errors import CadenceError
from cadence.schedulers.base import SchedulerFactory

log = logging.getLogger(__name__)


class SerialEngine:
    """Round-robin over ``engine.Request`` objects (implements ``cadence.batch.api.MultiEngine``)."""

    def __init__(self, engine: Engine, max_batch: int = 8):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise CadenceError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.engine = engine
        self.max_batch = max_batch
        self._ids = itertools.count(1)
        self._queue: OrderedDict[int, Request] = OrderedDict()  # rid -> request, oldest first
        self._running: OrderedDict[int, Request] = OrderedDict()

    def add(self, prompt_ids: list[int], cfg: GenerationConfig,
            scheduler: SchedulerFactory | None = None) -> int:
        req = self.engine.start(prompt_ids, cfg)  # validates: CadenceError on bad input
        if scheduler is not None:
            if self.engine.drafter is None:
                raise CadenceError("this engine decodes without a drafter (vanilla): a scheduler "
                                   "cannot be chosen per request")
            req.scheduler = scheduler(req.sampling)
        rid = next(self._ids)
        self._queue[rid] = req
        return rid

    def abort(self, rid: int) -> None:
        """Drop ``rid`` now (its cache goes with it); no event is emitted for it."""
        self._queue.pop(rid, None)
        self._running.pop(rid, None)

    def cut(self, rid: int) -> Event | None:
        req = self._queue.pop(rid, None)
        if req is None:
            req = self._running.pop(rid, None)
        if req is None:
            return None
        req.done = True
        return Event(rid, [], req.take_text(), finished=True, finish_reason="length", stats=req.stats)

    def has_work(self) -> bool:
        return bool(self._queue or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def step(self) -> list[Event]:
        """Admit waiting requests into free slots, then one step of every running one
        (an event for each, possibly without tokens)."""
        while self._queue and len(self._running) < self.max_batch:
            rid, req = self._queue.popitem(last=False)
            self._running[rid] = req
        events = [self._advance(rid, req) for rid, req in list(self._running.items())]
        for ev in events:
            if ev.finished:
                self._running.pop(ev.rid, None)
        return events

    def _advance(self, rid: int, req: Request) -> Event:
        """One step of ``req`` as an Event. A failure ends this request only
        (``api.failed``: finish_reason "error", 400 for a CadenceError, else 500)."""
        logged = len(req.stats.step_log)
        try:
            tokens = req.step()
        except Exception as exc:  # noqa: BLE001 - this request's failure: the others go on
            log.error("request %d failed: %s: %s", rid, type(exc).__name__, exc,
                      exc_info=not isinstance(exc, CadenceError))
            req.done = True
            return failed(rid, exc, req.stats)
        ev = Event(rid, list(tokens), req.take_text())
        if len(req.stats.step_log) > logged:  # this step ran a verify forward
            info = req.stats.step_log[-1]
            ev.drafted, ev.accepted = info.nodes - 1, info.accepted
            ev.accepted_at = [1] * info.accepted
        if req.done:
            ev.finished, ev.stats = True, req.stats
            ev.finish_reason = finish_reason(req)
        return ev


def finish_reason(req: Request) -> str:
    """"stop" for EOS or a stop string, else "length" (the token budget)."""
    eos = req.engine.backbone.eos_token_ids
    return "stop" if req.detok.stopped or (req.tokens and req.tokens[-1] in eos) else "length"
