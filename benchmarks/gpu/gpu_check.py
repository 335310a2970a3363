"""cadence on a GPU in one run: is it lossless there, and what do real shapes cost?

Runs from a checkout with ``PYTHONPATH=src`` on an existing torch + transformers, with no
network, no model download and nothing installed (tiny random models from
``tests/tiny.py``, random-weight backbones in real models' shapes from
``cadence.fast.shapes``, the shipped heads' files for predictions). Sections, each timed,
each recorded even when it fails:

1. ``greedy``: greedy output of every head type (medusa, hydra, mtp, mtp-attn, eagle, and
   ngram) under every lossless scheduler (static, dynamic, adaptive, adaptive-k, entmtp,
   entmtp-adaptive, clp) equals plain decoding, on tiny Llama and Qwen2 models, through
   transformers' forward and the fast decoder, in fp32 (random heads saved with synthetic
   acceptance tables, profiles and a random CLP, so every scheduler builds);
2. ``sampling``: chi-square tests of speculative sampling against the exact distribution of
   the first three tokens (vocabulary 8), as ``tests/test_sampling_lossless.py`` does;
   p-values from ``torch.special.gammaincc`` (no scipy needed);
3. ``bf16``: the identical rate of speculative greedy output against plain greedy output
   in bf16 (reported, not required: bf16 on a GPU is not row-consistent);
4. ``curves``: the verify curve T(n) of each shape in bf16 (synchronised timing), plain
   decoding tok/s, and random heads' drafting cost per level, written as a
   ``benchmarks/kernels/shapes.py``-style curve file per shape;
5. ``host``: the engine's host time per step on the first shape: cadence's plain decoding
   against a bare forward loop, and a random-heads chain step against its verify forward and
   drafting;
6. ``bounds``: *predicted* speedup of the best static tree and EntMTP's oracle bound on each
   curve (``benchmarks/analysis/entmtp_bound.py``, the shipped heads' profiles).

Writes ``OUT/gpu-check.json`` and ``OUT/summary.md``. ``--device cpu`` runs the same sections
on short lists and a tiny shape, in CI time (the test suite runs it). Exit status 1 when a
required check (greedy identity, chi-square) fails.

Usage:  PYTHONPATH=src python benchmarks/gpu/gpu_check.py --out runs/gpu-check          (CUDA)
        PYTHONPATH=src python benchmarks/gpu/gpu_check.py --device cpu --out runs/gpu-check-cpu
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # benchmarks/: the shared module
import common  # noqa: E402

sys.path.insert(0, str(common.ROOT / "tests"))  # tiny models and drafters (tests/tiny.py)
common.use("kernels", "analysis")

GREEDY_METHODS = ("medusa", "hydra", "mtp", "mtp-attn", "eagle")
LOSSLESS_SCHEDULERS = ("static", "dynamic", "adaptive", "adaptive-k", "entmtp", "entmtp-adaptive", "clp")
SHAPES = ("llama-3.2-1b", "qwen2.5-1.5b", "llama-3.1-8b")
CURVE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
V = 8  # vocabulary of the chi-square models
SAMPLE_PROMPT = [1, 5, 2, 7, 3]
ALPHA = 1e-3
TINY_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "rope_theta": 10000.0, "hidden_act": "silu"}


@dataclass
class Plan:
    """How much each section runs (``--device cpu`` picks the short lists)."""

    archs: tuple = ("llama", "qwen2")  # tiny model families checked
    backends: tuple = ("transformers", "fast")  # forwards checked
    methods: tuple = GREEDY_METHODS  # head types checked greedily (ngram and vanilla always)
    schedulers: tuple = LOSSLESS_SCHEDULERS  # lossless schedulers checked greedily
    greedy_tokens: int = 20  # tokens per greedy generation
    samples: int = 500  # generations per chi-square case
    sampling_cases: tuple = ("plain", "medusa-tree8", "hydra-chain-topk", "mtp-tree16-topp-qwen2", "mixed-q-tree")
    bf16_prompts: int = 6  # prompts of the bf16 identical rate
    shapes: tuple = SHAPES  # shapes whose verify curve is measured
    sizes: tuple = CURVE_SIZES  # tree sizes of the curves
    reps: int = 5  # timed repetitions per size (median)
    decode_tokens: int = 32  # tokens of the decoding speed and host-time runs
    budget_s: float = 450.0  # sections not started past this many seconds are skipped (and said so)
    notes: list = field(default_factory=list)


def cpu_plan() -> Plan:
    return Plan(archs=("llama",), backends=("fast",), methods=("hydra", "eagle"),
                schedulers=("static", "dynamic", "entmtp", "clp"), greedy_tokens=12, samples=150,
                sampling_cases=("hydra-chain-topk",), bf16_prompts=2, shapes=("tiny",), sizes=(1, 2, 4, 8),
                reps=2, decode_tokens=8, budget_s=120.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(bb, device: torch.device, dtype: torch.dtype = torch.float32, backend: str = "transformers"):
    """A tiny test backbone moved to ``device`` / ``dtype``, through ``backend``."""
    from cadence.backbone.base import Backbone
    from cadence.backbone.load import make_fast

    moved = Backbone(bb.model.to(device=device, dtype=dtype), bb.tokenizer, name=bb.name)
    return make_fast(moved, "fast") if backend == "fast" else moved


# -- 1. greedy identity ------------------------------------------------------------------
def calibrated_random_heads(bb, kind: str, directory: Path) -> Path:
    """Random heads of ``kind`` saved with synthetic acceptance tables, an entropy profile
    and a random CLP, so that every scheduler (entmtp, clp, ...) builds on them."""
    from cadence.heads import new_heads
    from cadence.heads.io import save_heads
    from cadence.heads.tables import DraftPolicy, save_policy
    from cadence.heads.small import CLP, CLP_FILE, save_small
    from cadence.heads.profiles import Profile, save_profiles

    k = 3
    heads = new_heads(kind, bb, k, random=True, seed=1)
    save_heads(heads, directory)
    table = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    copy_table = table + [[0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]  # rows past K: copies only (every row as wide)
    save_policy(directory, DraftPolicy(tree=[[0], [0, 0]], acceptance=table, copy_tree=[[0], [0, 0]],
                                       copy_acceptance=copy_table))
    low = [[min(0.95, a * 1.4) for a in row] for row in table]
    high = [[a * 0.5 for a in row] for row in table]
    save_profiles(directory, {"general": Profile(edges=[0.5, 2.0], tables=[low, table, high],
                                                 copy_tables=[low + copy_table[k:], copy_table, high + copy_table[k:]],
                                                 counts=[10, 10, 10])}, {"synthetic": True})
    torch.manual_seed(2)
    save_small(CLP(bb.hidden_size, k), directory, CLP_FILE, {"synthetic": True})
    return directory


def greedy_section(device: torch.device, plan: Plan, work: Path) -> dict:
    from tiny import tiny_backbone

    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.costs.latency import LatencyCurve
    from cadence.methods import Method, MethodSpec, make_engine

    latency = LatencyCurve([1, 4, 16, 64], [0.010, 0.011, 0.013, 0.020])  # synthetic: trees of a few nodes pay
    runs, failures = 0, []
    for arch, backend in itertools.product(plan.archs, plan.backends):
        bb = on_device(tiny_backbone(arch), device, torch.float32, backend)
        cfg = GenerationConfig(max_new_tokens=plan.greedy_tokens)
        prompts = [bb.encode_prompt(p, chat=True) for p in ("Write a poem about the sea.", "the the the cat the the")]
        refs = [Engine(bb).generate(ids, cfg).tokens for ids in prompts]
        cases = [("ngram", "static", None)] + [(m, s, None) for m in plan.methods for s in plan.schedulers]
        heads_dirs = {}
        for method, sched, _ in cases:
            if method != "ngram" and method not in heads_dirs:
                heads_dirs[method] = str(calibrated_random_heads(bb, method, work / f"heads-{arch}-{backend}-{method}"))
            spec = MethodSpec.parse(f"{method}+{sched}", MethodSpec(heads=heads_dirs.get(method, "random")))
            try:
                engine = make_engine(bb, spec, latency=latency)
                for ids, ref in zip(prompts, refs):
                    out = engine.generate(ids, cfg).tokens
                    runs += 1
                    if out != ref:
                        failures.append({"arch": arch, "backend": backend, "method": method, "scheduler": sched,
                                         "first_difference": next(i for i, (a, b) in enumerate(zip(out + [None], ref))
                                                                  if a != b)})
            except Exception as exc:  # a scheduler that cannot run here is a failure too
                failures.append({"arch": arch, "backend": backend, "method": method, "scheduler": sched,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
        del bb
    return {"ok": not failures, "generations": runs, "identical": runs - sum("error" not in f for f in failures),
            "failures": failures, "archs": list(plan.archs), "backends": list(plan.backends),
            "methods": ["ngram", *plan.methods], "schedulers": list(plan.schedulers), "tokens": plan.greedy_tokens}


# -- 2. chi-square -----------------------------------------------------------------------
def chi2_pvalue(obs: torch.Tensor, exp: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square statistic and its p-value (``gammaincc(df/2, stat/2)``)."""
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                               torch.tensor(stat / 2, dtype=torch.float64)))


def gof(counts: torch.Tensor, expected_p: torch.Tensor) -> dict:
    """Goodness of fit of counts to probabilities; cells expected < 5 pooled."""
    counts, expected_p = counts.flatten().double(), expected_p.flatten().double()
    n = counts.sum()
    zero = expected_p <= 1e-12
    if counts[zero].sum() > 0:
        return {"p": 0.0, "error": "a sequence outside the sampling support was emitted"}
    exp, obs = n * expected_p[~zero], counts[~zero]
    big = exp >= 5
    exp_b = torch.cat([exp[big], exp[~big].sum()[None]])
    obs_b = torch.cat([obs[big], obs[~big].sum()[None]])
    if exp_b[-1] == 0:
        exp_b, obs_b = exp_b[:-1], obs_b[:-1]
    exp_b = exp_b * obs_b.sum() / exp_b.sum()
    stat, p = chi2_pvalue(obs_b, exp_b)
    return {"chi2": round(stat, 2), "bins": len(obs_b), "p": p}


@torch.inference_mode()
def exact_joint(bb, sampling) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) under plain sampling, (V, V, V), float64 on the CPU."""
    from cadence.verify.sampling import probs

    seqs = torch.tensor([SAMPLE_PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)], device=bb.device)
    logits = bb.forward(seqs).logits.float()
    L = len(SAMPLE_PROMPT)
    p1 = probs(logits[0, L - 1], sampling).double().cpu()
    p2 = probs(logits[::V, L], sampling).double().cpu()
    p3 = probs(logits[:, L + 1], sampling).double().cpu().reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampling_section(device: torch.device, plan: Plan) -> dict:
    from tiny import BackboneDrafter, tiny_backbone

    from cadence.draft.head_drafter import HeadDrafter
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.heads import new_heads
    from cadence.schedulers.static import StaticScheduler
    from cadence.trees.tree import compile_tree

    small = {arch: on_device(tiny_backbone(arch, vocab=V, tokenizer=False, seed=1), device) for arch in ("llama", "qwen2")}
    cases = {  # name: (arch, engine builder, temperature, top_p, top_k)
        "plain": ("llama", lambda bb: Engine(bb), 1.0, 1.0, 0),
        "medusa-tree8": ("llama", lambda bb: Engine(bb, HeadDrafter(new_heads("medusa", bb, 3, random=True, seed=2)),
                                                   StaticScheduler.from_preset("tree-8", 3)), 1.0, 1.0, 0),
        "hydra-chain-topk": ("llama", lambda bb: Engine(bb, HeadDrafter(new_heads("hydra", bb, 3, random=True, seed=2)),
                                                       StaticScheduler.from_preset("chain", 3)), 0.8, 1.0, 4),
        "mtp-tree16-topp-qwen2": ("qwen2", lambda bb: Engine(bb, HeadDrafter(new_heads("mtp", bb, 3, random=True, seed=2)),
                                                            StaticScheduler.from_preset("tree-16", 3)), 1.2, 0.85, 0),
        "mixed-q-tree": ("qwen2", lambda bb: Engine(bb, BackboneDrafter(bb, 3, mix=0.5), StaticScheduler(
            compile_tree([(0,), (1,), (0, 0), (0, 1)], name="small-tree"))), 0.9, 0.95, 6),
    }
    out, ok = {}, True
    for name in plan.sampling_cases:
        arch, build, T, top_p, top_k = cases[name]
        bb = small[arch]
        engine = build(bb)  # heads bound to bb are on its device (``DraftHeads.bind``)
        cfg = GenerationConfig(temperature=T, top_p=top_p, top_k=top_k)
        joint = exact_joint(bb, cfg.sampling)
        counts = torch.zeros(V, V, V)
        taus = []
        for seed in range(plan.samples):
            g = engine.generate(SAMPLE_PROMPT, GenerationConfig(max_new_tokens=3, temperature=T, top_p=top_p,
                                                                top_k=top_k, seed=seed))
            counts[tuple(g.tokens)] += 1
            taus.append(g.stats.tau)
        tests = {"joint(x1,x2,x3)": gof(counts, joint), "marginal x2": gof(counts.sum((0, 2)), joint.sum((0, 2))),
                 "marginal x3": gof(counts.sum((0, 1)), joint.sum((0, 1))), "joint(x1,x2)": gof(counts.sum(2), joint.sum(2))}
        passed = all(t["p"] > ALPHA for t in tests.values())
        ok &= passed
        out[name] = {"ok": passed, "samples": plan.samples, "tau": round(statistics.mean(taus), 3), "tests": tests}
    return {"ok": ok, "alpha": ALPHA, "cases": out}


# -- 3. bf16 identical rate ----------------------------------------------------------------
def bf16_section(device: torch.device, plan: Plan, work: Path) -> dict:
    from tiny import tiny_backbone

    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.costs.latency import LatencyCurve
    from cadence.methods import Method, MethodSpec, make_engine

    latency = LatencyCurve([1, 4, 16, 64], [0.010, 0.011, 0.013, 0.020])
    prompts = ["Write a poem about the sea.", "Explain hash tables.", "1 2 3 4 5 6 7 8", "the cat sat on the mat",
               "Once upon a time", "def f(x): return x"][:plan.bf16_prompts]
    rows = {}
    for backend in plan.backends:
        bb = on_device(tiny_backbone("llama", hidden=128, layers=3), device, torch.bfloat16, backend)
        cfg = GenerationConfig(max_new_tokens=plan.greedy_tokens * 2)
        ids = [bb.encode_prompt(p, chat=True) for p in prompts]
        refs = [Engine(bb).generate(i, cfg).tokens for i in ids]
        for method in ("hydra", "eagle"):
            heads = str(calibrated_random_heads(bb, method, work / f"bf16-{backend}-{method}"))
            for sched in ("static", "dynamic"):
                engine = make_engine(bb, MethodSpec.parse(f"{method}+{sched}", MethodSpec(heads=heads)), latency=latency)
                same = sum(engine.generate(i, cfg).tokens == r for i, r in zip(ids, refs))
                rows[f"{backend}/{method}/{sched}"] = {"identical": same, "of": len(ids), "kernels": getattr(bb, "kernels", "transformers")}
        del bb
    total = sum(r["of"] for r in rows.values())
    return {"ok": True, "required": False, "identical_rate": round(sum(r["identical"] for r in rows.values()) / max(total, 1), 4),
            "rows": rows, "note": "reported, not required: bf16 on a GPU is not row-consistent"}


# -- 4. verify curves of real shapes ---------------------------------------------------------
@torch.inference_mode()
def timed_curve(bb, sizes, reps: int, context: int = 200) -> dict:
    """verify_cost.curve's loop with the device synchronised around each forward."""
    from verify_cost import binary_tree

    dev = bb.device
    ctx = torch.randint(0, min(bb.vocab_size, 1000), (1, context), generator=torch.Generator().manual_seed(0)).to(dev)
    cache = bb.new_cache()
    bb.forward(ctx, cache, need_logits=False)
    trees = {n: binary_tree(n) for n in sizes}
    gen, order = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    times = {n: [] for n in sizes}
    for rep in range(reps + 1):
        for i in torch.randperm(len(sizes), generator=order).tolist():
            n = sizes[i]
            mask, depth = trees[n]
            toks = torch.randint(0, min(bb.vocab_size, 1000), (1, n), generator=gen).to(dev)
            pos = (depth + context)[None].to(dev)
            sync(dev)
            t = time.perf_counter()
            bb.forward(toks, cache, pos, mask.to(dev))
            sync(dev)
            if rep:
                times[n].append(time.perf_counter() - t)
            cache.compact(context, [])
    med = [statistics.median(times[n]) for n in sizes]
    return {"sizes": list(sizes), "seconds": med, "ms": [round(m * 1000, 3) for m in med],
            "relative": [round(m / med[0], 3) for m in med], "context": context, "reps": reps, "tree": "binary",
            "statistic": "median", "knee_1.3x": next((n for n, m in zip(sizes, med) if m > 1.3 * med[0]), None)}


@torch.inference_mode()
def bare_decode(bb, tokens: int) -> float:
    """Seconds per token of a bare greedy loop over ``bb.forward`` (no engine)."""
    dev = bb.device
    cache = bb.new_cache()
    logits = bb.forward(torch.arange(16, device=dev)[None], cache).logits[0, -1]
    sync(dev)
    t = time.perf_counter()
    for _ in range(tokens):
        nxt = logits.argmax().view(1, 1)
        logits = bb.forward(nxt, cache).logits[0, -1]
    sync(dev)
    return (time.perf_counter() - t) / tokens


def shape_path(name: str, work: Path) -> str:
    if name != "tiny":
        return name
    path = work / "tiny-shape" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(TINY_SHAPE))
    return str(path)


def curves_section(device: torch.device, plan: Plan, work: Path, out: Path, deadline: float) -> dict:
    import shapes as shape_bench  # benchmarks/kernels/shapes.py

    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.fast import shapes

    rows, ok = {}, True
    for name in plan.shapes:
        if time.perf_counter() > deadline:
            rows[name] = {"skipped": "time budget spent"}
            continue
        try:
            t = time.perf_counter()
            bb = shapes.random_backbone(shape_path(name, work), "bfloat16", seed=0, device=device)
            sync(device)
            entry = {"load_s": round(time.perf_counter() - t, 2), "kernels": bb.kernels, "chains_only": bool(bb.chains_only),
                     "gpu_memory_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None}
            entry["curve"] = timed_curve(bb, list(plan.sizes), plan.reps)
            entry["draft_s"] = shape_bench.draft_costs(bb)
            engine, ids = Engine(bb), list(range(32))
            engine.generate(ids, GenerationConfig(max_new_tokens=4))
            sync(device)
            t = time.perf_counter()
            got = engine.generate(ids, GenerationConfig(max_new_tokens=plan.decode_tokens))
            sync(device)
            wall = time.perf_counter() - t
            entry["decode"] = {"tokens": len(got.tokens), "tok_s": round(len(got.tokens) / wall, 2)}
            if not rows:  # host time per step, on the first shape
                entry["host"] = host_times(bb, plan, entry)
            curve_file = out / f"curve-{Path(shape_path(name, work)).parent.name if name == 'tiny' else name}.json"
            common.write_json(curve_file, {"shape": shapes.describe(shape_path(name, work)), "device": str(device),
                                           "by_dtype": {"bfloat16": entry}}, quiet=True)
            entry["curve_file"] = str(curve_file)
            rows[name] = entry
            del bb, engine
        except Exception as exc:
            ok = False
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"ok": ok, "required": False, "shapes": rows}


def host_times(bb, plan: Plan, entry: dict) -> dict:
    """The engine's time per step beyond the forwards it runs: plain decoding against a bare
    forward loop; a chain of random hydra heads against its verify forward and drafting."""
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.heads import new_heads
    from cadence.schedulers.static import StaticScheduler

    dev, n = bb.device, plan.decode_tokens
    bare = bare_decode(bb, n)
    ids = list(range(32))

    def per_step(engine) -> float:
        engine.generate(ids, GenerationConfig(max_new_tokens=4))
        sync(dev)
        t = time.perf_counter()
        g = engine.generate(ids, GenerationConfig(max_new_tokens=n))
        sync(dev)
        return (time.perf_counter() - t) / max(g.stats.steps, 1)

    plain = per_step(Engine(bb))
    heads = new_heads("hydra", bb, 3, random=True, seed=0).to(device=dev, dtype=bb.dtype)
    chain = per_step(Engine(bb, HeadDrafter(heads), StaticScheduler.from_preset("chain", 3)))
    # a 4-node verify forward at about the runs' context, timed here (the curve's context is 200)
    t4 = timed_curve(bb, [4], max(plan.reps, 10), context=len(ids) + n // 2)["seconds"][0]
    draft = entry["draft_s"].get("hydra", 0.0) * 3
    return {"bare_forward_ms": round(bare * 1e3, 3), "engine_plain_step_ms": round(plain * 1e3, 3),
            "host_ms_plain": round((plain - bare) * 1e3, 3), "engine_chain_step_ms": round(chain * 1e3, 3),
            "verify4_ms": round(t4 * 1e3, 3), "draft3_ms": round(draft * 1e3, 3),
            "host_ms_chain": round((chain - t4 - draft) * 1e3, 3),
            "note": "host = step wall minus the forward (plain) or minus a 4-node verify forward and 3 drafted "
                    "levels (chain, K=3); includes the prompt's prefill spread over the steps"}


# -- 6. EntMTP bounds on the curves ---------------------------------------------------------
def bounds_section(curves: dict) -> dict:
    import entmtp_bound

    rows = {}
    for name, entry in curves.get("shapes", {}).items():
        if "curve_file" not in entry:
            continue
        p = entmtp_bound.curve_predictions(entry["curve_file"], "bfloat16")
        rows[name] = {m: {k: {"static_nodes": r["static_nodes"], "static_speedup": r["static_speedup"],
                              "bound": r["bound"]} for k, r in prof.items()} for m, prof in p.items()}
    return {"ok": True, "required": False, "predicted": rows,
            "note": "predicted: the shipped SmolLM2 heads' acceptance on these curves"}


# -- report ---------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    """Versions, the device, and the C++ extension (built here at the first forward of the
    fast decoder when a compiler is present: timed, since it counts against the budget)."""
    import transformers

    from cadence.fast import native

    t = time.perf_counter()
    built = native.module() is not None
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "cuda_available": torch.cuda.is_available(), "native_extension": built,
           "native_load_s": round(time.perf_counter() - t, 1)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                   cuda=torch.version.cuda)
    try:
        from cadence.system.machine import cpu_model

        env["cpu"] = cpu_model()
    except Exception:  # noqa: BLE001 - informative only
        pass
    return env


def summary(result: dict) -> str:
    s = result["sections"]
    env = result["environment"]
    lines = [f"# gpu_check on {env.get('gpu', env['device'])}", "",
             f"{result['date']}, commit {result.get('commit')}, torch {env['torch']}, transformers "
             f"{env['transformers']}, `{result['command']}`", "",
             "| section | required | ok | seconds | what |", "|---|---|---|---:|---|"]
    what = {"greedy": lambda r: f"{r.get('identical')}/{r.get('generations')} greedy outputs identical to plain decoding",
            "sampling": lambda r: ", ".join(f"{k}: min p {min(t['p'] for t in v['tests'].values()):.3g}"
                                             for k, v in r.get("cases", {}).items()),
            "bf16": lambda r: f"identical rate {r.get('identical_rate')}",
            "curves": lambda r: "; ".join(f"{k}: T(8)/T(1) {dict(zip(v['curve']['sizes'], v['curve']['relative'])).get(8)}"
                                          f", T(32)/T(1) {dict(zip(v['curve']['sizes'], v['curve']['relative'])).get(32)}"
                                          f", {v['decode']['tok_s']} tok/s"
                                          if "curve" in v else f"{k}: {v.get('error') or v.get('skipped')}"
                                          for k, v in r.get("shapes", {}).items()),
            "bounds": lambda r: "; ".join(f"{k}: eagle-taps +copy *predicted* {v['eagle-taps']['general+copy']['static_speedup']}x,"
                                          f" bound {v['eagle-taps']['general+copy']['bound']}"
                                          for k, v in r.get("predicted", {}).items() if "eagle-taps" in v)}
    for name, r in s.items():
        desc = r.get("error") or r.get("skipped") or (what[name](r) if name in what else "")
        lines.append(f"| {name} | {'yes' if r.get('required', True) else 'no'} | {r.get('ok')} | {r.get('seconds', '')} | {desc} |")
    host = next((v.get("host") for v in s.get("curves", {}).get("shapes", {}).values() if v.get("host")), None)
    if host:
        lines += ["", "Host time per step (first shape): " + ", ".join(f"{k} {v}" for k, v in host.items() if k != "note")]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the full check) or cpu (short lists, a tiny shape)")
    ap.add_argument("--out", default=str(common.RUNS / "gpu-check"), help="folder for gpu-check.json and summary.md")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"shapes whose curves are measured (default {' '.join(SHAPES)}; "
                                                              "cpu: a tiny shape)")
    ap.add_argument("--samples", type=int, default=None, help="generations per chi-square case (default 500; cpu 150)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip sections not started by then (default 450; cpu 120)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --device cpu for the short CPU run", file=sys.stderr)
        return 2
    plan = cpu_plan() if device.type == "cpu" else Plan()
    plan.shapes = tuple(args.shapes) if args.shapes else plan.shapes
    plan.samples = args.samples or plan.samples
    plan.budget_s = args.budget_s or plan.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + plan.budget_s
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(["python", "benchmarks/gpu/gpu_check.py", *sys.argv[1:]]),
              "environment": environment(device), "plan": {k: v for k, v in plan.__dict__.items() if k != "notes"},
              "sections": {}}
    try:
        from cadence.system.machine import git_commit

        result["commit"] = git_commit()
    except Exception:  # noqa: BLE001 - informative only
        result["commit"] = None
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        sections = [("greedy", lambda: greedy_section(device, plan, work)),
                    ("sampling", lambda: sampling_section(device, plan)),
                    ("bf16", lambda: bf16_section(device, plan, work)),
                    ("curves", lambda: curves_section(device, plan, work, out, deadline)),
                    ("bounds", lambda: bounds_section(result["sections"].get("curves", {})))]
        for name, run in sections:
            if time.perf_counter() > deadline and name not in ("bounds",):
                result["sections"][name] = {"ok": None, "skipped": f"time budget of {plan.budget_s:.0f} s spent"}
                continue
            t = time.perf_counter()
            try:
                r = run()
            except Exception as exc:
                r = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
            r["seconds"] = round(time.perf_counter() - t, 1)
            result["sections"][name] = r
            print(f"gpu_check: {name}: ok={r.get('ok')} in {r['seconds']} s", file=sys.stderr, flush=True)
            (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    required_failed = [n for n in ("greedy", "sampling") if result["sections"].get(n, {}).get("ok") is False]
    result["ok"] = not required_failed
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(summary(result))
    print(summary(result))
    return 1 if required_failed else 0


if __name__ == "__main__":
    sys.exit(main())
