"""Named decoding methods -> ready engines. Shared by the CLI, the benchmark and the server.

A method is a head family (or none, for ``vanilla``) plus where its heads come from
(``default`` = heads shipped for the default model, ``random``, or a directory) and a
tree preset. ``make_engine`` is the one place that assembles backbone + heads +
drafter + scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from cadence.context_copy import CopyConfig
from cadence.drafter import HeadDrafter
from cadence.engine import Engine
from cadence.errors import CadenceError
from cadence.heads import load_heads, new_heads
from cadence.sampling import SamplingParams
from cadence.schedulers import StaticScheduler
from cadence.trees import CompiledTree, compile_tree, grow_tree, preset

SHIPPED_HEADS = Path(__file__).parent / "assets" / "heads"
SHIPPED_FOR = {"SmolLM2-135M-Instruct": "smollm2"}  # backbone name -> folder under assets/heads


class Method(str, Enum):
    VANILLA = "vanilla"  # plain autoregressive decoding through the same engine
    MEDUSA = "medusa"
    HYDRA = "hydra"
    MTP = "mtp"

    def __str__(self) -> str:
        return self.value


@dataclass
class MethodSpec:
    """How to decode; CLI flags derive from these fields."""

    method: Method = Method.HYDRA  # vanilla | medusa | hydra | mtp
    heads: str = "default"  # default (shipped for the model) | random | path to a heads directory
    tree: str = "auto"  # tree preset (root, chain, chain-D, tree-N), auto (the heads' calibrated tree) or auto-N (N nodes grown from the heads' calibrated acceptance)
    num_heads: int = 3  # K for --heads random
    copy: bool = True  # greedy only: rank the context copy (token after the same n-gram earlier) first
    copy_depth: int = 8  # deepest tree level a context copy may fill (presets; calibrated trees say their own)
    heads_seed: int = 0  # seed for --heads random


def shipped_heads_dir(backbone, kind: str) -> Path | None:
    folder = SHIPPED_FOR.get(backbone.name)
    if folder is None:
        return None
    path = SHIPPED_HEADS / folder / kind
    return path if (path / "config.json").is_file() else None


def resolve_heads(backbone, spec: MethodSpec):
    if spec.heads == "random":
        return new_heads(spec.method.value, backbone, spec.num_heads, random=True, seed=spec.heads_seed)
    if spec.heads == "default":
        path = shipped_heads_dir(backbone, spec.method.value)
        if path is None:
            raise CadenceError(f"no {spec.method.value} heads are shipped for {backbone.name}; "
                               "pass --heads DIR (trained with `cadence train`) or --heads random")
    else:
        path = Path(spec.heads)
    heads = load_heads(path, backbone)
    if heads.cfg.kind != spec.method.value:
        raise CadenceError(f"{path} holds {heads.cfg.kind} heads, but --method is {spec.method.value}")
    return heads


def recommended_tree(heads, copy: bool = False) -> CompiledTree:
    """The tree calibrated for these heads (``copy_tree`` or ``tree`` in config.json, by
    ``copy``), else the top-1 chain of the K heads."""
    paths = heads.cfg.copy_tree if copy else heads.cfg.tree
    if paths is not None:  # [] is a calibrated answer too: do not speculate
        return compile_tree([tuple(p) for p in paths], name="calibrated+copy" if copy else "calibrated")
    return compile_tree(preset("chain", heads.K), name="chain")


def grown_tree(heads, copy: bool, name: str) -> CompiledTree:
    """``auto-N``: the N-node tree grown from the acceptance table ``cadence calibrate``
    measured for these heads (with or without context copy)."""
    size = name[len("auto-"):]
    if not size.isdigit() or int(size) < 1:
        raise CadenceError(f"bad tree {name!r}: auto-N needs a node count N >= 1, e.g. auto-8")
    table = heads.cfg.copy_acceptance if copy else heads.cfg.acceptance
    if table is None:
        raise CadenceError(f"--tree {name} needs the acceptance table of `cadence calibrate` "
                           f"({'copy_acceptance' if copy else 'acceptance'} in the heads' config.json)")
    return compile_tree(grow_tree(table, int(size)), name=name)


def make_engine(backbone, spec: MethodSpec) -> Engine:
    """Backbone + heads + drafter + static scheduler for ``spec`` (vanilla: no drafter)."""
    if spec.method is Method.VANILLA:
        return Engine(backbone)
    heads = resolve_heads(backbone, spec)
    copy = CopyConfig() if spec.copy else None
    tree = None
    if spec.tree == "auto":
        tree = recommended_tree(heads, spec.copy)
    elif spec.tree.startswith("auto-"):
        tree = grown_tree(heads, spec.copy, spec.tree)
    drafter = HeadDrafter(heads, copy, max(spec.copy_depth, tree.max_depth if tree is not None else 0))
    if tree is None:
        tree = compile_tree(preset(spec.tree, drafter.max_depth(SamplingParams())), name=spec.tree)
    return Engine(backbone, drafter, StaticScheduler(tree))
