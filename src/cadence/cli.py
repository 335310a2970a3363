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
# (``cadence.fast.cpu.ISA_ENV``, the same values; tests/test_gemm_q.py checks they agree):
# the command line sets them here, before anything imports torch, unless already set
_ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
if "torch" not in sys.modules:
    for _k, _v in _ISA_ENV.get(os.environ.get("CADENCE_ISA", "").strip().lower(), {}).items():
        os.environ.setdefault(_k, _v)

from cadence.cliargs import add_fields, from_args
from cadence.errors import CadenceError
from cadence.fast import QUANTS
from cadence.system import signals


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a HF model directory, or a .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU and on CPUs with native bf16 + oneDNN where the fast path's "
                   "bf16 is row-consistent, i.e. lossless; float32 on other CPUs) | float32 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "transformers"],
                   help="backbone forward: fast (compact decoder, Llama/Qwen families), transformers, "
                        "or auto (fast where supported)")
    p.add_argument("--quant", default="auto", choices=list(QUANTS),
                   help="auto (default: gguf where it applies, else none) | gguf: a GGUF model's own "
                        "Q4_0 / Q4_1 / Q8_0 blocks (CPU, float32; the file's weights, activations rounded to 8 "
                        "bits per 32 as llama.cpp) | none | int8 | int4: weight-only int8 / 4-bit "
                        "(groups of 32, like llama.cpp's Q4_1) projections and LM head (fast backend, CPU; LOSSY "
                        "against the unquantized model, speculation stays identical to plain decoding of the "
                        "quantized model)")


def _generate_parser(sub) -> None:
    from cadence.engine import GenerationConfig
    from cadence.methods import MethodSpec

    p = sub.add_parser("generate", help="generate text with speculative decoding")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help='JSONL file, one {"prompt": ...} per line')
    _add_model_args(p)
    add_fields(p, MethodSpec)
    add_fields(p, GenerationConfig, defaults={"max_new_tokens": 256})
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on when the model has one)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--compare", action="store_true",
                   help="also decode each prompt with vanilla (after a short warm-up of both) and print "
                        "the speed ratio")
    from cadence.pipo.command import add_generate_flags  # --pipo (LOSSY, opt-in): docs/pipo.md

    add_generate_flags(p)
    p.set_defaults(func=_run_generate)


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CadenceError("empty prompt")
        return [args.prompt]
    from cadence.prompts import jsonl_items

    items = [it.prompt for it in jsonl_items(args.prompt_file)]
    if not items:
        raise CadenceError(f"{args.prompt_file} holds no prompts")
    return items


def _run_generate(args) -> int:
    from cadence.backbone import load_backbone
    from cadence.engine import GenerationConfig
    from cadence.methods import Method, MethodSpec, make_engine

    prompts = _prompts(args)
    if getattr(args, "pipo", ""):
        from cadence.pipo.command import run_generate

        return run_generate(args, prompts)
    spec = from_args(MethodSpec, args)
    cfg = from_args(GenerationConfig, args)
    backbone = load_backbone(args.model, args.dtype, args.device, args.backend, args.quant)
    engine = make_engine(backbone, spec)
    vanilla = make_engine(backbone, MethodSpec(method=Method.VANILLA)) if args.compare else None
    chat = args.chat if args.chat is not None else bool(getattr(backbone.tokenizer, "chat_template", None))
    for prompt in prompts:
        ids = backbone.encode_prompt(prompt, chat=chat)
        if vanilla is not None:  # warm-up, excluded from the comparison
            for e in (engine, vanilla):
                e.generate(ids, GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens)))
        if args.json:
            g = engine.generate(ids, cfg)
            print(json.dumps({"prompt": prompt, "text": g.text, "method": spec.method.value,
                              "heads": spec.heads if spec.method.value != "vanilla" else None,
                              "scheduler": getattr(engine, "scheduler_name", None),
                              "lossless": cfg.rule.lossless(cfg.sampling) and not engine.allow_unverified,
                              **_precision(backbone), **g.stats.summary()}), flush=True)
            stats = g.stats
        else:
            stats = _stream(engine, ids, cfg)
        if vanilla is not None:
            _compare(stats, vanilla.generate(ids, cfg), spec)
    return 0


def _precision(backbone) -> dict:
    """dtype, quant (and why) and kernels of the backbone, for --json."""
    out = {"dtype": str(backbone.dtype).replace("torch.", "")}
    if hasattr(backbone, "quant"):
        out.update(quant=backbone.quant, quant_reason=backbone.quant_reason, kernels=backbone.kernels)
    return out


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
          f"{s.tokens_per_s:.1f} tok/s, tree {s.summary()['tree']}]", file=sys.stderr)
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
    import importlib

    parser = argparse.ArgumentParser(prog="cadence", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for module in ("cadence.training.command", "cadence.calibrate", "cadence.bench.command",
                   "cadence.training.small_heads", "cadence.server.command", "cadence.export",
                   "cadence.system.report", "cadence.pipo.command"):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

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
