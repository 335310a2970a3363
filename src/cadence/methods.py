"""Named decoding methods -> ready engines. Shared by the CLI, the benchmark and the server.

A method is a head family (or none, for ``vanilla``) plus where its heads come from
(``default`` = heads shipped for the default model, ``random``, or a directory) and a
tree preset. ``make_engine`` is the one place that assembles backbone + heads +
drafter + scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from cadence.context_copy import CopyConfig
from cadence.copy_drafter import CopyDrafter
from cadence.drafter import HeadDrafter
from cadence.engine import Engine
from cadence.errors import CadenceError
from cadence.heads import load_heads, new_heads
from cadence.heads.io import decode_dtype
from cadence.latency import LatencyCurve, load_or_measure
from cadence.sampling import SamplingParams
from cadence.schedulers import registry
from cadence.schedulers.registry import SchedulerContext
from cadence.schedulers.static import StaticScheduler
from cadence.trees import chain, compile_tree
from cadence.tree_policy import TreePolicy, draft_seconds

SHIPPED_HEADS = Path(__file__).parent / "assets" / "heads"
SHIPPED_FOR = {"SmolLM2-135M-Instruct": "smollm2"}  # backbone name -> folder under assets/heads


class Method(str, Enum):
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
    """How to decode; CLI flags derive from these fields."""

    method: Method = field(default=Method.HYDRA, metadata={
        "help": "vanilla | medusa | hydra | mtp | eagle | eagle3 | mtp-attn | ngram (context copy alone: any model, no heads)"})
    heads: str = field(default="default", metadata={
        "help": "default (shipped for the model and --method) | random | a heads directory | the name of a "
                "set shipped for the model (SmolLM2: eagle-taps; see the model card)"})
    tree: str = field(default="auto", metadata={"help": "auto (the tree of highest expected tokens/s from the heads' calibrated acceptance and this machine's measured verify latency; may be the root alone), auto-N (N nodes grown from the calibrated acceptance), or a preset: root, chain, chain-D, tree-N"})
    num_heads: int = field(default=3, metadata={"help": "K for --heads random"})
    copy: bool = field(default=True, metadata={"help": "rank the context copy (token after the same n-gram earlier) first (T > 0: verified as a point-mass proposal, still lossless)"})
    copy_depth: int = field(default=8, metadata={"help": "deepest tree level a context copy may fill (presets; calibrated trees say their own)"})
    heads_dtype: str = field(default="auto", metadata={
        "help": "dtype the heads draft in: auto (bfloat16 on a bfloat16 backbone, else float32), float32, bfloat16; "
                "drafts only: the output is the same either way"})
    heads_seed: int = field(default=0, metadata={"help": "seed for --heads random"})
    context_vocab: int = field(default=256, metadata={
        "help": "heads with a draft vocabulary may also draft up to N of the request's own tokens "
                "outside it, most recent first (names, numbers, loops; lossless); 0 = off"})
    scheduler: str = field(default="auto", metadata={
        "help": "how much to speculate each step: auto (dynamic with --tree auto on calibrated heads, "
                "else static), or one of `cadence.schedulers.registry.names()`: static (--tree), "
                "adaptive, adaptive-k, entmtp, dynamic (lossless); lossy, opt-in: clp-unverified, confidence"})
    profile: str = field(default="general", metadata={
        "help": "entmtp: acceptance profile (general | humaneval | gsm8k | sharegpt | writing)"})
    ent_window: int = field(default=1, metadata={
        "help": "entmtp-adaptive: steps of root entropy averaged to pick the bin (1 = the current root)"})
    clp: str = field(default="", metadata={"help": "clp schedulers: path of the trained CLP (default: beside the heads)"})
    confidence: str = field(default="", metadata={
        "help": "confidence scheduler: path of the trained confidence head (default: beside the heads)"})
    dyn_topk: int = field(default=4, metadata={
        "help": "dynamic scheduler: children per expanded node and nodes expanded per level (EAGLE-2's top-k)"})
    dyn_nodes: int = field(default=64, metadata={
        "help": "dynamic scheduler: most draft nodes verified per step; this machine's verify latency "
                "curve cuts each step's tree to the size that pays (fewer nodes), so the cap rarely binds"})
    dyn_depth: int = field(default=0, metadata={
        "help": "dynamic scheduler: levels the heads draft (0 = their K); eagle's layer serves any depth, "
                "other heads stop at K"})
    dyn_sampled: bool = field(default=False, metadata={
        "help": "dynamic scheduler at T > 0: grow dynamic trees verified as point masses (lossless) instead of "
                "adaptive's trees of i.i.d. draws from q (slower on the Zen 4 EPYC, 2026-12-03: hydra 1.26x "
                "against 1.53x at T = 0.7)"})
    copy_conf: float = field(default=0.4, metadata={
        "help": "dynamic scheduler: a context copy's value relative to its parent (at least; the heads' "
                "probability when higher)"})
    copy_run_conf: float = field(default=0.7, metadata={
        "help": "dynamic scheduler: the same for a copy whose parent is a copy (a copied run tends to go on)"})
    threshold: float = field(default=0.95, metadata={
        "help": "confidence scheduler: commit drafts above this confidence unverified (lossy)"})


def shipped_heads_dir(backbone, kind: str) -> Path | None:
    folder = SHIPPED_FOR.get(backbone.name)
    if folder is None:
        return None
    path = SHIPPED_HEADS / folder / kind
    return path if (path / "config.json").is_file() else None


def shipped_names() -> list[str]:
    """Every heads set shipped for any backbone, by folder name (``eagle``, ``eagle-taps``, ...)."""
    return sorted({p.parent.name for p in SHIPPED_HEADS.glob("*/*/config.json")})


def heads_path(backbone, heads: str) -> Path:
    """``--heads`` as a directory: a path that exists, else a set shipped for ``backbone`` by
    name (``eagle-taps`` -> assets/heads/smollm2/eagle-taps), else the path (load_heads says
    it is not a heads directory)."""
    path = Path(heads)
    if path.exists() or "/" in heads:
        return path
    return shipped_heads_dir(backbone, heads) or path


def resolve_heads(backbone, spec: MethodSpec):
    dtype = decode_dtype(backbone, spec.heads_dtype)
    if spec.heads == "random":
        return new_heads(spec.method.value, backbone, spec.num_heads, random=True, seed=spec.heads_seed).to(dtype)
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
    return heads


def make_engine(backbone, spec: MethodSpec, latency: LatencyCurve | None = None) -> Engine:
    """Backbone + heads + drafter + scheduler for ``spec`` (vanilla: no drafter). Trees are
    resolved per request (``tree_policy.TreePolicy``); ``latency``: this machine's verify
    curve for ``--tree auto`` and the adaptive schedulers (default: measured once per
    machine and cached)."""
    if spec.method is Method.VANILLA:
        return Engine(backbone)
    if spec.method is Method.NGRAM:
        return _ngram_engine(backbone, spec)
    heads = resolve_heads(backbone, spec)
    if spec.context_vocab < 0:
        raise CadenceError(f"--context-vocab must be >= 0, got {spec.context_vocab}")
    drafter = HeadDrafter(heads, CopyConfig() if spec.copy else None, _copy_depth(heads, spec), spec.context_vocab)
    policy = TreePolicy(spec.tree, heads, drafter, chains_only=getattr(backbone, "chains_only", False))
    name = resolve_scheduler_name(spec, heads)
    if (spec.tree == "auto" or name != "static") and heads.policy.calibrated:
        policy.latency = latency or load_or_measure(backbone, verbose=True)
        policy.draft_s = draft_seconds(drafter, backbone.hidden_size, backbone.device, backbone.dtype)
    policy.tree_for(SamplingParams())  # resolve now: a bad --tree fails before any request
    sched = registry.entry(name)
    engine = Engine(backbone, drafter, sched.build(SchedulerContext(backbone, heads, drafter, policy, spec)))
    engine.allow_unverified = sched.lossy  # choosing a lossy scheduler is the opt-in
    engine.tree_policy, engine.scheduler_name = policy, name
    return engine


def _ngram_engine(backbone, spec: MethodSpec) -> Engine:
    """The context copy alone (``copy_drafter.CopyDrafter``) on a static chain: ``--tree auto``
    or ``chain`` = ``--copy-depth`` copies, ``chain-D`` = D. A step whose root has no copy
    verifies the root alone (plain decoding), so nothing is paid where nothing repeats."""
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
    engine = Engine(backbone, CopyDrafter(CopyConfig(), depth),
                    StaticScheduler(compile_tree(chain(depth), name=f"ngram-{depth}")))
    engine.tree_policy, engine.scheduler_name = None, "static"
    return engine


def resolve_scheduler_name(spec: MethodSpec, heads) -> str:
    """``auto`` -> ``dynamic`` (adaptive's gate + EAGLE-2 dynamic trees at T = 0, adaptive's
    trees at T > 0) for ``--tree auto`` on calibrated heads, else ``static``."""
    if spec.scheduler != "auto":
        return spec.scheduler
    calibrated = heads.policy.calibrated
    return "dynamic" if spec.tree == "auto" and calibrated else "static"


def _copy_depth(heads, spec: MethodSpec) -> int:
    """Deepest level copies may fill: --copy-depth, or deeper if the table for auto-N /
    the tree calibrated with copies reaches further."""
    table = heads.policy.copy_acceptance if spec.copy and spec.tree.startswith("auto") else None
    return max(spec.copy_depth, len(table) if table else 0)
