"""Acceptance profiles as decoding reads them: the heads' acceptance tables per task,
binned by the backbone's entropy at the root (what EntMTP switches on). A property of the
heads: they ship beside them as ``profiles.json``; the trees are derived at run time with
this machine's latency.

Knows: the file's format, how to store and read it, and which bin an entropy falls in.
Does not know how the tables are measured (``cadence.calibration.entropy_profiles``),
schedulers or engines.

Tasks map to the self-distillation store's prompt sources: ``humaneval`` <- code,
``gsm8k`` <- gsm8k, ``sharegpt`` <- sharegpt, ``writing`` <- writing; ``general`` pools
them all.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cadence.errors import CadenceError
from cadence.system.atomic import atomic_write_json

TASK_SOURCES = {"humaneval": "code", "gsm8k": "gsm8k", "sharegpt": "sharegpt", "writing": "writing"}
PROFILES_FILE = "profiles.json"


@dataclass
class Profile:
    """Acceptance tables of one task, per entropy bin."""

    edges: list[float]  # bin edges (nats), ascending; bin i = edges[i-1] <= H < edges[i]
    tables: list[list[list[float]]]  # per bin: a[k][i] for the heads alone
    copy_tables: list[list[list[float]]] | None  # per bin: with the context copy ranked first
    counts: list[int]  # positions per bin

    def bin_of(self, h: float) -> int:
        """Example: edges [0.5, 2.0] -> h 0.1: bin 0, h 1.0: bin 1, h 3.0: bin 2."""
        return sum(h >= e for e in self.edges)


def save_profiles(heads_dir: str | Path, profiles: dict[str, Profile], info: dict) -> Path:
    path = Path(heads_dir) / PROFILES_FILE
    atomic_write_json(path, {"format": 1, **info, "profiles": {t: asdict(p) for t, p in profiles.items()}})
    return path


def load_profiles(heads_dir: str | Path | None) -> dict[str, Profile]:
    """The profiles shipped beside heads ({} when there are none)."""
    if heads_dir is None:
        return {}
    path = Path(heads_dir) / PROFILES_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {t: Profile(**p) for t, p in data["profiles"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise CadenceError(f"{path} is not a valid acceptance profile file: {exc}") from exc
