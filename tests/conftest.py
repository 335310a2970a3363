import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# --dtype auto stays float32 on every CPU here (it would be bf16 on CPUs with native bf16):
# the suite's tiny models then compute the same way on every machine
os.environ.setdefault("CADENCE_CPU_AUTO_DTYPE", "float32")


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
