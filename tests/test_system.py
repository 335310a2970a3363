"""A first run that never hangs: locks that die with their holder, a native build that
clears what a killed build left, SIGTERM handled as Ctrl-C, content-keyed model caches,
and ``cadence env`` / ``cadence cache``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.backbone import load as bbmod
from cadence.cli import main
from cadence.fast.native import build
from cadence.system import cache as disk_cache
from cadence.system import locks

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOLD = """
import sys, time
from cadence.system.locks import exclusive
with exclusive(sys.argv[1], what="holding it for a test", timeout_s=0) as held:
    print("held" if held else "busy", flush=True)
    time.sleep(120)
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _holder_process(lock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_whose_holder_is_killed_is_free_at_once(tmp_path):
    lock = tmp_path / "x.lock"
    proc = _holder_process(lock)
    try:
        other = locks.holder(lock)
        assert other is not None and other.pid == proc.pid and "holding it for a test" in other.describe()
    finally:
        proc.kill()  # SIGKILL: no finally block runs in the holder
        proc.wait()
    assert locks.holder(lock) is None
    start = time.monotonic()
    with locks.exclusive(lock, what="testing", timeout_s=5) as held:
        assert held
    assert time.monotonic() - start < 1.0


def test_a_live_holder_is_named_and_the_wait_is_bounded(tmp_path):
    lock = tmp_path / "x.lock"
    proc = _holder_process(lock)
    said = []
    try:
        start = time.monotonic()
        with locks.exclusive(lock, what="testing", timeout_s=0.5, notice=said.append) as held:
            assert not held
        assert 0.4 < time.monotonic() - start < 3
    finally:
        proc.kill()
        proc.wait()
    assert len(said) == 1 and f"process {proc.pid}" in said[0] and "holding it for a test" in said[0]


@pytest.fixture
def ext_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext"


def _fake_torch_load(calls):
    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        d = Path(build_directory)
        assert not (d / "lock").exists(), "torch's stale lock must be gone before the build"
        calls.append(name)
        (d / f"{name}.so").write_bytes(b"built")
        return f"module {name}"
    return load


def test_a_stale_torch_lock_and_half_built_objects_are_cleared(ext_root, monkeypatch, capsys):
    from torch.utils import cpp_extension

    d = build.build_dir("cadence_test_stale")
    (d / "lock").touch()  # left by a build killed with SIGKILL
    (d / "layers.o").write_bytes(b"half")
    (d / ".ninja_log").write_text("")
    calls = []
    monkeypatch.setattr(cpp_extension, "load", _fake_torch_load(calls))
    assert build.load("cadence_test_stale", [], [], [], what="building a test") == "module cadence_test_stale"
    assert calls == ["cadence_test_stale"]
    assert not (d / "layers.o").exists() and not (d / "lock").exists() and not (d / build.MARKER).exists()
    assert "stale build lock" in capsys.readouterr().err
    assert build.state("cadence_test_stale")["state"] == "built"


def test_an_unfinished_build_without_a_torch_lock_is_cleared_too(ext_root, monkeypatch, capsys):
    from torch.utils import cpp_extension

    d = build.build_dir("cadence_test_unfinished")
    (d / build.MARKER).touch()
    (d / "cadence_test_unfinished.so").write_bytes(b"truncated")
    assert build.state("cadence_test_unfinished")["state"] == "not built"
    monkeypatch.setattr(cpp_extension, "load", _fake_torch_load([]))
    build.load("cadence_test_unfinished", [], [], [], what="building a test")
    assert "unfinished build" in capsys.readouterr().err
    assert (d / "cadence_test_unfinished.so").read_bytes() == b"built"


def test_a_build_that_another_live_process_holds_gives_up_after_the_wait(ext_root, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("CADENCE_BUILD_WAIT", "0.3")
    monkeypatch.setattr(cpp_extension, "load", _fake_torch_load([]))
    d = build.build_dir("cadence_test_busy")
    proc = _holder_process(d / build.LOCK)
    try:
        assert build.state("cadence_test_busy")["state"] == "building"
        with pytest.raises(build.BuildBusy, match=f"process {proc.pid}"):
            build.load("cadence_test_busy", [], [], [], what="building a test")
    finally:
        proc.kill()
        proc.wait()
    assert build.load("cadence_test_busy", [], [], [], what="building a test") == "module cadence_test_busy"


def test_a_failed_build_leaves_its_reason_for_cadence_env(ext_root, monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kw):
        raise RuntimeError("Error building extension\nc++: fatal error: no compiler")
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError):
        build.load("cadence_test_failed", [], [], [], what="building a test")
    st = build.state("cadence_test_failed")
    assert st["state"] == "failed" and "no compiler" in st["reason"]


TINY_EXT = """
#include <torch/extension.h>
int64_t answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
BUILD_TINY = """
import sys
from cadence.fast.native import build
mod = build.load("cadence_test_tiny", [sys.argv[1]], ["-O0"], [], what="building a tiny extension",
                 announce="compiling")
print("answer", mod.answer(), flush=True)
"""


@pytest.mark.slow
def test_a_real_build_killed_mid_compile_is_followed_by_one_that_finishes(tmp_path):
    """torch's own lock file is left behind by a SIGKILL; the next build clears it and finishes."""
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_EXT)
    env = {**_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    first = subprocess.Popen([sys.executable, "-c", BUILD_TINY, str(src)], stderr=subprocess.PIPE, text=True, env=env)
    assert first.stderr.readline().strip() == "compiling"
    time.sleep(2)  # inside the compiler
    first.kill()
    first.wait()
    assert list((tmp_path / "ext").glob("cadence_test_tiny/lock")), "the killed build should leave torch's lock"
    second = subprocess.run([sys.executable, "-c", BUILD_TINY, str(src)], capture_output=True, text=True, env=env,
                            timeout=280)
    assert second.returncode == 0, second.stderr
    assert "answer 42" in second.stdout and "stale build lock" in second.stderr


FIFO_READER = "from cadence.cli import main; import sys; sys.exit(main(sys.argv[1:]))"


def test_sigterm_ends_a_command_like_ctrl_c(tmp_path):
    """``cadence generate`` blocked reading its prompt file gets SIGTERM: it reports it and
    exits 143 (128 + 15) instead of dying silently with its finally blocks skipped."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", FIFO_READER, "generate", "--prompt-file", str(fifo),
                             "--model", str(tmp_path / "none")], stderr=subprocess.PIPE, text=True, env=_env())
    fd, deadline = None, time.monotonic() + 60
    while fd is None:  # opening the write end succeeds once the command has opened the file to read
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.05)
    try:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        os.close(fd)
    assert rc == 128 + signal.SIGTERM
    err = proc.stderr.read()
    assert "cadence: terminated (SIGTERM)" in err and "Traceback" not in err


def test_sighup_is_handled_as_well(tmp_path):
    code = ("import time, sys\nfrom cadence.system import signals\nsignals.install()\n"
            "try:\n    print('ready', flush=True); time.sleep(60)\n"
            "except signals.Terminated as e:\n    print('finally ran', e.exit_status, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGHUP)
    assert proc.stdout.readline().strip() == f"finally ran {128 + signal.SIGHUP}"
    proc.wait(timeout=10)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_paths_to_one_gguf_share_one_converted_copy(tmp_path, cache_root, monkeypatch):
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "renamed-copy.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    converted = []

    def fake_convert(gguf, out):
        converted.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(bbmod, "_convert_into", fake_convert)
    assert bbmod.convert_gguf(a) == bbmod.convert_gguf(b)
    assert converted == [a]
    assert [e.path for e in disk_cache.entries(("models",))] == [bbmod.convert_gguf(a)]
    b.write_bytes(b"GGUF other bytes")  # new content, new entry
    assert bbmod.convert_gguf(b) != bbmod.convert_gguf(a) and len(converted) == 2


def test_the_content_digest_is_memoized_by_path_size_and_mtime(tmp_path, cache_root, monkeypatch):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" * 100)
    first = disk_cache.gguf_digest(g)
    monkeypatch.setattr(disk_cache, "file_digest", lambda p: pytest.fail("hashed twice"))
    assert disk_cache.gguf_digest(g) == first


def test_an_older_path_keyed_copy_is_moved_not_converted_again(tmp_path, cache_root, monkeypatch):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF legacy")
    legacy = bbmod._legacy_cache_dir(g)
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    monkeypatch.setattr(bbmod, "_convert_into", lambda *a: pytest.fail("converted again"))
    out = bbmod.convert_gguf(g)
    assert (out / "config.json").is_file() and not legacy.exists()


def test_temp_directories_of_dead_conversions_are_removed(tmp_path, cache_root, monkeypatch, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF dead temp")
    entry = disk_cache.model_entry(g)
    stale = entry.with_name(entry.name + f".tmp{pid}")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    live = entry.with_name(entry.name + f".tmp{os.getppid()}")  # a live process's: kept
    live.mkdir()

    def fake_convert(gguf, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(bbmod, "_convert_into", fake_convert)
    bbmod.convert_gguf(g)
    assert not stale.exists() and live.exists()
    assert f".tmp{pid}" in capsys.readouterr().err


def test_cadence_env_names_the_cpu_the_dtype_and_the_native_state(capsys):
    from cadence.system.machine import cpu_model

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert cpu_model() in out and "dtype auto" in out and "native build" in out
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cpu"]["model"] == cpu_model()
    assert info["auto_dtype"]["dtype"] in ("float32", "bfloat16")
    assert info["native"]["state"] in ("built", "building", "failed", "not built", "off")


def test_cadence_env_says_when_the_native_build_is_off(capsys, monkeypatch):
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    assert main(["env"]) == 0
    assert "native build  off" in capsys.readouterr().out


def test_cadence_cache_lists_and_clears_by_kind(tmp_path, cache_root, ext_root, capsys):
    (disk_cache.models_dir() / "m-0123").mkdir(parents=True)
    (disk_cache.models_dir() / "m-0123" / "model.safetensors").write_bytes(b"x" * 1000)
    disk_cache.latency_dir().mkdir(parents=True)
    (disk_cache.latency_dir() / "curve.json").write_text("{}")
    (ext_root / "cadence_layers_abc").mkdir(parents=True)
    (ext_root / "cadence_layers_abc" / "cadence_layers_abc.so").write_bytes(b"so")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "m-0123" in out and "curve.json" in out and "cadence_layers_abc" in out and "[built]" in out
    assert main(["cache", "--clear", "latency"]) == 0
    assert "removed 1 cached entry" in capsys.readouterr().out
    assert not (disk_cache.latency_dir() / "curve.json").exists() and (disk_cache.models_dir() / "m-0123").exists()
    assert main(["cache", "--clear"]) == 0
    assert disk_cache.entries() == []
