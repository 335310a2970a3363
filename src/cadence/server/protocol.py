"""OpenAI's wire format for the endpoints ``cadence serve`` offers.

Knows: the request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic
models, strict types: ``"max_tokens": "5"`` is an error, not 5), the extra body field
``cadence`` (per-request speculation options), the response objects, the streamed
chunks (server-sent events) and the error shape ``{"error": {"message", "type",
"param", "code"}}``. Does not know engines, tokenizers or HTTP routing.

Unknown fields are refused with a 400 that names them (``unknown_fields``; the server's
``--lenient`` ignores and logs them instead, for clients that send vendor extensions);
known ones that cadence cannot honour (``n`` > 1, ``logprobs`` / ``top_logprobs``,
``echo``, ``suffix``, ``best_of`` > 1, penalties, ``logit_bias``, tools / functions / a
``tool_choice`` that asks for a call, a ``response_format`` other than text, ``store``)
are refused with a 400 rather than silently dropped; their empty or neutral values
(``logit_bias: {}``, ``logprobs: false``, ``tool_choice: "none"``) are accepted, and so
are fields that change nothing here (``user``, ``metadata``, ``parallel_tool_calls``).
Every number must be finite (JSON's ``1e999`` reads as infinity: a 400), every text
valid Unicode (a lone surrogate such as ``"\\ud800"``: a 400), ``seed`` any integer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cadence.verify.rules import Rule

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop string (the detokenizer holds back up to this much text)


class ApiError(Exception):
    """An error answered in OpenAI's shape: HTTP ``status`` and the error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    """Strict types, finite numbers; unknown fields are kept aside (``model_extra``) for
    ``unknown_fields`` to refuse or, on a lenient server, to ignore."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields ``model`` (and the models inside it) did not declare.
    Example: a chat body with ``min_p`` and a message with ``foo`` -> ["min_p", "messages.0.foo"]."""
    out = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                out += unknown_fields(item, f"{prefix}{name}." + ("" if i is None else f"{i}."))
    return out


def unicode_text(v: str, what: str) -> str:
    """``v`` if it is valid Unicode (encodes to UTF-8); a lone surrogate is refused."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start} "
                         f"({v[exc.start]!r})") from None
    return v


class CadenceOptions(_Strict):
    """Per-request speculation options (extra body field ``cadence``); omitted ones take
    the server's configuration. Example: ``{"scheduler": "static", "tree": "chain-2",
    "rule": "greedy"}``."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    method: str | None = Field(None, description="a method name as `cadence generate --method` reads it "
                               "(MethodSpec.parse: METHOD[:TREE][+SCHEDULER][,NAME=VALUE]...), over the "
                               "server's; it may choose the tree, the scheduler and their options, not the heads")
    scheduler: str | None = Field(None, description="a name from cadence.schedulers.registry, or auto")
    tree: str | None = Field(None, description="--tree: auto, auto-N or a preset (root, chain-D, tree-N)")
    rule: Rule | None = Field(None, description="verification rule: auto, greedy, speculative, typical, relaxed")
    drift: float | None = Field(None, ge=0, description="--rule relaxed: drift budget in nats (lossy)")
    top_m: int | None = Field(None, ge=1, description="--rule relaxed: top-M at the parent (lossy)")

    @field_validator("rule", mode="before")
    @classmethod
    def _rule(cls, v):
        return Rule(v) if isinstance(v, str) else v  # strict mode takes no str for an enum


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    temperature: float | None = Field(None, ge=0, le=2, description="below sampling.MIN_TEMPERATURE: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, description="any integer (folded into 0 .. 2**63 - 1)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: float | None = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    frequency_penalty: float | None = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    user: str | None = None
    metadata: dict | None = Field(None, description="accepted, unused (it tags stored completions)")
    store: bool | None = Field(None, description="not supported: false only")
    parallel_tool_calls: bool | None = Field(None, description="accepted: tools are refused anyway")
    logit_bias: dict | None = Field(None, description="not supported: empty only")
    cadence: CadenceOptions | None = None

    @field_validator("store")
    @classmethod
    def _no_store(cls, v):
        if v:
            raise ValueError("store is not supported (this server keeps no completions)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for s in [v] if isinstance(v, str) else v or ():
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}")
            unicode_text(s, "a stop string")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @model_validator(mode="after")
    def _budget(self):
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; send one")
        if a is None:
            self.max_tokens = b
        return self

    @property
    def budget_param(self) -> str:
        """The name the client gave the token budget (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def stop_strings(self) -> tuple[str, ...] | None:
        if self.stop is None:
            return None
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool | None = Field(False, description="not supported")
    logprobs: int | None = Field(None, description="not supported (null only)")
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:  # 0 too: OpenAI answers 0 with the chosen tokens' logprobs
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of one string, a string, or token ids)")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("empty prompt")
        return unicode_text(v, "the prompt") if isinstance(v, str) else v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, v):
        return unicode_text(v, "the text")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, description="passed to chat templates that read it, else refused")

    @field_validator("content")
    @classmethod
    def _unicode(cls, v):
        return unicode_text(v, "the content") if isinstance(v, str) else v

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = Field(False, description="not supported")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="not supported: 0 only")
    tools: list | None = None
    functions: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} are not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError('tools are not supported: tool_choice may only be "none" or "auto"')
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("messages")
    @classmethod
    def _some_text(cls, v):
        if not any(m.text.strip() for m in v):
            raise ValueError("every message is empty")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported')
        return v


# ------------------------------------------------------------------ responses


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
             use: dict, created: int, extra: dict | None = None) -> dict:
    """The whole (non-streamed) completion object."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice], "usage": use}
    if extra:
        out.update(extra)
    return out


def chunk(rid: str, model: str, chat: bool, created: int, text: str | None = None,
          finish_reason: str | None = None, role: bool = False, use: dict | None = None) -> dict:
    """One streamed chunk. ``use`` alone (no text, no finish): the final usage chunk,
    whose ``choices`` is empty as in OpenAI's ``include_usage``."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": use}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
