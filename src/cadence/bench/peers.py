"""Baselines from other libraries, measured in the same run as cadence's methods.

Each peer has ``generate(prompt_ids, GenerationConfig) -> Generation`` like ``Engine``:
- ``hf-generate``: transformers ``model.generate`` on the very same loaded model (greedy or
  sampled as configured; no stop strings, no repetition penalty).
- ``hf-pld``: the same with transformers prompt-lookup decoding (``prompt_lookup_num_tokens=10``).
- ``llama.cpp``: llama-cpp-python on the GGUF the model was loaded from (the default model's
  ``smollm2_gguf_path()``), 2 threads for decoding and for the prompt, greedy sampler,
  no repetition penalty, context as long as the model's. Optional: when ``llama_cpp`` cannot
  be imported, or a test decode in a child process dies (a build with instructions this
  CPU cannot run: SIGILL would kill the whole benchmark), the peer is skipped and the report
  says so, with the build command
  (``python benchmarks/peers/build_llama_cpp.py``, which derives the CPU flags). It is fed the
  harness's token ids, i.e. the prompt through the HF tokenizer's chat template exactly as
  cadence's methods get it, and never re-tokenizes text: llama.cpp's own tokenizer splits
  some prompts differently (whitespace before digits in 3 of 45 HumanEval/GSM8K/writing
  prompts), while the ids map to the same vocabulary (same GGUF). Timing covers prefill and
  decoding, like cadence's. Its output is from the quantized weights (and quantized
  activations), so it is not expected to be identical to cadence's float decoding.

Peers have no step log; ``hf-generate`` runs one forward per token (tau 1), the others
report no tau.
"""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig as HFConfig

from cadence.backbone.load import DEFAULT_MODEL, smollm2_gguf_path
from cadence.decode.generation import Generation, GenerationConfig, Stats
from cadence.errors import CadenceError

PEERS = ("hf-generate", "hf-pld", "llama.cpp")
PLD_TOKENS = 10
LLAMA_CPP_THREADS = 2


def _strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


class HFGenerate:
    """transformers ``generate``, optionally with prompt lookup."""

    def __init__(self, backbone, prompt_lookup: int | None = None):
        self.backbone = backbone
        self.prompt_lookup = prompt_lookup

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generation:
        bb = self.backbone
        eos = sorted(bb.eos_token_ids)
        kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=not cfg.sampling.greedy,
                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
        if not cfg.sampling.greedy:
            kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        gen_cfg = HFConfig(**kw)
        ids = torch.tensor([prompt_ids], device=bb.device)
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        out = bb.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        wall = time.perf_counter() - t0
        tokens = out[0, len(prompt_ids):].tolist()
        for i, t in enumerate(tokens):  # cut padding after the first EOS
            if t in bb.eos_token_ids:
                tokens = tokens[:i + 1]
                break
        stats = Stats(new_tokens=len(tokens), steps=0 if self.prompt_lookup else len(tokens), wall_s=wall)
        text = bb.tokenizer.decode(tokens, skip_special_tokens=True) if bb.tokenizer is not None else ""
        return Generation(tokens=tokens, text=text, stats=stats)


def _parameters(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def build_note(llama_cpp, threads: int) -> str:
    """Which llama.cpp build ran, for the report's notes (a build limited to AVX2 on PYTHONPATH is
    not the installed one): version, directory, threads and its instruction flags."""
    info = getattr(llama_cpp, "llama_print_system_info", lambda: b"")()
    info = " ".join((info.decode() if isinstance(info, bytes) else str(info)).split())
    where = getattr(llama_cpp, "__file__", None)
    return (f"llama.cpp: llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
            + (f" from {Path(where).parent}" if where else "") + f", {threads} threads" + (f"; {info}" if info else ""))


class LlamaCpp:
    """llama-cpp-python on a GGUF file (plain decoding, 2 threads)."""

    def __init__(self, gguf: Path, backbone, n_ctx: int | None = None, threads: int = LLAMA_CPP_THREADS):
        import llama_cpp  # optional peer: llama-cpp-python, only when it runs

        self.backbone = backbone
        n_ctx = n_ctx or int(getattr(backbone, "max_positions", 4096) or 4096)
        kw = dict(model_path=str(gguf), n_threads=threads, n_ctx=n_ctx, verbose=False)
        # the prompt's threads too: their default is every core, which would favour llama.cpp's
        # prefill on a larger machine (older llama-cpp-python versions lack the parameter)
        if "n_threads_batch" in _parameters(llama_cpp.Llama):
            kw["n_threads_batch"] = threads
        self.llm = llama_cpp.Llama(**kw)
        self.eos = {int(self.llm.token_eos())} | set(backbone.eos_token_ids)
        self.build = build_note(llama_cpp, threads)

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generation:
        greedy = cfg.sampling.greedy
        if hasattr(self.llm, "set_seed"):
            self.llm.set_seed(cfg.seed)
        self.llm.reset()
        tokens: list[int] = []
        t0 = time.perf_counter()
        for t in self.llm.generate(prompt_ids, temp=0.0 if greedy else cfg.temperature,
                                   top_k=1 if greedy else (cfg.top_k or 0), top_p=1.0 if greedy else cfg.top_p,
                                   min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(t))
            if int(t) in self.eos or len(tokens) >= cfg.max_new_tokens:
                break
        wall = time.perf_counter() - t0
        text = self.backbone.tokenizer.decode(tokens, skip_special_tokens=True) \
            if self.backbone.tokenizer is not None else ""
        return Generation(tokens=tokens, text=text, stats=Stats(new_tokens=len(tokens), steps=0, wall_s=wall))


def llama_cpp_available() -> tuple[bool, str]:
    try:
        import llama_cpp  # noqa: F401  (optional peer: is it importable?)
    except Exception as exc:  # ImportError, or a broken native library
        return False, (f"llama.cpp skipped: the llama_cpp package is not importable ({type(exc).__name__}: "
                       f"{exc}); it is optional: build it for this CPU with "
                       "`python benchmarks/peers/build_llama_cpp.py` (see benchmarks/README.md)")
    return True, ""


# a child process decodes 4 tokens of argv[1] (a GGUF file)
_PROBE = ("import sys, llama_cpp\n"
          "llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=2, n_ctx=64, verbose=False)\n"
          "llm.create_completion('Hello', max_tokens=4, temperature=0.0)\n")


def llama_cpp_decodes(gguf: Path, timeout: float = 120.0, code: str = _PROBE) -> tuple[bool, str]:
    """Whether llama.cpp decodes ``gguf`` in a child process (a few seconds): a native crash
    there costs the benchmark one peer, not the whole run."""
    fix = "; rebuild it for this CPU with `python benchmarks/peers/build_llama_cpp.py`"
    try:
        r = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"llama.cpp skipped: a test decode in a child process took over {timeout:.0f} s{fix}"
    if r.returncode == 0:
        return True, ""
    if r.returncode == -signal.SIGILL:
        why = "SIGILL: the build uses an instruction this CPU cannot run"
    else:
        why = f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
    return False, f"llama.cpp skipped: a test decode in a child process died ({why}){fix}"


def gguf_for(model_spec: str) -> Path | None:
    """The GGUF file behind a --model value, when there is one."""
    if model_spec == DEFAULT_MODEL:
        return smollm2_gguf_path()
    path = Path(model_spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def make_peer(name: str, backbone, model_spec: str | None):
    """The peer engine for ``name``, or raise CadenceError with the reason it is unavailable."""
    if name == "hf-generate":
        return HFGenerate(backbone)
    if name == "hf-pld":
        return HFGenerate(backbone, prompt_lookup=PLD_TOKENS)
    if name == "llama.cpp":
        ok, why = llama_cpp_available()
        if not ok:
            raise CadenceError(why)
        gguf = gguf_for(model_spec) if model_spec else None
        if gguf is None:
            raise CadenceError("llama.cpp skipped: the model was not loaded from a GGUF file")
        ok, why = llama_cpp_decodes(gguf)
        if not ok:
            raise CadenceError(why)
        return LlamaCpp(gguf, backbone)
    raise CadenceError(f"unknown peer {name!r}; peers: {', '.join(PEERS)}")
