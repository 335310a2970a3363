"""Atomic file writes: write to a temporary sibling, fsync, rename. A crash never leaves half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then rename ``tmp_path`` over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))
