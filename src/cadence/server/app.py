"""The FastAPI app of ``cadence serve``: OpenAI-compatible routes over a ``MultiEngine``.

Knows: the routes (``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``), streaming as server-sent events,
turning every failure into OpenAI's error shape (400 bad input, 401 a missing or wrong
API key, 404 unknown model or route, 405 with ``Allow``, 413 a body over the limit, 429
over the limits, 503 shutting down or engine gone, 500 engine failure), noticing clients
that leave, and the app's life span (the worker thread starts with the app and stops
with it). Does not know how the engine is built (``cadence.server.command``) or how a
request becomes engine settings (``cadence.server.options``).

The event loop only routes: prompts are tokenized on a thread of their own (a 1 MiB
prompt takes about a second to tokenize; ``/health`` and every stream go on meanwhile),
detokenized by the engine worker, and a body over ``max_body_bytes`` is refused with a
413 from its ``Content-Length`` before any of it is read (a body sent in chunks: as soon
as it crosses the limit). The API key (``Authorization: Bearer KEY``) is checked before
that, in constant time.

``create_app`` takes an already-built ``Engine`` (its backbone tokenizes, its drafter
and tree policy serve per-request scheduler options) and the ``MultiEngine`` that runs
requests on it (``SerialEngine`` or ``BatchEngine``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cadence.batch.api import Event, MultiEngine
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import MethodSpec
from cadence.server import protocol as P
from cadence.server.metrics import CONTENT_TYPE, Metrics
from cadence.server.options import Schedulers, encode, generation_config
from cadence.server.worker import Failure, Overloaded, ShuttingDown, Stream, Worker

log = logging.getLogger(__name__)
GONE = object()  # put into a request's queue when its client disconnected


OPEN_PATHS = ("/health", "/metrics")  # open without the API key unless AppSettings.public_health is off


@dataclass
class AppSettings:
    """What the app needs besides the engines (``ServeConfig`` holds the flags' help)."""

    model_name: str  # the id clients send as ``model``
    max_queue: int = 32  # requests waiting beyond the engine's max_batch; more get 429
    defaults: GenerationConfig = field(default_factory=lambda: GenerationConfig(temperature=1.0))
    spec: MethodSpec | None = None  # how the engine was built (per-request scheduler / tree)
    api_key: str = ""  # clients send ``Authorization: Bearer <api_key>``; empty: no key
    public_health: bool = True  # /health and /metrics answer without the key
    max_body_bytes: int = 1 << 20  # a larger request body is a 413 (0: no limit)
    max_tokens_limit: int = 0  # at most this many new tokens per request (0: the context's room)
    request_timeout: float = 0.0  # seconds a request may take before it ends as "length" (0: none)
    stream_buffer: int = 64  # events waiting for a stream's reader before it counts as stalled
    stall_timeout: float = 30.0  # seconds a stalled stream keeps its slot before it is dropped
    lenient: bool = False  # unknown request fields are ignored (logged) instead of refused


def create_app(engine: Engine, multi: MultiEngine, settings: AppSettings) -> FastAPI:
    metrics = Metrics(settings.model_name)
    store = getattr(engine.drafter, "datastore", None)
    if hasattr(store, "add"):  # ``--online-store``: its size on /metrics
        metrics.watch_online_store(store)
    worker = Worker(multi, metrics, settings.max_queue, request_timeout=settings.request_timeout,
                    stream_buffer=settings.stream_buffer, stall_timeout=settings.stall_timeout)
    service = Service(engine, worker, metrics, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:  # requests still in flight get a 503 / an error event, then the thread ends
            await asyncio.to_thread(worker.stop)
            service.tokenizer.shutdown(wait=False)

    app = FastAPI(title="cadence", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, multi
    app.add_middleware(Guard, settings=settings, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return service.error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return service.error(request, P.ApiError(exc.status_code, str(exc.detail), kind, code=code),
                             headers=getattr(exc, "headers", None))  # 405: Allow

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
        if not worker.alive:
            raise P.ApiError(503, "the engine worker thread is not running", "server_error")
        return service.answer(request, {"status": "ok", "running": multi.running, "queued": multi.queued})

    @app.get("/metrics")
    async def metrics_route(request: Request):
        metrics.answer(request.url.path, 200)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app


class Guard:
    """ASGI middleware in front of the routes: the API key, then the body limit.

    A request without the key (``Authorization: Bearer <key>``, compared in constant time)
    gets OpenAI's 401 (``code: "invalid_api_key"``) before its body is read; ``/health``
    and ``/metrics`` stay open while ``public_health``. A ``Content-Length`` over
    ``max_body_bytes`` gets a 413 at once; a body without one (chunked) is counted as it
    comes and refused with a 413 once it crosses the limit."""

    def __init__(self, app, settings: AppSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.key = settings.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.key and not (self.settings.public_health and path in OPEN_PATHS):
            error = self._auth(scope)
            if error is not None:
                return await self._refuse(scope, receive, send, error)
        limit = self.settings.max_body_bytes
        if limit:
            length = _header(scope, b"content-length")
            if length is not None:
                if not length.strip().isdigit():
                    return await self._refuse(scope, receive, send, P.ApiError(400, "bad Content-Length header"))
                if int(length) > limit:
                    return await self._refuse(scope, receive, send, _too_large(int(length), limit))
            receive = _counted(receive, limit)
        return await self.app(scope, receive, send)

    def _auth(self, scope) -> P.ApiError | None:
        got = _header(scope, b"authorization")
        if got is None:
            return P.ApiError(401, "You didn't provide an API key. Send it as a Bearer token: "
                                   "Authorization: Bearer YOUR_KEY", code="invalid_api_key")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            return P.ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    async def _refuse(self, scope, receive, send, error: P.ApiError) -> None:
        self.metrics.answer(scope.get("path", ""), error.status)
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        if error.status == 413:
            headers = {"Connection": "close"}  # the unread body stays behind: the connection ends
        await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _too_large(size: int, limit: int) -> P.ApiError:
    what = f"{size} bytes" if size >= 0 else "more bytes"
    return P.ApiError(413, f"the request body is {what}; this server takes at most {limit} "
                           "(--max-body-bytes)", code="request_too_large")


def _counted(receive, limit: int):
    """``receive`` that raises a 413 once the request's body passes ``limit`` bytes."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, _too_large(-1, limit).message)
        return message

    return wrapped


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
        # one thread: tokenizations run off the event loop, one at a time (a tokenizer is not
        # safe to call from several threads at once)
        self.tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cadence-tokenize")

    def error(self, request: Request, exc: P.ApiError, headers: dict | None = None) -> JSONResponse:
        self.metrics.answer(request.url.path, exc.status)
        headers = dict(headers or {})
        if exc.status == 429:
            headers["Retry-After"] = "1"
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    def answer(self, request: Request, body: dict) -> JSONResponse:
        self.metrics.answer(request.url.path, 200)
        return JSONResponse(body)

    def model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "cadence"}

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise P.ApiError(404, f"the model {name!r} does not exist; this server serves "
                                  f"{self.settings.model_name!r}", "not_found_error", "model", "model_not_found")

    def check_fields(self, body) -> None:
        """Unknown fields: a 400 naming them, or (``lenient``) a log line."""
        unknown = P.unknown_fields(body)
        if not unknown:
            return
        names = ", ".join(unknown)
        if self.settings.lenient:
            log.warning("ignored unknown request fields: %s", names)
            return
        raise P.ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''}: {names} (not a parameter "
                              "this server knows; it refuses rather than ignores them: start it with "
                              "--lenient to ignore unknown fields)", param=unknown[0], code="unknown_parameter")

    async def complete(self, body, request: Request, chat: bool):
        self.check_model(body.model)
        self.check_fields(body)
        bb = self.engine.backbone
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.tokenizer, encode, bb, body)
        cfg = generation_config(body, self.settings.defaults, len(ids), bb.max_positions,
                                self.settings.max_tokens_limit)
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
            watch = self._watch(request, stream)  # now: the generator may never start
            return StreamingResponse(self._events(stream, watch, request.url.path, rid, created, chat,
                                                  body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(stream, request, rid, created, chat)

    async def _collect(self, stream: Stream, request: Request, rid: str, created: int, chat: bool):
        """Wait for the whole result; a client that leaves meanwhile aborts the request."""
        texts, n = [], 0
        watch = self._watch(request, stream)
        try:
            while True:
                item = await stream.get()
                if item is GONE:
                    self.metrics.answer(request.url.path, 499)
                    return Response(status_code=499)
                if isinstance(item, Failure):
                    raise P.ApiError(item.status, item.message, item.type)
                if item.finish_reason == "error":
                    raise _failed(item)
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

    async def _events(self, stream: Stream, watch: asyncio.Task, path: str, rid: str, created: int, chat: bool,
                      include_usage: bool):
        """Server-sent events: a role chunk (chat), text chunks, a finish chunk, the usage
        chunk when asked for, ``[DONE]``. A failure after the start becomes an error event
        (OpenAI clients raise it). ``watch`` (``_watch``) aborts the request when the client
        leaves, whether or not this generator ever runs. The stream is counted in the
        metrics when it ends: 200 once ``[DONE]`` is sent, the error's status, or 499 for
        a client that left."""
        model, n, status = self.settings.model_name, 0, 499
        try:
            if chat:
                yield P.sse(P.chunk(rid, model, chat, created, role=True))
            while True:
                item = await stream.get()
                if item is GONE:  # the client left: nothing more to send
                    return
                if isinstance(item, Failure) or item.finish_reason == "error":
                    err = P.ApiError(item.status, item.message, item.type) if isinstance(item, Failure) \
                        else _failed(item)
                    status = err.status
                    yield P.sse(P.error_body(err.message, err.type, code=str(err.status)))
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
            status = 200 if status == 499 else status
        finally:  # also on cancellation (client disconnect) and generator close
            watch.cancel()
            self.worker.cancel(stream)
            self.metrics.answer(path, status)


def _failed(ev: Event) -> P.ApiError:
    """The error of a request that ended with finish_reason "error" (``api.failed``)."""
    if ev.error_status == 400:
        return P.ApiError(400, f"the request failed on its input: {ev.error}")
    return P.ApiError(ev.error_status, f"the request failed: {ev.error}", "server_error")


def _stats(ev: Event) -> dict:
    """The request's decoding statistics (an extra field ``cadence`` in the response)."""
    s = ev.stats.summary()
    return {k: s[k] for k in ("steps", "tau", "accepted_at_depth", "tree", "mean_nodes", "wall_s")}
