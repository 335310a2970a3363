"""``cadence`` command line: generate | distill | train | bench.

Every user-facing failure is a CadenceError: printed as ``cadence: error: ...`` with
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cadence.cliargs import add_fields, from_args
from cadence.errors import CadenceError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a HF model directory, or a .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")


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
    from cadence.methods import MethodSpec, make_engine

    prompts = _prompts(args)
    spec = from_args(MethodSpec, args)
    cfg = from_args(GenerationConfig, args)
    backbone = load_backbone(args.model, args.dtype, args.device)
    engine = make_engine(backbone, spec)
    chat = args.chat if args.chat is not None else bool(getattr(backbone.tokenizer, "chat_template", None))
    for prompt in prompts:
        ids = backbone.encode_prompt(prompt, chat=chat)
        if args.json:
            g = engine.generate(ids, cfg)
            print(json.dumps({"prompt": prompt, "text": g.text, "method": spec.method.value,
                              "heads": spec.heads if spec.method.value != "vanilla" else None,
                              "tree": engine.scheduler.choose().name if engine.drafter else "root",
                              **g.stats.summary()}), flush=True)
        else:
            _stream(engine, ids, cfg)
    return 0


def _stream(engine, ids, cfg) -> None:
    """Print text as it is committed, then a one-line summary on stderr."""
    tokens: list[int] = []
    shown = ""
    for chunk in engine.stream(ids, cfg):
        tokens.extend(chunk)
        text = engine.decode(tokens)
        hit = next((s for s in cfg.stop if s in text), None)
        if hit:
            text = text[:text.index(hit)]
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
        if hit:
            break
    s = engine.last_stats
    print(f"\n[{s.new_tokens} tokens, {s.steps} steps, tau {s.tau:.2f}, {s.wall_s:.2f} s, "
          f"{s.tokens_per_s:.1f} tok/s]", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for module in ("cadence.training.command", "cadence.calibrate", "cadence.bench.command"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar hides our own output
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CadenceError as exc:
        print(f"cadence: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cadence: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
