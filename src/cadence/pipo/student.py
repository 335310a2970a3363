"""The PIPO student: compressor, LoRA adapter, pair-out head and confidence head on a frozen backbone.

Knows: the three small modules, how the adapter is attached (``peft`` LoRA injected into a copy
of the backbone's module tree that shares every weight tensor with it, so the backbone itself,
and with it plain and speculative decoding, is untouched), the per-position gate that switches
the adapter on at pair positions only, and the directory format (``config.json`` +
``pipo.safetensors``, bfloat16). Does not know training, decoding loops or data.

Shapes: B batch, n positions, d model width, V vocabulary.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cadence.backbone.base import cache_kwarg
from cadence.errors import CadenceError
from cadence.pipo.config import StudentConfig

CONFIG = "config.json"
WEIGHTS = "pipo.safetensors"
FORMAT = "cadence-pipo-1"
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "heads" / "smollm2" / "pipo"


class PairCompressor(nn.Module):
    """[e(a) ; e(b)] -> one latent: ``e(b) + W_up silu(W_down [e(a); e(b)])``. W_up starts at zero,
    so an untrained compressor keeps the second token of the pair (and drops the first)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.down = nn.Linear(2 * d, hidden)
        self.up = nn.Linear(hidden, d, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, ea: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
        # ea, eb: (..., d) embeddings of the pair's first and second token -> (..., d)
        dt = self.up.weight.dtype if not torch.is_autocast_enabled(ea.device.type) else ea.dtype
        ea, eb = ea.to(dt), eb.to(dt)
        return eb + self.up(nn.functional.silu(self.down(torch.cat([ea, eb], -1))))


class PairHead(nn.Module):
    """Pair-out (MTP) head: from the hidden state h that predicts token a (LM head) and a's
    embedding, a state whose LM-head logits predict the token after a:
    ``h + W_up silu(W_down [h; e(a)])`` (W_up zero at start)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.down = nn.Linear(2 * d, hidden)
        self.up = nn.Linear(hidden, d, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor, ea: torch.Tensor) -> torch.Tensor:
        # h: (..., d) final-norm hidden; ea: (..., d) -> (..., d)
        dt = self.up.weight.dtype if not torch.is_autocast_enabled(h.device.type) else h.dtype
        x = torch.cat([h.to(dt), ea.to(dt)], -1)
        return (h.to(dt) + self.up(nn.functional.silu(self.down(x)))).to(h.dtype)


class PairConfidence(nn.Module):
    """P(the pair-out draft b would be kept), trained on ``min(1, p_teacher(b) / q_student(b))``,
    from [h ; g ; e(b) ; log q(b) ; entropy of q] (g: the pair head's state)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3 * d + 2, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def logit(self, h, g, eb, logq, ent) -> torch.Tensor:
        # h, g, eb: (..., d); logq, ent: (...,) -> (...,) logit
        x = torch.cat([h.float(), g.float(), eb.float(), logq.float()[..., None], ent.float()[..., None]], -1)
        return self.net(x.to(self.net[0].weight.dtype))[..., 0]

    def forward(self, h, g, eb, logq, ent) -> torch.Tensor:
        return torch.sigmoid(self.logit(h, g, eb, logq, ent).float())


def _peft():
    try:
        import peft  # optional: only PIPO needs it
    except ImportError as exc:
        raise CadenceError("PIPO needs the peft package: pip install 'peft>=0.21' (older peft does not import with transformers 5)") from exc
    return peft


def _hf_model(backbone) -> nn.Module:
    model = getattr(backbone, "model", None)
    if model is None or not hasattr(model, "model") or not hasattr(model, "get_input_embeddings"):
        raise CadenceError("PIPO needs the transformers backend (--backend transformers)")
    return model


class Student(nn.Module):
    """Trainable parts (``compressor``, ``pair_head``, ``confidence``, the LoRA tensors) plus
    references to the frozen backbone (``base``: its own Hugging Face model, never modified)
    and ``adapted``: a copy of that model's module tree holding the *same* weight tensors, with
    LoRA adapters injected. Only adapter tensors are new; ``base`` is not a registered submodule."""

    def __init__(self, backbone, cfg: StudentConfig | None = None):
        super().__init__()

        cfg = cfg or StudentConfig()
        base = _hf_model(backbone)
        object.__setattr__(self, "base", base)  # not registered: its weights are not ours
        object.__setattr__(self, "backbone", backbone)
        shared = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}
        adapted = copy.deepcopy(base, memo=shared)
        names = {n.rsplit(".", 1)[-1] for n, m in adapted.named_modules() if isinstance(m, nn.Linear)}
        missing = [t for t in cfg.lora_targets if t not in names]
        if missing:
            raise CadenceError(f"LoRA targets {missing} are not linear layers of {backbone.name}")
        peft = _peft()
        peft.inject_adapter_in_model(peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                     target_modules=list(cfg.lora_targets), lora_dropout=0.0,
                                                     bias="none"), adapted)
        self.adapted = adapted
        self.cfg = cfg
        d = base.config.hidden_size
        self.compressor = PairCompressor(d, cfg.compressor_hidden)
        self.pair_head = PairHead(d, cfg.pair_head_hidden)
        self.confidence = PairConfidence(d, cfg.confidence_hidden)
        self._gate: torch.Tensor | None = None  # (B, n, 1) while a gated forward runs
        for m in adapted.modules():
            if hasattr(m, "lora_B"):
                for lin in m.lora_B.values():
                    lin.register_forward_hook(self._gate_hook)
        self._cache_kwarg = cache_kwarg(base.model)
        self.to(device=backbone.device)

    # ------------------------------------------------------------ parameters

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.adapted.named_parameters() if "lora_" in n}

    def trainable(self) -> list[nn.Parameter]:
        """Everything trained: the adapter, the compressor and the two heads."""
        return list(self.lora_parameters().values()) + [
            p for m in (self.compressor, self.pair_head, self.confidence) for p in m.parameters()]

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"lora.{n}": p.detach() for n, p in self.lora_parameters().items()}
        for name in ("compressor", "pair_head", "confidence"):
            out.update({f"{name}.{k}": v.detach() for k, v in getattr(self, name).state_dict().items()})
        return out

    def load_state(self, sd: dict[str, torch.Tensor]) -> None:
        own = self.state()
        if set(sd) != set(own):
            extra, missing = sorted(set(sd) - set(own))[:3], sorted(set(own) - set(sd))[:3]
            raise CadenceError(f"PIPO weights do not match this student (unexpected {extra}, missing {missing})")
        with torch.no_grad():
            for k, v in sd.items():
                if v.shape != own[k].shape:
                    raise CadenceError(f"PIPO weight {k}: shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
                own[k].copy_(v.to(own[k].dtype))

    # ------------------------------------------------------------ forwards

    def _gate_hook(self, module, inputs, output):
        return output if self._gate is None else output * self._gate.to(output.dtype)

    @property
    def embed(self) -> nn.Embedding:
        return self.base.get_input_embeddings()

    def latents(self, ids: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """ids (B, n, 2), sizes (B, n) in {1, 2} -> input vectors (B, n, d): the compressor's latent
        at pair positions, the token's own embedding at plain ones."""
        e = self.embed(ids)
        pair = self.compressor(e[..., 0, :], e[..., 1, :]).to(e.dtype)
        return torch.where((sizes == 2)[..., None], pair, e[..., 0, :])

    def run(self, embeds: torch.Tensor, gate: torch.Tensor | None, cache=None,
            position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder over input vectors embeds (B, n, d) -> final-norm hidden (B, n, d).
        gate (B, n): 1 where the adapter is read (pair positions), 0 where the unmodified weights
        are (plain positions); None = 1 everywhere. An all-zero gate runs ``base`` itself.
        cache: a transformers Cache (mutated), or None."""
        tree = self.adapted
        g = None
        if gate is not None:
            if not bool(gate.any()):
                tree = self.base
            elif not bool(gate.all()):
                g = gate.to(embeds.dtype)[..., None]
        kwargs = {self._cache_kwarg: cache} if cache is not None else {}
        self._gate = g
        try:
            out = tree.model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=cache is not None, **kwargs)
        finally:
            self._gate = None
        return out.last_hidden_state

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> float32 (..., V) through the backbone's own LM head."""
        return self.base.get_output_embeddings()(h).float()

    def pair_state(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """h (..., d) hidden that predicted a; a (...,) token ids -> (..., d) state predicting the token after a."""
        return self.pair_head(h, self.embed(a))

    def confidence_of(self, h, g, b, logq_all: torch.Tensor) -> torch.Tensor:
        """Confidence that draft b (...,) is kept, from h, g (..., d) and the pair head's
        log-probabilities logq_all (..., V)."""
        logq = logq_all.gather(-1, b[..., None])[..., 0]
        ent = -(logq_all.exp() * logq_all).sum(-1)
        return self.confidence(h, g, self.embed(b), logq, ent)


# ---------------------------------------------------------------- directory


def _backbone_sig(backbone) -> dict:
    c = _hf_model(backbone).config
    return {"name": backbone.name, "model_type": c.model_type, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "vocab_size": c.vocab_size}


def save_student(student: Student, out: str | Path, meta: dict | None = None) -> Path:
    """Write ``out`` (replaced atomically): config.json (format, backbone, student config, meta)
    and pipo.safetensors (bfloat16)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous().cpu() for k, v in student.state().items()}, str(tmp / WEIGHTS))
    cfg = {"format": FORMAT, "lossy": True, "backbone": _backbone_sig(student.backbone),
           "student": student.cfg.to_dict(), **(meta or {})}
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def resolve_dir(spec: str) -> Path:
    """A --pipo value: a directory, or ``shipped`` (the compressor shipped for the default model)."""
    path = SHIPPED if spec == "shipped" else Path(spec).expanduser()
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        hint = " (the shipped compressor is missing from this install)" if spec == "shipped" else ""
        raise CadenceError(f"{spec!r} is not a PIPO directory: it needs {CONFIG} and {WEIGHTS}{hint}")
    return path


def load_student(backbone, spec: str) -> tuple[Student, dict]:
    """Load a PIPO directory onto ``backbone``; CadenceError when it was trained for another model."""
    path = resolve_dir(spec)
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CadenceError(f"{path / CONFIG} is unreadable: {exc}") from exc
    if cfg.get("format") != FORMAT:
        raise CadenceError(f"{path} is not a PIPO directory (format {cfg.get('format')!r})")
    want, have = cfg.get("backbone", {}), _backbone_sig(backbone)
    bad = {k: (want.get(k), have[k]) for k in have if k != "name" and want.get(k) != have[k]}
    if bad:
        raise CadenceError(f"{path} was trained for another backbone: {bad} (trained, loaded)")
    st = cfg.get("student", {})
    student = Student(backbone, StudentConfig(**{**st, "lora_targets": tuple(st.get("lora_targets", ()))}))
    try:
        sd = load_file(str(path / WEIGHTS))
    except Exception as exc:
        raise CadenceError(f"{path / WEIGHTS} is unreadable: {exc}") from exc
    student.load_state(sd)
    return student.eval(), cfg
