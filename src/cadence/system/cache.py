"""What cadence keeps on disk, and how to list and clear it (``cadence cache``).

Knows: the cache root (``$CADENCE_CACHE`` or ``~/.cache/cadence``) and its layout:
- ``models/<stem>-<content digest>/``: a GGUF dequantized into a Hugging Face directory, named
  by a digest of the GGUF's *bytes*, so two paths to one file (two clones, two virtual
  environments) share one copy. ``gguf-index.json`` remembers the digest of each
  (path, size, mtime) seen, so a load hashes a file once, not every time;
- ``latency/``: verify-latency curves per machine and build (``cadence.costs.latency``,
  ``cadence.batch.narrow``);
- ``datastore/``: n-gram tables built from a self-distilled store (``cadence.draft.datastore``),
  named by the store and a digest of its manifest;
- the native kernels' build directories under torch's extension root
  (``cadence_layers_<digest>``, ``cadence.fast.native``);
- temporary ``*.tmp<pid>`` entries of conversions still running, removed once their process
  is gone (``sweep_dead_temps``).
Does not know: how to convert a model (``cadence.backbone.load``) or build a kernel
(``cadence.fast.native``); it only names, measures and removes their files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

from cadence.system.atomic import atomic_write_json
from cadence.system.locks import holder

KINDS = ("models", "kernels", "latency", "datastore")  # what ``cadence cache --clear KIND`` selects
_TMP = re.compile(r"\.tmp(\d+)$")


def root() -> Path:
    """The cache root: ``$CADENCE_CACHE`` or ``~/.cache/cadence``."""
    return Path(os.environ.get("CADENCE_CACHE", Path.home() / ".cache" / "cadence"))


def models_dir() -> Path:
    return root() / "models"


def latency_dir() -> Path:
    return root() / "latency"


def datastore_dir() -> Path:
    return root() / "datastore"


def kernels_root() -> Path:
    """Where torch builds extensions (``$TORCH_EXTENSIONS_DIR`` or its default root)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)

    return Path(get_default_build_root())


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, hex (about 0.1 s for the 98 MB default GGUF)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_digest(gguf: Path) -> str:
    """The content digest of ``gguf`` (first 16 hex digits), memoized by path, size and mtime
    in ``gguf-index.json`` so an unchanged file is hashed once."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    seen = f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = root() / "gguf-index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    if isinstance(index.get(seen), str):
        return index[seen]
    digest = file_digest(gguf)[:16]
    index[seen] = digest
    try:
        atomic_write_json(index_path, index)
    except OSError:  # a read-only cache still converts; it just hashes again next time
        pass
    return digest


def model_entry(gguf: Path) -> Path:
    """The directory a GGUF's conversion lives in: ``models/<stem>-<content digest>``; an
    existing conversion of the same bytes under another file name is that directory."""
    digest = gguf_digest(gguf)
    for done in sorted(models_dir().glob(f"*-{digest}")):
        if (done / "config.json").is_file():
            return done
    return models_dir() / f"{Path(gguf).stem}-{digest}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_dead_temps(directory: Path) -> list[Path]:
    """Remove ``*.tmp<pid>`` entries in ``directory`` whose process is gone; the removed paths."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        m = _TMP.search(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def size_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


@dataclass
class Entry:
    kind: str  # one of KINDS
    path: Path  # the file or directory
    size: int  # bytes on disk
    note: str = ""  # e.g. "built", "no library (incomplete build)", "legacy (path-keyed)"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "size_bytes": self.size, "note": self.note}


def entries(kinds: tuple[str, ...] = KINDS) -> list[Entry]:
    """Everything cadence has cached, by kind."""
    out: list[Entry] = []
    if "models" in kinds:
        for d in _children(models_dir()):
            if d.suffix != ".lock":
                out.append(Entry("models", d, size_bytes(d), "converting" if _TMP.search(d.name) else ""))
        for d in _children(root()):  # older installs named conversions by path and mtime
            if d.is_dir() and (d / "config.json").is_file():
                out.append(Entry("models", d, size_bytes(d), "legacy (path-keyed copy; safe to clear)"))
    if "latency" in kinds:
        for f in _children(latency_dir()):
            out.append(Entry("latency", f, size_bytes(f)))
    if "datastore" in kinds:
        for f in _children(datastore_dir()):
            out.append(Entry("datastore", f, size_bytes(f)))
    if "kernels" in kinds:  # torch's default root has a folder per python/accelerator; $TORCH_EXTENSIONS_DIR not
        tops = _children(kernels_root())
        for b in [*tops, *(c for d in tops if d.is_dir() for c in _children(d))]:
            if b.is_dir() and b.name.startswith("cadence_"):
                built = any(b.glob(f"{b.name}*.so"))
                out.append(Entry("kernels", b, size_bytes(b), "built" if built else "no library (not built)"))
    return out


def _children(d: Path) -> list[Path]:
    try:
        return sorted(d.iterdir())
    except OSError:
        return []


def clear(kinds: tuple[str, ...]) -> list[Entry]:
    """Remove every cached entry of ``kinds`` (but a kernel that a live process is building);
    the entries removed."""
    gone = [e for e in entries(kinds) if not (e.kind == "kernels" and holder(e.path / "cadence.lock"))]
    for e in gone:
        if e.path.is_dir():
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            e.path.unlink(missing_ok=True)
    if "models" in kinds:
        (root() / "gguf-index.json").unlink(missing_ok=True)
    return gone


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
