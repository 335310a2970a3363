"""The batched speculative engine: one backbone forward verifies every running row's tree.

Knows: continuous batching over ``engine.Request`` objects (each row keeps its own
scheduler, RNG, context-copy index, detokenizer, stop strings, budget and ``Stats``,
exactly as a single request does), the ragged batch KV cache (``BatchKVCache``: rows in
slots 0..B-1, each at its own length), packing trees of different sizes into one
forward (``layout.pack``) and narrowing speculation as the batch grows (``narrow``).
Does not know: HTTP, how drafts are made or accepted (the row's ``Request`` does that
with the engine's drafter and ``verify.RULES``), or which tree a row wants.

One ``step()``:
  1. admit queued requests into free slots: their prompts go straight into the row's
     slot; the row's root token is picked as ``Request`` picks it. With
     ``prefill_chunk`` = 0, or when no row is running, each admitted prompt is one
     forward; otherwise the step spends at most ``prefill_chunk`` prompt tokens
     (``cadence.batch.prefill``), one request at a time, and a request joins the running
     rows once its whole prompt is in (the slot after theirs holds it meanwhile);
  2. every running row drafts its step (``Request.begin_step``) with its tree capped at
     ``narrow.cap(B)`` nodes, or 1 (the root alone) where whole steps at B rows measured faster
     that way (``step_rates``); a row whose root alone ends it (EOS, last token of its
     budget) commits without a forward and leaves;
  3. one ``FastBackbone.forward_rows`` over the B rows' padded trees (logits only for
     real nodes);
  4. every row verifies its own nodes and compacts its own cache row
     (``Request.finish_step``); finished rows leave, and the last row moves into each
     freed slot so the running rows stay contiguous.
Per row, the order of operations and of random draws is that of ``Engine.generate``, so
a row's output is the single request's output (greedy: up to float rounding of a
batched forward, which can only matter at an exact near-tie; sampling: the same draws
from the same per-request generator).

Rows are isolated: whatever one row's request raises (in its prefill, drafting,
verification or commit) ends that request alone with an error event (400 for a
``CadenceError``: its own input; else 500), and the step goes on for the others. A
batched forward that raises is re-run one row at a time, so only the rows it fails on end.

Backbones: ``cadence.fast.FastBackbone`` only (Llama / Mistral / Qwen2 / Qwen3, the
default on CPU). Any other backbone is refused with a ``CadenceError`` that points to
``cadence.batch.serial.SerialEngine`` (one forward per request, any backbone); there is
no silent fallback.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from cadence.batch.api import Event, failed
from cadence.batch.layout import pack
from cadence.batch.narrow import batch_latency, CappedScheduler, NarrowConfig, Narrowing
from cadence.batch.prefill import Prefill
from cadence.batch.step_rates import ROOT, SPECULATE, StepRates
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.decode.request import drafter_states, PendingStep, Request
from cadence.errors import CadenceError
from cadence.schedulers.base import SchedulerFactory
from cadence.trees.budget import MAX_NODES

INITIAL_CAPACITY = 256  # per-row cache entries before the first doubling
log = logging.getLogger(__name__)


@dataclass
class _Row:
    rid: int
    req: Request
    slot: int = -1  # index in the batch cache while running (or while its prompt goes in)
    prefill: Prefill | None = None  # set while the prompt is entering the cache in chunks


class BatchEngine:
    """``MultiEngine`` with one batched forward per step over all running rows.

    backbone: a ``FastBackbone``. drafter / scheduler: as ``engine.Engine`` (scheduler: a
    ``SchedulerFactory`` or a stateless ``Scheduler``; default the drafter's top-1 chain).
    narrow: how speculation narrows with the batch size; latency: this machine's
    ``narrow.BatchLatency`` (measured and cached on first use when ``narrow.mode`` is
    auto and there is a drafter); draft_s: seconds per drafted level (from the engine's
    tree policy when built with ``from_engine``). prefill_chunk: most prompt tokens a step
    spends on admitting requests while other rows are running (0 = a whole prompt per
    forward, however long; see ``cadence.batch.prefill``).
    """

    def __init__(self, backbone, drafter=None, scheduler=None, max_batch: int = 8,
                 narrow: NarrowConfig | None = None, latency=None, draft_s: float = 0.0,
                 tree_policy=None, allow_unverified: bool = False, prefill_chunk: int = 0):
        if not hasattr(backbone, "forward_rows"):
            raise CadenceError(
                f"BatchEngine needs the fast backend (cadence.fast.FastBackbone: Llama, Mistral, Qwen2/3); "
                f"{type(backbone).__name__} ({getattr(backbone, 'name', '?')}) has no batched forward. "
                "Use cadence.batch.serial.SerialEngine (one forward per request, any backbone) instead")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise CadenceError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise CadenceError(f"prefill_chunk must be an integer >= 0 (0 = whole prompts), got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.engine = Engine(backbone, drafter, scheduler)  # what rows share (Request reads it)
        self.engine.allow_unverified = allow_unverified
        self.backbone, self.drafter, self.max_batch = backbone, drafter, max_batch
        self.tree_policy = tree_policy
        self.narrow_cfg = narrow or NarrowConfig()
        if latency is None and drafter is not None and self.narrow_cfg.mode == "auto":
            latency = batch_latency(backbone, verbose=True)
        self.narrowing = Narrowing(self.narrow_cfg, latency, draft_s, drafter.num_heads if drafter else 1)
        cfg = self.narrow_cfg
        self.step_rates = StepRates() if drafter is not None and cfg.mode == "auto" and cfg.measured else None
        self._mode = SPECULATE  # this step's choice (step_rates)
        self.cache = backbone.new_batch_cache(max_batch, capacity=INITIAL_CAPACITY)
        self.cache.max_positions = backbone.max_positions + MAX_NODES  # room for padded dummy nodes
        self.rows: list[_Row] = []  # running; rows[i].slot == i
        self.waiting: deque[_Row] = deque()
        self.filling: _Row | None = None  # the request whose prompt is entering slot len(rows)
        self._next = 0

    @classmethod
    def from_engine(cls, engine: Engine, max_batch: int = 8, **kwargs) -> "BatchEngine":
        """The batched twin of an engine built by ``methods.make_engine`` (same drafter,
        scheduler factory, tree policy and lossy opt-in)."""
        policy = getattr(engine, "tree_policy", None)
        kwargs.setdefault("draft_s", getattr(policy, "draft_s", 0.0) if policy is not None else 0.0)
        return cls(engine.backbone, engine.drafter, engine.new_scheduler, max_batch, tree_policy=policy,
                   allow_unverified=engine.allow_unverified, **kwargs)

    # -- the MultiEngine protocol ----------------------------------------------------------
    def add(self, prompt_ids: list[int], cfg: GenerationConfig,
            scheduler: SchedulerFactory | None = None) -> int:
        req = Request(self.engine, list(prompt_ids), cfg)  # validates (CadenceError)
        if scheduler is not None and self.drafter is not None:
            req.scheduler = scheduler(req.sampling)
        if req.scheduler is not None:
            req.scheduler = CappedScheduler(req.scheduler)
        rid, self._next = self._next, self._next + 1
        self.waiting.append(_Row(rid, req))
        return rid

    def abort(self, rid: int) -> None:
        for row in self.waiting:
            if row.rid == rid:
                self.waiting.remove(row)
                return
        if self.filling is not None and self.filling.rid == rid:
            self._drop_filling()
            return
        for row in self.rows:
            if row.rid == rid:
                self._leave(row)
                return

    def cut(self, rid: int) -> Event | None:
        row = next((r for r in list(self.waiting) + self.rows + [self.filling] if r is not None and r.rid == rid),
                   None)
        if row is None:
            return None
        row.req.done = True
        ev = Event(rid=rid, tokens=[], text=row.req.take_text(), finished=True, finish_reason="length",
                   stats=row.req.stats)
        self.abort(rid)
        return ev

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting or self.filling)

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def queued(self) -> int:
        """Requests not decoding yet: waiting for a slot, or with their prompt going in."""
        return len(self.waiting) + (self.filling is not None)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One step (see the module docstring). A row that fails (its prefill, drafting,
        verification or commit raises, or the batched forward fails on it alone) ends with
        an error event (``api.failed``); the others go on as if it had never run."""
        events = self._admit()
        t0, batch, done = time.perf_counter(), len(self.rows), len(events)
        self._mode = SPECULATE
        if self.step_rates is not None and batch >= self.narrow_cfg.min_batch:
            self._mode = self.step_rates.mode(batch)
        jobs: dict[int, PendingStep] = {}
        for row in list(self.rows):
            try:
                self._set_cap(row)
                job = row.req.begin_step()
                if isinstance(job, PendingStep):
                    jobs[row.rid] = job
                    continue
                events.append(self._event(row, job, None))  # the root alone finished it: no forward
            except Exception as exc:  # noqa: BLE001 - this row's failure, not the step's
                events.append(self._fail(row, exc))
                continue
            self._leave(row)
        if self.rows:
            events.extend(self._verify([(row, jobs[row.rid]) for row in self.rows]))
        if self.step_rates is not None and batch >= self.narrow_cfg.min_batch:
            self.step_rates.record(batch, self._mode, sum(len(ev.tokens) for ev in events[done:]),
                                   time.perf_counter() - t0)
        return events

    # -- internals ---------------------------------------------------------------------------
    def _admit(self) -> list[Event]:
        """Queued requests take free slots and their prompts go in: whole prompts when no
        row is running or ``prefill_chunk`` is 0, else at most ``prefill_chunk`` prompt
        tokens this step (a prompt may take several steps; the next one starts when it is
        in). A prefill that fails ends its request (an error event) and frees the slot."""
        events = []
        budget = self.prefill_chunk if self.rows else 0  # 0: no limit this step
        spent = 0
        while True:
            if self.filling is None:
                if not self.waiting or len(self.rows) >= self.max_batch:
                    break
                self._start_filling(self.waiting.popleft())
            row = self.filling
            try:
                spent += row.prefill.advance(self.backbone, self.cache, budget - spent if budget else 0,
                                             self.engine.taps)
                if row.prefill.remaining == 0:
                    row.prefill.finish()
            except Exception as exc:  # noqa: BLE001 - this request's failure
                self._drop_filling()
                events.append(self._fail(row, exc, running=False))
                continue
            if row.prefill.remaining:
                break  # this step's budget is spent
            row.prefill, self.filling = None, None
            self.rows.append(row)
            if budget and spent >= budget:
                break
        return events

    def _start_filling(self, row: _Row) -> None:
        """``row`` takes the slot after the running rows; its prompt goes in from there."""
        row.slot = len(self.rows)
        self.cache.lengths[row.slot] = 0
        row.req.cache = self.cache.row(row.slot)
        row.prefill = Prefill(row.req, row.slot)
        self.filling = row

    def _drop_filling(self) -> None:
        """The request whose prompt is going in leaves (aborted, cut or failed); its slot is freed."""
        row, self.filling = self.filling, None
        self.cache.lengths[row.slot] = 0
        row.slot, row.prefill = -1, None

    def _set_cap(self, row: _Row) -> None:
        sched = row.req.scheduler
        if sched is None:
            return
        sampling = row.req.sampling
        copying = getattr(self.drafter, "copy", None) is not None
        table = self.tree_policy.table(copying) if self.tree_policy is not None else None
        sched.cap = self.narrowing.cap(len(self.rows), table, self.drafter.max_depth(sampling))
        if self._mode == ROOT:
            sched.cap = 1

    def _verify(self, work: list[tuple[_Row, PendingStep]]) -> list[Event]:
        """One forward over every row's tree, then each row verifies and commits. Should the
        forward fail, each row is run alone, so that only the rows it fails on end."""
        try:
            logits, states = self._forward(work, 0)
        except Exception:  # noqa: BLE001 - find the rows it fails on
            log.warning("batched verify forward failed; running its %d rows one at a time", len(work),
                        exc_info=True)
            logits, states = None, None
        events, ended, offset = [], [], 0
        for b, (row, job) in enumerate(work):
            m = job.tree.size
            try:
                if logits is None:
                    row_logits, row_states = self._forward([(row, job)], row.slot)
                    row_states = row_states[0]
                else:
                    row_logits, row_states = logits[offset:offset + m], states[b]
                job.rows = len(work)
                committed = row.req.finish_step(job, row_logits, row_states[:m])
                events.append(self._event(row, committed, job))
            except Exception as exc:  # noqa: BLE001 - this row's failure
                events.append(self._fail(row, exc, leave=False))
                ended.append(row)
            offset += m
        for row, _ in work:
            if row.req.done or row in ended:
                self._leave(row)
        return events

    def _forward(self, work: list[tuple[_Row, PendingStep]], first: int):
        """The verify forward of ``work``'s rows (in slots ``first``..): the logits of their
        real nodes, row after row, and the drafter states (B, n, ...)."""
        p = pack([row.req.past for row, _ in work], [job.tree for _, job in work],
                 [job.tokens for _, job in work], self.backbone.device)
        out = self.backbone.forward_rows(p.tokens, self.cache, first, p.starts, p.positions, p.mask,
                                         need_logits=False, taps=self.engine.taps)
        states = drafter_states(out)  # (B, n, d) or, for a drafter reading taps, (B, n, d * (1 + taps))
        n = p.tokens.shape[1]
        real = torch.cat([torch.arange(m) + b * n for b, m in enumerate(p.sizes)]).to(out.hidden.device)
        return self.backbone.logits(out.hidden.reshape(-1, out.hidden.shape[-1])[real]), states

    def _fail(self, row: _Row, exc: Exception, running: bool = True, leave: bool = True) -> Event:
        """The error event of ``row``, whose request raised ``exc``; it leaves the batch
        (now, or when ``leave`` is False, by the caller once the step's rows are done)."""
        log.error("request %d failed: %s: %s", row.rid, type(exc).__name__, exc,
                  exc_info=not isinstance(exc, CadenceError))
        row.req.done = True
        if running and leave:
            self._leave(row)
        return failed(row.rid, exc, row.req.stats)

    def _event(self, row: _Row, committed: list[int], job: PendingStep | None) -> Event:
        req = row.req
        accepted = req.stats.step_log[-1].accepted if job is not None else 0
        ev = Event(rid=row.rid, tokens=list(committed), text=req.take_text(), finished=req.done,
                   drafted=job.tree.size - 1 if job is not None else 0, accepted=accepted,
                   accepted_at=[1] * accepted)
        if req.done:
            ev.finish_reason = self._reason(req)
            ev.stats = req.stats
        return ev

    def _reason(self, req: Request) -> str:
        if req.detok.stopped or (req.tokens and req.tokens[-1] in self.backbone.eos_token_ids):
            return "stop"
        return "length"

    def _leave(self, row: _Row) -> None:
        """Free ``row``'s slot: the last running row moves into it."""
        slot, last = row.slot, self.rows[-1]
        self.rows.pop()
        if last is not row:
            self.cache.move(last.slot, slot)
            last.slot = slot
            last.req.cache.slot = slot
            self.rows[slot] = last
        else:
            self.cache.lengths[slot] = 0
        row.slot = -1
        if self.filling is not None and self.filling.slot != len(self.rows):  # keep it right after the rows
            fill, dst = self.filling, len(self.rows)
            self.cache.move(fill.slot, dst)
            fill.slot = fill.prefill.slot = fill.req.cache.slot = dst
