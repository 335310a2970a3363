"""The decoding loop: prefill -> (draft -> verify -> commit)* as a token generator.

Knows: the order of a step, the KV cache bookkeeping, stopping, and statistics.
Does not know: how drafts are made (a Drafter), which tree to use (a Scheduler),
or how drafts are accepted (a verification rule). With no drafter it is plain
autoregressive decoding through the very same backbone path ("vanilla").

One step, with ``past`` committed tokens in the cache and ``root`` the backbone's
next token (not yet in the cache), ``h`` the hidden state that produced it:
  1. stop here if committing ``root`` finishes the request (EOS / max tokens);
  2. tree = scheduler.choose(), cut to the depth the drafter can fill (copies reach
     deeper than the heads, greedy only); the drafter fills it from (h, root);
  3. one backbone forward over the N+1 nodes with the tree mask, positions past+depth;
  4. verdict = rule(tree, tokens, logits): accepted nodes (root first) and a bonus;
  5. commit the accepted tokens, compact the cache to them, root <- bonus,
     h <- hidden state of the last accepted node; scheduler.observe(step info).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from cadence import kv_cache
from cadence.errors import CadenceError
from cadence.sampling import SamplingParams, entropy, probs, sample
from cadence.schedulers.base import Scheduler, StepInfo
from cadence.schedulers.static import StaticScheduler
from cadence.trees import attention_mask, compile_tree, truncate
from cadence.verify import RULES, Rule, VerifyContext


@dataclass
class GenerationConfig:
    """Per-request decoding settings; CLI flags derive from these fields."""

    max_new_tokens: int = 256  # hard cap on generated tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass (T > 0)
    top_k: int = 0  # top-k sampling (T > 0), 0 = off
    seed: int = 0  # RNG seed for sampling and acceptance tests
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the text contains one
    rule: Rule = Rule.AUTO  # verification rule (AUTO = greedy at T=0, speculative sampling otherwise)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class Stats:
    """Statistics of one generation."""

    new_tokens: int = 0  # tokens generated (EOS included)
    steps: int = 0  # commits; each commits 1 + accepted drafts
    forwards: int = 0  # backbone forwards after prefill
    accepted_at_depth: list[int] = field(default_factory=list)  # steps whose accepted length >= d, d=1..
    prefill_s: float = 0.0  # prompt forward
    wall_s: float = 0.0  # whole request, prefill included
    step_log: list[StepInfo] = field(default_factory=list)  # one record per step

    @property
    def tau(self) -> float:
        """Tokens committed per step (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "forwards": self.forwards,
                "tau": round(self.tau, 4), "accepted_at_depth": self.accepted_at_depth,
                "prefill_s": round(self.prefill_s, 4), "wall_s": round(self.wall_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 3)}


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded)
    text: str  # decoded, special tokens skipped, cut at a stop string
    stats: Stats


ROOT_ONLY = compile_tree([], name="root")


class Engine:
    """Self-speculative decoding of one request at a time on a frozen backbone."""

    def __init__(self, backbone, drafter=None, scheduler: Scheduler | None = None):
        self.backbone = backbone
        self.drafter = drafter
        if scheduler is None:
            scheduler = StaticScheduler(ROOT_ONLY) if drafter is None else \
                StaticScheduler.from_preset("chain", drafter.num_heads)
        self.scheduler = scheduler
        self.last_stats = Stats()

    def _check_prompt(self, prompt_ids: list[int], cfg: GenerationConfig) -> None:
        if not prompt_ids:
            raise CadenceError("empty prompt")
        if cfg.max_new_tokens < 1:
            raise CadenceError("max_new_tokens must be at least 1")
        limit = self.backbone.max_positions
        need = len(prompt_ids) + cfg.max_new_tokens + 64
        if need > limit:
            raise CadenceError(f"prompt of {len(prompt_ids)} tokens + {cfg.max_new_tokens} new tokens "
                               f"exceeds the model's {limit} positions")

    def _pick(self, logits: torch.Tensor, cfg: GenerationConfig, gen) -> int:
        if cfg.sampling.greedy:
            return int(logits.argmax())
        return sample(probs(logits, cfg.sampling), gen)

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], cfg: GenerationConfig | None = None) -> Iterator[list[int]]:
        """Yield lists of newly committed token ids; ``self.last_stats`` holds the statistics."""
        cfg = cfg or GenerationConfig()
        self._check_prompt(prompt_ids, cfg)
        bb, stats = self.backbone, Stats()
        self.last_stats = stats
        gen = torch.Generator(device=bb.device).manual_seed(cfg.seed)
        rule = RULES[cfg.rule]
        eos = bb.eos_token_ids
        t0 = time.perf_counter()
        cache = kv_cache.new_cache(bb)
        ids = torch.tensor([prompt_ids], device=bb.device)
        out = bb.forward(ids, cache, need_logits=False)
        hidden = out.hidden[0, -1]
        root = self._pick(bb.logits(hidden), cfg, gen)
        past = len(prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        context = list(prompt_ids)
        self.scheduler.reset()
        while True:
            if root in eos or stats.new_tokens + 1 >= cfg.max_new_tokens:
                stats.new_tokens += 1
                stats.steps += 1
                stats.wall_s = time.perf_counter() - t0
                yield [root]
                return
            t_step = time.perf_counter()
            tree = self.scheduler.choose() if self.drafter is not None else ROOT_ONLY
            if tree.size > 1:
                tree = truncate(tree, self.drafter.max_depth(cfg.sampling))
                draft = self.drafter.draft(tree, root, hidden, context, cfg.sampling, gen)
                tokens, q, tree = draft.tokens, draft.q, draft.tree or tree
            else:
                tokens, q = torch.tensor([root], device=bb.device), None
            if tree.is_chain:  # causal attention and contiguous positions suffice
                mask = positions = None
            else:
                mask = attention_mask(tree, past, bb.dtype, bb.device)
                positions = (torch.tensor(tree.depths, device=bb.device) + past)[None]
            out = bb.forward(tokens[None], cache, positions, mask)
            stats.forwards += 1
            logits = out.logits[0]
            verdict = rule(tree, tokens, logits, VerifyContext(cfg.sampling, q, gen))
            kv_cache.compact(cache, past, verdict.path)
            committed = tokens[verdict.path].tolist()
            done = False
            for i, t in enumerate(committed):  # cut at EOS / the token budget
                if t in eos or stats.new_tokens + i + 1 >= cfg.max_new_tokens:
                    committed, done = committed[:i + 1], True
                    break
            past += len(verdict.path)
            hidden = out.hidden[0, verdict.path[-1]]
            root = verdict.bonus
            context.extend(committed)
            self._record(stats, tree, len(verdict.path) - 1, float(entropy(logits[0])),
                         time.perf_counter() - t_step, len(committed))
            stats.wall_s = time.perf_counter() - t0
            yield committed
            if done:
                return

    def _record(self, stats: Stats, tree, accepted: int, ent: float, seconds: float, n: int) -> None:
        stats.new_tokens += n
        stats.steps += 1
        while len(stats.accepted_at_depth) < accepted:
            stats.accepted_at_depth.append(0)
        for d in range(accepted):
            stats.accepted_at_depth[d] += 1
        info = StepInfo(tree=tree.name, nodes=tree.size, accepted=accepted, entropy=ent,
                        seconds=seconds, depth=tree.max_depth)
        stats.step_log.append(info)
        self.scheduler.observe(info)

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig | None = None) -> Generation:
        """Run ``stream`` to the end; decode the text and cut it at a stop string."""
        cfg = cfg or GenerationConfig()
        tokens: list[int] = []
        for chunk in self.stream(prompt_ids, cfg):
            tokens.extend(chunk)
            if cfg.stop and self._hit_stop(tokens, cfg.stop):
                break
        stats = self.last_stats
        text = self.decode(tokens)
        for s in cfg.stop:
            if s in text:
                text = text[:text.index(s)]
        return Generation(tokens=tokens, text=text, stats=stats)

    def _hit_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        text = self.decode(tokens)
        return any(s in text for s in stop)

    def decode(self, tokens: list[int]) -> str:
        tok = self.backbone.tokenizer
        return tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""
