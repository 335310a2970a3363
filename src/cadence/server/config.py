"""Settings of ``cadence serve``; its CLI flags derive from these fields.

Knows: where to listen, the API key, the limits (requests decoding at once, requests
waiting, prompt tokens a step may spend on admissions, body size, tokens per request, a
request's time, a stalled reader's time),
whether unknown request fields are refused, how the multi-request engine is chosen,
how long shutdown waits, and the batched engine's
narrowing settings as ``--narrow-*`` flags (``NarrowFlags``: the fields, defaults and
help of ``cadence.batch.narrow.NarrowConfig``, prefixed). Does not know the model or
the decoding method (``MethodSpec``) or per-request defaults (``GenerationConfig``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import Enum

from cadence.batch.narrow import NarrowConfig
from cadence.errors import CadenceError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "CADENCE_API_KEY"  # the API key when --api-key is not given
PREFILL_CHUNK = 256  # default --prefill-chunk: on the AMX Xeon it cut running rows' p99 gap 2.5x for 1.8x a long prompt's TTFT (docs/serving.md)


class Batching(str, Enum):
    SERIAL = "serial"  # cadence.batch.serial.SerialEngine: requests take turns (any backbone)
    BATCHED = "batched"  # cadence.batch.engine.BatchEngine: one forward over every running request
    AUTO = "auto"  # batched where available, else serial

    def __str__(self) -> str:
        return self.value


@dataclass
class ServeConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port (0 = any free port)"})
    served_model_name: str = field(default="", metadata={
        "help": "model id clients must send (and /v1/models lists); default: the model's name"})
    max_batch: int = field(default=8, metadata={"help": "requests decoding at once (the engine's batch)"})
    max_queue: int = field(default=32, metadata={
        "help": "requests waiting for a slot beyond --max-batch; more are answered 429"})
    prefill_chunk: int = field(default=PREFILL_CHUNK, metadata={
        "help": "batched engine: most prompt tokens one step spends admitting requests while others "
                "decode, so a long prompt enters in chunks and running streams keep their inter-token "
                "latency (0 = each prompt in one forward)"})
    batching: Batching = field(default=Batching.AUTO, metadata={
        "help": "serial (requests take turns, any backbone), batched (one forward over all running "
                "requests; needs cadence.batch.engine), auto (batched where available, else serial)"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds shutdown waits for requests in flight to finish before cancelling them"})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level: critical | error | warning | info | debug"})
    api_key: str = field(default="", metadata={
        "help": "clients must send 'Authorization: Bearer KEY' (else 401); default: the environment "
                f"variable {API_KEY_ENV}, else no key (anyone who reaches the port may use it)"})
    public_health: bool = field(default=True, metadata={
        "help": "GET /health and /metrics answer without the API key (probes, Prometheus); "
                "--no-public-health requires it there too"})
    max_body_bytes: int = field(default=1 << 20, metadata={
        "help": "largest request body in bytes; a larger one is refused with 413 before it is read "
                "(0 = no limit)"})
    max_tokens_limit: int = field(default=0, metadata={
        "help": "most new tokens one request may ask for (larger max_tokens: 400); also caps the "
                "default budget (0 = what the context leaves after the prompt)"})
    request_timeout: float = field(default=0.0, metadata={
        "help": "seconds after which a request still decoding (or waiting) ends as if its budget ran "
                "out: finish_reason 'length', the text so far (0 = no deadline)"})
    stream_buffer: int = field(default=64, metadata={
        "help": "events a stream's reader may fall behind before it counts as stalled"})
    stall_timeout: float = field(default=30.0, metadata={
        "help": "seconds a stalled stream (a client that stopped reading) keeps its slot before it is dropped"})
    lenient: bool = field(default=False, metadata={
        "help": "ignore (and log) unknown request fields instead of refusing them with 400 "
                "(for clients that send vendor extensions)"})

    def __post_init__(self):
        self.batching = Batching(self.batching)
        if not 0 <= self.port <= 65535:
            raise CadenceError(f"--port must be in 0..65535, got {self.port}")
        if self.max_batch < 1:
            raise CadenceError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise CadenceError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.prefill_chunk < 0:
            raise CadenceError(f"--prefill-chunk must be >= 0 (0 = whole prompts), got {self.prefill_chunk}")
        if self.log_level not in LOG_LEVELS:
            raise CadenceError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("shutdown_timeout", "request_timeout", "stall_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise CadenceError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        for name in ("max_body_bytes", "max_tokens_limit"):
            if getattr(self, name) < 0:
                raise CadenceError(f"--{name.replace('_', '-')} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if self.stream_buffer < 1:
            raise CadenceError(f"--stream-buffer must be >= 1, got {self.stream_buffer}")
        if not self.api_key:
            self.api_key = os.environ.get(API_KEY_ENV, "")


class NarrowMode(str, Enum):
    AUTO = "auto"
    NONE = "none"
    ROOT = "root"

    def __str__(self) -> str:
        return self.value


def _narrow(name: str) -> dict:
    """The metadata of ``--narrow-<name>``: ``NarrowConfig.<name>``'s help."""
    f = next(f for f in dataclasses.fields(NarrowConfig) if f.name == name)
    return {"help": "batched engine: " + f.metadata["help"]}


@dataclass
class NarrowFlags:
    """``NarrowConfig`` as flags of ``cadence serve`` (``--narrow-mode`` ...: its fields'
    defaults and help); they apply to the batched engine only (``--batching batched``, or
    ``auto`` where it is batched)."""

    narrow_mode: NarrowMode = field(default=NarrowMode(NarrowConfig.mode), metadata=_narrow("mode"))
    narrow_min_batch: int = field(default=NarrowConfig.min_batch, metadata=_narrow("min_batch"))
    narrow_max_nodes: int = field(default=NarrowConfig.max_nodes, metadata=_narrow("max_nodes"))
    narrow_margin: float = field(default=NarrowConfig.margin, metadata=_narrow("margin"))
    narrow_measured: bool = field(default=NarrowConfig.measured, metadata=_narrow("measured"))

    def __post_init__(self):
        try:
            self.narrow_mode = NarrowMode(self.narrow_mode)
        except ValueError:
            raise CadenceError(f"--narrow-mode must be one of auto, none, root, got {self.narrow_mode!r}") from None
        if self.narrow_min_batch < 1:
            raise CadenceError(f"--narrow-min-batch must be >= 1, got {self.narrow_min_batch}")
        if self.narrow_max_nodes < 0:
            raise CadenceError(f"--narrow-max-nodes must be >= 0 (0 = no cap), got {self.narrow_max_nodes}")
        if not (math.isfinite(self.narrow_margin) and self.narrow_margin >= 0):
            raise CadenceError(f"--narrow-margin must be a finite number >= 0, got {self.narrow_margin}")

    def config(self) -> NarrowConfig:
        return NarrowConfig(mode=self.narrow_mode.value, min_batch=self.narrow_min_batch,
                            max_nodes=self.narrow_max_nodes, margin=self.narrow_margin,
                            measured=self.narrow_measured)

    @property
    def is_default(self) -> bool:
        return self == NarrowFlags()
