"""Confidence-gated unverified commits (PIPO-style; METHODS §5). LOSSY, opt-in.

Each step the scheduler runs the heads' top-1 chain itself (K head steps from h_t and
the root), and the confidence head (``cadence.heads.small.ConfidenceHead``, trained with
``cadence train-confidence``) gives c_k = P(draft k accepted | drafts < k were) from
[h_t ; g_k ; k ; log q_k]. The cumulative confidence C_k = c_1 ... c_k is the estimated
chance that drafts 1..k are all right.

* ``mode="all"`` (default, **choice**): if C_K >= threshold (every draft of the chain
  passes), the K drafts are committed without verification; if any draft is below the
  threshold, the step is a normal verified step on the ``--tree`` plan (lossless step).
* ``mode="prefix"``: the longest prefix with C_k >= threshold (if any) is committed
  unverified; a step whose first draft is below is a normal verified step.

The engine commits the tokens the drafter drafts, so for an unverified step the scheduler
pins its own chain on the drafter (``HeadDrafter.pin``): what is committed is exactly
what was judged (a context copy never replaces a judged draft). As with every unverified
plan the backbone still runs over the chain (cache, next root): an unverified step saves
no forward, it keeps drafts that verification would have rejected.

The root token is needed to draft; at T = 0 it is the argmax of ``state.root_logits``.
At T > 0 the sampled root is not part of ``StepState``, so the scheduler plans normal
verified steps (a lossless fallback), unless the state carries ``root``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cadence.heads.small import CONF_FILE, load_small
from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.schedulers.clp import small_head_path
from cadence.trees.tree import chain, compile_tree
from cadence.verify.sampling import argmax


@dataclass(frozen=True)
class ConfidenceOptions:
    """Settings of ``confidence``; CLI flags and method-name options derive from them."""

    confidence: str = field(default="", metadata={
        "help": "confidence scheduler: path of the trained confidence head (default: beside the heads)"})
    threshold: float = field(default=0.95, metadata={
        "help": "confidence scheduler: commit drafts above this confidence unverified (lossy)"})



class ConfidenceScheduler:
    def __init__(self, heads, head, fallback: Plan, drafter=None, threshold: float = 0.95,
                 mode: str = "all"):
        if mode not in ("all", "prefix"):
            raise ValueError(f"mode must be 'all' or 'prefix', not {mode!r}")
        self.heads, self.head, self.drafter = heads, head, drafter
        self.fallback, self.threshold, self.mode = fallback, threshold, mode
        self.plans = [None] + [Plan(compile_tree(chain(d), name=f"conf-{d}"), verify=False)
                               for d in range(1, heads.K + 1)]
        self.confidences: list[list[float]] = []  # per step: cumulative confidences (diagnostics)

    @torch.inference_mode()
    def chain(self, hidden: torch.Tensor, root: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The heads' top-1 chain from (h_t, root): tokens (root first), features (K, d),
        log q of each draft (K,)."""
        heads = self.heads
        state = heads.init_state(hidden[None])
        token = torch.tensor([root], device=hidden.device)
        tokens, feats, logq = [root], [], []
        for k in range(1, heads.K + 1):
            f, state = heads.step_features(k, state, token)
            lg = heads.draft_logits(f)[0]
            top = int(argmax(lg))
            logq.append(torch.log_softmax(lg, -1)[top])
            token_id = int(heads.draft_vocab[top]) if heads.draft_vocab is not None else top
            tokens.append(token_id)
            feats.append(f[0])
            token = torch.tensor([token_id], device=hidden.device)
        return tokens, torch.stack(feats), torch.stack(logq)

    def choose(self, state: StepState) -> Plan:
        root = getattr(state, "root", None)
        if root is None:
            if not state.sampling.greedy:
                return self.fallback
            root = int(argmax(state.root_logits))
        tokens, feats, logq = self.chain(state.hidden, root)
        cum = self.head.confidence(state.hidden, feats, logq).cumprod(0)
        self.confidences.append([round(float(c), 4) for c in cum])
        passed = int((cum >= self.threshold).long().cumprod(0).sum())
        length = passed if self.mode == "prefix" else (self.heads.K if passed == self.heads.K else 0)
        if length == 0:
            return self.fallback
        if self.drafter is not None and hasattr(self.drafter, "pin"):
            self.drafter.pin(state.hidden, tokens[:length + 1])
        return self.plans[length]

    def observe(self, info: StepInfo) -> None:
        pass


@register("confidence", lossy=True, options=ConfidenceOptions, help="LOSSY: a confidence head (`cadence train-confidence`) commits "
                                          "the heads' chain WITHOUT verification when every draft passes "
                                          "--threshold; other steps verify the --tree plan (opt-in)")
def build_confidence(ctx):
    head = load_small(small_head_path(ctx, ctx.options.confidence, CONF_FILE), CONF_FILE, ctx.heads)
    head = head.to(ctx.backbone.device)
    policy, threshold = ctx.policy, ctx.options.threshold
    return lambda sampling: ConfidenceScheduler(ctx.heads, head, Plan(policy.tree_for(sampling)), ctx.drafter,
                                                threshold)
