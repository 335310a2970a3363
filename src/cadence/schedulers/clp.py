"""CLP, the collocation-length predictor (METHODS §5; Backbone-as-Architect): one linear
layer on the backbone state h_t that produced the root predicts how many of the heads'
top-1 drafts are right, L in 0..K, and that sets this step's draft length.

* ``clp`` (lossless): the step verifies the chain of L drafts (L = 0: the root alone, a
  plain decoding step). Only the amount of speculation changes, so the output is that of
  plain decoding (greedy and speculative sampling).
* ``clp-unverified`` (LOSSY, opt-in, the paper's mode): the chain of L drafts is committed
  without checking it (``Plan(chain, verify=False)``). The engine still runs the backbone
  over the chain (to fill the KV cache and get the next root), so this mode saves no
  forward; what it adds over ``clp`` is the drafts that verification would have rejected.

With context copy (greedy) the drafter fills the chain as usual: a node's candidate is
the context copy when there is one, else the head's top-1 **(choice: CLP sets the chain
length only, 0..K, and never reaches past the heads; the copies deeper than K that
static/adaptive trees use are not drafted)**. In the unverified mode the committed chain
is the drafter's (copy first), not necessarily the heads' top-1.

The predictor is ``clp.safetensors`` beside the heads (``--clp PATH`` overrides); train
it with ``cadence train-clp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cadence.errors import CadenceError
from cadence.heads.shipped import heads_path, shipped_heads_dir
from cadence.heads.small import CLP_FILE, load_small
from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.trees.tree import chain, compile_tree


@dataclass(frozen=True)
class CLPOptions:
    """Settings of ``clp`` and ``clp-unverified``; CLI flags and method-name options derive from them."""

    clp: str = field(default="", metadata={"help": "clp schedulers: path of the trained CLP (default: beside the heads)"})


ROOT = compile_tree([], name="root")


class ClpScheduler:
    def __init__(self, clp, max_depth: int, verify: bool = True):
        self.clp, self.verify = clp, verify
        self.plans = [Plan(ROOT)] + [Plan(compile_tree(chain(d), name=f"clp-{d}"), verify)
                                     for d in range(1, max_depth + 1)]
        self.lengths: list[int] = []  # predicted length per step (diagnostics)

    def choose(self, state: StepState) -> Plan:
        length = min(self.clp.predict(state.hidden), len(self.plans) - 1)
        self.lengths.append(length)
        return self.plans[length]

    def observe(self, info: StepInfo) -> None:
        pass


def small_head_path(ctx, explicit: str, name: str) -> Path:
    """``explicit`` if given, else ``name``.safetensors beside the heads' directory."""
    if explicit:
        return Path(explicit)
    if ctx.heads_source == "random":
        raise CadenceError(f"--heads random has no trained {name} head; pass its path (--{name} PATH)")
    if ctx.heads_source == "default":
        folder = shipped_heads_dir(ctx.backbone, ctx.method)
        if folder is None:
            raise CadenceError(f"no {ctx.method} heads are shipped for {ctx.backbone.name}")
        return folder / f"{name}.safetensors"
    return heads_path(ctx.backbone, ctx.heads_source) / f"{name}.safetensors"


def _load_clp(ctx):
    clp = load_small(small_head_path(ctx, ctx.options.clp, CLP_FILE), CLP_FILE, ctx.heads)
    return clp.to(ctx.backbone.device)


@register("clp", lossy=False, options=CLPOptions, help="collocation-length predictor sets each step's chain length 0..K "
                                   "(verified, lossless; needs `cadence train-clp`)")
def build_clp(ctx):
    clp, K = _load_clp(ctx), ctx.heads.K
    return lambda sampling: ClpScheduler(clp, K, verify=True)


@register("clp-unverified", lossy=True, options=CLPOptions, help="LOSSY: commits the CLP-predicted span of drafts WITHOUT "
                                              "verification (the CLP paper's mode; opt-in)")
def build_clp_unverified(ctx):
    clp, K = _load_clp(ctx), ctx.heads.K
    return lambda sampling: ClpScheduler(clp, K, verify=False)
