"""The decoding loop: prefill -> (plan -> draft -> score -> verify -> commit)* per request.

Knows: the order of a step, the KV cache bookkeeping, stopping (EOS, token budget,
stop strings), and statistics. Does not know: how drafts are made (a Drafter), how
much to speculate (a Scheduler), how a tree is scored (``scorer.score``) or how drafts
are accepted (a verification rule). With no drafter it is plain autoregressive
decoding through the very same backbone path ("vanilla").

An ``Engine`` holds only what requests share (backbone, drafter, scheduler factory);
everything that changes while a request decodes lives in its ``Request`` (cache,
context, copy index, scheduler memory, RNG, statistics, text), so several requests can
be in flight on one engine, interleaved step by step.

One step, with ``past`` committed tokens in the cache and ``root`` the backbone's
next token (not yet in the cache), ``h`` the hidden state that produced it:
  1. stop here if committing ``root`` finishes the request (EOS / max tokens);
  2. plan = scheduler.choose(state); its tree is cut to what the drafter can fill
     (copies reach deeper than the heads), to the tokens still allowed and
     to the model's positions; the drafter fills it from (h, root) (a dynamic plan: the
     drafter grows the tree itself, ``draft.grow``; at T > 0 verified as point masses; a
     copies-only plan, ``Plan.copies_only``: copies fill it, no head call; a scheduler with
     ``wants_copy`` sees the root's copy in ``StepState.copy``). A root-alone plan
     may ask for a shadow draft (T = 0): the depth-1 top candidate is drafted (one head
     call, no verify cost) and, once the root's forward gives the true next token,
     the scheduler learns whether it would have been accepted; it is never committed
     (head-drafted shadows may wait for a batch of them: one head call judges them all);
  3. one backbone forward over the N+1 nodes with the tree mask, positions past+depth;
  4. verdict = rule(tree, tokens, logits): accepted nodes (root first) and a bonus;
  5. commit the accepted tokens (cut at EOS, the budget or a stop string), compact the
     cache to them, hand their hidden states to the drafter's per-request state (if it
     has one: attention heads), root <- bonus, h <- hidden state of the last accepted node;
     scheduler.observe(step info) (with the verdicts on a dynamic tree's context copies).
A finished request hands its reply to ``drafter.learn`` (an online store, ``draft.online_store``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from cadence.decode.detok import Detokenizer
from cadence.decode.generation import GenerationConfig, Stats
from cadence.draft.base import Draft
from cadence.draft.context_copy import copy_after
from cadence.draft.copy_drafter import draft_copies
from cadence.errors import CadenceError
from cadence.schedulers.base import Plan, StepInfo, StepState
from cadence.trees.tree import compile_tree, CompiledTree, truncate
from cadence.verify.rules import RULES, unverified, VerifyContext
from cadence.verify.sampling import argmax, probs, sample
from cadence.verify.scorer import score


ROOT_ONLY = compile_tree([], name="root")
SHADOW_CHAIN = compile_tree([(0,)], name="shadow")  # the root and its top depth-1 candidate


def copy_outcomes(tree: CompiledTree, path: list[int], copy_nodes: dict | None) -> tuple:
    """(is a copied run, accepted) for each context copy of a dynamic tree whose parent was
    accepted (the others were never judged). Example: chain root -> 1 -> 2, node 2 a copy
    under a head node, path [0, 1] -> ((False, False),)."""
    if not copy_nodes:
        return ()
    on = set(path)
    return tuple((run, node in on) for node, run in copy_nodes.items() if tree.parents[node] in on)


@dataclass
class PendingStep:
    """A drafted step waiting for its verify forward (``Request.begin_step``)."""

    state: StepState  # what the scheduler saw
    plan: Plan  # what it planned (tree cut to what can be drafted)
    tree: CompiledTree  # the tree that runs (unfilled nodes dropped): N+1 nodes
    tokens: torch.Tensor  # (N+1,) long, node 0 the root
    q: torch.Tensor | None  # (N+1, V) draft distributions (T > 0), else None
    t_step: float  # perf_counter() when the step began
    shadow: int | None = None  # the shadow draft's token (Plan.shadow), checked against the bonus
    shadow_later: torch.Tensor | int | None = None  # a shadow draft deferred to a batch (Plan.shadow_batch):
    #                                                what ``HeadDrafter.shadow_key`` keeps (the root's state, or eagle's entry position)
    rows: int = 1  # requests sharing the verify forward (set by a batched engine)
    copy_nodes: dict | None = None  # dynamic trees: node -> parent is a copy too, for each context copy
    fixed: frozenset = frozenset()  # T > 0: nodes proposed as a point mass (context copies), not drawn from q



def drafter_states(out) -> torch.Tensor:
    """What the drafter commits per position: the backbone's last-layer state (b, n, d), with
    the tapped layers' states appended when the forward tapped some (b, n, d * (1 + n_taps))."""
    if out.taps is None:
        return out.hidden
    return torch.cat([out.hidden, out.taps.flatten(-2).to(out.hidden.dtype)], dim=-1)

class Request:
    """One request in flight: everything that changes while it decodes.

    Iterating yields each step's committed token ids; ``tokens`` are all of them,
    ``text`` the text so far (complete characters, cut at a stop string), ``take_text()``
    the part of it not shown yet that can be shown safely (see ``cadence.decode.detok``).
    """

    def __init__(self, engine, prompt_ids: list[int], cfg: GenerationConfig):  # engine: the ``Engine`` it runs on
        bb = engine.backbone
        if not prompt_ids:
            raise CadenceError("empty prompt")
        limit = bb.max_positions
        if len(prompt_ids) + cfg.max_new_tokens > limit:
            raise CadenceError(
                f"prompt of {len(prompt_ids)} tokens + {cfg.max_new_tokens} new tokens exceeds the "
                f"model's {limit} positions (at most {max(limit - len(prompt_ids), 0)} new tokens fit "
                "after this prompt)")
        if cfg.stop and bb.tokenizer is None:
            raise CadenceError("stop strings need a tokenizer; this backbone has none")
        self.engine, self.prompt_ids, self.cfg = engine, prompt_ids, cfg
        self.sampling = cfg.sampling
        self.rule = RULES[cfg.rule]
        self.generator = torch.Generator(device=bb.device).manual_seed(cfg.seed)
        drafter = engine.drafter
        self.scheduler = engine.new_scheduler(self.sampling) if drafter is not None else None
        self.copies = drafter.new_index() if drafter is not None else None
        # per-request drafter state (attention heads' KV cache); drafters without new_state have none
        new_state = getattr(drafter, "new_state", None)
        self.draft_state = new_state() if new_state is not None else None
        self.detok = Detokenizer(bb.tokenizer, cfg.stop)
        self.stats = Stats()
        self.tokens: list[int] = []
        self.done = False
        self.cache = None  # created at the first step (prefill)
        self.shadow_rows: list[tuple] = []  # deferred shadows: (shadow_key, root, truth)
        self._t0 = 0.0

    @property
    def text(self) -> str:
        return self.detok.text

    def take_text(self) -> str:
        """New text safe to show now (everything that is left once the request is done)."""
        return self.detok.finish() if self.done else self.detok.take()

    def __iter__(self) -> Iterator[list[int]]:
        while not self.done:
            chunk = self.step()
            if chunk:
                yield chunk

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One engine step (the first also prefills); the token ids it committed."""
        if self.done:
            return []
        if self.cache is None:
            self._prefill()
        job = self.begin_step()
        if not isinstance(job, PendingStep):
            return job
        out = score(self.engine.backbone, self.cache, self.past, job.tree, job.tokens, self.engine.taps)
        return self.finish_step(job, out.logits[0], drafter_states(out)[0])

    def begin_step(self) -> "PendingStep | list[int]":
        """Steps 1-2 (see the module docstring): the tree to verify, drafted, as a
        ``PendingStep``; or, when committing the root alone ends the request (EOS, the last
        token of the budget), the committed token ids (no forward needed). Batched engines
        call this, run one forward for many requests, then ``finish_step``."""
        t_step = time.perf_counter()
        remaining = self.cfg.max_new_tokens - len(self.tokens)
        if self.root in self.engine.backbone.eos_token_ids or remaining == 1:
            self.stats.steps += 1
            return self._commit([self.root], force_done=True)
        state = StepState(hidden=self.hidden, root_logits=self.root_logits, step=self.stats.steps,
                          new_tokens=len(self.tokens), past=self.past, sampling=self.sampling,
                          copy=(copy_after(self.root, self.context, self.copies)
                                if getattr(self.scheduler, "wants_copy", False) else None))
        plan = self._plan(state, remaining)
        d = (self._draft_copies(plan.tree) if plan.copies_only
             else self._draft(plan.tree, plan.dynamic, remaining))
        shadow, later = self._shadow(plan)
        return PendingStep(state, plan, d.tree, d.tokens, d.q, t_step, shadow, later, copy_nodes=d.copy_nodes,
                           fixed=d.fixed)

    def finish_step(self, job: "PendingStep", logits: torch.Tensor, hidden: torch.Tensor) -> list[int]:
        """Steps 4-5 for the verify forward's output over ``job.tree``'s N+1 nodes:
        logits (N+1, V), hidden (N+1, d) (extra rows, e.g. a batch's padding, are ignored);
        for a drafter reading taps, (N+1, d * (1 + len(taps))) = ``drafter_states``, of which
        the first d columns are the backbone's last-layer states.
        Verifies, compacts ``self.cache`` to the accepted path, commits; the committed ids."""
        self.stats.forwards += 1
        tree, tokens = job.tree, job.tokens
        logits, hidden = logits[:tree.size], hidden[:tree.size]
        rule = self.rule if job.plan.verify else unverified
        verdict = rule(tree, tokens, logits, VerifyContext(self.sampling, job.q, self.generator, drift=self.cfg.drift,
                                                           top_m=self.cfg.top_m, fixed=job.fixed))
        self.cache.compact(self.past, verdict.path)
        if self.draft_state is not None:  # the accepted path's true states, root first
            self.engine.drafter.commit(self.draft_state, hidden[verdict.path], tokens[verdict.path])
        self.past += len(verdict.path)
        last = hidden[verdict.path[-1]]
        self.hidden = last[:self.engine.backbone.hidden_size] if self.engine.taps else last
        self.root_logits = logits[verdict.path[-1]]
        self.root = verdict.bonus
        committed = self._commit(tokens[verdict.path].tolist())
        shadows = self._judge_shadows(job, verdict.bonus)
        copies = copy_outcomes(tree, verdict.path, job.copy_nodes)
        self._record(job, tree, len(verdict.path) - 1, time.perf_counter() - job.t_step, shadows, copies)
        return committed

    def _prefill(self) -> None:
        bb = self.engine.backbone
        t0 = time.perf_counter()
        self.cache = bb.new_cache()
        out = bb.forward(torch.tensor([self.prompt_ids], device=bb.device), self.cache, need_logits=False,
                         **({"taps": self.engine.taps} if self.engine.taps else {}))
        self.prefilled(out.hidden[0, -1], t0, drafter_states(out)[0])

    def prefilled(self, hidden: torch.Tensor, t0: float, prompt_hidden: torch.Tensor | None = None) -> None:
        """Bookkeeping after the prompt's forward (``self.cache`` holds the prompt):
        hidden (d,) is the last prompt position's state; picks the root token. ``t0``:
        when the request started (its wall time counts from there). prompt_hidden (P, d):
        every prompt position's state, for a drafter with per-request state (attention
        heads); without it such heads draft from h_t and the draft path alone (still lossless)."""
        self._t0 = t0
        self.hidden = hidden
        if self.draft_state is not None:
            if prompt_hidden is None:
                self.draft_state = None
            else:
                self.engine.drafter.commit(self.draft_state, prompt_hidden, self.prompt_ids)
        self.root_logits = self.engine.backbone.logits(self.hidden)
        self.root = self._pick(self.root_logits)
        self.past = len(self.prompt_ids)
        self.context = list(self.prompt_ids)
        self.stats.prefill_s = time.perf_counter() - t0

    def _pick(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(argmax(logits))
        return sample(probs(logits, self.sampling), self.generator)

    def _plan(self, state: StepState, remaining: int) -> Plan:
        """The scheduler's plan, its tree cut to what can be drafted and committed here."""
        if self.scheduler is None:
            return Plan(ROOT_ONLY)
        plan = self.scheduler.choose(state)
        if not plan.verify and not self.engine.allow_unverified:
            raise CadenceError("the scheduler planned an unverified step, but this engine was not opted in "
                               "to lossy unverified commits (Engine.allow_unverified)")
        depth = min(self.engine.drafter.max_depth(self.sampling), remaining - 1)
        return replace(plan, tree=truncate(plan.tree, depth)) if plan.tree.max_depth > depth else plan

    def _shadow(self, plan: Plan) -> tuple[int | None, torch.Tensor | None]:
        """(token, deferred state) of the shadow draft of a root-alone plan that asks for one
        (T = 0 only: at T > 0 a draft would consume the request's random stream); (None, None)
        for none. Example: root r, the heads' (or a context copy's) next guess d; the root's
        forward then gives the true next token b, and the scheduler is told d == b. A guess
        the heads must make waits for ``plan.shadow_batch`` of them (``_judge_shadows``) where
        the drafter batches shadows: (None, ``drafter.shadow_key``)."""
        if not plan.shadow or plan.tree.size != 1 or not self.sampling.greedy:
            return None, None
        drafter = self.engine.drafter
        if getattr(drafter, "batches_shadows", False):
            tok = drafter.shadow_copy(self.root, self.context, self.copies)
            if tok is not None:
                return tok, None
            if plan.shadow_batch > 1:
                return None, drafter.shadow_key(self.hidden, self.context)
            if not getattr(drafter.heads, "attends", False):
                return drafter.shadow_heads(self.hidden[None], [self.root])[0], None
        d = self._draft(SHADOW_CHAIN)
        return (int(d.tokens[1]) if d.tree.size == 2 else None), None

    def _judge_shadows(self, job: PendingStep, truth: int) -> tuple[bool, ...]:
        """Verdicts of the shadow drafts judged now: this step's own (its guess against
        ``truth``, the token after its root), or, once ``job.plan.shadow_batch`` deferred
        ones are pending, all of them in one head call. Example: batch 4, steps 1-3 defer
        (verdicts ()), step 4 drafts the four guesses at once -> 4 verdicts, oldest first."""
        if job.shadow is not None:
            return (job.shadow == truth,)
        if job.shadow_later is None:
            return ()
        self.shadow_rows.append((job.shadow_later, int(job.tokens[0]), truth))
        if len(self.shadow_rows) < job.plan.shadow_batch:
            return ()
        rows, self.shadow_rows = self.shadow_rows, []
        guesses = self.engine.drafter.judge_shadows([k for k, _, _ in rows], [r for _, r, _ in rows],
                                                    self.draft_state, self.hidden, self.context, self.root)
        return () if guesses is None else tuple(g == t for g, (_, _, t) in zip(guesses, rows))

    def _draft(self, tree, dynamic=None, remaining: int = 0) -> Draft:
        """The drafter fills ``tree``; ``Draft.tree`` is the tree that runs (nodes it could not
        fill are gone). ``dynamic``: a ``grow.DynamicTree`` to grow instead, with head
        drafters (then ``tree`` is ignored), at most ``remaining - 1`` levels deep; its context
        copies come back as ``Draft.copy_nodes``."""
        drafter = self.engine.drafter
        if dynamic is not None and hasattr(drafter, "draft_dynamic"):
            return drafter.draft_dynamic(dynamic, self.root, self.hidden, self.context, remaining - 1,
                                         self.copies, self.draft_state, self.sampling)
        if tree.size == 1:
            return Draft(tokens=torch.tensor([self.root], device=self.engine.backbone.device), q=None, tree=tree)
        extra = {"state": self.draft_state} if self.draft_state is not None else {}
        draft = drafter.draft(tree, self.root, self.hidden, self.context, self.sampling, self.generator,
                              self.copies, **extra)
        return draft if draft.tree is not None else replace(draft, tree=tree)

    def _draft_copies(self, tree) -> Draft:
        """A copies-only plan (``Plan.copies_only``): ``tree`` filled by copies, no head call."""
        if self.copies is None:
            raise CadenceError("a copies-only plan needs a drafter with context copies")
        draft = draft_copies(tree, self.root, self.context, self.copies, self.engine.backbone.device)
        return draft if draft.tree is not None else replace(draft, tree=tree)

    def _commit(self, committed: list[int], force_done: bool = False) -> list[int]:
        """Append ``committed`` up to the first EOS, the token budget or a stop string."""
        eos = self.engine.backbone.eos_token_ids
        done = force_done
        for i, t in enumerate(committed):
            self.tokens.append(t)
            stop_hit = self.detok.push(t)
            if t in eos or len(self.tokens) >= self.cfg.max_new_tokens or stop_hit:
                committed, done = committed[:i + 1], True
                break
        self.context.extend(committed)
        self.stats.new_tokens = len(self.tokens)
        self.stats.wall_s = time.perf_counter() - self._t0
        self.done = done
        if done and hasattr(self.engine.drafter, "learn"):  # a shared online store learns the reply
            self.engine.drafter.learn(self.tokens)
        return committed

    def _record(self, job: PendingStep, tree, accepted: int, seconds: float, shadows: tuple[bool, ...],
                copies: tuple = ()) -> None:
        state, plan = job.state, job.plan
        stats = self.stats
        stats.steps += 1
        while len(stats.accepted_at_depth) < accepted:
            stats.accepted_at_depth.append(0)
        for d in range(accepted):
            stats.accepted_at_depth[d] += 1
        stats.unverified_steps += not plan.verify
        info = StepInfo(tree=tree.name, nodes=tree.size, accepted=accepted, seconds=seconds,
                        depth=tree.max_depth, planned=plan.tree.name, verified=plan.verify,
                        entropy=state.entropy if self.engine.trace_entropy or "entropy" in vars(state) else None,
                        shadows=shadows, rows=job.rows, copies=copies)
        stats.step_log.append(info)
        if self.scheduler is not None:
            self.scheduler.observe(info)
