"""The FastAPI app of ``cadence serve``: OpenAI-compatible routes over a ``MultiEngine``.

Knows: the routes (``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``), streaming as server-sent events,
turning every failure into OpenAI's error shape (400 bad input, 404 unknown model or
route, 429 over the limits, 503 shutting down, 500 engine failure), noticing clients
that leave, and the app's life span (the worker thread starts with the app and stops
with it). Does not know how the engine is built (``cadence.server.command``) or how a
request becomes engine settings (``cadence.server.options``).

``create_app`` takes an already-built ``Engine`` (its backbone tokenizes, its drafter
and tree policy serve per-request scheduler options) and the ``MultiEngine`` that runs
requests on it (``SerialEngine`` or ``BatchEngine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cadence.batch.api import Event, MultiEngine
from cadence.engine import Engine, GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import MethodSpec
from cadence.server import protocol as P
from cadence.server.metrics import CONTENT_TYPE, Metrics
from cadence.server.options import Schedulers, encode, generation_config
from cadence.server.worker import Failure, Overloaded, ShuttingDown, Stream, Worker

log = logging.getLogger(__name__)
GONE = object()  # put into a request's queue when its client disconnected


@dataclass
class AppSettings:
    """What the app needs besides the engines."""

    model_name: str  # the id clients send as ``model``
    max_queue: int = 32  # requests waiting beyond the engine's max_batch; more get 429
    defaults: GenerationConfig = field(default_factory=lambda: GenerationConfig(temperature=1.0))
    spec: MethodSpec | None = None  # how the engine was built (per-request scheduler / tree)


def create_app(engine: Engine, multi: MultiEngine, settings: AppSettings) -> FastAPI:
    metrics = Metrics(settings.model_name)
    worker = Worker(multi, metrics, settings.max_queue)
    service = Service(engine, worker, metrics, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:  # requests still in flight get a 503 / an error event, then the thread ends
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="cadence", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, multi

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return service.error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return service.error(request, P.ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(P.ApiError)
    async def _api(request: Request, exc: P.ApiError):
        return service.error(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return service.error(request, P.ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await service.complete(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await service.complete(body, request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        return service.answer(request, {"object": "list", "data": [service.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        service.check_model(model)
        return service.answer(request, service.model_card())

    @app.get("/health")
    async def health(request: Request):
        if worker.closing:
            raise P.ApiError(503, "shutting down", "server_error")
        return service.answer(request, {"status": "ok", "running": multi.running, "queued": multi.queued})

    @app.get("/metrics")
    async def metrics_route(request: Request):
        metrics.answer(request.url.path, 200)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app


UNION_TAGS = ("str", "list[str]", "list[int]", "list[TextPart]", "dict[any,any]")  # pydantic's branch names


def _path(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body" and p not in UNION_TAGS]


def validation_error(exc: RequestValidationError) -> P.ApiError:
    """pydantic's first complaint as a 400; ``param`` is the field's dotted path. Of a
    union's complaints (one per branch), the one deepest inside the field (it names
    the part that is wrong). Example: content [{"type": "image_url"}] -> loc ("body",
    "messages", 0, "content", "str") and (..., "content", "list[TextPart]", 0, "type")
    -> param "messages.0.content.0.type", "Input should be 'text'"."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return P.ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                          code="invalid_json")
    head = _path(first)
    same = [e for e in errors if _path(e)[:len(head)] == head]
    first = max(same, key=lambda e: len(_path(e)), default=first)  # max keeps the first of equals
    param = ".".join(_path(first)) or None
    msg = first.get("msg", "invalid request")
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the body must be a JSON object (Content-Type: application/json)"
    return P.ApiError(400, f"{param}: {msg}" if param else msg, param=param,
                      code="missing_field" if first.get("type") == "missing" else "invalid_value")


class Service:
    """The request handlers' logic (one per app)."""

    def __init__(self, engine: Engine, worker: Worker, metrics: Metrics, settings: AppSettings):
        self.engine, self.worker, self.metrics, self.settings = engine, worker, metrics, settings
        self.schedulers = Schedulers(engine, settings.spec)
        self.created = P.now()

    def error(self, request: Request, exc: P.ApiError) -> JSONResponse:
        self.metrics.answer(request.url.path, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def answer(self, request: Request, body: dict) -> JSONResponse:
        self.metrics.answer(request.url.path, 200)
        return JSONResponse(body)

    def model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "cadence"}

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise P.ApiError(404, f"the model {name!r} does not exist; this server serves "
                                  f"{self.settings.model_name!r}", "not_found_error", "model", "model_not_found")

    async def complete(self, body, request: Request, chat: bool):
        self.check_model(body.model)
        bb = self.engine.backbone
        ids = encode(bb, body)
        cfg = generation_config(body, self.settings.defaults, len(ids), bb.max_positions)
        scheduler = self.schedulers.factory(body.cadence)
        try:
            stream = await self.worker.submit(ids, cfg, scheduler)
        except Overloaded as exc:
            raise P.ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded") from exc
        except ShuttingDown as exc:
            raise P.ApiError(503, str(exc), "server_error") from exc
        except CadenceError as exc:
            raise P.ApiError(400, str(exc)) from exc
        rid, created = P.new_id(chat), P.now()
        if body.stream:
            self.metrics.answer(request.url.path, 200)
            watch = self._watch(request, stream)  # now: the generator may never start
            return StreamingResponse(self._events(stream, watch, rid, created, chat, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(stream, request, rid, created, chat)

    async def _collect(self, stream: Stream, request: Request, rid: str, created: int, chat: bool):
        """Wait for the whole result; a client that leaves meanwhile aborts the request."""
        texts, n = [], 0
        watch = self._watch(request, stream)
        try:
            while True:
                item = await stream.queue.get()
                if item is GONE:
                    self.metrics.answer(request.url.path, 499)
                    return Response(status_code=499)
                if isinstance(item, Failure):
                    raise P.ApiError(item.status, item.message, item.type)
                if item.finish_reason == "error":
                    raise P.ApiError(500, f"the request failed: {item.error}", "server_error")
                texts.append(item.text)
                n += len(item.tokens)
                if item.finished:
                    break
        finally:
            watch.cancel()
            self.worker.cancel(stream)
        extra = {"cadence": _stats(item)} if item.stats is not None else None
        return self.answer(request, P.response(rid, self.settings.model_name, chat, "".join(texts),
                                               item.finish_reason, P.usage(stream.prompt_tokens, n), created, extra))

    def _watch(self, request: Request, stream: Stream) -> asyncio.Task:
        """A task that waits for the client to leave, then aborts ``stream``'s request at
        once (queued or decoding: the worker drops it before its next step) and wakes its
        handler with ``GONE``. Started before any byte of the answer is sent, so a client
        that leaves at any point (queued, before the first chunk, mid-stream, before a
        plain answer) frees its slot whatever the ASGI server does with writes to a closed
        connection; the handler cancels it when it is done."""

        async def watch() -> None:
            try:
                while (await request.receive())["type"] != "http.disconnect":
                    pass  # the body was read already: nothing else comes before the disconnect
            except Exception:  # a receive that fails: the connection is gone too
                log.debug("receive failed while watching for a disconnect", exc_info=True)
            self.worker.cancel(stream)
            stream.queue.put_nowait(GONE)

        return asyncio.get_running_loop().create_task(watch(), name="cadence-disconnect-watch")

    async def _events(self, stream: Stream, watch: asyncio.Task, rid: str, created: int, chat: bool,
                      include_usage: bool):
        """Server-sent events: a role chunk (chat), text chunks, a finish chunk, the usage
        chunk when asked for, ``[DONE]``. A failure after the start becomes an error event
        (OpenAI clients raise it). ``watch`` (``_watch``) aborts the request when the client
        leaves, whether or not this generator ever runs."""
        model, n = self.settings.model_name, 0
        try:
            if chat:
                yield P.sse(P.chunk(rid, model, chat, created, role=True))
            while True:
                item = await stream.queue.get()
                if item is GONE:  # the client left: nothing more to send
                    return
                if isinstance(item, Failure) or item.finish_reason == "error":
                    msg = item.message if isinstance(item, Failure) else f"the request failed: {item.error}"
                    yield P.sse(P.error_body(msg, "server_error", code=str(getattr(item, "status", 500))))
                    break
                n += len(item.tokens)
                if item.text:
                    yield P.sse(P.chunk(rid, model, chat, created, text=item.text))
                if item.finished:
                    yield P.sse(P.chunk(rid, model, chat, created, finish_reason=item.finish_reason))
                    if include_usage:
                        yield P.sse(P.chunk(rid, model, chat, created, use=P.usage(stream.prompt_tokens, n)))
                    break
            yield P.sse("[DONE]")
        finally:  # also on cancellation (client disconnect) and generator close
            watch.cancel()
            self.worker.cancel(stream)


def _stats(ev: Event) -> dict:
    """The request's decoding statistics (an extra field ``cadence`` in the response)."""
    s = ev.stats.summary()
    return {k: s[k] for k in ("steps", "tau", "accepted_at_depth", "tree", "mean_nodes", "wall_s")}
