"""Describe the machine a measurement ran on (for every figure the project reports)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


def git_commit(repo: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=repo or Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    """CPU, cores, RAM, accelerator, library versions, commit."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "ram_gib": ram_gib(), "gpu": gpu,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "commit": git_commit(), "isa_limit": _isa_note()}


def _isa_note() -> str | None:
    from cadence.fast.cpu import isa_note

    return isa_note()


def machine_line(info: dict | None = None) -> str:
    info = info or machine_info()
    acc = info["gpu"] or "no GPU"
    limit = f" ({info['isa_limit']})" if info.get("isa_limit") else ""
    return (f"{info['cpu']}{limit}, {info['cores']} cores, {info['ram_gib']} GiB RAM, {acc}; torch {info['torch']}, "
            f"transformers {info['transformers']}, commit {info['commit']}")
