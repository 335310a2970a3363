"""Measuring acceptance profiles (``cadence calibrate --profiles``): the heads' acceptance
tables per task and per bin of the backbone's root entropy, and the Pareto frontier of
trees per bin (a plot).

Knows: teacher-forced ranks on distilled sequences (``acceptance.sequence_ranks``), split
by quantile bins of the root entropy and by the prompt source of each sequence. Does not
know schedulers or engines; what it measures is read at run time by ``cadence.heads.profiles``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from cadence.calibration.acceptance import RankHistogram, sequence_ranks
from cadence.costs.tree_choice import step_seconds
from cadence.draft.context_copy import CopyConfig
from cadence.errors import CadenceError
from cadence.heads.profiles import TASK_SOURCES, Profile
from cadence.training.data import iter_sequences, load_manifest, read_shard
from cadence.training.store import read_store_shard
from cadence.trees.tree import expected_tau, grow_tree


def _sequences_with_source(data_dir: Path, split: str):
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json")
    shards = [s for s in manifest["shards"] if s["split"] == split]
    if not shards:
        raise CadenceError(f"{data_dir} has no {split!r} shards yet")
    for shard in shards:
        path = data_dir / shard["file"]
        meta = read_store_shard(path, with_meta=True).get("meta", {}) if path.suffix == ".npz" else {}
        sources = meta.get("sources") or [None] * 10 ** 9
        for (ids, plen), src in zip(iter_sequences(read_shard(path)), sources):
            yield ids, plen, src


def measure_profiles(backbone, heads, data_dir: str | Path, tasks: list[str], bins: int = 5,
                     tokens: int = 12000, ranks: int = 10, copy: CopyConfig | None = CopyConfig(),
                     copy_depth: int = 8, split: str = "val", context_vocab: bool = False) -> dict[str, Profile]:
    """Profiles for ``tasks`` (``general`` and/or keys of ``TASK_SOURCES``), each from up to
    ``tokens`` reply tokens of its sources; bin edges are quantiles of that task's entropies.
    ``context_vocab``: rank the context's tokens outside the heads' draft vocabulary too, as
    the drafter does with ``--context-vocab`` (``acceptance.sequence_ranks``).
    A task whose source has no sequences in the data is left out (``general`` never is)."""
    depth = max(copy_depth, heads.K)
    wanted = {t: (None if t == "general" else TASK_SOURCES[t]) for t in tasks}
    got: dict[str, list] = {t: [] for t in tasks}
    seen = {t: 0 for t in tasks}
    bar = tqdm(total=tokens * len(tasks), desc="profiles", unit="tok")
    for ids, plen, src in _sequences_with_source(Path(data_dir), split):
        takers = [t for t, s in wanted.items() if seen[t] < tokens and (s is None or s == src)]
        if not takers:
            if all(v >= tokens for v in seen.values()):
                break
            continue
        r = sequence_ranks(backbone, heads, ids, plen, ranks, copy, depth, want_entropy=True,
                           context_vocab=context_vocab)
        if r is None:
            continue
        for t in takers:
            got[t].append(r)
            seen[t] += len(ids) - plen
        bar.update(len(takers) * (len(ids) - plen))
    bar.close()
    out = {}
    for t, seqs in got.items():
        if not seqs and t != "general":
            continue
        if not seqs:
            raise CadenceError(f"no {split} sequences in {data_dir}")
        ent = torch.cat([r.entropy for r in seqs])
        edges = torch.quantile(ent, torch.linspace(0, 1, bins + 1)[1:-1]).tolist()
        plain = [RankHistogram(heads.K, ranks) for _ in range(bins)]
        copied = [RankHistogram(depth, ranks) for _ in range(bins)] if copy is not None else None
        counts = [0] * bins
        for r in seqs:
            b = torch.bucketize(r.entropy, torch.tensor(edges), right=True)
            for i in range(bins):
                keep = b == i
                counts[i] += int(keep.sum())
                plain[i].add(r.plain, keep)
                if copied is not None:
                    copied[i].add(r.copied, keep)
        out[t] = Profile([round(e, 4) for e in edges], [h.table() for h in plain],
                         [h.table() for h in copied] if copied is not None else None, counts)
    return out


def plot_frontiers(profile: Profile, latency, draft_s: float, num_heads: int, copy: bool, out: str | Path) -> None:
    """Expected tokens/s (relative to plain decoding) of the tree grown for each node budget,
    one line per entropy bin: where each bin's best tree is."""
    import matplotlib  # the bench extra: plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend (above)

    tables = profile.copy_tables if copy and profile.copy_tables else profile.tables
    fig, ax = plt.subplots(figsize=(7, 4))
    budgets = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63]
    lo = [float("-inf")] + profile.edges
    hi = profile.edges + [float("inf")]
    for i, table in enumerate(tables):
        ys = []
        for b in budgets:
            paths = grow_tree(table, b)
            secs = step_seconds(latency, len(paths) + 1, max(map(len, paths), default=0), draft_s, num_heads)
            ys.append(expected_tau(paths, table) / secs * latency(1))
        ax.plot(budgets, ys, marker="o", ms=3, label=f"H in [{lo[i]:.2f}, {hi[i]:.2f})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes")
    ax.set_ylabel("expected speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
