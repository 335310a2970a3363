"""``cadence export``: trained heads as a draft-model directory for vLLM / SGLang.

Knows three layouts, each checked by reading the servers' loaders.

EAGLE-1 (``vllm-eagle``, ``sglang-eagle``; vLLM ``vllm/model_executor/models/llama_eagle.py``
at commit 00da923 of vllm-project/vllm, SGLang ``python/sglang/srt/models/llama_eagle.py``
at 034b3be of sgl-project/sglang):

* ``config.json``: the backbone's Llama config with ``num_hidden_layers`` = the drafter's
  layers (1 for EAGLE-1; both loaders build that many, only layer 0 without its input norm) and
  ``architectures = ["EagleLlamaForCausalLM"]`` (vLLM) or ``["LlamaForCausalLMEagle"]``
  (SGLang); the layer's shape (heads, kv heads, head_dim, intermediate size, RoPE theta,
  RMS eps) is the one the heads were trained with;
* ``model.safetensors``: ``fc.weight`` [H, 2H] applied to ``cat(embedding, hidden)`` (that
  order in both loaders; SGLang's ``fc`` has a bias, written as zeros) and ``layers.{i}.*``
  with transformers' ``LlamaDecoderLayer`` names, layer 0 with no ``input_layernorm`` (both
  servers drop it there). No ``embed_tokens`` / ``lm_head``: both share the target model's
  (vLLM skips ``embed_tokens`` from the draft checkpoint when pipeline parallelism is off).
  The draft vocabulary (a cadence-only speed-up) is not exported: servers draft over the
  full vocabulary with the shared LM head, which the heads were trained through.

Medusa (``vllm-medusa``; vLLM ``vllm/model_executor/models/medusa.py`` and
``vllm/transformers_utils/configs/medusa.py`` at commit 09cddad of vllm-project/vllm):

* ``config.json``: ``model_type: medusa``, ``num_heads``, ``num_hidden_layers`` (1: one
  residual block per head), ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``,
  ``medusa_fc_bias: true`` (cadence's blocks have a bias) and ``original_lm_head: true`` (one
  LM head shared by every head, as cadence shares the backbone's);
* ``model.safetensors``: ``blocks.{i}.layers.0.weight`` / ``.bias`` (head i's block,
  x + SiLU(W x + b) in both) and ``lm_heads.0.weight``: the backbone's LM head, cut to the
  draft vocabulary when the heads have one, with that vocabulary as ``token_map`` (vLLM
  scatters the cut logits back into the full vocabulary, so the argmax is cadence's).

EAGLE-3 (``vllm-eagle3``, ``sglang-eagle3``; ``--format vllm|sglang`` with eagle3 heads): vLLM
``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``) at commit 00bd149 of
vllm-project/vllm, with the target-side capture in ``vllm/model_executor/models/llama.py`` (e06c9ba)
and ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (da84445); SGLang
``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``) at 03d5a77 of
sgl-project/sglang, with ``python/sglang/srt/models/llama.py`` (``set_eagle3_layers_to_capture``,
0023954) and the ``eagle_config`` lookup of ``python/sglang/srt/model_executor/model_runner.py``:

* ``model.safetensors``: ``fc.weight`` [H, 3H] over the three taps concatenated low to high
  (no bias: SGLang's ``fc`` has one only when the config says ``bias``), ``midlayer.*`` (one
  decoder layer: ``input_layernorm`` on the embedding, ``hidden_norm`` on the fused feature,
  ``self_attn.{q,k,v}_proj`` [.., 2H] over ``[embedding ; fused]`` in that order, ``o_proj``,
  ``post_attention_layernorm``, ``mlp.*``; vLLM renames ``midlayer.`` to ``layers.0.``),
  ``norm.weight``, ``lm_head.weight`` [V', H] (the draft vocabulary), ``d2t`` [V'] int64 (target id
  minus draft index; both add ``arange(V')`` back) and ``t2d`` [V] bool (both loaders skip it; the
  reference stores it). No ``embed_tokens``: both share the target's. The residual stream of the
  layer is the un-normed fused feature (vLLM's default ``norm_before_residual: false``, SGLang's
  only form), the drafter's own output before ``norm`` is fed back, as cadence drafts;
* ``config.json``: the backbone's Llama config with ``num_hidden_layers`` 1, ``architectures``
  ``["Eagle3LlamaForCausalLM"]`` (vLLM) or ``["LlamaForCausalLMEagle3"]`` (SGLang),
  ``draft_vocab_size`` V', ``target_hidden_size`` H, ``tie_word_embeddings: false`` (SGLang
  would otherwise use the embedding as the LM head) and the taps. The two servers number taps
  differently: vLLM captures the residual stream *entering* layer i (0-based), i.e. after i
  layers, which is cadence's 1-based tap i, read from a top-level
  ``eagle_aux_hidden_state_layer_ids``; SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
  as 0-based *output* layers and adds 1, so it gets tap - 1. Without ids both default to
  (2, L // 2, L - 3), cadence's default taps.

Refused (not written half-compatible): eagle3 heads with other than three taps (both ``fc``s
are 3H wide), taps outside the backbone's layers or a backbone of another width (when the
backbone's config is known), weights that miss any of the layout's norms or projections.

Does not know: mtp / mtp-attn / hydra export. vLLM's MTP models (``deepseek_mtp``,
``mimo_mtp``) belong to those architectures, and there is no vLLM counterpart for MTP
modules on a Llama backbone or for Hydra heads, so they are refused rather than written
half-compatible. Not checked here: loading in a running vLLM / SGLang (neither is installed
on this machine); the tests rebuild each layout's forward from the exported tensors and
re-import the directory into cadence (identical drafts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cadence.backbone.load import load_backbone, resolve_model_dir
from cadence.errors import CadenceError
from cadence.heads.base import HeadConfig
from cadence.heads.io import head_class, new_heads
from cadence.system.atomic import atomic_write, atomic_write_json

FORMATS = {"vllm-eagle": "EagleLlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle",
           "vllm-eagle3": "Eagle3LlamaForCausalLM", "sglang-eagle3": "LlamaForCausalLMEagle3",
           "vllm-medusa": "MedusaModel"}
KIND_OF = {"vllm-eagle": "eagle", "sglang-eagle": "eagle", "vllm-eagle3": "eagle3", "sglang-eagle3": "eagle3",
           "vllm-medusa": "medusa"}
ALIASES = {"eagle": "vllm-eagle", "medusa": "vllm-medusa", "eagle3": "vllm-eagle3"}  # vLLM's layouts
SERVERS = ("vllm", "sglang")  # --format vllm|sglang: that server's layout for the heads' kind (or --method)
WEIGHTS = "model.safetensors"


def _llama_config(heads, backbone_config: dict | None, fmt: str) -> dict:
    c = heads.cfg
    base = dict(backbone_config or {})
    for k in ("architectures", "quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        base.pop(k, None)
    base.update({
        "architectures": [FORMATS[fmt]], "model_type": "llama", "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_eps, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "rope_theta": c.rope_theta, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })
    base.setdefault("rope_parameters", {"rope_type": "default"})
    if isinstance(base.get("rope_parameters"), dict):
        base["rope_parameters"] = {**base["rope_parameters"], "rope_theta": c.rope_theta}
    base.setdefault("max_position_embeddings", 8192)
    base["cadence"] = {"kind": c.kind, "backbone": c.backbone, "num_heads": c.num_heads,
                       "note": "EAGLE-1 draft layer exported by cadence; embed_tokens / lm_head are the target's"}
    return base


def eagle_state(heads, fmt: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The server-side tensors of ``heads`` (an EagleHeads)."""
    out = {"fc.weight": heads.fc.weight}
    for i, layer in enumerate(heads.layers):
        for name, t in layer.state_dict().items():
            out[f"layers.{i}.{name}"] = t
    if fmt == "sglang-eagle":
        out["fc.bias"] = torch.zeros(heads.cfg.hidden_size)
    return {k: v.detach().to(dtype).cpu().contiguous() for k, v in out.items()}


def eagle3_state(heads, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The server-side tensors of ``heads`` (Eagle3Heads): weights in ``dtype``, ``d2t`` (V',)
    int64 and ``t2d`` (V,) bool. Example: draft vocabulary [0, 5, 9] of V = 12 -> d2t [0, 4, 7],
    t2d True at 0, 5 and 9."""
    out = {"fc.weight": heads.fc.weight, "norm.weight": heads.norm.weight, "lm_head.weight": heads.lm_head.weight}
    for name, t in heads.midlayer.state_dict().items():
        out[f"midlayer.{name}"] = t
    out = {k: v.detach().to(dtype).cpu().contiguous() for k, v in out.items()}
    V = heads.cfg.vocab_size
    ids = torch.arange(V) if heads.draft_vocab is None else heads.draft_vocab.detach().long().cpu()
    out["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def _eagle3_config(heads, backbone_config: dict | None, fmt: str) -> dict:
    """``_llama_config`` plus what the EAGLE-3 loaders read (module docstring)."""
    c = heads.cfg
    conf = _llama_config(heads, backbone_config, fmt)
    conf.update(num_hidden_layers=1, draft_vocab_size=int(heads.lm_head.out_features),
                target_hidden_size=c.hidden_size, tie_word_embeddings=False)
    if fmt == "vllm-eagle3":
        conf.update(eagle_aux_hidden_state_layer_ids=list(c.taps), norm_before_residual=False,
                    eagle_config={"use_aux_hidden_state": True})
    else:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in c.taps]}
    conf["cadence"] = {**conf["cadence"], "taps": list(c.taps),
                       "note": "EAGLE-3 drafter exported by cadence; embed_tokens is the target's"}
    return conf


def _check_eagle3(cfg, heads_dir: Path, backbone_config: dict | None) -> None:
    """Refuse eagle3 heads the EAGLE-3 layout cannot hold (module docstring)."""
    if len(cfg.taps) != 3:
        raise CadenceError(f"{heads_dir} is an eagle3 drafter over taps {cfg.taps}: vLLM's and SGLang's EAGLE-3 "
                           "fc takes exactly three (low, middle, high); not exportable")
    if backbone_config:
        n = int(backbone_config.get("num_hidden_layers", 0) or 0)
        if n and any(not 1 <= j < n for j in cfg.taps):
            raise CadenceError(f"taps {cfg.taps} of {heads_dir} are not layers 1..{n - 1} of this backbone "
                               "(wrong --model?): the servers could not capture them")
        width = backbone_config.get("hidden_size")
        if width is not None and int(width) != cfg.hidden_size:
            raise CadenceError(f"{heads_dir} was trained on hidden size {cfg.hidden_size}, this backbone has "
                               f"{width}: wrong --model for these heads")


def resolve_format(fmt: str, kind: str, method: str | None = None) -> str:
    """``--format`` (and ``--method``) to a layout name of ``FORMATS`` for heads of ``kind``.
    Example: ("vllm", "eagle3") -> "vllm-eagle3"; ("eagle", "eagle") -> "vllm-eagle"."""
    if method and method != kind:
        raise CadenceError(f"--method {method}, but the heads directory holds {kind} heads")
    if fmt in SERVERS:
        fmt = f"{fmt}-{method or kind}"
        if fmt not in FORMATS:
            raise CadenceError(f"no {fmt.split('-', 1)[0]} layout for {method or kind} heads; exportable: "
                               + ", ".join(sorted(FORMATS)))
    return ALIASES.get(fmt, fmt)


def medusa_state(heads, lm_weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The server-side tensors of ``heads`` (MedusaHeads); lm_weight (V, H): the backbone's
    LM head. Example: K = 3, a draft vocabulary of 8192 ids -> blocks.{0,1,2}.layers.0.weight
    (H, H) and .bias (H,), lm_heads.0.weight (8192, H), token_map (8192,) int64."""
    out = {}
    for i, block in enumerate(heads.blocks):
        out[f"blocks.{i}.layers.0.weight"] = block.linear.weight
        out[f"blocks.{i}.layers.0.bias"] = block.linear.bias
    vocab = heads.draft_vocab
    out["lm_heads.0.weight"] = lm_weight if vocab is None else lm_weight.index_select(0, vocab.to(lm_weight.device))
    out = {k: v.detach().to(dtype).cpu().contiguous() for k, v in out.items()}
    if vocab is not None:
        out["token_map"] = vocab.detach().long().cpu().contiguous()
    return out


def _medusa_config(heads) -> dict:
    c = heads.cfg
    vocab = heads.draft_vocab
    return {"model_type": "medusa", "architectures": [FORMATS["vllm-medusa"]], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": 1,
            "truncated_vocab_size": c.vocab_size if vocab is None else int(vocab.numel()),
            "medusa_fc_bias": True, "original_lm_head": True, "torch_dtype": "bfloat16",
            "cadence": {"kind": c.kind, "backbone": c.backbone, "num_heads": c.num_heads,
                        "note": "Medusa heads exported by cadence; lm_heads.0 is the target's LM head"}}


def export_heads(heads_dir: str | Path, fmt: str, out: str | Path, backbone_config: dict | None = None,
                 lm_weight: torch.Tensor | None = None, method: str | None = None) -> Path:
    """Write ``out/config.json`` and ``out/model.safetensors`` for ``fmt`` (a layout, an alias, or
    a server with the heads' kind or ``method``) from a heads directory. lm_weight (V, H): the
    backbone's LM head (``vllm-medusa`` ships it)."""
    heads_dir, out = Path(heads_dir), Path(out)
    cfg_path = heads_dir / "config.json"
    if not cfg_path.is_file() or not (heads_dir / "heads.safetensors").is_file():
        raise CadenceError(f"{heads_dir} is not a heads directory (needs config.json and heads.safetensors)")
    try:
        raw = json.loads(cfg_path.read_text())
        cfg = HeadConfig(**{k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw})
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise CadenceError(f"{cfg_path} is malformed: {exc}") from exc
    fmt = resolve_format(fmt, cfg.kind, method)
    if fmt not in FORMATS:
        raise CadenceError(f"unknown export format {fmt!r}; choose one of {', '.join([*FORMATS, *ALIASES, *SERVERS])}")
    if cfg.kind != KIND_OF[fmt]:
        raise CadenceError(f"{heads_dir} holds {cfg.kind} heads; --format {fmt} needs {KIND_OF[fmt]} heads. "
                           "Exportable: eagle (vllm-eagle, sglang-eagle), eagle3 (vllm-eagle3, sglang-eagle3) and "
                           "medusa (vllm-medusa); mtp / mtp-attn / hydra heads of cadence have no vLLM / SGLang "
                           "loader that matches them")
    if cfg.kind == "eagle3":
        _check_eagle3(cfg, heads_dir, backbone_config)
    elif cfg.taps:
        raise CadenceError(f"{heads_dir} is an eagle drafter that reads backbone taps {cfg.taps} (fc over "
                           f"{2 + len(cfg.taps)}x hidden); vLLM's and SGLang's llama_eagle take [embedding ; "
                           "hidden] only, and their EAGLE-3 drafters are a different layer: not exportable")
    if fmt == "vllm-medusa" and lm_weight is None:
        raise CadenceError("--format vllm-medusa writes the backbone's LM head: pass the backbone (--model)")
    if lm_weight is not None and tuple(lm_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CadenceError(f"the backbone's LM head is {tuple(lm_weight.shape)}, but the heads were trained for "
                           f"({cfg.vocab_size}, {cfg.hidden_size}): wrong --model for these heads")
    heads = head_class(cfg.kind)(cfg)
    try:
        state = load_file(str(heads_dir / "heads.safetensors"))
        vocab = state.pop("draft_vocab", None)
        missing, unexpected = heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        heads.draft_vocab = None if vocab is None else vocab.long()
    except Exception as exc:
        raise CadenceError(f"{heads_dir / 'heads.safetensors'} is corrupt or does not match its config: {exc}") from exc
    if missing or [k for k in unexpected if k != "draft_vocab"]:
        raise CadenceError(f"{heads_dir / 'heads.safetensors'} does not match its config "
                           f"(missing {missing}, unexpected {unexpected})")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "vllm-medusa":
        tensors, conf = medusa_state(heads, lm_weight), _medusa_config(heads)
    elif cfg.kind == "eagle3":
        tensors, conf = eagle3_state(heads), _eagle3_config(heads, backbone_config, fmt)
    else:
        tensors, conf = eagle_state(heads, fmt), _llama_config(heads, backbone_config, fmt)
    atomic_write(out / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    atomic_write_json(out / "config.json", conf)
    return out


def import_medusa(directory: str | Path, backbone):
    """Read an exported ``vllm-medusa`` directory back into cadence MedusaHeads bound to
    ``backbone``; refuses a directory whose LM head is not this backbone's (up to bf16)."""
    directory = Path(directory)
    try:
        conf = json.loads((directory / "config.json").read_text())
        state = load_file(str(directory / WEIGHTS))
        k = int(conf["num_heads"])
    except Exception as exc:
        raise CadenceError(f"{directory} is not an exported medusa directory: {exc}") from exc
    vocab = state.get("token_map")
    lm = backbone.lm_head.weight.detach().float().cpu()
    mine = lm if vocab is None else lm.index_select(0, vocab.long())
    theirs = state["lm_heads.0.weight"].float()
    if theirs.shape != mine.shape or not torch.allclose(theirs, mine.to(torch.bfloat16).float(), atol=1e-2):
        raise CadenceError(f"{directory}'s LM head is not {backbone.name}'s: these heads belong to another backbone")
    heads = new_heads("medusa", backbone, k)
    with torch.no_grad():
        for i, block in enumerate(heads.blocks):
            block.linear.weight.copy_(state[f"blocks.{i}.layers.0.weight"].float())
            block.linear.bias.copy_(state[f"blocks.{i}.layers.0.bias"].float())
    heads.set_draft_vocab(vocab)
    return heads


def import_eagle(directory: str | Path, backbone):
    """Read an exported directory back into cadence EagleHeads bound to ``backbone``."""
    directory = Path(directory)
    try:
        conf = json.loads((directory / "config.json").read_text())
        state = load_file(str(directory / WEIGHTS))
    except Exception as exc:
        raise CadenceError(f"{directory} is not an exported eagle directory: {exc}") from exc
    shape = {k: conf[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                  "rope_theta")}
    try:
        heads = new_heads("eagle", backbone, conf.get("cadence", {}).get("num_heads", 3), rms_eps=conf["rms_norm_eps"],
                          num_layers=int(conf.get("num_hidden_layers", 1)), **shape)
        with torch.no_grad():
            heads.fc.weight.copy_(state["fc.weight"].float())
            for i, layer in enumerate(heads.layers):
                pre = f"layers.{i}."
                layer.load_state_dict({k[len(pre):]: v.float() for k, v in state.items() if k.startswith(pre)})
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CadenceError(f"{directory} does not hold the eagle layers its config.json describes: {exc}") from exc
    return heads


def _backbone_config(spec: str) -> dict | None:
    if not spec:
        return None

    path, _ = resolve_model_dir(spec)
    return json.loads((Path(path) / "config.json").read_text())


def register(sub) -> None:
    p = sub.add_parser("export", help="write eagle / eagle3 / medusa heads as a vLLM / SGLang draft-model directory",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="heads directory (trained eagle, eagle3 or medusa heads)")
    p.add_argument("--format", required=True, choices=sorted([*FORMATS, *ALIASES, *SERVERS]),
                   help="target server layout: vllm | sglang (that server's layout for the heads' kind), or a "
                        "layout by name (eagle = vllm-eagle, eagle3 = vllm-eagle3, medusa = vllm-medusa)")
    p.add_argument("--method", default=None, choices=sorted(set(KIND_OF.values())),
                   help="the heads' kind, checked against the directory (default: read from it)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--model", default="smollm2",
                   help="backbone whose config.json seeds the eagle draft config (RoPE, positions, token "
                        "ids) and whose LM head vllm-medusa ships; '' to write only what the heads know (eagle)")
    p.set_defaults(func=_run)


def _lm_weight(spec: str) -> torch.Tensor | None:
    if not spec:
        return None

    return load_backbone(spec, "float32", backend="transformers").lm_head.weight.detach()


def _kind_of(heads_dir: str) -> str | None:
    """The kind recorded in a heads directory's config.json (None when unreadable: export says why)."""
    try:
        return str(json.loads((Path(heads_dir) / "config.json").read_text())["kind"])
    except Exception:
        return None


def _run(args: argparse.Namespace) -> int:
    kind = _kind_of(args.heads)
    fmt = resolve_format(args.format, kind, args.method) if kind else ALIASES.get(args.format, args.format)
    lm = _lm_weight(args.model) if fmt == "vllm-medusa" else None
    out = export_heads(args.heads, fmt, args.out, _backbone_config(args.model), lm, args.method)
    print(f"wrote {out / 'config.json'} and {out / WEIGHTS}")
    if fmt.startswith("vllm-"):
        method = {"vllm-medusa": "medusa", "vllm-eagle": "eagle", "vllm-eagle3": "eagle3"}[fmt]
        print(f"serve: vllm serve TARGET_MODEL --speculative-config "
              f"'{{\"method\": \"{method}\", \"model\": \"{out}\", \"num_speculative_tokens\": 3}}'")
    else:
        algo = "EAGLE3" if fmt == "sglang-eagle3" else "EAGLE"
        print(f"serve: python -m sglang.launch_server --model-path TARGET_MODEL --speculative-algorithm {algo} "
              f"--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 4 "
              "--speculative-num-draft-tokens 8")
    return 0
