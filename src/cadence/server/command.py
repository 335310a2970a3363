"""``cadence serve``: load the model, build the engine, serve it with uvicorn.

Knows: the subcommand's flags (from ``ServeConfig``, ``NarrowFlags``, ``MethodSpec`` and
``GenerationConfig``, whose values are the per-request defaults), the one place where
the multi-request engine is chosen (``multi_engine``), and that FastAPI / uvicorn /
prometheus-client come with the ``serve`` extra (imported only when the command runs).
Does not know the routes (``cadence.server.app``).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

from cadence.backbone.load import add_model_args, load_backbone, path_label
from cadence.batch.serial import SerialEngine
from cadence.cliargs import add_fields, from_args
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import MethodSpec, add_method_flags, make_engine
from cadence.server.config import Batching, NarrowFlags, ServeConfig
from cadence.system.heap import settled

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
        description="Serve the model with speculative decoding behind an OpenAI-compatible API. "
                    "Generation flags set the defaults of requests that do not say otherwise.")
    add_model_args(p)
    add_fields(p, ServeConfig)
    add_fields(p, NarrowFlags)
    add_method_flags(p)
    add_fields(p, GenerationConfig, exclude=("seed",),  # a request without seed gets a fresh one
               defaults={"temperature": 1.0, "max_new_tokens": 256})
    p.set_defaults(func=run)


def multi_engine(engine, batching: Batching, max_batch: int, narrow: NarrowFlags | None = None,
                 prefill_chunk: int = 0):
    """The ``MultiEngine`` over ``engine``: ``serial`` (any backbone), ``batched``
    (``cadence.batch.engine.BatchEngine`` with ``narrow``'s settings and chunked prefill of
    ``prefill_chunk`` tokens a step; a clear error while it is missing or refuses this
    backbone) or ``auto`` (batched where it works, else serial). Narrowing flags set on a
    serial engine are reported as ignored (stderr); the serial engine prefills whole prompts."""
    narrow = narrow or NarrowFlags()
    batching = Batching(batching)
    if batching is Batching.SERIAL:
        return _serial(engine, max_batch, narrow)
    try:
        from cadence.batch.engine import BatchEngine  # an install may lack it (auto falls back to serial)
    except ImportError as exc:
        if batching is Batching.AUTO:
            return _serial(engine, max_batch, narrow)
        raise CadenceError(f"--batching batched needs cadence.batch.engine, which this install lacks "
                           f"({exc}); use --batching serial") from exc
    try:
        return BatchEngine.from_engine(engine, max_batch=max_batch, narrow=narrow.config(),
                                       prefill_chunk=prefill_chunk)
    except CadenceError:
        if batching is Batching.AUTO:
            return _serial(engine, max_batch, narrow)
        raise


def _serial(engine, max_batch: int, narrow: NarrowFlags):
    if not narrow.is_default:
        print("cadence: note: --narrow-* flags apply to the batched engine only; this server runs "
              "requests in turn (SerialEngine), so they are ignored", file=sys.stderr, flush=True)
    return SerialEngine(engine, max_batch=max_batch)


def _need_extra() -> None:
    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise CadenceError(f"cadence serve needs {', '.join(missing)}: pip install 'cadence[serve]'")


def build(args: argparse.Namespace):
    """(app, ServeConfig) from parsed flags: model, engine, app; nothing listens yet."""
    _need_extra()
    from cadence.server.app import AppSettings, create_app  # the serve extra (fastapi), checked just above

    conf = from_args(ServeConfig, args)
    narrow = from_args(NarrowFlags, args)
    spec = MethodSpec.from_args(args)
    defaults = from_args(GenerationConfig, args)  # validated now: bad defaults exit 2
    backbone = load_backbone(args.model, args.dtype, args.device, args.backend, args.quant, args.kv_dtype)
    engine = make_engine(backbone, spec)
    spec = engine.spec  # ``auto`` settled: a request's cadence.method is read against what this server decodes
    if engine.auto_reason:
        print(f"cadence: {engine.auto_reason}", file=sys.stderr, flush=True)
    multi = multi_engine(engine, conf.batching, conf.max_batch, narrow, conf.prefill_chunk)
    settings = AppSettings(model_name=conf.served_model_name or backbone.name, max_queue=conf.max_queue,
                           defaults=defaults, spec=spec if spec.method.value != "vanilla" else None,
                           api_key=conf.api_key, public_health=conf.public_health,
                           max_body_bytes=conf.max_body_bytes, max_tokens_limit=conf.max_tokens_limit,
                           request_timeout=conf.request_timeout, stream_buffer=conf.stream_buffer,
                           stall_timeout=conf.stall_timeout, lenient=conf.lenient)
    app = create_app(engine, multi, settings)
    app.state.backbone_path = path_label(backbone)  # the start-up line's "float32 on gguf blocks"
    return app, conf


def run(args: argparse.Namespace) -> int:
    _need_extra()
    from cadence.server.runner import listen, make_server  # the serve extra (uvicorn), checked just above

    conf = from_args(ServeConfig, args)
    from_args(NarrowFlags, args)  # bad flags fail now, before the model loads
    sock = listen(conf.host, conf.port)  # a port in use fails now, before the model loads
    app, conf = build(args)
    port = sock.getsockname()[1]
    logging.basicConfig(level=conf.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    print(f"cadence: serving {app.state.metrics.model} ({app.state.backbone_path}; "
          f"{type(app.state.engine).__name__}, "
          f"max batch {app.state.engine.max_batch}, queue {conf.max_queue}) on http://{conf.host}:{port}",
          flush=True)
    if not conf.api_key and conf.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"cadence: warning: listening on {conf.host} without --api-key: anyone who can reach the port "
              "can use this server", file=sys.stderr, flush=True)
    with settled():  # the loaded model's objects out of the collector's way (system.heap)
        make_server(app, conf.host, port, conf.shutdown_timeout, conf.log_level).run(sockets=[sock])
    return 0
