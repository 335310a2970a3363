"""Quality measures of a PIPO student that need the student itself (the benchmark script
``benchmarks/e2e/pipo_bench.py`` times and aggregates them).

Knows: teacher-forced NLL of reference replies under the student in either mode (and under
the unmodified backbone, the baseline), and agreement of two token sequences. Does not time
anything.
"""

from __future__ import annotations

import math

import torch

from cadence.pipo.groups import PAIR, PLAIN, pack, pad_batch, prompt_groups, starts


def reply_groups(n: int, mode: str) -> list[int]:
    """Group sizes of an n-token reply read in ``mode``: plain tokens (prompt) or pairs (pairs;
    an odd reply ends with a plain position)."""
    if mode == "prompt":
        return [PLAIN] * n
    return [PAIR] * (n // 2) + [PLAIN] * (n % 2)


@torch.no_grad()
def reply_nll(student, items: list[tuple[list[int], list[int]]], mode: str, batch: int = 8) -> dict:
    """Mean negative log-likelihood (nats per reply token) of the replies in ``items`` (prompt ids,
    reply ids) given their prompts. ``mode``: ``plain`` (the unmodified backbone, no compression),
    ``prompt`` (compressed prompt, plain reply positions: the LM head predicts every token) or
    ``pairs`` (reply read as pairs: the first token of each group from the LM head, the second
    from the pair head given the true first)."""
    total, count = 0.0, 0
    dev = student.base.device
    for k in range(0, len(items), batch):
        chunk = items[k:k + batch]
        if mode == "plain":
            T = max(len(p) + len(r) for p, r in chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.long, device=dev)
            mask = torch.zeros_like(ids)
            for i, (p, r) in enumerate(chunk):
                ids[i, :len(p) + len(r)] = torch.tensor(p + r)
                mask[i, :len(p) + len(r)] = 1
            hid = student.base.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for i, (p, r) in enumerate(chunk):
                lq = torch.log_softmax(student.lm_logits(hid[i, len(p) - 1:len(p) + len(r) - 1]), -1)
                total -= float(lq.gather(-1, torch.tensor(r, device=dev)[:, None]).sum())
                count += len(r)
            continue
        sizes = [prompt_groups(len(p)) + reply_groups(len(r), mode) for p, r in chunk]
        packed = [pack(p + r, z) for (p, r), z in zip(chunk, sizes)]
        ids, sz, mask, pos = (t.to(dev) for t in pad_batch(packed, left=False))
        hid = student.run(student.latents(ids, sz), ((sz == PAIR) & (mask == 1)).float(), None, pos, mask)
        for i, ((p, r), z) in enumerate(zip(chunk, sizes)):
            toks, lp = p + r, len(p)
            rows, tgt, pair_rows, pair_prev, pair_tgt = [], [], [], [], []
            for g, (st, n) in enumerate(zip(starts(z), z)):
                t1 = st + n
                if lp <= t1 < len(toks):
                    rows.append(g)
                    tgt.append(toks[t1])
                    if g + 1 < len(z) and z[g + 1] == PAIR:  # the next group's second token
                        pair_rows.append(g)
                        pair_prev.append(toks[t1])
                        pair_tgt.append(toks[t1 + 1])
            h = hid[i, rows]
            lq = torch.log_softmax(student.lm_logits(h), -1)
            total -= float(lq.gather(-1, torch.tensor(tgt, device=dev)[:, None]).sum())
            count += len(tgt)
            if pair_rows:
                g2 = student.pair_state(hid[i, pair_rows], torch.tensor(pair_prev, device=dev))
                lq2 = torch.log_softmax(student.lm_logits(g2), -1)
                total -= float(lq2.gather(-1, torch.tensor(pair_tgt, device=dev)[:, None]).sum())
                count += len(pair_tgt)
    return {"nll": total / max(count, 1), "ppl": math.exp(min(total / max(count, 1), 50.0)), "tokens": count}


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """How far ``tokens`` follow ``reference`` (plain greedy output): identical, length of the
    common prefix, and the share of the reference's positions matched before the first divergence."""
    n = 0
    for x, y in zip(tokens, reference):
        if x != y:
            break
        n += 1
    return {"identical": tokens == reference, "prefix": n, "prefix_share": n / max(len(reference), 1)}
