"""Named decoding methods -> ready engines. Shared by the CLI, the benchmark and the server.

A method is a head family (or none, for ``vanilla``) plus where its heads come from
(``default`` = heads shipped for the default model, ``random``, or a directory) and a
tree preset. ``make_engine`` is the one place that assembles backbone + heads +
drafter + scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from enum import Enum

import torch

from cadence.cliargs import add_fields, from_args
from cadence.costs.latency import LatencyCurve, latency_curve
from cadence.costs.tree_choice import TreePolicy, draft_seconds
from cadence.decode.engine import Engine
from cadence.draft.context_copy import CopyConfig
from cadence.draft.copy_drafter import CopyDrafter
from cadence.draft.datastore import load_datastore
from cadence.draft.online_store import OnlineStore
from cadence.draft.head_drafter import HeadDrafter
from cadence.errors import CadenceError
from cadence.heads.io import decode_dtype, load_heads, new_heads
from cadence.heads.shipped import heads_kind, heads_path, shipped_heads_dir, shipped_store_dir
from cadence.schedulers import registry
from cadence.schedulers.base import SchedulerContext
from cadence.schedulers.copy_chain import CopyChainScheduler
from cadence.schedulers.copy_first import CopyFirst
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import chain, compile_tree
from cadence.verify.sampling import SamplingParams


class Method(str, Enum):
    AUTO = "auto"  # settled per backbone by ``resolve_method`` before an engine is built
    VANILLA = "vanilla"  # plain autoregressive decoding through the same engine
    MEDUSA = "medusa"
    HYDRA = "hydra"
    MTP = "mtp"
    EAGLE = "eagle"  # one decoder layer, feature-level autoregression (attention over the context)
    EAGLE3 = "eagle3"  # EAGLE-3: fused taps, a 2d-input layer, its own draft-vocabulary LM head
    MTP_ATTN = "mtp-attn"  # chained MTP modules with attention (DeepSeek-V3 / MiMo)
    NGRAM = "ngram"  # the context copy alone (prompt lookup): any model, no heads (``copy_drafter``)

    def __str__(self) -> str:
        return self.value


@dataclass
class MethodSpec:
    """How to decode; CLI flags derive from these fields (and each scheduler's options, ``options``);
    ``parse`` / ``format`` read and write it as a method name."""

    method: Method = field(default=Method.AUTO, metadata={
        "help": "auto (ngram where the backbone computes from GGUF blocks or no heads ship for it, eagle with "
                "the eagle-taps set on dense bfloat16, hydra on dense float32, the heads' own kind with --heads DIR; "
                "printed, and in --json) | vanilla | medusa | "
                "hydra | mtp | eagle | eagle3 | mtp-attn | ngram (context copy alone: any model, no heads)"})
    heads: str = field(default="default", metadata={
        "help": "default (shipped for the model and --method) | random | a heads directory | the name of a "
                "set shipped for the model (SmolLM2: eagle-taps; see the model card)"})
    tree: str = field(default="auto", metadata={"help": "auto (the tree of highest expected tokens/s from the heads' calibrated acceptance and this machine's measured verify latency; may be the root alone), auto-N (N nodes grown from the calibrated acceptance), or a preset: root, chain, chain-D, tree-N"})
    num_heads: int = field(default=3, metadata={"help": "K for --heads random"})
    copy: bool = field(default=True, metadata={"help": "rank the context copy (token after the same n-gram earlier) first (T > 0: verified as a point-mass proposal, still lossless)"})
    copy_first: bool = field(default=True, metadata={"help": (
        "heads methods with calibrated heads and --tree auto: a step whose root has a copy may verify the copy "
        "chain alone, no head call, where that has been giving this request more tokens per second "
        "(schedulers.copy_first; lossless)")})
    online_store: int = field(default=0, metadata={"help": (
        "keep the n-grams of this engine's finished replies as copy sources (a server learns from what it "
        "serves; draft.online_store), at most this many, oldest dropped first; 0 = off. Lossless, but shared "
        "by every request: latency may reveal that a phrase was generated before")})
    copy_depth: int = field(default=8, metadata={"help": "deepest tree level a context copy may fill (presets; calibrated trees say their own)"})
    datastore: str = field(default="auto", metadata={
        "help": "a self-distilled store directory (e.g. data/selfdistill/smollm2, written by `cadence distill`) "
                "whose replies also supply copies where the request has none: the token that most often "
                "followed the same 2-4 tokens there (REST-style; drafts only, the output is unchanged); "
                "auto = the model's own store where a source checkout has one (SmolLM2: data/selfdistill/smollm2), "
                "else off; none = off"})
    heads_dtype: str = field(default="auto", metadata={
        "help": "dtype the heads draft in: auto (bfloat16 on a bfloat16 backbone, else float32), float32, bfloat16; "
                "drafts only: the output is the same either way"})
    draft_weights: str = field(default="auto", metadata={
        "help": "how the drafting kernels hold the heads' weights: dense (the heads' dtype), q8_0 (GGUF Q8_0 "
                "blocks, int8 + an fp16 scale per 32 weights, on the integer kernel, CPUs: about half the bytes "
                "of bf16 and a quarter of fp32 to read per draft; the attention heads' projections, the MLP "
                "heads' layers and the draft-vocabulary LM head), q4_1 / q4_0 (4-bit GGUF blocks: half of "
                "q8_0's bytes) or auto (q4_1 where the heads draft in float32; in bfloat16 q8_0 on CPUs without AMX, dense with it); "
                "drafts only: the output is the same either way"})
    heads_seed: int = field(default=0, metadata={"help": "seed for --heads random"})
    context_vocab: int = field(default=256, metadata={
        "help": "heads with a draft vocabulary may also draft up to N of the request's own tokens "
                "outside it, most recent first (names, numbers, loops; lossless); 0 = off"})
    scheduler: str = field(default="auto", metadata={
        "help": "how much to speculate each step: auto (with --tree auto on calibrated heads: dynamic where this "
                "machine verifies 8 nodes in at most 1.4 one-token forwards, adaptive where that costs more; "
                "else static), or one of `cadence.schedulers.registry.names()`: static (--tree), "
                "adaptive, adaptive-k, entmtp, dynamic (lossless); lossy, opt-in: clp-unverified, confidence"})
    options: dict = field(default_factory=dict, metadata={
        "help": "scheduler options by name (each scheduler's own dataclass, ``SchedulerEntry.options``: "
                "e.g. max_nodes, dyn_topk, profile, threshold); unset ones keep their defaults", "flag": False})

    def scheduler_options(self, name: str):
        """The options of scheduler ``name`` (its own dataclass) from ``self.options``."""
        cls = registry.entry(name).options
        keys = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in self.options.items() if k in keys})

    @classmethod
    def parse(cls, text: str, base: "MethodSpec | None" = None) -> "MethodSpec":
        """A method name -> its spec; ``base`` gives what the name leaves out (default:
        ``MethodSpec()`` with the method's own heads). The grammar, one for the command line,
        the benchmark, the server and the benchmark scripts::

            METHOD[:TREE][+SCHEDULER][@HEADS][/nocopy][/novocab][,NAME=VALUE]...

        NAME is a field of ``MethodSpec`` or of a scheduler's options (``--max-nodes``
        -> ``max_nodes``, dashes or underscores). Example: ``hydra:tree-16+dynamic@runs/h/nocopy,max_nodes=8``
        -> method hydra, tree tree-16, scheduler dynamic, heads runs/h, no copy, options
        {"max_nodes": 8}."""
        text = text.strip()
        body, *assignments = text.split(",")
        spec = dataclasses.replace(base or cls(), options=dict((base or cls()).options))
        flags = set()
        while body.endswith(("/nocopy", "/novocab")):
            body, _, opt = body.rpartition("/")
            flags.add(opt)
        body, at, where = body.partition("@")
        if at and not where:
            raise CadenceError(f"{text}: '@' names no heads directory")
        if "/" in body:
            raise CadenceError(f"unknown method option in {text!r}; the options are /nocopy and /novocab")
        body, _, scheduler = body.partition("+")
        name, _, tree = body.partition(":")
        try:
            spec.method = Method(name.lower())
        except ValueError:
            raise CadenceError(f"unknown method {name!r}; choose from {', '.join(m.value for m in Method)}") from None
        if spec.method in (Method.VANILLA, Method.NGRAM) and (where or "novocab" in flags):
            raise CadenceError(f"{spec.method} has no heads: {'@' + where if where else '/novocab'} does not apply")
        if spec.method is Method.VANILLA and (tree or scheduler or flags):
            raise CadenceError("vanilla takes no tree, scheduler or option")
        if scheduler:
            registry.entry(scheduler)  # an unknown name fails here, before any model is loaded
        spec.tree, spec.scheduler = tree or spec.tree, scheduler or spec.scheduler
        spec.heads = where or spec.heads
        spec.copy = spec.copy and "nocopy" not in flags
        if "novocab" in flags:
            spec.context_vocab = 0
        for item in assignments:
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq:
                raise CadenceError(f"{text}: {item!r} is not NAME=VALUE")
            spec.set(key, value)
        return spec

    def set(self, key: str, value) -> None:
        """Set a MethodSpec field or a scheduler option by name (``value`` a string is converted
        to the field's type); an unknown name is a CadenceError."""
        fields = {f.name: f for f in dataclasses.fields(self) if f.name != "options"}
        option = option_fields().get(key)
        if key not in fields and option is None:
            raise CadenceError(f"unknown method setting {key!r}; settings: "
                               f"{', '.join(sorted([*fields, *option_fields()]))}")
        default = getattr(self, key) if key in fields else option.default
        if isinstance(value, str) and not isinstance(default, str):
            value = _convert(value, type(default), key)
        if key in fields:
            setattr(self, key, value)
        else:
            self.options[key] = value

    def format(self) -> str:
        """The method name ``parse`` reads back to this spec (settings at their defaults left out).
        Example: MethodSpec(method=Method.HYDRA, tree="tree-16", copy=False) -> 'hydra:tree-16/nocopy'."""
        out = self.method.value
        default = MethodSpec()
        if self.tree != default.tree:
            out += f":{self.tree}"
        if self.scheduler != default.scheduler:
            out += f"+{self.scheduler}"
        if self.heads != default.heads:
            out += f"@{self.heads}"
        if not self.copy:
            out += "/nocopy"
        rest = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if f.name not in ("method", "tree", "scheduler", "heads", "copy", "options")
                and getattr(self, f.name) != getattr(default, f.name)]
        rest += [f"{k}={v}" for k, v in sorted(self.options.items()) if v != option_fields()[k].default]
        return ",".join([out, *rest])

    @classmethod
    def from_args(cls, args) -> "MethodSpec":
        """The spec of parsed command-line flags (``add_method_flags``)."""
        spec = from_args(cls, args, options={}, method=Method(cls().method))
        for name, f in option_fields().items():
            value = getattr(args, name, f.default)
            if value != f.default:
                spec.options[name] = value
        return cls.parse(str(getattr(args, "method", spec.method)), spec)


def option_fields() -> dict[str, dataclasses.Field]:
    """Every registered scheduler's option fields by name (schedulers may share a dataclass;
    one name means one setting)."""
    out = {}
    for name in registry.names():
        for f in dataclasses.fields(registry.entry(name).options):
            out.setdefault(f.name, f)
    return out


def add_method_flags(parser) -> None:
    """``MethodSpec``'s flags and every scheduler's options: what ``generate``, ``bench`` and
    ``serve`` offer alike."""
    parser.add_argument("--method", default=MethodSpec().method.value, metavar="METHOD", type=_method_name, help=(
        "a method name, METHOD[:TREE][+SCHEDULER][@HEADS][/nocopy][/novocab][,NAME=VALUE]... (MethodSpec.parse): "
        + MethodSpec.__dataclass_fields__["method"].metadata["help"] + "; what it names overrides the flags below"
        f" (default: {MethodSpec().method.value})"))
    add_fields(parser, MethodSpec, exclude=("method", "options"))
    seen = set()
    for name in registry.names():
        cls = registry.entry(name).options
        if cls not in seen:
            seen.add(cls)
            add_fields(parser, cls)


def _method_name(text: str) -> str:
    """``--method``'s argparse type: a name ``MethodSpec.parse`` reads (else a usage error, exit 2)."""
    try:
        MethodSpec.parse(text)
    except CadenceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _convert(text: str, kind: type, key: str):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return kind(text)
    except ValueError:
        raise CadenceError(f"{key}={text!r}: expected {kind.__name__}") from None


def resolve_heads(backbone, spec: MethodSpec):
    dtype = decode_dtype(backbone, spec.heads_dtype)
    if spec.heads == "random":
        heads = new_heads(spec.method.value, backbone, spec.num_heads, random=True, seed=spec.heads_seed).to(dtype)
        return heads.set_draft_format(spec.draft_weights)
    if spec.heads == "default":
        path = shipped_heads_dir(backbone, spec.method.value)
        if path is None:
            kind = spec.method.value
            raise CadenceError(f"no {kind} heads are shipped for {backbone.name}: train a set with "
                               f"`cadence train --kind {kind} --data DIR --out OUT` and pass --heads OUT/heads "
                               "(or --heads random)")
    else:
        path = heads_path(backbone, spec.heads)
    heads = load_heads(path, backbone, dtype=dtype)
    if heads.cfg.kind != spec.method.value:
        raise CadenceError(f"{path} holds {heads.cfg.kind} heads, but --method is {spec.method.value}")
    return heads.set_draft_format(spec.draft_weights)


# ``--method auto`` takes ngram (context copy + the model's datastore) on a backbone computed from
# GGUF blocks: a forward there is cheap and 8 verify nodes cost 1.4-2.1 of them, so the heads'
# drafting costs about what their extra tokens gain. On dense bf16 (flat verify curve) it takes
# eagle with the shipped eagle-taps set; on dense float32 it keeps hydra, the former default.
# Default model, held-out prompts, 128 tokens, one interleaved `cadence bench` each:
# - GGUF, AMX Xeon (2026-12-08, docs/results/xeon-amx/2026-12-08-method-auto): ngram + datastore 1.36x
#   plain decoding, hydra + datastore 1.27x, eagle-taps + datastore 1.25x, hydra 1.23x; Zen 4 EPYC
#   (2026-12-07): ngram + datastore 1.31x, mtp 1.27x, hydra 1.23x.
# - bf16: AMX (same results) eagle-taps + datastore 1.59x, ngram + datastore 1.64x, hydra + datastore
#   1.55x (56 prompts, 2026-12-07: 1.75x, 1.76x, hydra 1.56x); EPYC (2026-12-07) eagle-taps 1.83x,
#   hydra 1.71x, ngram + datastore 1.70x.
BLOCK_QUANTS = ("gguf", "q8_0", "q4_1", "q4_0")  # backbone.quant values computed from GGUF blocks
BF16_HEADS = (Method.EAGLE, "eagle-taps")  # auto's heads on dense bf16, where that set ships
# trees ngram draws as well (and chain-D); ``--method auto`` with any other (tree-16, auto-N) takes heads
_COPY_TREES = ("auto", "chain")


def resolve_method(backbone, spec: MethodSpec) -> tuple[MethodSpec, str]:
    """``spec`` with its ``auto`` settings settled for ``backbone``, and why, in words (empty where
    nothing was auto). ``method`` auto: the kind of ``--heads DIR``; hydra where the spec asks for
    what only heads do (random heads, a tree preset, a scheduler, ``--no-copy``); ngram where no
    heads ship for the backbone or it computes from GGUF blocks (``BLOCK_QUANTS``); else eagle
    with ``BF16_HEADS`` on bf16 where they ship, hydra otherwise. ``datastore`` auto: the
    backbone's store in a source checkout (``shipped_store_dir``), else off.
    Example: SmolLM2 on its GGUF, MethodSpec() -> method ngram, datastore data/selfdistill/smollm2."""
    why = []
    if spec.method is Method.AUTO:
        method, heads, reason = _auto_method(backbone, spec)
        spec = dataclasses.replace(spec, method=method, heads=heads, options=dict(spec.options))
        why.append(f"--method auto: {method.value}{'' if heads == 'default' else '@' + heads} ({reason})")
    if spec.datastore == "auto":
        store = shipped_store_dir(backbone) if spec.copy and spec.method is not Method.VANILLA else None
        spec = dataclasses.replace(spec, datastore=str(store) if store else "none", options=dict(spec.options))
        if store is not None:
            why.append(f"--datastore auto: {store}")
    return spec, "; ".join(why)


def _auto_method(backbone, spec: MethodSpec) -> tuple[Method, str, str]:
    """The method and heads ``--method auto`` stands for on ``backbone``, and why (``resolve_method``)."""
    if spec.heads not in ("default", "random"):
        kind = heads_kind(heads_path(backbone, spec.heads))
        if kind is None:
            raise CadenceError(f"--heads {spec.heads}: no heads config.json to take the method from; "
                               "name the method (--method hydra | eagle | ...)")
        try:
            return Method(kind), spec.heads, f"the kind of --heads {spec.heads}"
        except ValueError:
            raise CadenceError(f"--heads {spec.heads} holds {kind!r} heads, not a decoding method's") from None
    tree_preset = spec.tree not in _COPY_TREES and not spec.tree.startswith("chain-")
    if spec.heads == "random" or tree_preset or spec.scheduler not in ("auto", "static") or not spec.copy:
        return Method.HYDRA, spec.heads, "the settings ask for heads"
    if shipped_heads_dir(backbone, Method.HYDRA.value) is None:
        return Method.NGRAM, "default", f"no heads ship for {backbone.name}"
    quant = getattr(backbone, "quant", "none")
    if quant in BLOCK_QUANTS:
        return Method.NGRAM, "default", f"{quant} blocks: drafting with heads costs about what it gains there"
    method, name = BF16_HEADS
    if getattr(backbone, "dtype", None) == torch.bfloat16 and shipped_heads_dir(backbone, name) is not None:
        return method, name, "dense bfloat16: the flat verify curve pays attention heads"
    return Method.HYDRA, "default", f"dense {str(getattr(backbone, 'dtype', 'float32')).replace('torch.', '')}"


def make_engine(backbone, spec: MethodSpec, latency: LatencyCurve | None = None) -> Engine:
    """Backbone + heads + drafter + scheduler for ``spec`` (vanilla: no drafter), its ``auto``
    settings settled first (``resolve_method``; the engine keeps the result as ``engine.spec``
    and the reason as ``engine.auto_reason``). Trees are resolved per request
    (``tree_choice.TreePolicy``); ``latency``: this machine's verify curve for ``--tree auto``
    and the adaptive schedulers (default: measured once per machine and cached)."""
    spec, why = resolve_method(backbone, spec)
    engine = _engine(backbone, spec, latency)
    engine.spec, engine.auto_reason = spec, why
    return engine


def _engine(backbone, spec: MethodSpec, latency: LatencyCurve | None) -> Engine:
    """``make_engine`` for a spec with nothing left on auto."""
    if spec.method is Method.VANILLA:
        return Engine(backbone)
    if spec.method is Method.NGRAM:
        return _ngram_engine(backbone, spec, latency)
    heads = resolve_heads(backbone, spec)
    if spec.heads != "random" and spec.tree == "auto" and not heads.policy.calibrated:
        print(f"cadence: the {spec.method.value} heads '{spec.heads}' carry no acceptance table, so they draft "
              f"the top-1 chain of {heads.K} every step; `cadence calibrate --heads DIR --data STORE` measures one "
              "and trees sized for this machine follow", file=sys.stderr)
    if spec.context_vocab < 0:
        raise CadenceError(f"--context-vocab must be >= 0, got {spec.context_vocab}")
    drafter = HeadDrafter(heads, CopyConfig() if spec.copy else None, _copy_depth(heads, spec), spec.context_vocab,
                          datastore=_datastore(spec))
    policy = TreePolicy(spec.tree, heads, drafter, chains_only=getattr(backbone, "chains_only", False))
    if heads.policy.calibrated and (spec.tree == "auto" or spec.scheduler not in ("auto", "static")):
        policy.latency = latency or latency_curve(backbone, verbose=True)
        policy.draft_s = draft_seconds(drafter, backbone.hidden_size, backbone.device, backbone.dtype)
    name = resolve_scheduler_name(spec, heads, policy.latency)
    policy.tree_for(SamplingParams())  # resolve now: a bad --tree fails before any request
    sched = registry.entry(name)
    factory = sched.build(scheduler_context(backbone, heads, drafter, policy, spec, name))
    factory = with_copy_first(factory, spec, policy, drafter)
    engine = Engine(backbone, drafter, factory)
    engine.allow_unverified = sched.lossy  # choosing a lossy scheduler is the opt-in
    engine.tree_policy, engine.scheduler_name = policy, name
    return engine


def with_copy_first(factory, spec: MethodSpec, policy: TreePolicy, drafter):
    """``factory``'s schedulers wrapped in ``CopyFirst`` where ``spec`` asks for it (``copy_first``,
    copies on) and the heads are calibrated (``policy.latency``), else ``factory`` as is. A stateless
    scheduler shared by every request becomes a factory: each request keeps its own arms."""
    if not (spec.copy and spec.copy_first and policy.latency is not None and getattr(drafter, "copy", None)):
        return factory
    inner = factory if not hasattr(factory, "choose") else (lambda sampling: factory)
    depth = drafter.copy_depth
    return lambda sampling: CopyFirst(inner(sampling), CopyChainScheduler(policy.latency, depth, name="copies"),
                                      policy.latency, policy.draft_s)


def scheduler_context(backbone, heads, drafter, policy: TreePolicy, spec: MethodSpec, name: str) -> SchedulerContext:
    """What scheduler ``name`` is built from: the engine's parts and its own options."""
    return SchedulerContext(backbone, heads, drafter, policy, spec.scheduler_options(name),
                            heads_source=spec.heads, method=spec.method.value)


def _ngram_engine(backbone, spec: MethodSpec, latency: LatencyCurve | None = None) -> Engine:
    """The context copy alone (``copy_drafter.CopyDrafter``) on chains: ``--tree auto`` = per step
    the depth (up to ``--copy-depth``) this request's copy acceptance and this machine's verify
    curve pay (``schedulers.copy_chain``), ``chain`` = ``--copy-depth`` copies, ``chain-D`` = D. A
    step whose root has no copy verifies the root alone (plain decoding), so nothing is paid where
    nothing repeats."""
    if spec.scheduler not in ("auto", "static"):
        raise CadenceError(f"ngram drafts a static chain of copies; --scheduler {spec.scheduler} needs heads")
    if not spec.copy:
        raise CadenceError("ngram is the context copy: with --no-copy it has nothing to draft")
    tree = spec.tree
    if tree in ("auto", "chain"):
        depth = spec.copy_depth
    elif tree.startswith("chain-") and tree[len("chain-"):].isdigit() and int(tree[len("chain-"):]) >= 1:
        depth = int(tree[len("chain-"):])
    else:
        raise CadenceError(f"ngram drafts chains: --tree auto | chain | chain-D, not {tree!r}")
    if depth < 1:
        raise CadenceError(f"--copy-depth must be at least 1 for ngram, got {depth}")
    drafter = CopyDrafter(CopyConfig(), depth, _datastore(spec))
    if tree == "auto":
        curve = latency or latency_curve(backbone, verbose=True)
        engine = Engine(backbone, drafter, lambda sampling: CopyChainScheduler(curve, depth))
        engine.tree_policy, engine.scheduler_name = None, "copy-chain"
        return engine
    engine = Engine(backbone, drafter, StaticScheduler(compile_tree(chain(depth), name=f"ngram-{depth}")))
    engine.tree_policy, engine.scheduler_name = None, "static"
    return engine


# ``--scheduler auto`` grows dynamic trees only where 8 verify nodes cost at most this many
# one-token forwards (``latency.ratio(8)``). Where the curve is steeper, as on a GGUF model's
# blocks (1.54-1.85), the dynamic trees' width and extra drafted levels cost more than they
# gain and adaptive's small static candidates pay: Zen 4 EPYC, 28 held-out prompts, one
# interleaved run (``benchmarks/e2e/paths.py``, 2026-12-06): hydra 0.97x -> 1.10x plain decoding,
# eagle-taps 0.99x -> 1.10x; bf16 curves are flat (1.07-1.16) and keep ``dynamic``. With the
# kernel's prefetched weight stream (2026-12-07) the blocks' curve is flat to 4 nodes (1.08-1.10)
# but 1.5-1.65 at 8, and adaptive still won: hydra 1.23x vs 1.06x, eagle-taps 1.26x vs 1.16x.
DYNAMIC_MAX_RATIO8 = 1.4


def resolve_scheduler_name(spec: MethodSpec, heads, latency: LatencyCurve | None = None) -> str:
    """``auto`` -> ``dynamic`` (adaptive's gate + EAGLE-2 dynamic trees at T = 0, adaptive's
    trees at T > 0) for ``--tree auto`` on calibrated heads where this machine's verify curve
    is flat (``DYNAMIC_MAX_RATIO8``; no curve: flat), ``adaptive`` where it is steep, else
    ``static``. Example: T(8) / T(1) 1.07 -> dynamic; 1.69 -> adaptive."""
    if spec.scheduler != "auto":
        return spec.scheduler
    if not (spec.tree == "auto" and heads.policy.calibrated):
        return "static"
    return "adaptive" if latency is not None and latency.ratio(8) > DYNAMIC_MAX_RATIO8 else "dynamic"


def _datastore(spec: MethodSpec):
    """The datastore ``--datastore`` names (built once per process), behind a new ``OnlineStore`` with
    ``--online-store`` (one per engine), or None; refused without copies."""
    if spec.online_store < 0:
        raise CadenceError(f"--online-store must be >= 0 (0 = off), got {spec.online_store}")
    named = spec.datastore not in ("", "none")  # "auto" was settled by resolve_method
    if not (named or spec.online_store):
        return None
    if not spec.copy:
        what = "--datastore" if named else "--online-store"
        raise CadenceError(f"{what} supplies copies: it needs --copy (the method has /nocopy or --no-copy)")
    store = load_datastore(spec.datastore) if named else None
    return OnlineStore(spec.online_store, then=store) if spec.online_store else store


def _copy_depth(heads, spec: MethodSpec) -> int:
    """Deepest level copies may fill: --copy-depth, or deeper if the table for auto-N /
    the tree calibrated with copies reaches further."""
    table = heads.policy.copy_acceptance if spec.copy and spec.tree.startswith("auto") else None
    return max(spec.copy_depth, len(table) if table else 0)
