"""From a validated OpenAI request to what the engine takes: prompt ids, a
``GenerationConfig`` and, when the request chooses one, a scheduler factory.

Knows: the server's defaults (a ``GenerationConfig``: temperature, top-p, rule, token
budget...), the chat template, the model's context length, and how a scheduler is
built from a name and a tree (as ``methods.make_engine`` does, reusing the engine's
drafter, heads and measured latency). Does not know HTTP or the engine's threading.

Every refusal is an ``ApiError`` (400) naming the offending field, e.g. a prompt of 500
tokens with ``max_tokens`` 100 on a 512-position model -> param ``max_tokens``, "at most
12 new tokens fit after this prompt of 500 tokens".
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections import OrderedDict

from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import MethodSpec, resolve_scheduler_name, scheduler_context, with_copy_first
from cadence.verify.sampling import SamplingParams
from cadence.schedulers import registry
from cadence.schedulers.base import SchedulerFactory
from cadence.server.protocol import (
    ApiError,
    CadenceOptions,
    ChatCompletionRequest,
    CompletionRequest,
)
from cadence.costs.tree_choice import TreePolicy
from cadence.trees.budget import AUTO_NODES

FACTORY_CACHE = 32  # scheduler factories kept per method name (scheduler, tree, options)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def encode(backbone, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """Prompt token ids: the raw prompt for completions, the chat template for chat."""
    tok = backbone.tokenizer
    if isinstance(body, ChatCompletionRequest):
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad("this model has no chat template; use /v1/completions", "messages")
        names = template_reads_names(tok.chat_template)
        for i, m in enumerate(body.messages):
            if m.name is not None and not names:
                raise bad("this model's chat template has no place for a participant's name; leave "
                          "name out (or put it into the content)", f"messages.{i}.name")
        messages = [{"role": m.role, "content": m.text} | ({"name": m.name} if m.name is not None else {})
                    for m in body.messages]
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:
            raise bad(f"the chat template refused these messages: {exc}", "messages") from exc
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)
    if isinstance(body.prompt, list):  # token ids
        bad_ids = [t for t in body.prompt if not 0 <= t < backbone.vocab_size]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{backbone.vocab_size - 1})", "prompt")
        return list(body.prompt)
    try:
        return backbone.encode_prompt(body.prompt, chat=False)
    except CadenceError as exc:
        raise bad(str(exc), "prompt") from exc


def template_reads_names(template) -> bool:
    """Whether a chat template reads a message's ``name`` (``message['name']``, ``m.name``...)."""
    return isinstance(template, str) and re.search(r"""(\.name\b|\[\s*['"]name['"]\s*\])""", template) is not None


def generation_config(body, defaults: GenerationConfig, prompt_len: int, limit: int,
                      max_tokens_limit: int = 0) -> GenerationConfig:
    """The request's settings over the server's ``defaults``. ``limit``: the model's
    positions; ``max_tokens_limit``: the server's cap on a request's budget (0: none).
    Without ``max_tokens`` the budget is the server's, cut to what fits and to the cap.
    ``seed``: any integer, folded into 0 .. 2**63 - 1 (-1 -> 2**63 - 1)."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    room = limit - prompt_len
    if room < 1:
        raise bad(f"the prompt is {prompt_len} tokens; this model's context is {limit} positions, "
                  "so no token fits after it", param, "context_length_exceeded")
    name = body.budget_param
    if max_tokens_limit and body.max_tokens is not None and body.max_tokens > max_tokens_limit:
        raise bad(f"{name} is {body.max_tokens}, but this server generates at most {max_tokens_limit} "
                  "tokens per request", name)
    if body.max_tokens is not None and body.max_tokens > room:
        raise bad(f"{name} is {body.max_tokens}, but at most {room} new tokens fit after this prompt "
                  f"of {prompt_len} tokens (context {limit})", name, "context_length_exceeded")
    budget = min(defaults.max_new_tokens, room, max_tokens_limit or room)
    opts = body.cadence or CadenceOptions()
    pick = lambda v, d: d if v is None else v
    stop = body.stop_strings
    seed = secrets.randbelow(2 ** 63) if body.seed is None else body.seed % 2 ** 63
    try:
        return GenerationConfig(
            max_new_tokens=body.max_tokens if body.max_tokens is not None else budget,
            temperature=pick(body.temperature, defaults.temperature), top_p=pick(body.top_p, defaults.top_p),
            top_k=pick(body.top_k, defaults.top_k), seed=seed,
            stop=defaults.stop if stop is None else stop, rule=pick(opts.rule, defaults.rule),
            drift=pick(opts.drift, defaults.drift), top_m=pick(opts.top_m, defaults.top_m))
    except CadenceError as exc:
        msg = str(exc)
        field = next((f for f in ("rule", "drift", "top_m") if msg.startswith(f) or f"--{f.replace('_', '-')}" in msg),
                     None)
        raise bad(msg, f"cadence.{field}" if field else None) from exc


class Schedulers:
    """Scheduler factories for per-request ``cadence.scheduler`` / ``cadence.tree``, built
    like ``make_engine`` builds the engine's own (same heads, drafter and latency curve)
    and cached per (scheduler, tree)."""

    def __init__(self, engine: Engine, spec: MethodSpec | None):
        self.engine, self.spec = engine, spec
        self._cache: OrderedDict[tuple, SchedulerFactory] = OrderedDict()

    def factory(self, opts: CadenceOptions | None) -> SchedulerFactory | None:
        """None when the request keeps the server's scheduler and tree."""
        if opts is None or (opts.scheduler is None and opts.tree is None and opts.method is None):
            return None
        param = ("cadence.method" if opts.method is not None else
                 "cadence.scheduler" if opts.scheduler is not None else "cadence.tree")
        base = getattr(self.engine, "tree_policy", None)
        if self.engine.drafter is None or base is None or self.spec is None:
            raise bad("this server decodes without draft heads (or its engine was not built by "
                      "make_engine): cadence.method, cadence.scheduler and cadence.tree cannot be chosen", param)
        spec = self.spec
        if opts.method is not None:
            try:
                spec = MethodSpec.parse(opts.method, self.spec)
            except CadenceError as exc:
                raise bad(str(exc), "cadence.method") from exc
            drafter_of = lambda m: (m.method, m.heads, m.copy, m.context_vocab, m.datastore, m.online_store)  # noqa: E731
            if drafter_of(spec) != drafter_of(self.spec):
                raise bad(f"cadence.method {opts.method!r} changes the heads or the drafter; this server decodes "
                          f"{self.spec.format()} (a request may choose the tree, the scheduler and their options)",
                          "cadence.method")
        spec = dataclasses.replace(spec, scheduler=opts.scheduler or spec.scheduler, tree=opts.tree or spec.tree)
        key = spec.format()
        if key not in self._cache:
            self._cache[key] = self._build(spec, base)
            while len(self._cache) > FACTORY_CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def _build(self, spec: MethodSpec, base: TreePolicy) -> SchedulerFactory:
        engine, drafter = self.engine, self.engine.drafter
        heads = drafter.heads
        size = spec.tree[len("auto-"):] if spec.tree.startswith("auto-") else ""
        if size.isdigit() and int(size) > AUTO_NODES:
            raise bad(f"tree {spec.tree!r}: at most auto-{AUTO_NODES}", "cadence.tree")
        try:
            name = resolve_scheduler_name(spec, heads, base.latency)
            entry = registry.entry(name)
        except CadenceError as exc:
            raise bad(str(exc), "cadence.scheduler") from exc
        if entry.lossy and not engine.allow_unverified:
            raise bad(f"scheduler {name!r} is lossy (commits unverified drafts); this server was not "
                      "started with a lossy scheduler, so it refuses one per request", "cadence.scheduler")
        policy = TreePolicy(spec.tree, heads, drafter, latency=base.latency, draft_s=base.draft_s,
                            margin=base.margin, chains_only=getattr(engine.backbone, "chains_only", False))
        try:
            policy.tree_for(SamplingParams())  # a bad tree name fails here, not mid-request
            factory = entry.build(scheduler_context(engine.backbone, heads, drafter, policy, spec, name))
            return with_copy_first(factory, spec, policy, drafter)
        except CadenceError as exc:
            raise bad(str(exc), "cadence.tree" if "tree" in str(exc) else "cadence.scheduler") from exc
