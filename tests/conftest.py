import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def default_backbone():
    """The real default model for ``-m slow`` tests: skips when missing, fails under CI=true."""
    from default_model import load_default_backbone
    return load_default_backbone()


@pytest.fixture(scope="session")
def llama():
    from tiny import tiny_backbone
    return tiny_backbone("llama")


@pytest.fixture(scope="session")
def qwen2():
    from tiny import tiny_backbone
    return tiny_backbone("qwen2")
