"""The engine requests share: backbone, drafter and scheduler factory (``Engine``).

Knows: how a request starts (``start``, ``stream``, ``generate``: a ``Request`` each) and how
tokens become text. Does not know a step's order (``request``), how drafts are made (a
Drafter), how much to speculate (a Scheduler) or how drafts are accepted (a rule). With no
drafter it is plain autoregressive decoding through the very same backbone path ("vanilla").
"""

from __future__ import annotations

from contextlib import contextmanager

from cadence.decode.generation import Generation, GenerationConfig
from cadence.decode.request import Request
from cadence.schedulers.base import Scheduler, SchedulerFactory
from cadence.schedulers.static import StaticScheduler


class Engine:
    """Self-speculative decoding on a frozen backbone; any number of requests in flight.

    scheduler: a ``SchedulerFactory`` (``factory(sampling) -> Scheduler``, called once
    per request) or a stateless ``Scheduler`` shared by every request (e.g. a
    ``StaticScheduler``). Default: the top-1 chain of the drafter's heads.
    """

    def __init__(self, backbone, drafter=None, scheduler: Scheduler | SchedulerFactory | None = None):
        self.backbone = backbone
        self.drafter = drafter
        if scheduler is None and drafter is not None:
            scheduler = StaticScheduler.from_preset("chain", drafter.num_heads)
        if scheduler is not None and hasattr(scheduler, "choose"):
            shared = scheduler
            scheduler = lambda sampling: shared  # noqa: E731 - a stateless scheduler serves all
        self.new_scheduler: SchedulerFactory | None = scheduler
        # backbone layers the drafter also reads (eagle heads with taps): every forward taps them
        self.taps: tuple[int, ...] = tuple(getattr(drafter, "taps", ()) or ())
        self.trace_entropy = False  # record the root entropy of every step (a softmax per step)
        self.allow_unverified = False  # opt-in: schedulers may commit drafts without verification (lossy)

    def start(self, prompt_ids: list[int], cfg: GenerationConfig | None = None) -> "Request":
        """A new request (validated, nothing computed yet); iterate it or call ``step``."""
        return Request(self, list(prompt_ids), cfg or GenerationConfig())

    def stream(self, prompt_ids: list[int], cfg: GenerationConfig | None = None) -> "Request":
        """The request as an iterator of newly committed token-id lists; afterwards it
        holds ``tokens``, ``text`` and ``stats``."""
        return self.start(prompt_ids, cfg)

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig | None = None) -> Generation:
        """Run a request to the end."""
        req = self.start(prompt_ids, cfg)
        for _ in req:
            pass
        return Generation(tokens=req.tokens, text=self.final_text(req.tokens, req.cfg.stop), stats=req.stats)

    def final_text(self, tokens: list[int], stop: tuple[str, ...] = ()) -> str:
        """The whole decoded text, cut before the first stop string."""
        text = self.decode(tokens)
        cut = min((text.find(s) for s in stop if s and s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def decode(self, tokens: list[int]) -> str:
        tok = self.backbone.tokenizer
        return tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""


@contextmanager
def not_learning(engine):
    """Within: the engine's finished replies do not reach an online store (``drafter.learning``),
    e.g. for untimed warm-ups."""
    drafter = getattr(engine, "drafter", None)  # bench peers (transformers, llama.cpp) have none
    before = getattr(drafter, "learning", None)
    if before is not None:
        drafter.learning = False
    try:
        yield engine
    finally:
        if before is not None:
            drafter.learning = before
