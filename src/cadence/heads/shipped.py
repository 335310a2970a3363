"""What ships for a backbone: heads in the package (``assets/heads/<model>/<set>/``), found by
backbone and name, and the self-distilled store in a source checkout (``data/selfdistill/<model>/``).

Knows: which backbone each folder is for, the sets in it (``medusa``, ``hydra``, ``eagle``,
``eagle-taps``, ...), the small heads (CLP, confidence) beside them, and where a checkout keeps
the model's store (the wheel does not carry it: 8 MB of training data). Does not load heads
(``io``) or stores (``draft.datastore``), or know methods.
"""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "assets" / "heads"
SHIPPED_FOR = {"SmolLM2-135M-Instruct": "smollm2"}  # backbone name -> folder under assets/heads
CHECKOUT_STORES = Path(__file__).resolve().parents[3] / "data" / "selfdistill"  # a source checkout's stores


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


def shipped_store_dir(backbone, root: Path | None = None) -> Path | None:
    """The self-distilled store of ``backbone`` (``<root>/<folder>/manifest.json``; root: the checkout's
    ``data/selfdistill``), or None: a model without shipped heads, or an install without the
    checkout's ``data/`` (a wheel)."""
    folder = SHIPPED_FOR.get(backbone.name)
    if folder is None:
        return None
    path = (root or CHECKOUT_STORES) / folder
    return path if (path / "manifest.json").is_file() else None


def heads_kind(path: Path) -> str | None:
    """The ``kind`` a heads directory's ``config.json`` names, or None where there is none to read."""
    try:
        kind = json.loads((Path(path) / "config.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None
