"""What every benchmark script shares: where things are, the machine, the backbone, writing results.

Knows: the repository's layout (``benchmarks/<group>/<script>.py``, ``benchmarks/prompts/``,
the ignored ``runs/`` where results go by default), how to make a sibling group's script
importable (``use``), the description of the machine a figure comes from (``cadence.system.machine``
plus the CPU flags that pick kernels and precision), loading the backbone, and writing a
result as JSON with its date, commit and CPU in it.
Does not know: what any script measures, nor how to time anything.

A script imports it by putting ``benchmarks/`` on ``sys.path`` first, so that it runs as
``python benchmarks/<group>/<script>.py`` from the repository root::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common  # noqa: E402
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROMPTS = BENCH / "prompts"
RUNS = ROOT / "runs"

if str(ROOT / "src") not in sys.path:  # a checkout without `pip install -e .` still imports cadence
    sys.path.append(str(ROOT / "src"))


def use(*groups: str) -> None:
    """Make the scripts of ``benchmarks/<group>/`` importable by module name (``use("e2e")``
    then ``from categories import PROMPTS``)."""
    for g in groups:
        p = str(BENCH / g)
        if p not in sys.path:
            sys.path.insert(1, p)


def out_path(given: str | Path | None, default_name: str) -> Path:
    """``given`` when set, else ``runs/<default_name>`` (ignored by git)."""
    return Path(given) if given else RUNS / default_name


def cpu_slug(cpu: str | None = None) -> str:
    """The CPU's model string as a file-name part: 'intel-r-xeon-r-platinum-8488c'."""
    from cadence.system.machine import cpu_model

    return re.sub(r"[^a-z0-9]+", "-", (cpu or cpu_model()).lower()).strip("-") or "cpu"


def machine() -> dict:
    """``cadence.system.machine.machine_info()`` (CPU model, cores, RAM, torch / transformers versions,
    commit, instruction-set limits) plus the CPU flags that decide kernels (``cpu_features``)."""
    from cadence.system.machine import describe
    from cadence.system.machine import machine_info

    return {**machine_info(), "cpu_features": describe()}


def machine_line(info: dict | None = None) -> str:
    """One line for a report's header."""
    from cadence.system.machine import machine_line as line

    return line(info or machine())


def backbone(model: str = "smollm2", dtype=None, backend: str = "auto", quant: str = "none"):
    """The frozen backbone, as ``cadence.backbone.load.load_backbone`` loads it."""
    from cadence.backbone.load import load_backbone

    return load_backbone(model, dtype, backend=backend, quant=quant)


def write_json(path: str | Path, result: dict, indent: int = 1, quiet: bool = False) -> Path:
    """Write ``result`` to ``path`` (parents created) with ``date`` (UTC) and, where the script
    did not record it, ``machine`` (whose ``cpu`` and ``commit`` say where and on what code)."""
    path = Path(path)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    if "machine" not in result:
        result["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return path
