"""The heads shipped in the package (``assets/heads/<model>/<set>/``), found by backbone and name.

Knows: which backbone each folder is for, the sets in it (``medusa``, ``hydra``, ``eagle``,
``eagle-taps``, ...) and the small heads (CLP, confidence) beside them. Does not load
heads (``io``) or know methods.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "assets" / "heads"
SHIPPED_FOR = {"SmolLM2-135M-Instruct": "smollm2"}  # backbone name -> folder under assets/heads


def shipped_heads_dir(backbone, kind: str) -> Path | None:
    folder = SHIPPED_FOR.get(backbone.name)
    if folder is None:
        return None
    path = SHIPPED_HEADS / folder / kind
    return path if (path / "config.json").is_file() else None


def shipped_names() -> list[str]:
    """Every heads set shipped for any backbone, by folder name (``eagle``, ``eagle-taps``, ...)."""
    return sorted({p.parent.name for p in SHIPPED_HEADS.glob("*/*/config.json")})


def heads_path(backbone, heads: str) -> Path:
    """``--heads`` as a directory: a path that exists, else a set shipped for ``backbone`` by
    name (``eagle-taps`` -> assets/heads/smollm2/eagle-taps), else the path (load_heads says
    it is not a heads directory)."""
    path = Path(heads)
    if path.exists() or "/" in heads:
        return path
    return shipped_heads_dir(backbone, heads) or path
