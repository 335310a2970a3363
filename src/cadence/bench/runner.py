"""The measuring loop of ``cadence bench``: one backbone, many methods, interleaved, resumable.

Knows: parsing method names, building every engine on ONE loaded backbone, the fixed
prompt subsets, warm-up, interleaving, seeding, and the ``records.jsonl`` log.
Does not know: how metrics are computed or reports drawn (``metrics``, ``report``).

Order of work: for each task, for each prompt of its subset, for each repeat, every
method once (the method order rotates by one per prompt, so no method is always
first after another's cache traffic). Before the first timed generation each method
runs one untimed warm-up generation. Every generation is appended to
``OUT/records.jsonl`` as soon as it finishes; a rerun with the same ``--out`` skips every
(task, key, method, repeat) already there, so an interrupted run resumes. The settings
that make records comparable (model, token budget, sampling, heads) are kept in
``OUT/run.json``; resuming with different ones is refused.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from cadence.backbone.load import load_backbone
from cadence.bench import report
from cadence.bench import tasks as T
from cadence.bench.peers import PEERS, make_peer
from cadence.decode.generation import GenerationConfig
from cadence.decode.engine import not_learning
from cadence.errors import CadenceError
from cadence.heads.shipped import shipped_names
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers import registry
from cadence.system.atomic import atomic_write_json
from cadence.system.heap import settled
from cadence.verify.rules import Rule

ENGINE_METHODS = tuple(m.value for m in Method)
LOSSLESS_FAMILIES = ENGINE_METHODS  # lossless at T = 0 under a lossless rule
BASELINE = "vanilla"
CONTEXT_MARGIN = 64  # the engine keeps this many positions free


@dataclass
class BenchConfig:
    """Everything a ``cadence bench`` run depends on."""

    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    methods: list[str] = field(default_factory=lambda: ["vanilla", "auto"])
    heads: str = "default"  # default | random | DIR (one head type) for every head method
    heads_dir: str | None = None  # DIR with medusa/ hydra/ mtp/ subdirectories (overrides heads)
    num_heads: int = 3  # K for random heads
    heads_seed: int = 0
    limit: int = 20  # prompts per task
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rule: str = "auto"
    repeats: int = 1
    out: str = "bench-results"
    model: str = "smollm2"
    dtype: str = "auto"
    quant: str = "auto"  # auto | gguf | none | int8 | int4 (the backbone every method runs, vanilla included)
    kv_dtype: str = "auto"  # the backbone's KV cache: auto | float32 | float16 | bfloat16
    device: str = "auto"
    custom: str | None = None  # JSONL file for the custom task
    subset_seed: int = 0
    humaneval_timeout: float = T.HUMANEVAL_TIMEOUT_S
    warmup: bool = True
    plots: bool = True
    command: str | None = None  # the command line, for the report
    seed: int = 0  # added to every generation's seed (each prompt and repeat has its own, the same for every method)
    backend: str = "auto"  # --backend: fast | transformers | auto (``backbone.load``)
    settings: dict = field(default_factory=dict)  # method flags set on the command line (MethodSpec fields and
    #                                               scheduler options, ``MethodSpec.set``), for every engine method
    decoding: dict = field(default_factory=dict)  # GenerationConfig flags set on the command line beyond
    #                                               the ones above (seed, stop, drift, top_m)

    def base_spec(self) -> MethodSpec:
        """The spec every engine method name starts from: the run's heads and method flags."""
        spec = MethodSpec(heads=self.heads, num_heads=self.num_heads, heads_seed=self.heads_seed)
        for key, value in self.settings.items():
            spec.set(key, value)
        return spec

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generation(self, seed: int = 0, max_new_tokens: int | None = None) -> GenerationConfig:
        return GenerationConfig(**{**self.decoding, "max_new_tokens": max_new_tokens or self.max_new_tokens,
                                   "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                   "seed": (seed + self.seed) % 2 ** 63, "rule": Rule(self.rule)})

    def comparable(self) -> dict:
        """The settings that must match for records of two runs to be mixed."""
        keys = ("model", "dtype", "quant", "max_new_tokens", "temperature", "top_p", "top_k", "rule",
                "heads", "heads_dir", "num_heads", "heads_seed", "subset_seed", "custom")
        out = {k: getattr(self, k) for k in keys}
        # newer settings join the key only when set, so runs that never set them still resume
        out.update({k: v for k, v in (("backend", self.backend), ("settings", self.settings),
                                      ("decoding", self.decoding), ("seed", self.seed)) if v not in ("auto", {}, 0)})
        return out


@dataclass
class MethodEntry:
    label: str  # as written on the command line (normalized), the key in records
    kind: str  # "engine" | "peer"
    spec: MethodSpec | None = None

    @property
    def lossless(self) -> bool:
        """Engine methods are lossless unless their scheduler is a lossy (opt-in) one."""
        if self.kind != "engine":
            return False
        scheduler = self.spec.scheduler if self.spec is not None else "auto"
        return scheduler == "auto" or not registry.entry(scheduler).lossy


def parse_method(text: str, cfg: BenchConfig) -> MethodEntry:
    """A method name of ``MethodSpec.parse``'s grammar (``hydra``, ``hydra:tree-16``,
    ``hydra+entmtp``, ``hydra:chain+static/nocopy``, ``eagle@runs/eagle/heads``,
    ``eagle+dynamic,max_nodes=8``) over the run's settings (``--heads``, ``--heads-dir``, the
    method flags), or a peer (``hf-generate``, ``hf-pld``, ``llama.cpp``).

    ``@DIR`` takes the heads from DIR instead of --heads / --heads-dir, so two sets of the same
    kind (e.g. shipped and retrained) run side by side."""
    text = text.strip()
    name = text.partition(":")[0].partition("+")[0].partition("@")[0].partition("/")[0].partition(",")[0].lower()
    if name in ("llama-cpp", "llamacpp", "llama_cpp"):
        name = "llama.cpp"
    if name in PEERS:
        if "@" in text or "/novocab" in text:
            raise CadenceError(f"{name} has no heads: {text!r} names heads or their vocabulary")
        if text.lower() not in (name, "llama-cpp", "llamacpp", "llama_cpp"):
            raise CadenceError(f"peer {name} takes no tree, scheduler or option ({text!r})")
        return MethodEntry(name, "peer")
    if name not in ENGINE_METHODS:
        raise CadenceError(f"unknown method {text!r}; choose from {', '.join(ENGINE_METHODS + PEERS)} "
                           "(head methods may name a tree, e.g. hydra:tree-16)")
    base = cfg.base_spec()
    if name not in ("vanilla", "ngram", "auto") and "@" not in text:
        if cfg.heads_dir:
            sub = Path(cfg.heads_dir) / name
            if not (sub / "config.json").is_file():
                raise CadenceError(f"--heads-dir {cfg.heads_dir} has no {name}/ heads directory")
            base.heads = str(sub)
        elif base.heads not in ("default", "random", *shipped_names()) and not Path(base.heads).is_dir():
            raise CadenceError(f"heads directory {base.heads} does not exist")
    spec = MethodSpec.parse(text, base)
    if "@" in text and not (Path(spec.heads) / "config.json").is_file() and spec.heads not in shipped_names():
        raise CadenceError(f"{spec.heads} is not a heads directory (no config.json) nor a shipped set "
                           f"({', '.join(shipped_names())})")
    if spec.method is Method.NGRAM and not spec.copy:
        raise CadenceError("ngram is the context copy: /nocopy leaves nothing to draft")
    if spec.method is Method.VANILLA:
        return MethodEntry("vanilla", "engine", MethodSpec(method=Method.VANILLA))
    return MethodEntry(_label(text), "engine", spec)


def _label(text: str) -> str:
    """A method name in one spelling (the key of its records): the method in lower case, the
    options in the grammar's order. Example: 'Eagle/novocab/nocopy' -> 'eagle/nocopy/novocab'."""
    body, *assignments = text.split(",")
    flags = []
    while body.endswith(("/nocopy", "/novocab")):
        body, _, opt = body.rpartition("/")
        flags.append(opt)
    head, at, where = body.partition("@")
    name, sep, rest = head.partition(":") if ":" in head else head.partition("+")
    head = name.lower() + sep + rest
    return ",".join([head + (at + where) + "".join(f"/{f}" for f in ("nocopy", "novocab") if f in flags),
                     *assignments])


def parse_methods(cfg: BenchConfig) -> list[MethodEntry]:
    entries = [parse_method(m, cfg) for m in cfg.methods]
    labels = [e.label for e in entries]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise CadenceError(f"method listed twice: {', '.join(dupes)}")
    if not entries:
        raise CadenceError("no methods given")
    return entries


def validate(cfg: BenchConfig) -> list[MethodEntry]:
    if not cfg.tasks:
        raise CadenceError("no tasks given")
    for t in cfg.tasks:
        if t not in T.TASKS:
            raise CadenceError(f"unknown task {t!r}; choose from {', '.join(T.TASKS)}")
    if len(set(cfg.tasks)) != len(cfg.tasks):
        raise CadenceError("a task is listed twice")
    if "custom" in cfg.tasks and not cfg.custom:
        raise CadenceError("the custom task needs --custom FILE")
    if cfg.custom and not Path(cfg.custom).is_file():
        raise CadenceError(f"prompt file {cfg.custom} does not exist")
    if cfg.limit < 1 or cfg.repeats < 1 or cfg.max_new_tokens < 1:
        raise CadenceError("--limit, --repeats and --max-new-tokens must be at least 1")
    if cfg.temperature < 0:
        raise CadenceError("--temperature must be >= 0")
    try:
        Rule(cfg.rule)
    except ValueError as exc:
        raise CadenceError(f"unknown rule {cfg.rule!r}; choose from {', '.join(r.value for r in Rule)}") from exc
    return parse_methods(cfg)


# ---------------------------------------------------------------- records

def read_records(path: Path) -> list[dict]:
    """Records of ``records.jsonl`` (or a gzipped copy, ``records.jsonl.gz``, as results are
    kept in the repo); a torn last line (interrupted write) is ignored."""
    if not path.is_file():
        return []
    out = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def record_id(r: dict) -> tuple:
    return (r["task"], r["key"], r["method"], r["repeat"])


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _repair_tail(path: Path) -> None:
    """Cut a torn last line so that appended records start on a line of their own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def generation_seed(key: str, repeat: int) -> int:
    """The same seed for every method on one (prompt, repeat): sampled runs stay comparable."""
    return (int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) + 7919 * repeat) % (2 ** 31)


def step_log_dict(stats) -> dict | None:
    log = getattr(stats, "step_log", None)
    if not log:
        return None
    return {"tree": [s.tree for s in log], "nodes": [s.nodes for s in log],
            "accepted": [s.accepted for s in log], "entropy": [None if s.entropy is None else round(s.entropy, 4) for s in log],
            "seconds": [round(s.seconds, 6) for s in log], "depth": [s.depth for s in log]}


def make_record(task: str, item: T.BenchItem, method: str, repeat: int, prompt_len: int,
                gen, eos: set[int], score: T.Score) -> dict:
    tokens = list(gen.tokens)
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    s = gen.stats
    return {"task": task, "key": item.key, "method": method, "repeat": repeat,
            "prompt_tokens": prompt_len, "tokens": tokens, "text": gen.text,
            "new_tokens": s.new_tokens, "steps": s.steps or None, "wall_s": s.wall_s,
            "prefill_s": s.prefill_s or None, "accepted_at_depth": list(s.accepted_at_depth),
            "step_log": step_log_dict(s), "score": score.value, "score_detail": score.detail,
            "time": time.time()}


# ---------------------------------------------------------------- the run

@dataclass
class TaskPlan:
    tasks: dict[str, T.Task]
    subsets: dict[str, list[T.BenchItem]]
    encoded: dict[tuple[str, str], list[int]]
    notes: list[str]


def plan_tasks(cfg: BenchConfig, backbone) -> TaskPlan:
    """Load every task and take its seeded subset of prompts that fit the model's context."""
    tasks, subsets, encoded, notes = {}, {}, {}, []
    limit_pos = backbone.max_positions
    for name in cfg.tasks:
        task = T.load_task(name, custom_path=cfg.custom, humaneval_timeout=cfg.humaneval_timeout)
        skipped = []

        def fits(item, _task=name, _skipped=skipped):
            ids = backbone.encode_prompt(item.prompt, chat=True)
            if len(ids) + cfg.max_new_tokens + CONTEXT_MARGIN > limit_pos:
                _skipped.append(item.key)
                return False
            encoded[(_task, item.key)] = ids
            return True

        subset = T.seeded_subset(task.items, cfg.limit, cfg.subset_seed, fits)
        if skipped:
            notes.append(f"{name}: {len(skipped)} prompt(s) passed over for not fitting the model's "
                         f"{limit_pos} positions with {cfg.max_new_tokens} new tokens")
        if len(subset) < cfg.limit:
            notes.append(f"{name}: only {len(subset)} prompt(s) available (limit {cfg.limit})")
        tasks[name], subsets[name] = task, subset
    return TaskPlan(tasks, subsets, encoded, notes)


def build_engines(entries: list[MethodEntry], backbone, cfg: BenchConfig) -> tuple[dict, list[str]]:
    engines, notes = {}, []
    for e in entries:
        if e.kind == "engine":
            engines[e.label] = make_engine(backbone, e.spec)
            engines[e.label].trace_entropy = True  # per-step entropy goes into the records
            if engines[e.label].auto_reason:  # what an ``auto`` setting settled to on this backbone
                notes.append(f"{e.label}: {engines[e.label].auto_reason}")
            continue
        try:
            engines[e.label] = make_peer(e.label, backbone, cfg.model)
            if getattr(engines[e.label], "build", None):
                notes.append(engines[e.label].build)
        except CadenceError as exc:
            if e.label != "llama.cpp":
                raise
            notes.append(str(exc))
    return engines, notes


def check_resume(out: Path, cfg: BenchConfig, backbone_name: str) -> None:
    run_path = out / "run.json"
    want = {**cfg.comparable(), "backbone": backbone_name}
    if run_path.is_file() and (out / "records.jsonl").is_file():
        try:
            have = json.loads(run_path.read_text())
        except json.JSONDecodeError:
            have = None
        if have is not None and have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            raise CadenceError(f"{out} holds a run with other settings ({', '.join(diff)}); "
                               "use another --out or delete it")
    atomic_write_json(run_path, want)


def precision_note(backbone) -> str:
    """The path every method ran on, resolved (``--dtype auto`` / ``--quant auto`` name no path).
    Example: "backbone path: float32, quant gguf, kernels gguf-avx512-vnni/...; auto: float32 on ..."."""
    text = f"backbone path: {str(backbone.dtype).replace('torch.', '')}"
    if hasattr(backbone, "quant"):
        text += f", quant {backbone.quant}, kernels {backbone.kernels}"
    reason = getattr(backbone, "dtype_reason", "")
    return text + (f" ({reason})" if reason else "")


def run_bench(cfg: BenchConfig, backbone=None, progress: bool = True, log=None) -> dict:
    """Measure, append records, and write results.json / report.md / plots under ``cfg.out``.

    ``backbone``: an already loaded Backbone (tests); else ``cfg.model`` is loaded.
    Returns the results dict written to results.json.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    entries = validate(cfg)
    if backbone is None:
        backbone = load_backbone(cfg.model, cfg.dtype, cfg.device, cfg.backend, cfg.quant, cfg.kv_dtype)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    check_resume(out, cfg, backbone.name)
    engines, notes = build_engines(entries, backbone, cfg)
    notes.insert(0, precision_note(backbone))
    plan = plan_tasks(cfg, backbone)
    notes += plan.notes
    records_path = out / "records.jsonl"
    _repair_tail(records_path)
    done = {record_id(r) for r in read_records(records_path)}
    labels = [e.label for e in entries if e.label in engines]

    pending = []
    for task in cfg.tasks:
        for i, item in enumerate(plan.subsets[task]):
            order = labels[i % len(labels):] + labels[:i % len(labels)] if labels else []
            for rep in range(cfg.repeats):
                for m in order:
                    if (task, item.key, m, rep) not in done:
                        pending.append((task, item, rep, m))
    if done and pending:
        log(f"resuming: {len(done)} generation(s) already in {records_path}, {len(pending)} to go")
    elif done:
        log(f"nothing to run: every generation is already in {records_path}")

    eos = backbone.eos_token_ids
    if pending and cfg.warmup:
        task, item, _, _ = pending[0]
        ids = plan.encoded[(task, item.key)]
        for m in dict.fromkeys(p[3] for p in pending):
            with not_learning(engines[m]):  # an online store must not learn the warm-up's reply
                engines[m].generate(ids, cfg.generation(0, min(16, cfg.max_new_tokens)))

    bar = tqdm(total=len(pending), disable=not progress or not pending, desc="bench", unit="gen", file=sys.stderr)
    try:
        with settled():  # the loaded models' objects out of the collector's way (system.heap)
            for task, item, rep, m in pending:
                bar.set_postfix_str(f"{task} {m}", refresh=False)
                ids = plan.encoded[(task, item.key)]
                gen = engines[m].generate(ids, cfg.generation(generation_seed(item.key, rep)))
                score = plan.tasks[task].score(item, gen.text)
                _append(records_path, make_record(task, item, m, rep, len(ids), gen, eos, score))
                bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        log(f"interrupted: reporting what was measured; rerun with --out {out} to resume")
        _report(out, cfg, plan, entries, labels, notes + ["interrupted run: incomplete"], backbone.name,
                records_path)
        raise
    finally:
        bar.close()
    return _report(out, cfg, plan, entries, labels, notes, backbone.name, records_path)


def _report(out, cfg, plan, entries, labels, notes, backbone_name, records_path) -> dict:
    wanted = {(t, it.key) for t in cfg.tasks for it in plan.subsets[t]}
    records = [r for r in read_records(records_path)
               if (r["task"], r["key"]) in wanted and r["method"] in labels and r["repeat"] < cfg.repeats]
    task_info = {t: {"prompts": len(plan.subsets[t]), "pool": len(plan.tasks[t].items),
                     "score": plan.tasks[t].score_name, "note": plan.tasks[t].note} for t in cfg.tasks}
    return report.write_all(out, cfg=asdict(cfg), records=records, methods=entries, labels=labels,
                            task_info=task_info, notes=notes, backbone_name=backbone_name,
                            plots=cfg.plots)
