"""Random-weight backbones in the shape of real models, for benchmarks and tests only.

Knows: the model shapes kept in ``cadence/assets/shapes/<name>/config.json`` (Hugging Face
config files without weights; where each value comes from: the README beside them), how to
build a transformers model of such a config without ever materialising it in fp32 (built
on the ``meta`` device, then given storage in the requested dtype and filled in place from
a seeded pool of normal draws, ``_fill``), how much memory that needs against what this machine has free, and
how to put ``cadence.fast``'s decoder over it.
Does not know: tokenizers (there is none: callers use random token ids), trained weights,
or what the model would say. What a random-weight model costs per forward is what the
real model of the same shape costs on the same kernels (the work does not depend on the
values); what it accepts when drafted for is meaningless, so acceptance must come from
elsewhere (``benchmarks/kernels/shapes.py`` uses the shipped heads' profiles and labels every figure
from them *predicted*).

A user's ``--model`` never reaches this module: ``load_backbone`` has no fallback to it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cadence.backbone.base import Backbone, resolve_dtype
from cadence.errors import CadenceError
from cadence.fast import arch
from cadence.fast.model import FastBackbone

SHAPES_DIR = Path(__file__).resolve().parents[1] / "assets" / "shapes"  # one folder per shape: config.json
PREFIX = "shape:"  # ``shape:llama-3.2-1b`` names a shape where a benchmark takes a model spec
INIT_STD = 0.02  # std of the normal draws for matrices and embeddings (the configs' initializer_range)
POOL = 4_194_301  # seeded normal draws that weights are read from (a prime, so rows do not repeat in step)
HEADROOM_BYTES = 1 << 30  # kept free beyond the estimate: activations, KV cache, the interpreter


def shape_names() -> list[str]:
    """The shapes kept in the package, by folder name: ['llama-3.1-8b', 'llama-3.2-1b', ...]."""
    return sorted(p.parent.name for p in SHAPES_DIR.glob("*/config.json"))


def is_shape_spec(spec: str) -> bool:
    """Whether a benchmark's model spec names a shape (``shape:NAME`` or ``shape:PATH``)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def config_path(name: str | Path) -> Path:
    """The config.json of ``name``: a kept shape (``llama-3.2-1b``, with or without the
    ``shape:`` prefix), a folder holding a config.json, or a config.json file."""
    text = str(name)
    text = text[len(PREFIX):] if text.startswith(PREFIX) else text
    kept = SHAPES_DIR / text / "config.json"
    if kept.is_file():
        return kept
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return path
    raise CadenceError(f"unknown shape {text!r}: use one of {', '.join(shape_names())}, "
                       "a folder with a config.json, or a config.json file")


def load_config(name: str | Path):
    """The transformers config of a shape."""
    path = config_path(name)
    try:
        return AutoConfig.from_pretrained(path.parent)
    except Exception as exc:  # transformers raises many types for a bad file
        raise CadenceError(f"cannot read the shape config {path}: {exc}") from exc


def parameter_count(config) -> int:
    """Parameters of a Llama-family model of ``config`` (embedding, layers, norms, untied head).
    Example: Llama-3.2-1B's config -> 1,235,814,400."""
    d, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or d // heads
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":  # q/k/v bias
        attn += heads * hd + 2 * kv * hd
    qk_norm = 2 * hd if config.model_type == "qwen3" else 0
    per_layer = attn + 3 * d * inter + 2 * d + qk_norm
    head = 0 if getattr(config, "tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * per_layer + d + head


@dataclass(frozen=True)
class MemoryPlan:
    """What building a shape needs against what this machine has, in bytes."""

    weights: int  # every parameter once, in the requested dtype
    packed_head: int  # the fast path's packed copy of the LM head (vocab x hidden)
    largest_layer: int  # one decoder layer's weights: the transient copy while packing it
    available: int  # free bytes: MemAvailable of /proc/meminfo, or the GPU's free memory (0: unknown, unchecked)

    @property
    def need(self) -> int:
        return self.weights + self.packed_head + self.largest_layer + HEADROOM_BYTES

    @property
    def fits(self) -> bool:
        return self.available == 0 or self.need <= self.available


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_plan(config, dtype: torch.dtype, device: str | torch.device = "cpu") -> MemoryPlan:
    """The memory a ``random_backbone`` of ``config`` in ``dtype`` needs (see ``MemoryPlan``);
    ``available`` is this machine's free memory on CPU, the GPU's free memory on CUDA, 0
    (unchecked) elsewhere."""
    size = torch.empty(0, dtype=dtype).element_size()
    d = config.hidden_size
    layer = (parameter_count(config) - config.vocab_size * d * (1 if config.tie_word_embeddings else 2)) \
        // max(config.num_hidden_layers, 1)
    dev = torch.device(device)
    on_cpu = dev.type == "cpu"
    if on_cpu:
        available = mem_available()
    elif dev.type == "cuda" and torch.cuda.is_available():
        available = torch.cuda.mem_get_info(dev)[0]  # free bytes on that GPU
    else:
        available = 0
    return MemoryPlan(weights=parameter_count(config) * size, packed_head=config.vocab_size * d * size if on_cpu else 0,
                      largest_layer=layer * size, available=available)


def _fill(model, seed: int, std: float) -> None:
    """Seeded values in place: norms 1; matrices, embeddings and biases N(0, std) values
    read from one seeded pool of ``POOL`` draws, each tensor from its own random offset
    (wrapping). Drawing every value separately runs one thread and took about 6 s per
    billion values on the 2-core Xeon (40 s for the 8B shape); copying from the pool runs
    at memory speed. No fp32 copy of the model ever exists: the pool is in the model's dtype."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = next(model.parameters())
    pool = torch.empty(POOL, dtype=first.dtype).normal_(0.0, std, generator=gen)
    pool = torch.cat([pool, pool]).to(first.device)  # any window of POOL values is contiguous
    seen = set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:  # a tied LM head is the embedding
            continue
        seen.add(p.data_ptr())
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        flat = p.data.view(-1)
        offset = int(torch.randint(0, POOL, (1,), generator=gen))
        for start in range(0, flat.numel(), POOL):
            n = min(POOL, flat.numel() - start)
            flat[start:start + n].copy_(pool[offset:offset + n])


def random_model(config, dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str | torch.device = "cpu",
                 std: float = INIT_STD):
    """A transformers causal LM of ``config`` with seeded random weights in ``dtype`` on
    ``device``, built on the meta device first (no fp32 copy, no second copy). Its EOS is
    cleared (``eos_token_id`` None): a random model's EOS means nothing, and decoding it runs
    for the tokens asked."""
    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    rotary = model.model.rotary_emb  # its inv_freq buffers are not parameters: to_empty left them empty
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    _fill(model, seed, std)
    model.config.eos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return model.eval()


def random_backbone(name: str | Path, dtype: str | torch.dtype = "bfloat16", seed: int = 0,
                    device: str | torch.device = "cpu", kernel: str = "auto", check_memory: bool = True):
    """``cadence.fast.FastBackbone`` over a random-weight model of the shape ``name``
    (``shape_names()``, a folder or a config.json). CadenceError, before anything is
    allocated, when the shape needs more memory than the machine has free (``memory_plan``;
    ``check_memory=False`` skips the check) or the fast path does not support it."""
    dev = torch.device(device)
    dt = resolve_dtype(dtype, dev)
    config = load_config(name)
    arch.check(config)
    plan = memory_plan(config, dt, dev)
    if check_memory and not plan.fits:
        gib = 1 << 30
        raise CadenceError(
            f"shape {Path(str(name)).name} in {str(dt).removeprefix('torch.')} needs about {plan.need / gib:.1f} GiB "
            f"(weights {plan.weights / gib:.1f}, packed LM head {plan.packed_head / gib:.1f}, one layer while packing "
            f"{plan.largest_layer / gib:.1f}, headroom {HEADROOM_BYTES / gib:.0f}); this machine has "
            f"{plan.available / gib:.1f} GiB available. Use bfloat16 or a smaller shape, or free memory.")
    model = random_model(config, dt, seed, dev)
    label = config_path(name).parent.name
    backbone = Backbone(model, None, name=f"shape:{label}")
    return FastBackbone.from_backbone(backbone, kernel=kernel)


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS of /proc/self/status; 0 where unknown)."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def describe(name: str | Path) -> dict:
    """The shape's defining values, as reports print them."""
    c = load_config(name)
    raw = json.loads(config_path(name).read_text())
    return {"name": config_path(name).parent.name, "model_type": c.model_type, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "intermediate": c.intermediate_size, "heads": c.num_attention_heads,
            "kv_heads": getattr(c, "num_key_value_heads", None), "head_dim": getattr(c, "head_dim", None)
            or c.hidden_size // c.num_attention_heads, "vocab": c.vocab_size,
            "tied_head": bool(getattr(c, "tie_word_embeddings", False)), "parameters": parameter_count(c),
            "rope_scaling": raw.get("rope_scaling")}
