"""The one thread that owns the engine: it adds, aborts and steps requests, and hands
each request's events to that request's asyncio queue.

Knows: a ``MultiEngine`` (``cadence.batch.api``), the limits (``max_batch`` decoding +
``max_queue`` waiting; beyond them ``Overloaded``), and the handshake with the event
loop: the loop sends commands through a thread-safe queue, the worker answers with
``loop.call_soon_threadsafe``. Torch work never runs in the event loop. Does not know
HTTP, OpenAI's format or tokenizers.

Commands are handled in order between engine steps: ``add`` (answers the rid, or the
engine's ``CadenceError``), ``cancel`` (a client went away: ``engine.abort`` at once,
so the slot is free for the next step), ``fail`` (every request left gets a
``Failure``: shutdown after its grace period), ``stop`` (the same, then the thread ends). A cancel that arrives before its add is handled after
it, so a client that leaves while its request is being admitted still frees the slot.

What a request's queue receives: ``Event``s (the last one ``finished``), or one
``Failure`` (engine error, shutdown, a stalled reader) after which nothing more comes.

Limits kept here, between engine steps:
- ``request_timeout``: a request still in the engine that many seconds after it was
  submitted ends as if its token budget ran out (``MultiEngine.cut``: finish_reason
  "length", the text so far); queued requests too (then with no text).
- ``stream_buffer`` / ``stall_timeout``: a request whose handler has not taken
  ``stream_buffer`` of its events (a streaming client that stopped reading: the socket's
  buffers are full) counts as stalled; stalled for ``stall_timeout`` seconds, it is
  dropped (its slot freed, a ``Failure`` queued last), so a reader that never reads
  holds neither a slot nor an ever-growing queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from cadence.batch.api import Event, MultiEngine
from cadence.server.metrics import Metrics
from cadence.system.threads import release_openmp_pool

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Every slot and every queue place is taken (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new request (HTTP 503)."""


@dataclass
class Failure:
    """The request ended without a result."""

    status: int  # HTTP status for a response not started yet
    message: str
    type: str = "server_error"


@dataclass
class Stream:
    """One request as seen by its HTTP handler."""

    loop: asyncio.AbstractEventLoop
    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: int | None = None  # set by the worker once added
    closed: bool = False  # the handler saw the end (or gave up)
    t0: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sent: int = 0  # items the worker put (worker thread)
    taken: int = 0  # items the handler took (event loop)
    stalled_since: float | None = None  # worker thread: when the reader fell stream_buffer behind

    def put(self, item: Event | Failure) -> None:
        """From the worker thread."""
        self.sent += 1
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (process exiting)
            pass

    async def get(self):
        """The next item (from the handler)."""
        item = await self.queue.get()
        self.taken += 1
        return item

    @property
    def pending(self) -> int:
        return self.sent - self.taken


class Worker:
    def __init__(self, engine: MultiEngine, metrics: Metrics, max_queue: int, request_timeout: float = 0.0,
                 stream_buffer: int = 64, stall_timeout: float = 30.0):
        self.engine, self.metrics = engine, metrics
        self.limit = engine.max_batch + max_queue  # requests in flight at most
        self.request_timeout, self.stream_buffer, self.stall_timeout = request_timeout, stream_buffer, stall_timeout
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}  # rid -> stream; worker thread only
        self._lock = threading.Lock()  # guards _inflight and closing
        self._inflight = 0
        self.closing = False
        self._thread = threading.Thread(target=self._run, name="cadence-engine", daemon=True)

    # ---------------------------------------------------------------- event-loop side

    def start(self) -> None:
        release_openmp_pool()  # else the worker's forwards run at one core's speed (``cadence.system.threads``)
        self._thread.start()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def alive(self) -> bool:
        """The engine thread is running (it ends only with ``stop``, or by a bug)."""
        return self._thread.is_alive()

    async def submit(self, prompt_ids: list[int], cfg, scheduler=None) -> Stream:
        """Queue a request; its Stream. Raises Overloaded, ShuttingDown or the engine's
        CadenceError (bad input)."""
        stream = Stream(asyncio.get_running_loop(), len(prompt_ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            if not self._thread.is_alive():
                raise ShuttingDown("the engine worker is not running (the app's lifespan did not start it)")
            if self._inflight >= self.limit:
                raise Overloaded(f"{self._inflight} requests in flight (the limit is {self.limit}: "
                                 f"{self.engine.max_batch} decoding + {self.limit - self.engine.max_batch} "
                                 "waiting); retry later")
            self._inflight += 1
            self._cmds.put(("add", (prompt_ids, cfg, scheduler, stream), fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(stream)
            raise
        return stream

    def cancel(self, stream: Stream) -> None:
        """The handler is done with ``stream`` (finished, failed or its client left):
        abort the request if it is still in the engine. Idempotent."""
        if not stream.closed:
            stream.closed = True
            self._cmds.put(("cancel", stream, None))

    def drain(self, timeout: float) -> None:
        """Shutdown, first half: take no new request, let those in flight finish for up to
        ``timeout`` seconds, then fail the rest (503 / an error event), so every client
        gets a complete answer before the connections close. Blocking: call it in a thread."""
        with self._lock:
            self.closing = True
        deadline = time.monotonic() + timeout
        while self._inflight > 0 and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        if self._inflight > 0:
            with self._lock:
                self._cmds.put(("fail", None, None))
            while self._inflight > 0 and self._thread.is_alive():  # the current step ends first
                time.sleep(0.01)

    def stop(self, timeout: float | None = None) -> None:
        """Fail what is left, end the thread (blocks up to ``timeout`` for the current step)."""
        with self._lock:
            self.closing = True
            self._cmds.put(("stop", None, None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        while True:
            try:
                if not self._commands(block=not self.engine.has_work()):
                    return
                self._deadlines()
                if self.engine.has_work():
                    self._step()
            except Exception:
                log.exception("engine worker: unexpected failure")
                self._fail_all(Failure(500, "internal error in the engine worker"))

    def _commands(self, block: bool) -> bool:
        """Handle queued commands (wait for one when ``block``); False on stop."""
        while True:
            try:
                kind, arg, fut = self._cmds.get() if block else self._cmds.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "add":
                self._add(arg, fut)
            elif kind == "cancel":
                self._abort(arg)
            elif kind in ("fail", "stop"):
                self._fail_all(Failure(503, "the server is shutting down; the request was cancelled"))
                if kind == "stop":
                    return False
            self.metrics.queues(self.engine.running, self.engine.queued)

    def _add(self, arg, fut: concurrent.futures.Future) -> None:
        prompt_ids, cfg, scheduler, stream = arg
        try:
            stream.rid = self.engine.add(prompt_ids, cfg, scheduler)
        except Exception as exc:  # noqa: BLE001 - CadenceError (bad input) or anything else: the caller's
            self._release()
            fut.set_exception(exc)
            return
        self._streams[stream.rid] = stream
        self.metrics.admitted(len(prompt_ids))
        fut.set_result(stream.rid)

    def _abort(self, stream: Stream) -> None:
        if stream.rid is not None and stream.rid in self._streams:
            self._abort_stream(stream.rid, stream)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all(Failure(500, f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        self.metrics.step(events)
        now = time.perf_counter()
        for ev in events:
            stream = self._streams.get(ev.rid)
            if stream is None:  # aborted meanwhile
                continue
            if ev.tokens and stream.first_token_s is None:
                stream.first_token_s = now - stream.t0
                self.metrics.ttft.labels(self.metrics.model).observe(stream.first_token_s)
            if ev.finished:
                del self._streams[ev.rid]
                self._release()
                self.metrics.finished(ev.finish_reason or "stop")
                self.metrics.e2e.labels(self.metrics.model).observe(now - stream.t0)
            stream.put(ev)
        self.metrics.queues(self.engine.running, self.engine.queued)

    def _deadlines(self) -> None:
        """End the requests past ``request_timeout`` ("length") and drop stalled readers."""
        now = time.perf_counter()
        for rid, stream in list(self._streams.items()):
            if self.request_timeout and now - stream.t0 > self.request_timeout:
                ev = self.engine.cut(rid)
                del self._streams[rid]
                self._release()
                self.metrics.finished("length")
                if ev is not None:
                    stream.put(ev)
                else:  # the engine had no such request: end the stream all the same
                    stream.put(Event(rid, [], "", finished=True, finish_reason="length"))
                log.info("request %d ran past --request-timeout (%.1f s): ended as length", rid,
                         self.request_timeout)
            elif stream.pending < self.stream_buffer:
                stream.stalled_since = None
            elif stream.stalled_since is None:
                stream.stalled_since = now
            elif now - stream.stalled_since > self.stall_timeout:
                log.warning("request %d: its reader took nothing for %.1f s (%d events waiting): dropped",
                            rid, now - stream.stalled_since, stream.pending)
                self._abort_stream(rid, stream)
                stream.put(Failure(503, f"the client stopped reading for over {self.stall_timeout:g} s; "
                                        "the request was dropped"))

    def _abort_stream(self, rid: int, stream: Stream) -> None:
        self._streams.pop(rid, None)
        self.engine.abort(rid)
        self._release()
        self.metrics.finished("abort")

    def _fail_all(self, failure: Failure) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of request %d failed", rid)
            stream.put(failure)
            self.metrics.finished("abort" if failure.status == 503 else "error")
            self._release()
        self._streams.clear()
        self.metrics.queues(self.engine.running, self.engine.queued)

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1
