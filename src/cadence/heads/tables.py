"""The heads' decoding policy, kept apart from their weights and shape.

``config.json`` says what the heads *are* (kind, K, sizes, the backbone they belong to);
``draft_config.json`` says how they were measured to *draft*: the acceptance tables and the
trees ``cadence calibrate`` chose from them, as transformers keeps ``generation_config.json``
apart from ``config.json``. Recalibrating rewrites only this file; training writes none
(uncalibrated heads draft the top-1 chain).

Heads saved before the split carry these fields inside ``config.json``; they are read from
there when ``draft_config.json`` is absent.

Example ``draft_config.json``: ``{"tree": [[0], [0, 0]], "acceptance": [[0.6, 0.1],
[0.5, 0.1]], "copy_tree": null, "copy_acceptance": null}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from cadence.system.atomic import atomic_write_json
from cadence.errors import CadenceError

POLICY_FILE = "draft_config.json"


@dataclass
class DraftPolicy:
    """What ``cadence calibrate`` measured; every field None until then."""

    tree: list | None = None  # best tree on the calibrating machine (rank paths), heads alone
    acceptance: list | None = None  # a[k][i]: measured P(head k+1's rank-i candidate is right | path right)
    copy_tree: list | None = None  # best tree when drafting with context copy (greedy)
    copy_acceptance: list | None = None  # a[k][i] with the context copy ranked first (rows past K: copy only)

    @property
    def calibrated(self) -> bool:
        return self.acceptance is not None or self.copy_acceptance is not None

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftPolicy":
        return cls(**{f.name: raw.get(f.name) for f in fields(cls)})


def load_policy(directory: str | Path, config: dict | None = None) -> DraftPolicy:
    """``directory``'s draft_config.json, else the legacy fields of its config.json (``config``)."""
    path = Path(directory) / POLICY_FILE
    if not path.is_file():
        return DraftPolicy.from_dict(config or {})
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
        raise CadenceError(f"{path} is malformed: {exc}") from exc
    return DraftPolicy.from_dict(raw)


def save_policy(directory: str | Path, policy: DraftPolicy) -> Path:
    """Write draft_config.json; drop the legacy fields from config.json so one file rules."""
    directory = Path(directory)
    atomic_write_json(directory / POLICY_FILE, asdict(policy))
    cfg_path = directory / "config.json"
    if cfg_path.is_file():
        conf = json.loads(cfg_path.read_text())
        if any(f.name in conf for f in fields(DraftPolicy)):
            atomic_write_json(cfg_path, {k: v for k, v in conf.items()
                                         if k not in {f.name for f in fields(DraftPolicy)}})
    return directory / POLICY_FILE
