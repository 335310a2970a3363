"""``cadence bench``: measure methods and peers on benchmark tasks; ``--compare`` two runs.

Example::

    cadence bench --tasks gsm8k humaneval --methods vanilla hydra hydra:tree-16 hf-generate \\
        --heads random --limit 10 --max-new-tokens 128 --out runs/cpu-1
    cadence bench --compare runs/cpu-1/results.json runs/cpu-2/results.json
"""

from __future__ import annotations

import argparse
import shlex
import sys


def register(subparsers) -> None:
    from cadence.bench.peers import PEERS
    from cadence.bench.runner import ENGINE_METHODS
    from cadence.bench.tasks import TASKS
    from cadence.fast import QUANTS

    p = subparsers.add_parser(
        "bench", help="benchmark decoding methods and peers (Spec-Bench-style report)",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"tasks: {', '.join(TASKS)}\nmethods: {', '.join(ENGINE_METHODS)} (optionally NAME:TREE, "
               f"e.g. hydra:tree-16; a trailing /nocopy turns context copy off, e.g. hydra/nocopy, /novocab the context vocabulary) and peers {', '.join(PEERS)}")
    p.add_argument("--tasks", nargs="+", default=["gsm8k"], metavar="TASK", help="tasks to run (default: gsm8k)")
    p.add_argument("--methods", nargs="+", default=["vanilla", "hydra"], metavar="METHOD",
                   help="methods and peers, run interleaved per prompt (default: vanilla hydra)")
    p.add_argument("--heads", default="default",
                   help="default (shipped for the model) | random | DIR, for every head method (default: default)")
    p.add_argument("--heads-dir", default=None, metavar="DIR",
                   help="directory with medusa/ hydra/ mtp/ head subdirectories (overrides --heads)")
    p.add_argument("--num-heads", type=int, default=3, help="K for --heads random (default: 3)")
    p.add_argument("--heads-seed", type=int, default=0, help="seed for --heads random (default: 0)")
    p.add_argument("--limit", type=int, default=20, help="prompts per task (default: 20)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="token budget per generation (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass at T > 0 (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k at T > 0, 0 = off (default: 0)")
    p.add_argument("--rule", default="auto", help="verification rule: auto | greedy | speculative | typical")
    p.add_argument("--repeats", type=int, default=1, help="generations per prompt and method (default: 1)")
    p.add_argument("--out", default="bench-results", help="output directory; rerun to resume (default: bench-results)")
    p.add_argument("--custom", default=None, metavar="FILE", help='JSONL for the custom task ({"prompt": ...} per line)')
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the fixed prompt subset (default: 0)")
    p.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds per HumanEval test run (default: 10)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up generations")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a HF model directory, or a .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU and on CPUs where bf16 is lossless: native bf16 + oneDNN + the fast path; else float32) | float32 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--quant", default="none", choices=list(QUANTS),
                   help="int8 | int4: weight-only quantized backbone (LOSSY against the unquantized model; every "
                        "method, vanilla included, runs the same quantized model) | gguf: float32 on a GGUF model's own "
                        "blocks (the file's weights, 8-bit activations as llama.cpp) | auto: gguf where it applies")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="print the difference between two results.json files (or run directories) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def config_from_args(args):
    from cadence.bench.runner import BenchConfig

    return BenchConfig(
        tasks=list(args.tasks), methods=list(args.methods), heads=args.heads, heads_dir=args.heads_dir,
        num_heads=args.num_heads, heads_seed=args.heads_seed, limit=args.limit,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        rule=args.rule, repeats=args.repeats, out=args.out, model=args.model, dtype=args.dtype, quant=args.quant,
        device=args.device, custom=args.custom, subset_seed=args.subset_seed,
        humaneval_timeout=args.humaneval_timeout, warmup=args.warmup, plots=args.plots,
        command=shlex.join(["cadence"] + sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None)


def run(args) -> int:
    from cadence.bench import report

    if args.compare:
        a, b = (report.load_results(p) for p in args.compare)
        print(report.compare(a, b, args.compare[0], args.compare[1]))
        return 0
    from cadence.bench.runner import run_bench

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

