"""``cadence`` command line: generate | distill | train | calibrate | bench | serve | export | env | cache | train-pipo.

Every user-facing failure is a CadenceError: printed as ``cadence: error: ...`` with
exit status 2, never a traceback. SIGTERM and SIGHUP end a command as Ctrl-C does (its
``finally`` blocks run; exit status 128 + the signal's number), except ``serve``, which drains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# CADENCE_ISA=avx2|avx512 also needs torch's own switches, which torch reads once at import
# (``cadence.system.machine.ISA_ENV``, the same values; tests/test_gemm_q.py checks they agree):
# the command line sets them here, before anything imports torch, unless already set
_ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
if "torch" not in sys.modules:
    for _k, _v in _ISA_ENV.get(os.environ.get("CADENCE_ISA", "").strip().lower(), {}).items():
        os.environ.setdefault(_k, _v)

import importlib

from transformers.utils import logging as hf_logging

from cadence.backbone.load import add_model_args, load_backbone, path_label
from cadence.backbone.load import precision as _precision
from cadence.cliargs import add_fields, from_args
from cadence.decode.generation import GenerationConfig
from cadence.decode.engine import not_learning
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, add_method_flags, make_engine
from cadence.pipo.command import add_generate_flags as add_pipo_flags
from cadence.pipo.command import run_generate as run_pipo
from cadence.prompts import jsonl_items
from cadence.system import signals
from cadence.system.heap import settled

# the subcommands beside generate, each a module with ``register(subparsers)``; imported by
# name in ``build_parser`` so that a broken one raises there (tests/test_hidden_failures.py)
COMMANDS = ("cadence.training.command", "cadence.calibration.command", "cadence.bench.command",
            "cadence.training.small_heads", "cadence.server.command", "cadence.heads.export",
            "cadence.fast.report", "cadence.pipo.command")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help='JSONL file, one {"prompt": ...} per line')
    add_model_args(p)
    add_method_flags(p)
    add_fields(p, GenerationConfig, defaults={"max_new_tokens": 256})
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on when the model has one)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--compare", action="store_true",
                   help="also decode each prompt with vanilla (after a short warm-up of both) and print "
                        "the speed ratio")
    add_pipo_flags(p)  # --pipo (LOSSY, opt-in): docs/pipo.md
    p.set_defaults(func=_run_generate)


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CadenceError("empty prompt")
        return [args.prompt]
    items = [it.prompt for it in jsonl_items(args.prompt_file)]
    if not items:
        raise CadenceError(f"{args.prompt_file} holds no prompts")
    return items


def _run_generate(args) -> int:
    prompts = _prompts(args)
    if getattr(args, "pipo", ""):
        return run_pipo(args, prompts)
    spec = MethodSpec.from_args(args)
    cfg = from_args(GenerationConfig, args)
    backbone = load_backbone(args.model, args.dtype, args.device, args.backend, args.quant, args.kv_dtype)
    engine = make_engine(backbone, spec)
    spec = engine.spec  # ``auto`` settled for this backbone (methods.resolve_method)
    if engine.auto_reason and not args.json:
        print(f"cadence: {engine.auto_reason}", file=sys.stderr)
    vanilla = make_engine(backbone, MethodSpec(method=Method.VANILLA)) if args.compare else None
    chat = args.chat if args.chat is not None else bool(getattr(backbone.tokenizer, "chat_template", None))
    with settled():  # the loaded model's objects out of the collector's way (system.heap)
        for prompt in prompts:
            ids = backbone.encode_prompt(prompt, chat=chat)
            if vanilla is not None:  # warm-up, excluded from the comparison
                for e in (engine, vanilla):
                    with not_learning(e):  # an online store must not learn the warm-up's reply
                        e.generate(ids, GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens)))
            if args.json:
                g = engine.generate(ids, cfg)
                print(json.dumps({"prompt": prompt, "text": g.text, "method": spec.method.value,
                                  "heads": spec.heads if spec.method.value not in ("vanilla", "ngram") else None,
                                  "auto": engine.auto_reason or None,
                                  "scheduler": getattr(engine, "scheduler_name", None),
                                  "datastore": _datastore_info(engine), "online_store": _online_info(engine),
                                  "lossless": cfg.rule.lossless(cfg.sampling) and not engine.allow_unverified,
                                  **_precision(backbone), **g.stats.summary()}), flush=True)
                stats = g.stats
            else:
                stats = _stream(engine, ids, cfg)
            if vanilla is not None:
                _compare(stats, vanilla.generate(ids, cfg), spec)
    return 0


def _datastore_info(engine) -> dict | None:
    """The drafter's datastore (``--datastore``) for ``--json``: where from, reply tokens, n-grams."""
    ds = getattr(engine.drafter, "datastore", None)
    ds = ds.then if hasattr(ds, "add") else ds  # behind an online store (``--online-store``)
    return None if ds is None else {"store": ds.name, "reply_tokens": ds.tokens, "ngrams": len(ds)}


def _online_info(engine) -> dict | None:
    """The drafter's online store (``--online-store``) for ``--json``, or None."""
    ds = getattr(engine.drafter, "datastore", None)
    return ds.describe() if hasattr(ds, "add") else None


def _stream(engine, ids, cfg):
    """Print text as it is committed (never part of a stop string), then a one-line
    summary on stderr; returns the statistics."""
    req = engine.stream(ids, cfg)
    for _ in req:
        sys.stdout.write(req.take_text())
        sys.stdout.flush()
    sys.stdout.write(req.take_text() + "\n")
    s = req.stats
    print(f"[{s.new_tokens} tokens, {s.steps} steps, tau {s.tau:.2f}, {s.wall_s:.2f} s, "
          f"{s.tokens_per_s:.1f} tok/s, tree {s.summary()['tree']}, {path_label(engine.backbone)}]", file=sys.stderr)
    return s


def _compare(stats, plain, spec) -> None:
    p = plain.stats
    print(f"[vanilla: {p.new_tokens} tokens, {p.wall_s:.2f} s, {p.tokens_per_s:.1f} tok/s] "
          f"{spec.method.value} / vanilla = {stats.tokens_per_s / max(p.tokens_per_s, 1e-9):.2f}x",
          file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The full parser. Every subcommand module is imported unconditionally: one that cannot
    be imported is a broken install and raises here, instead of vanishing from --help.
    Optional extras (cadence[train], cadence[bench]) are imported only when a subcommand
    runs, which then fails with a CadenceError naming the package to install; registering
    a subcommand must never import one (tests/test_hidden_failures.py checks both)."""
    parser = argparse.ArgumentParser(prog="cadence", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    hf_logging.disable_progress_bar()  # the weight-loading bar hides our own output
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":  # the server drains on SIGTERM through uvicorn's own handlers
        signals.install()
    try:
        return args.func(args)
    except CadenceError as exc:
        print(f"cadence: error: {exc}", file=sys.stderr)
        return 2
    except signals.Terminated as exc:  # SIGTERM / SIGHUP: every finally block has run, as for Ctrl-C
        print(f"cadence: terminated ({exc.args[0]})", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("cadence: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
