"""``cadence train-pipo`` and the ``cadence generate --pipo`` hook. Flags derive from
``cadence.pipo.config``; registering imports neither peft nor torch-heavy modules."""

from __future__ import annotations

import json
import sys
import time

from cadence.backbone.load import load_backbone
from cadence.cliargs import add_fields, from_args
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.pipo.config import PipoDecodeConfig, StudentConfig, TrainPipoConfig
from cadence.pipo.decode import PipoDecoder
from cadence.pipo.student import load_student
from cadence.pipo.train import train_pipo

LOSSY_NOTE = ("LOSSY: PIPO output is not plain decoding's (the prompt is read as compressed token pairs"
              "{pairs}); quality: docs/pipo.md")


def register(sub) -> None:
    p = sub.add_parser("train-pipo", help="PIPO (LOSSY, opt-in): train the pair compressor, LoRA adapter, "
                                          "pair-out and confidence heads by on-policy distillation",
                       description="On-policy distillation of a PIPO student (compressor folding two input "
                                   "tokens into one position, LoRA adapter, pair-out head, confidence head) "
                                   "from the unmodified backbone, on prompts of a self-distillation store. "
                                   "Resumes from OUT/checkpoint.pt; writes OUT/final (load it with "
                                   "`cadence generate --pipo OUT/final`). See docs/pipo.md.")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a HF model directory, or a .gguf file")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_fields(p, TrainPipoConfig)
    add_fields(p, StudentConfig)
    p.set_defaults(func=run_train_pipo)


def add_generate_flags(p) -> None:
    """The --pipo flags of ``cadence generate`` (inert unless --pipo is given)."""
    add_fields(p, PipoDecodeConfig)


def run_train_pipo(args) -> int:
    cfg = from_args(TrainPipoConfig, args)
    scfg = from_args(StudentConfig, args)
    # --bf16: the frozen backbone (teacher and student alike) is held in bfloat16, which halves the
    # memory traffic of every forward; the trained tensors stay float32
    backbone = load_backbone(args.model, "bfloat16" if cfg.bf16 else "float32", args.device, "transformers", "none")
    t0 = time.time()
    summary = train_pipo(cfg, scfg, backbone)
    summary["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(summary), flush=True)
    return 0


def run_generate(args, prompts: list[str]) -> int:
    """``cadence generate --pipo DIR``: PIPO decoding of each prompt (the speculative method flags
    do not apply)."""
    pcfg = from_args(PipoDecodeConfig, args)
    cfg = from_args(GenerationConfig, args)
    if args.compare:
        raise CadenceError("--compare does not apply to --pipo; benchmarks/e2e/pipo_bench.py compares PIPO "
                           "with plain decoding")
    if cfg.stop:
        raise CadenceError("--stop is not supported with --pipo")
    if args.backend == "fast" or args.quant not in ("auto", "none"):
        raise CadenceError("--pipo runs on the transformers backend without --quant (its adapter is "
                           "a peft LoRA on transformers modules)")
    dtype = "float32" if args.dtype == "auto" else args.dtype
    backbone = load_backbone(args.model, dtype, args.device, "transformers", "none")
    student, meta = load_student(backbone, pcfg.pipo)
    decoder = PipoDecoder(student, pcfg.pipo_mode, pcfg.pipo_accept, pcfg.pipo_threshold)
    chat = args.chat if args.chat is not None else bool(getattr(backbone.tokenizer, "chat_template", None))
    pairs = pcfg.pipo_mode == "pairs"
    note = LOSSY_NOTE.format(pairs=(", and the reply's second tokens are " + (
        "kept on the confidence head's word, unverified" if pcfg.pipo_accept == "confidence"
        else "verified over the compressed prompt")) if pairs else "")
    for prompt in prompts:
        ids = backbone.encode_prompt(prompt, chat=chat)
        limit = backbone.max_positions
        if len(ids) + cfg.max_new_tokens > 2 * limit:
            raise CadenceError(f"prompt of {len(ids)} tokens + {cfg.max_new_tokens} new tokens is too long")
        res = decoder.generate(ids, cfg.max_new_tokens, cfg.temperature, cfg.seed, backbone.eos_token_ids)
        text = backbone.tokenizer.decode(res.tokens, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "method": "pipo", "pipo": pcfg.pipo,
                              "pipo_mode": pcfg.pipo_mode,
                              "pipo_accept": pcfg.pipo_accept if pairs else None,
                              "pipo_threshold": pcfg.pipo_threshold if pairs and pcfg.pipo_accept == "confidence"
                              else None,
                              "lossless": False, "lossy": True, "note": note,
                              "trained_steps": meta.get("training", {}).get("step"),
                              "dtype": str(backbone.dtype).replace("torch.", ""), **res.summary()}), flush=True)
        else:
            print(text, flush=True)
            s = res.summary()
            print(f"[pipo {pcfg.pipo_mode}{'/' + pcfg.pipo_accept if pairs else ''} (LOSSY): {s['new_tokens']} "
                  f"tokens, {s['forwards']} forwards, prompt {len(ids)} tokens in {s['prompt_positions']} "
                  f"positions, ttft {s['ttft_s']:.3f} s, {s['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0
