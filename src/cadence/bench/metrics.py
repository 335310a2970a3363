"""Spec-Bench-style metrics over benchmark records (pure functions, no I/O).

A record is one generation as the runner stores it (a dict)::

    {"task", "key", "method", "repeat", "tokens": [ids, trailing EOS removed],
     "new_tokens": int (EOS counted), "steps": int | None, "wall_s": float,
     "accepted_at_depth": [int, ...], "step_log": {"accepted": [...], "nodes": [...],
     "entropy": [...], "seconds": [...], "depth": [...], "tree": [...]} | None,
     "score": float | None}

Conventions (docs/methods.md section 7):
- tokens/s = total new tokens / total wall time over the records (pooled, not a mean of rates).
- speedup = tokens/s of a method / tokens/s of the baseline (``vanilla``) on the prompts
  (task, key, repeat) both have.
- tau = total new tokens / total steps; its histogram counts steps by tokens committed
  (accepted drafts + 1) from the step logs.
- acceptance per depth d = share of steps that accepted at least d drafts.
- identical-output rate = share of (task, key, repeat) pairs whose token ids equal the baseline's.
- repetition ratio = 1 - distinct 4-grams / total 4-grams of one generation's tokens; the
  task figure is the mean over generations with at least one 4-gram.
- score = mean of the per-generation scores (pass@1 / accuracy).
- slow generation = mean step time over 2x the method's median (``slow_generations``): the
  report notes it, as a sign that something else ran on the CPU.
"""

from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Iterable, Sequence


def repetition_ratio(tokens: Sequence[int], n: int = 4) -> float | None:
    """1 - distinct n-grams / total n-grams; None when there is no n-gram."""
    total = len(tokens) - n + 1
    if total <= 0:
        return None
    grams = {tuple(tokens[i:i + n]) for i in range(total)}
    return 1.0 - len(grams) / total


def tokens_per_s(records: Iterable[dict]) -> float | None:
    recs = list(records)
    tokens = sum(r["new_tokens"] for r in recs)
    seconds = sum(r["wall_s"] for r in recs)
    return tokens / seconds if seconds > 0 else None


def _pair_key(r: dict) -> tuple:
    return (r.get("task"), r["key"], r["repeat"])


def paired(records: Iterable[dict], baseline: Iterable[dict]) -> tuple[list[dict], list[dict]]:
    """The records of both lists whose (task, key, repeat) is present in both, in the same order."""
    base = {_pair_key(r): r for r in baseline}
    mine = [r for r in records if _pair_key(r) in base]
    return mine, [base[_pair_key(r)] for r in mine]


def speedup(records: Iterable[dict], baseline: Iterable[dict]) -> float | None:
    """Ratio of pooled tokens/s on the shared (task, key, repeat) generations."""
    mine, base = paired(records, baseline)
    if not mine:
        return None
    a, b = tokens_per_s(mine), tokens_per_s(base)
    return a / b if a is not None and b else None


def identical_rate(records: Iterable[dict], baseline: Iterable[dict]) -> float | None:
    """Share of shared (task, key, repeat) generations whose generated token ids equal the baseline's."""
    mine, base = paired(records, baseline)
    if not mine:
        return None
    same = sum(1 for r, b in zip(mine, base) if list(r["tokens"]) == list(b["tokens"]))
    return same / len(mine)


def tau(records: Iterable[dict]) -> float | None:
    """Total new tokens / total steps (records without a step count are ignored)."""
    recs = [r for r in records if r.get("steps")]
    steps = sum(r["steps"] for r in recs)
    return sum(r["new_tokens"] for r in recs) / steps if steps else None


def tau_histogram(records: Iterable[dict]) -> dict[int, int]:
    """Steps counted by tokens committed (accepted + 1), from the step logs."""
    hist: Counter = Counter()
    for r in records:
        log = r.get("step_log")
        if log:
            hist.update(a + 1 for a in log["accepted"])
    return dict(sorted(hist.items()))


def acceptance_by_depth(records: Iterable[dict]) -> list[float]:
    """For d = 1..(deepest tree), the share of steps that accepted at least d drafts."""
    recs = [r for r in records if r.get("steps")]
    steps = sum(r["steps"] for r in recs)
    if not steps:
        return []
    depth = max((len(r.get("accepted_at_depth") or []) for r in recs), default=0)
    depth = max([depth] + [max(r["step_log"]["depth"], default=0) for r in recs if r.get("step_log")])
    totals = [0] * depth
    for r in recs:
        for d, n in enumerate(r.get("accepted_at_depth") or []):
            totals[d] += n
    return [t / steps for t in totals]


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def mean_repetition(records: Iterable[dict], n: int = 4) -> float | None:
    return mean(repetition_ratio(r["tokens"], n) for r in records)


def task_score(records: Iterable[dict]) -> float | None:
    return mean(r.get("score") for r in records)


def slow_generations(records: Iterable[dict], factor: float = 2.0, min_steps: int = 8) -> list[dict]:
    """Generations whose mean step took over ``factor`` x their method's median mean step.

    A method's mean step time moves little from prompt to prompt (at most 1.5x over five
    runs, 2026-12-02 to 2026-12-03, 128 new tokens), so a generation at 2x or more was most likely
    slowed by something else on the CPU, and its speedup is not the method's. Example
    (2026-12-03, d7eae0c), hydra: mean steps of 21-32 ms on 39 prompts, 59 ms on one (a few 0.2 s
    steps while another process ran) -> that one is listed, ratio 59 / 23.4 = 2.5.
    Returns [{"method", "task", "key", "ratio"}], worst first; generations without a step
    log or with fewer than ``min_steps`` steps are not judged.
    """
    by: dict[str, list[tuple[dict, float]]] = {}
    for r in records:
        secs = (r.get("step_log") or {}).get("seconds") or []
        if len(secs) >= min_steps:
            by.setdefault(r["method"], []).append((r, sum(secs) / len(secs)))
    out = []
    for method, gens in by.items():
        typical = median(m for _, m in gens)
        for r, m in gens:
            if typical > 0 and m > factor * typical:
                out.append({"method": method, "task": r.get("task"), "key": r["key"], "ratio": m / typical})
    return sorted(out, key=lambda x: -x["ratio"])


def summarize(records: list[dict], baseline: list[dict] | None, compare_outputs: bool = True) -> dict:
    """Every metric of one (task, method) cell; ``baseline`` = the vanilla records of the task.

    ``compare_outputs`` = False (sampling runs) leaves the identical-output rate out: it is
    defined against greedy decoding.
    """
    wall = sum(r["wall_s"] for r in records)
    hist = tau_histogram(records)
    return {
        "generations": len(records),
        "prompts": len({r["key"] for r in records}),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "wall_s": wall,
        "tokens_per_s": tokens_per_s(records),
        "speedup": speedup(records, baseline) if baseline else None,
        "tau": tau(records),
        "tau_histogram": {str(k): v for k, v in hist.items()},
        "acceptance_by_depth": acceptance_by_depth(records),
        "identical_rate": identical_rate(records, baseline) if baseline and compare_outputs else None,
        "score": task_score(records),
        "repetition": mean_repetition(records),
    }
