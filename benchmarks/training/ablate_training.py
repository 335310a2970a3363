"""Training ablations for draft heads: one head type, a fixed budget, one setting changed per cell.

Knows: how the ablation data are laid out (one pool of shards, with a held-out split shared
by every cell, and per-setting data sets that link into it), the grid of cells, running one
cell (train with ``cadence.training.trainer``, held-out metrics from the trainer's own
evaluation, a tree from ``cadence.calibration.command``, measured tau and speedup from
``cadence.bench``), recording each finished cell in ``OUT/results.json`` (a rerun skips it). The table and
plots of ``docs/ablations.md`` are ``ablate_report.py``'s (it reads this script's results).
Does not know: how heads, losses or decoding work (it only sets their options).

Data (``prepare``): the self-distilled store's shards as they are when ``prepare`` runs
(listed in the pool's manifest) are split by prompt into a held-out set (``--val-percent``
of prompts, by a SHA-1 of the prompt hash) and training sequences; the training sequences
are dealt, in a seeded order, into ``--parts`` shards of equal reply-token count (the
token budget: 1 part = 1/parts of the data). Reference replies (``cadence distill --mode
reference``; prompts that are held out are dropped) are dealt the same way, up to the
self-distilled training token count. Each data set (``sd-1x``, ``ref-0.5x``, ``mix-1x``,
...) is a directory whose manifest lists links to some pool shards plus the held-out shard;
all share the pool's manifest ``config``, so one hidden-state cache serves every cell.

Example: 4 parts of about 33 K reply tokens each: ``sd-0.25x`` = part 0, ``sd-0.5x`` =
parts 0-1, ``sd-1x`` = parts 0-3, ``mix-1x`` = self-distilled parts 0-1 + reference parts
0-1 (half of each, the same total).

Every cell trains the same head type for the same steps, batch, seed and draft vocabulary
(picked from ``sd-1x``, the data decoding sees); CE cells use the backbone's argmax as the
target (for reference data that is what makes them teach the backbone's choices) and every
held-out number is measured against the backbone's argmax on the same held-out split.

Usage::

    python benchmarks/training/ablate_training.py prepare          # pool + data sets + hidden cache
    python benchmarks/training/ablate_training.py grid --wrap "nice -n 10"   # each cell its own process
    python benchmarks/training/ablate_report.py                    # docs/ablations.md + docs/ablations/*.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cadence.system.atomic import atomic_write_json
from cadence.cliargs import add_fields, from_args
from cadence.errors import CadenceError

POOL_FORMAT = 1
RESULTS = "results.json"
GRID_JSON = "grid.json"
VAL = "val.safetensors"


@dataclass
class AblateConfig:
    """Settings of an ablation grid; CLI flags derive from these fields."""

    out: str = field(default="runs/ablate", metadata={
        "help": "grid directory: grid.json, results.json, cells/NAME/ (heads, logs, bench)"})
    pool: str = field(default="data/distill-ablate", metadata={
        "help": "ablation data: pool/ shards, sets/NAME/ data sets (git-ignored)"})
    store: str = field(default="data/selfdistill/smollm2", metadata={"help": "self-distilled store"})
    store_shards: list[str] = field(default_factory=list, metadata={
        "help": "store shards to use (default: every shard its manifest lists when prepare runs)"})
    reference: str = field(default="data/distill-ref-smollm2", metadata={
        "help": "reference-reply data (cadence distill --mode reference)"})
    val_percent: int = field(default=10, metadata={"help": "share of self-distilled prompts held out"})
    parts: int = field(default=4, metadata={"help": "training shards per source (budget unit = 1/parts)"})
    cache: str = field(default="runs/ablate-cache", metadata={"help": "hidden-state cache of the pool"})
    cells: list[str] = field(default_factory=list, metadata={
        "help": "cells to run, in order (default: the whole grid, most informative first)"})
    kind: str = field(default="hydra", metadata={"help": "head type trained in every cell"})
    num_heads: int = field(default=3, metadata={"help": "K"})
    steps: int = field(default=300, metadata={"help": "optimizer steps per cell (same for every cell)"})
    batch_size: int = field(default=4, metadata={"help": "packed rows per step"})
    max_len: int = field(default=512, metadata={"help": "tokens per packed row"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=30, metadata={"help": "linear warm-up steps"})
    draft_vocab: int = field(default=8192, metadata={"help": "draft vocabulary (from sd-1x), same for all"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast in training"})
    eval_every: int = field(default=50, metadata={"help": "held-out evaluation every N steps (the curves)"})
    seed: int = field(default=0, metadata={"help": "seed of cells that do not name their own"})
    calib_tokens: int = field(default=8000, metadata={"help": "held-out reply tokens for calibrate"})
    calib_budgets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8], metadata={
        "help": "tree sizes calibrate tries"})
    calib_reps: int = field(default=5, metadata={"help": "calibrate's timed rounds"})
    tasks: list[str] = field(default_factory=lambda: ["humaneval", "gsm8k", "sharegpt", "writing"], metadata={
        "help": "benchmark tasks for measured tau / speedup (prompts never trained on)"})
    custom: str = field(default="", metadata={"help": "JSONL prompts for the custom task"})
    limit: int = field(default=2, metadata={"help": "benchmark prompts per task"})
    max_new_tokens: int = field(default=96, metadata={"help": "tokens per benchmark generation"})
    methods: list[str] = field(default_factory=lambda: ["hydra+static/nocopy", "hydra:chain+static/nocopy"],
                               metadata={"help": "benchmarked methods besides vanilla ({kind} is replaced)"})
    threads: int = field(default=1, metadata={
        "help": "torch threads of a cell (training, calibration, benchmark); 0 = torch's default. One "
                "thread is far more robust when other processes share a 2-core machine"})
    wrap: str = field(default="", metadata={
        "help": "command prefix of each cell process, e.g. 'nice -n 10' or a machine-wide lock"})
    in_process: bool = field(default=False, metadata={"help": "run cells in this process (tests)"})
    workers: int = field(default=1, metadata={
        "help": "cell processes started at once; each still takes --wrap's lock for itself, so with 2 the "
                "next cell waits in the lock's queue while one runs (cells never overlap under a lock)"})
    model: str = field(default="smollm2", metadata={"help": "backbone"})
    dtype: str = field(default="auto", metadata={"help": "backbone dtype (cache, calibration, bench)"})
    progress: bool = field(default=True, metadata={"help": "progress bars"})


# ---------------------------------------------------------------- cells

@dataclass(frozen=True)
class Cell:
    """One setting: data set, loss, AdaMTP c, seed."""

    name: str
    data: str  # sd | ref | mix
    budget: str  # 0.25x | 0.5x | 1x
    loss: str  # ce | kl | ce+adamtp | kl+adamtp
    adamtp_c: float = 2.0
    seed: int = 0
    kind: str = ""  # head type; "" = the grid's --kind

    @property
    def dataset(self) -> str:
        return f"{self.data}-{self.budget}"


ATTENTION_KINDS = ("eagle", "mtp-attn")


def attention_cells() -> list[Cell]:
    """Extra cells for the attention-bearing heads (run with --cells NAME ...): data and loss at
    1x, and a second seed of the self-distilled CE cell (that head's noise bar)."""
    cells = [Cell(f"{kind}-{data}-1x-{loss}", data, "1x", loss, kind=kind)
             for kind in ATTENTION_KINDS for data, loss in (("sd", "ce"), ("ref", "ce"), ("sd", "kl"),
                                                            ("sd", "ce+adamtp"), ("mix", "ce"),
                                                            ("sd", "kl+adamtp"))]
    return cells + [Cell(f"{kind}-sd-1x-ce-s1", "sd", "1x", "ce", seed=1, kind=kind) for kind in ATTENTION_KINDS]


def grid_cells() -> list[Cell]:
    """The grid, most informative first (data x loss at 1x, a second seed, then the sweeps)."""
    def c(data, loss, budget="1x", ca=2.0, seed=0):
        name = f"{data}-{budget}-{loss}" + (f"-c{ca:g}" if ca != 2.0 else "") + (f"-s{seed}" if seed else "")
        return Cell(name, data, budget, loss, ca, seed)

    out = [c("sd", "ce"), c("ref", "ce"), c("mix", "ce"), c("sd", "kl"), c("sd", "ce+adamtp"),
           c("sd", "ce", seed=1), c("ref", "kl"), c("mix", "kl"), c("sd", "kl+adamtp"),
           c("ref", "ce+adamtp"), c("mix", "ce+adamtp"), c("ref", "kl+adamtp"), c("mix", "kl+adamtp"),
           c("sd", "ce+adamtp", ca=1.0), c("sd", "ce+adamtp", ca=3.0),
           c("sd", "ce", "0.25x"), c("sd", "ce", "0.5x"), c("ref", "ce", "0.25x"), c("ref", "ce", "0.5x")]
    return out


def cells_by_name(cfg: AblateConfig) -> dict[str, Cell]:
    if not cfg.cells:
        return {c.name: c for c in grid_cells()}
    every = {c.name: c for c in grid_cells() + attention_cells()}
    unknown = [n for n in cfg.cells if n not in every]
    if unknown:
        raise CadenceError(f"unknown cell(s) {', '.join(unknown)}; cells: {', '.join(every)}")
    return {n: every[n] for n in cfg.cells}


# ---------------------------------------------------------------- data

def _held_out(prompt_hash: str, percent: int) -> bool:
    return int(hashlib.sha1(f"ablate-val:{prompt_hash}".encode()).hexdigest()[:8], 16) % 100 < percent


def _store_sequences(directory: Path, files: list[str]) -> list[tuple[str, list[int], int]]:
    """(prompt hash, token ids, prompt length) of every sequence with a reply in ``files``."""
    from cadence.training.data import iter_sequences, read_shard
    from cadence.training.store import read_store_shard

    out = []
    for name in files:
        path = directory / name
        if path.suffix == ".npz":
            data = read_store_shard(path, with_meta=True)
            hashes = data["meta"].get("prompt_hashes") or data["meta"]["keys"]
        else:
            data = read_shard(path)
            hashes = [f"{name}:{i}" for i in range(data["prompt_lens"].numel())]
        for h, (ids, plen) in zip(hashes, iter_sequences(data)):
            if len(ids) > plen:
                out.append((h, ids.tolist(), plen))
    return out


def _deal(seqs: list, parts: int, seed: str, budget: int | None = None) -> list[list]:
    """Shuffle (seeded), keep up to ``budget`` reply tokens, deal into ``parts`` lists of
    nearly equal reply-token count (each sequence to the lightest part so far)."""
    order = list(seqs)
    random.Random(seed).shuffle(order)
    out: list[list] = [[] for _ in range(parts)]
    load = [0] * parts
    total = 0
    for s in order:
        n = len(s[1]) - s[2]
        if budget is not None and total + n > budget:
            continue
        i = load.index(min(load))
        out[i].append(s)
        load[i] += n
        total += n
    return out


def _write(path: Path, seqs: list) -> dict:
    from cadence.training.data import write_shard

    write_shard(path, [s[1] for s in seqs], [s[2] for s in seqs], [s[0] for s in seqs])
    return {"file": path.name, "sequences": len(seqs), "tokens": sum(len(s[1]) for s in seqs),
            "reply_tokens": sum(len(s[1]) - s[2] for s in seqs)}


def dataset_shards(parts: int) -> dict[str, list[str]]:
    """Data set name -> its training shards (pool file names)."""
    sets = {}
    for frac, n in (("1x", parts), ("0.5x", max(1, parts // 2)), ("0.25x", max(1, parts // 4))):
        sets[f"sd-{frac}"] = [f"sd-{i}.safetensors" for i in range(n)]
        sets[f"ref-{frac}"] = [f"ref-{i}.safetensors" for i in range(n)]
    half = max(1, parts // 2)
    sets["mix-1x"] = [f"sd-{i}.safetensors" for i in range(half)] + [f"ref-{i}.safetensors" for i in range(half)]
    return sets


def prepare(cfg: AblateConfig, backbone=None) -> dict:
    """Write the pool, the data sets and the hidden-state cache (see the module docstring)."""
    from cadence.training.data import load_manifest

    store, ref = Path(cfg.store), Path(cfg.reference)
    sm, rm = load_manifest(store), load_manifest(ref)
    if sm is None or rm is None:
        raise CadenceError(f"{store if sm is None else ref} has no manifest.json")
    files = list(cfg.store_shards) or [s["file"] for s in sm["shards"]]
    pool = Path(cfg.pool) / "pool"
    old = load_manifest(pool)
    if old is not None and old["config"]["store_shards"] != files:
        raise CadenceError(f"{pool} was made from other store shards {old['config']['store_shards']}; "
                           "use another --pool or the same --store-shards")
    pool.mkdir(parents=True, exist_ok=True)
    sd = _store_sequences(store, files)
    val = [s for s in sd if _held_out(s[0], cfg.val_percent)]
    val_hashes = {s[0] for s in val}
    train = [s for s in sd if s[0] not in val_hashes]
    ref_seqs = [s for s in _store_sequences(ref, [s["file"] for s in rm["shards"]]) if s[0] not in val_hashes]
    budget = sum(len(s[1]) - s[2] for s in train)
    config = {"ablate_pool": POOL_FORMAT, "model": sm["config"].get("model"),
              "vocab_size": sm["config"].get("vocab_size"), "store": str(store), "store_shards": files,
              "reference": str(ref), "val_percent": cfg.val_percent, "parts": cfg.parts}
    shards = [{**_write(pool / VAL, val), "split": "val", "source": "sd"}]
    for src, seqs in (("sd", train), ("ref", ref_seqs)):
        for i, part in enumerate(_deal(seqs, cfg.parts, f"ablate:{src}", budget)):
            shards.append({**_write(pool / f"{src}-{i}.safetensors", part), "split": "train", "source": src})
    manifest = {"config": config, "prompts_done": 0, "skipped": 0, "shards": shards, "seconds": 0.0}
    atomic_write_json(pool / "manifest.json", manifest)
    by_file = {s["file"]: s for s in shards}
    for name, train_files in dataset_shards(cfg.parts).items():
        d = Path(cfg.pool) / "sets" / name
        d.mkdir(parents=True, exist_ok=True)
        for f in train_files + [VAL]:
            link = d / f
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(pool / f, d))
        atomic_write_json(d / "manifest.json", {**manifest, "shards": [by_file[f] for f in train_files + [VAL]]})
    if backbone is None:
        from cadence.backbone.load import load_backbone
        backbone = load_backbone(cfg.model, cfg.dtype, "cpu")
    from cadence.training.hidden_cache import build_cache
    build_cache(cfg.cache, backbone, pool, None, progress=cfg.progress)
    return manifest


# ---------------------------------------------------------------- one cell

def train_config(cfg: AblateConfig, cell: Cell, out: Path):
    """The ``TrainConfig`` of one cell: every cell shares all but data, loss, c and seed."""
    from cadence.training.trainer import TrainConfig

    sets = Path(cfg.pool) / "sets"
    return TrainConfig(data=str(sets / cell.dataset), out=str(out), kind=cell.kind or cfg.kind, num_heads=cfg.num_heads,
                       loss=cell.loss, target="backbone", teacher="full", adamtp_c=cell.adamtp_c,
                       steps=cfg.steps, batch_size=cfg.batch_size, max_len=cfg.max_len, lr=cfg.lr,
                       warmup_steps=cfg.warmup_steps, bf16=cfg.bf16, eval_every=cfg.eval_every,
                       log_every=min(10, cfg.eval_every or 10), save_every=max(cfg.steps // 4, 1),
                       cache_hidden=cfg.cache, draft_vocab=cfg.draft_vocab,
                       draft_vocab_from=str(sets / "sd-1x") if cfg.draft_vocab else "",
                       eval_target="backbone", seed=cell.seed, progress=cfg.progress, model=cfg.model,
                       dtype="auto", device="cpu")


def read_curve(log_path: Path) -> list[dict]:
    """Held-out evaluations of a training log with the tokens seen at their step.

    A log holds train records (cumulative ``tokens`` at their step) and eval records; an
    evaluation at step s is matched with the train record of step s (``eval_every`` is a
    multiple of ``log_every``, and the last step always logs).
    """
    tokens, evals = {}, []
    for line in log_path.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            tokens[r["step"]] = r["tokens"]
        elif r["kind"] == "eval":
            evals.append(r)
    return [{"step": e["step"], "tokens": tokens.get(e["step"]), "tau": e["tau"], "chain": e["chain"],
             "top1": e["top1"]} for e in evals]


def median_speedups(records_path: Path, methods: list[str]) -> dict[str, float | None]:
    """Per method, the median over prompts of vanilla's wall time / the method's (same tokens:
    the methods are lossless), robust to one generation slowed by another process."""
    import statistics

    from cadence.bench.runner import read_records

    wall: dict = {}
    for r in read_records(records_path):
        wall.setdefault((r["task"], r["key"], r["repeat"]), {})[r["method"]] = r["wall_s"]
    out = {}
    for m in methods:
        ratios = [w["vanilla"] / w[m] for w in wall.values() if "vanilla" in w and m in w and w[m] > 0]
        out[m] = statistics.median(ratios) if ratios else None
    return out


def _bench_summary(results: dict, methods: list[str], records_path: Path) -> dict:
    summary = results["summary"]
    pooled = summary["all"] if "all" in summary else next(iter(summary.values()))  # one task: no pooled row
    med = median_speedups(records_path, methods)
    return {m: {**{k: pooled.get(m, {}).get(k) for k in ("speedup", "tau", "tokens_per_s", "identical_rate")},
                "median_speedup": med[m]} for m in methods}


def run_cell(cfg: AblateConfig, name: str, backbone=None) -> dict:
    """Train, evaluate, calibrate and benchmark one cell; record it in OUT/results.json."""
    import torch

    every = {c.name: c for c in grid_cells() + attention_cells()}
    if name not in every:
        raise CadenceError(f"unknown cell {name!r}; cells: {', '.join(every)}")
    cell = every[name]
    done = load_results(cfg.out)
    if name in done:
        return done[name]
    out = Path(cfg.out) / "cells" / name
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_cell(cfg, cell, out, backbone)
    finally:
        torch.set_num_threads(threads)


def _run_cell(cfg: AblateConfig, cell: Cell, out: Path, backbone) -> dict:
    import torch

    from cadence.system.machine import machine_info
    from cadence.training.trainer import train

    name = cell.name
    t0 = time.time()
    backbone = backbone or _backbone(cfg)
    res = train(train_config(cfg, cell, out), backbone=backbone)
    t_train = time.time() - t0
    record = {"name": name, "cell": asdict(cell), "dataset": cell.dataset,
              "train": {**{k: res.summary.get(k) for k in ("step", "tokens", "train_seconds", "tokens_per_s",
                                                           "train_reply_tokens", "val_reply_tokens", "max_rss_mib")},
                        "threads": torch.get_num_threads()},
              "heldout": res.summary.get("heldout"), "curve": read_curve(out / "train_log.jsonl"),
              **_measure(cfg, cell, out, backbone), "machine": machine_info()}
    record["seconds"] = {"train": round(t_train, 1), **record["seconds"],
                         "total": round(time.time() - t0, 1)}
    done = load_results(cfg.out)
    done[name] = record
    atomic_write_json(Path(cfg.out) / RESULTS, done)
    return record


def _backbone(cfg: AblateConfig):
    from cadence.backbone.load import load_backbone

    return load_backbone(cfg.model, cfg.dtype, "cpu")


def _measure(cfg: AblateConfig, cell: Cell, out: Path, backbone) -> dict:
    """Calibrate the cell's trained heads (out/heads) and benchmark them: the record's
    ``calibrated``, ``bench`` and ``seconds`` (calibrate, bench) fields."""
    from cadence.bench.runner import BenchConfig, run_bench
    from cadence.calibration.command import CalibrateConfig, calibrate

    t0 = time.time()
    heads = out / "heads"
    rep = calibrate(CalibrateConfig(heads=str(heads), data=str(Path(cfg.pool) / "sets" / cell.dataset),
                                    tokens=cfg.calib_tokens, budgets=list(cfg.calib_budgets), reps=cfg.calib_reps,
                                    copy=False, profiles=False, model=cfg.model, dtype=cfg.dtype, device="cpu"),
                    backbone=backbone)
    t_calib = time.time() - t0
    methods = ["vanilla"] + [m.replace("hydra", cell.kind or cfg.kind, 1) for m in cfg.methods]
    bench = run_bench(BenchConfig(tasks=list(cfg.tasks), methods=methods, heads=str(heads), limit=cfg.limit,
                                  max_new_tokens=cfg.max_new_tokens, out=str(out / "bench"), model=cfg.model,
                                  dtype=cfg.dtype, device="cpu", custom=cfg.custom or None, plots=False,
                                  command=f"ablate_training.py cell {cell.name}"),
                      backbone=backbone, progress=cfg.progress, log=lambda m: None)
    chosen = rep["chosen"]["heads"]
    return {"calibrated": {"tree": chosen["paths"], "nodes": chosen["budget"],
                           "expected_speedup": chosen["expected_speedup"], "acceptance": rep["acceptance"],
                           "expected_tau": max((r["expected_tau"] for r in rep["trees"]
                                                if r["paths"] == chosen["paths"]), default=1.0)},
            "bench": _bench_summary(bench, methods, out / "bench" / "records.jsonl"),
            "seconds": {"calibrate": round(t_calib, 1), "bench": round(time.time() - t0 - t_calib, 1)}}


def remeasure(cfg: AblateConfig, names: list[str], backbone=None) -> dict:
    """Calibrate and benchmark recorded cells again (their heads and held-out numbers stay):
    for cells whose timing shared the machine with another job. The old measurement is kept
    in the record under ``replaced``."""
    import shutil

    import torch

    from cadence.system.machine import machine_info

    done = load_results(cfg.out)
    every = {c.name: c for c in grid_cells() + attention_cells()}
    missing = [n for n in names if n not in done or n not in every]
    if missing:
        raise CadenceError(f"not recorded (run them first): {', '.join(missing)}")
    backbone = backbone or _backbone(cfg)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        for name in names:
            out = Path(cfg.out) / "cells" / name
            shutil.rmtree(out / "bench", ignore_errors=True)
            new = _measure(cfg, every[name], out, backbone)
            done = load_results(cfg.out)
            old = done[name]
            old["replaced"] = {k: old.get(k) for k in ("calibrated", "bench", "seconds", "machine")}
            old.update(calibrated=new["calibrated"], bench=new["bench"], machine=machine_info(),
                       seconds={**old.get("seconds", {}), **new["seconds"]})
            atomic_write_json(Path(cfg.out) / RESULTS, done)
    finally:
        torch.set_num_threads(threads)
    return load_results(cfg.out)


def load_results(out: str | Path) -> dict:
    path = Path(out) / RESULTS
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CadenceError(f"{path} is corrupt ({exc.msg}); fix or delete it") from exc


# ---------------------------------------------------------------- the grid

_GRID_KEYS = ("pool", "cache", "kind", "num_heads", "steps", "batch_size", "max_len", "lr", "warmup_steps",
              "draft_vocab", "bf16", "eval_every", "calib_tokens", "calib_budgets", "calib_reps", "tasks",
              "custom", "limit", "max_new_tokens", "methods", "model", "dtype")


def _grid_config(cfg: AblateConfig) -> AblateConfig:
    """The settings recorded in OUT/grid.json (what every cell of this grid ran with)."""
    path = Path(cfg.out) / GRID_JSON
    if not path.exists():
        return cfg
    saved = json.loads(path.read_text())
    return AblateConfig(**{**asdict(cfg), **{k: saved[k] for k in _GRID_KEYS if k in saved}})


def run_grid(cfg: AblateConfig, log=print) -> dict:
    """Run every cell not yet recorded, in order, each as its own process (``--wrap`` in front)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / GRID_JSON
    mine = {k: v for k, v in asdict(cfg).items() if k in _GRID_KEYS}
    if path.exists():
        saved = {k: v for k, v in json.loads(path.read_text()).items() if k in _GRID_KEYS}
        diff = {k: (saved.get(k), mine.get(k)) for k in _GRID_KEYS if saved.get(k) != mine.get(k)}
        if diff:
            raise CadenceError(f"{out} holds a grid run with other settings {diff}; use another --out")
    else:
        atomic_write_json(path, mine)
    cells = list(cells_by_name(cfg))
    todo = []
    for i, name in enumerate(cells, 1):
        if name in load_results(out):
            log(f"[{i}/{len(cells)}] {name}: recorded, skipped")
        else:
            todo.append((i, name))

    def one(i: int, name: str) -> str | None:
        t = time.time()
        log(f"[{i}/{len(cells)}] {name}: running")
        if cfg.in_process:
            run_cell(cfg, name)
        else:
            cmd = shlex.split(cfg.wrap) + [sys.executable, str(Path(__file__).resolve()), "cell", name,
                                           "--out", str(out)] + ([] if cfg.progress else ["--no-progress"])
            rc = subprocess.run(cmd, check=False).returncode
            if rc != 0:
                log(f"[{i}/{len(cells)}] {name}: FAILED (exit status {rc}): {shlex.join(cmd)}")
                return name
        r = load_results(out)[name]
        log(f"[{i}/{len(cells)}] {name}: {time.time() - t:.0f} s; held-out tau {r['heldout']['tau']:.3f}, "
            f"measured tau {_first_bench(r)['tau']:.2f}, speedup {_first_bench(r)['speedup']:.2f}x")
        return None

    if cfg.in_process or cfg.workers <= 1:
        failed = [f for f in (one(i, n) for i, n in todo) if f]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(cfg.workers) as pool:  # submitted in grid order, started in that order
            failed = [f for f in pool.map(lambda x: one(*x), todo) if f]
    if failed:
        raise CadenceError(f"cell(s) failed: {', '.join(failed)}; rerun the same command to retry them")
    return load_results(out)


def _first_bench(record: dict) -> dict:
    return next(v for k, v in record["bench"].items() if k != "vanilla")


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("prepare", "write the pool, the data sets and the hidden-state cache"),
                        ("grid", "run every cell not yet in OUT/results.json, each its own process"),
                        ("cell", "run one cell (what grid starts)"),
                        ("remeasure", "calibrate and benchmark recorded cells again (their heads stay)")):
        p = sub.add_parser(name, help=help_)
        add_fields(p, AblateConfig)
        if name == "cell":
            p.add_argument("name", help="cell name")
        if name == "remeasure":
            p.add_argument("names", nargs="+", help="recorded cell names")
    args = ap.parse_args(argv)
    cfg = from_args(AblateConfig, args)
    try:
        if args.cmd == "prepare":
            m = prepare(cfg)
            for s in m["shards"]:
                print(f"{s['file']}: {s['split']}, {s['sequences']} sequences, {s['reply_tokens']} reply tokens")
        elif args.cmd == "grid":
            run_grid(cfg)
        elif args.cmd == "cell":
            run_cell(_grid_config(cfg), args.name)
        else:
            remeasure(_grid_config(cfg), args.names)
    except CadenceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
