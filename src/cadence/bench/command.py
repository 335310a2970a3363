"""``cadence bench``: measure methods and peers on benchmark tasks; ``--compare`` two runs.

Example::

    cadence bench --tasks gsm8k humaneval --methods vanilla hydra hydra:tree-16 hf-generate \\
        --heads random --limit 10 --max-new-tokens 128 --out runs/cpu-1
    cadence bench --compare runs/cpu-1/results.json runs/cpu-2/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from cadence.backbone.load import add_model_args
from cadence.bench import report
from cadence.bench.peers import PEERS
from cadence.bench.runner import ENGINE_METHODS, BenchConfig, run_bench
from cadence.bench.tasks import TASKS
from cadence.cliargs import add_fields
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import MethodSpec, add_method_flags, option_fields


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark decoding methods and peers (Spec-Bench-style report)",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"tasks: {', '.join(TASKS)}\nmethods: {', '.join(ENGINE_METHODS)}, named as for `cadence generate "
               f"--method` (MethodSpec.parse: METHOD[:TREE][+SCHEDULER][@HEADS][/nocopy][/novocab][,NAME=VALUE]..., "
               f"e.g. hydra:tree-16, hydra/nocopy, eagle+dynamic,max_nodes=8) and peers {', '.join(PEERS)}")
    p.add_argument("--tasks", nargs="+", default=["gsm8k"], metavar="TASK", help="tasks to run (default: gsm8k)")
    p.add_argument("--methods", nargs="+", default=["vanilla", "auto"], metavar="METHOD",
                   help="methods and peers, run interleaved per prompt (default: vanilla auto, i.e. the default "
                        "method, which the report's notes name); the method flags "
                        "below apply to every engine method, a method name overrides them")
    p.add_argument("--heads-dir", default=None, metavar="DIR",
                   help="directory with medusa/ hydra/ mtp/ head subdirectories (overrides --heads)")
    p.add_argument("--limit", type=int, default=20, help="prompts per task (default: 20)")
    p.add_argument("--repeats", type=int, default=1, help="generations per prompt and method (default: 1)")
    p.add_argument("--out", default="bench-results", help="output directory; rerun to resume (default: bench-results)")
    p.add_argument("--custom", default=None, metavar="FILE", help='JSONL for the custom task ({"prompt": ...} per line)')
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the fixed prompt subset (default: 0)")
    p.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds per HumanEval test run (default: 10)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up generations")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="print the difference between two results.json files (or run directories) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # the decoding flags of `cadence generate`, from the same dataclasses
    add_model_args(p)  # every method, vanilla included, runs the same backbone: generate's default path
    add_method_flags(p)
    add_fields(p, GenerationConfig, defaults={"max_new_tokens": 256})
    p.set_defaults(func=run)


def config_from_args(args) -> BenchConfig:
    spec = MethodSpec()
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(MethodSpec)
                if f.name not in ("method", "options", "heads", "num_heads", "heads_seed")
                and getattr(args, f.name, f.default) != f.default}
    settings.update({name: getattr(args, name) for name, f in option_fields().items()
                     if getattr(args, name, f.default) != f.default})
    if getattr(args, "method", spec.method.value) != spec.method.value:
        raise CadenceError("cadence bench names its methods with --methods (--method is cadence generate's)")
    own = ("max_new_tokens", "temperature", "top_p", "top_k", "rule", "seed")
    decoding = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)
                if f.name not in own and getattr(args, f.name, f.default) != f.default}
    return BenchConfig(
        tasks=list(args.tasks), methods=list(args.methods), heads=args.heads, heads_dir=args.heads_dir,
        num_heads=args.num_heads, heads_seed=args.heads_seed, limit=args.limit,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        rule=str(args.rule.value if hasattr(args.rule, "value") else args.rule), repeats=args.repeats, out=args.out,
        model=args.model, dtype=args.dtype, quant=args.quant, kv_dtype=args.kv_dtype, backend=args.backend,
        device=args.device, custom=args.custom, subset_seed=args.subset_seed,
        humaneval_timeout=args.humaneval_timeout, warmup=args.warmup, plots=args.plots,
        settings=settings, seed=args.seed, decoding={k: list(v) if isinstance(v, tuple) else v for k, v in decoding.items()},
        command=shlex.join(["cadence"] + sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None)


def run(args) -> int:
    if args.compare:
        a, b = (report.load_results(p) for p in args.compare)
        print(report.compare(a, b, args.compare[0], args.compare[1]))
        return 0
    cfg = config_from_args(args)
    if cfg.command is None:
        cfg.command = shlex.join(["cadence", "bench"] + _argv_guess(args))
    results = run_bench(cfg, progress=not args.quiet)
    print(f"wrote {cfg.out}/results.json and {cfg.out}/report.md ({results['records']} generations)")
    for f in results["flags"]:
        print(f"FLAG: {f}", file=sys.stderr)
    return 0


def _argv_guess(args) -> list[str]:
    """A command line equivalent to ``args`` (when not called from the console script)."""
    out = ["--tasks", *args.tasks, "--methods", *args.methods, "--heads", args.heads,
           "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", str(args.temperature), "--repeats", str(args.repeats), "--out", args.out,
           "--model", args.model]
    if args.heads_dir:
        out += ["--heads-dir", args.heads_dir]
    if args.custom:
        out += ["--custom", args.custom]
    return out

