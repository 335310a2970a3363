"""The scheduler interface: what a scheduler sees before a step, what it returns, and
the record of the step it learns from.

A ``Scheduler`` decides one request's steps; it may keep memory (an entropy average,
acceptance estimates), so the engine makes a new one for every request through the
method's ``SchedulerFactory`` (``factory(sampling) -> Scheduler``). The factory also
resolves anything that depends on the request's sampling settings, such as which
tree is valid (context copies only exist at T = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Protocol

import torch

from cadence.backbone.base import Backbone
from cadence.costs.tree_choice import TreePolicy
from cadence.draft.grow import DynamicTree
from cadence.draft.head_drafter import HeadDrafter
from cadence.heads.base import DraftHeads
from cadence.trees.tree import CompiledTree
from cadence.verify.sampling import SamplingParams, entropy


@dataclass
class StepState:
    """What a scheduler sees before drafting a step."""

    hidden: torch.Tensor  # (d,) backbone hidden state that produced the root token
    root_logits: torch.Tensor  # (V,) backbone logits the root token was chosen from
    step: int  # steps taken so far in this request (0 for the first)
    new_tokens: int  # tokens committed so far (prompt excluded)
    past: int  # tokens in the KV cache (prompt + committed, the root excluded)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the request's sampling
    copy: int | None = None  # the copy after the root (context or datastore), for schedulers with
    #                          ``wants_copy`` set; None: no copy there, or not looked up

    @cached_property
    def entropy(self) -> float:
        """Entropy (nats) of the backbone's distribution at the root, computed on demand
        (a full-vocabulary softmax: schedulers that do not ask do not pay for it)."""
        return float(entropy(self.root_logits))


@dataclass(frozen=True)
class Plan:
    """What to do in one step."""

    tree: CompiledTree  # the tree to draft and verify (size 1 = the root alone, no drafts)
    verify: bool = True  # False: commit the drafted chain without a verify pass (lossy, opt-in schedulers only)
    shadow: bool = False  # root-alone plans, T = 0: also draft the depth-1 top candidate, unverified and
    #                       never committed; whether it would have been accepted comes back in StepInfo.shadows
    shadow_batch: int = 1  # head-drafted shadows wait until this many are pending, then run as one head
    #                        call (cheaper per shadow, verdicts later); context copies are judged at once
    copies_only: bool = False  # fill ``tree`` from copies alone, no head call (``copy_drafter.draft_copies``;
    #                            lossless: only which tokens are verified changes)
    dynamic: DynamicTree | None = None  # a ``draft.grow.DynamicTree``: at T = 0 the drafter grows the step's tree from its
    #                         own confidence (EAGLE-2) instead of filling ``tree`` (lossless: verification is unchanged)


@dataclass
class StepInfo:
    """What one engine step did; the engine passes it to ``Scheduler.observe``."""

    tree: str  # name of the tree that ran (after the drafter dropped unfilled nodes)
    nodes: int  # nodes actually verified, root included (width of the verify forward)
    accepted: int  # drafts accepted (committed tokens = accepted + 1)
    seconds: float  # wall time of the step (draft + verify + commit)
    depth: int  # deepest node of the tree that ran
    planned: str = ""  # name of the tree the scheduler planned (differs when nodes were dropped)
    verified: bool = True  # False: the drafts were committed unverified (lossy plan)
    entropy: float | None = None  # nats at the root, when the scheduler asked for it or the engine traces it
    shadows: tuple[bool, ...] = ()  # verdicts of shadow drafts (Plan.shadow) judged in this step, this
    #                                 step's own or earlier ones of a batch: would each have been accepted?
    rows: int = 1  # requests that shared the verify forward (a batch): seconds are then not this step's own
    copies: tuple[tuple[bool, bool], ...] = ()  # dynamic trees: (copied run, accepted) per context copy whose
    #                                             parent was accepted


class Scheduler(Protocol):
    def choose(self, state: StepState) -> Plan:
        """The plan for the next step."""

    def observe(self, info: StepInfo) -> None:
        """Outcome of the step just taken."""


SchedulerFactory = Callable[[SamplingParams], Scheduler]


@dataclass(frozen=True)
class NoOptions:
    """A scheduler without settings of its own."""


@dataclass
class SchedulerContext:
    """What a scheduler builder may use."""

    backbone: Backbone  # the frozen LM (fast or transformers)
    heads: DraftHeads  # the draft heads (``heads.policy`` holds calibration tables)
    drafter: HeadDrafter  # fills and grows the heads' trees
    policy: TreePolicy  # ``--tree`` resolved per request (latency curve, draft cost, tables)
    options: object  # the scheduler's own options (an instance of its ``SchedulerEntry.options``)
    heads_source: str = "default"  # where the heads came from (--heads): small heads are looked up beside them
    method: str = ""  # the head family (--method), to find the shipped small heads


@dataclass(frozen=True)
class SchedulerEntry:
    build: Callable[[SchedulerContext], SchedulerFactory]
    lossy: bool  # may commit drafts without verification
    help: str  # one line for --help and reports
    options: type = NoOptions  # the dataclass of its settings (CLI flags and method-name options derive from it)


SCHEDULERS: dict[str, SchedulerEntry] = {}


def register(name: str, lossy: bool, help: str, options: type = None):
    """Register ``build`` as scheduler ``name`` (called by each scheduler module at import)."""
    def deco(build):
        SCHEDULERS[name] = SchedulerEntry(build, lossy, help, options or NoOptions)
        return build
    return deco
