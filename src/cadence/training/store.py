"""The self-distillation store: compact token-id shards that accumulate, kept in git.

Knows: the shard file format (``.npz``), the store's manifest (one line per shard, so
git diffs and merges stay small), which prompts a store already holds (by prompt hash,
read from the shards' own metadata),
the writer's lock, and clean-up after an interrupted writer.
Does not know: models, prompt sources, training.

Layout (e.g. ``data/selfdistill/smollm2/``)::

    manifest.json          {"format": "cadence-store-1", "config": {...}, totals, "mix",
                            "skipped_hashes", "shards": [ one JSON object per line ]}
    shard-00000.npz        one flush of a ``cadence distill`` run (train or val sequences)

A shard is a ``.npz`` (the zip of ``.npy`` files that ``numpy.savez`` writes, read with
``numpy.load``) whose members are LZMA-compressed (``zipfile.ZIP_LZMA``; on ShareGPT token
ids 1.04 MiB per million tokens against 1.17 for ``savez_compressed``'s deflate, and
still millions of tokens per second) holding

    tokens        uint16 (uint32 when the vocabulary exceeds 65,536), all sequences back to back
    lengths       uint32, tokens per sequence
    prompt_lens   uint32, prompt tokens per sequence (the rest is the backbone's reply)
    meta          uint8, UTF-8 JSON: keys, prompt_hashes, sources, settings
    topk_ids      optional, same dtype as tokens, (reply tokens x k)
    topk_logits   optional, float16, (reply tokens x k)

Reading (``read_store_shard``) gives the same dictionary of torch tensors as the
safetensors shards of older data directories (``tokens`` int32, ``offsets`` int64,
``prompt_lens`` int32), so every reader goes through ``cadence.training.data.read_shard``.

Each manifest entry records the shard's split, counts, generation ``settings`` (model,
dtype, max_new_tokens, temperature, mode, topk_logits) and ``sources`` (prompts per
source). The ``prompt_hashes`` of its sequences (``cadence.prompts.prompt_hash``) live
in the shard's ``meta`` only: repeating them in the manifest made 0.75 of its 0.94 MiB in a
size-capped git tree at 47 k prompts. Manifests written before that still carry them
per entry; a writer drops them when it opens the store, and ``verify_store`` checks any
that remain against the shard.
Crash safety: a shard is written to a temporary file and renamed, then the manifest is
rewritten the same way; a shard file the manifest does not list (the writer died in
between) and temporary files are deleted when the next writer opens the store. So an
interruption loses at most the sequences not yet flushed, and those prompts are simply
answered again by the next run.
"""

from __future__ import annotations

import fcntl
import io
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from cadence.system.atomic import atomic_write
from cadence.errors import CadenceError

FORMAT = "cadence-store-1"
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".npz"
LOCK = ".lock"


def is_store(manifest: dict | None) -> bool:
    return bool(manifest) and manifest.get("format") == FORMAT


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ---------------------------------------------------------------- shards


def encode_shard(seqs: list[list[int]], prompt_lens: list[int], meta: dict, vocab_size: int,
                 topk: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> bytes:
    """The bytes of one shard file (see the module docstring)."""
    dt = token_dtype(vocab_size)
    flat = [t for s in seqs for t in s]
    if flat and (min(flat) < 0 or max(flat) >= vocab_size):
        raise CadenceError(f"token id outside the vocabulary ({vocab_size})")
    arrays = {
        "tokens": np.asarray(flat, dtype=dt),
        "lengths": np.asarray([len(s) for s in seqs], dtype=np.uint32),
        "prompt_lens": np.asarray(prompt_lens, dtype=np.uint32),
        "meta": np.frombuffer(json.dumps(meta, separators=(",", ":")).encode("utf-8"), dtype=np.uint8),
    }
    if topk:
        arrays["topk_ids"] = torch.cat([i for i, _ in topk]).numpy().astype(dt)
        arrays["topk_logits"] = torch.cat([v for _, v in topk]).to(torch.float16).numpy()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_LZMA) as zf:  # what np.savez writes, LZMA-packed
        for k, v in arrays.items():
            with zf.open(k + ".npy", "w") as fh:
                np.lib.format.write_array(fh, np.ascontiguousarray(v), allow_pickle=False)
    return buf.getvalue()


def write_store_shard(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_store_shard(path: str | Path, with_meta: bool = False) -> dict:
    """Load a store shard as torch tensors (``tokens`` int32, ``offsets`` int64,
    ``prompt_lens`` int32, optional ``topk_ids`` / ``topk_logits``); ``meta`` (a dict)
    too when ``with_meta``. CadenceError when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CadenceError(f"shard {path} is missing")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CadenceError(f"shard {path} is corrupt: {exc}") from exc
    for k in ("tokens", "lengths", "prompt_lens"):
        if k not in arrays:
            raise CadenceError(f"shard {path} lacks array {k!r}")
    lengths = arrays["lengths"].astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = {
        "tokens": torch.from_numpy(arrays["tokens"].astype(np.int32)),
        "offsets": torch.from_numpy(offsets),
        "prompt_lens": torch.from_numpy(arrays["prompt_lens"].astype(np.int32)),
    }
    if "topk_ids" in arrays:
        out["topk_ids"] = torch.from_numpy(arrays["topk_ids"].astype(np.int32))
        out["topk_logits"] = torch.from_numpy(arrays["topk_logits"].astype(np.float16))
    if with_meta:
        out["meta"] = _decode_meta(arrays.get("meta"), path)
    return out


def _decode_meta(meta: np.ndarray | None, path) -> dict:
    """The ``meta`` member's JSON ({} when a shard has none)."""
    try:
        return json.loads(meta.tobytes().decode("utf-8")) if meta is not None else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CadenceError(f"shard {path} is corrupt: bad metadata ({exc})") from exc


def read_shard_meta(path: str | Path) -> dict:
    """Only the ``meta`` member of a store shard (the other members stay compressed)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = z["meta"] if "meta" in z.files else None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CadenceError(f"shard {path} is corrupt: {exc}") from exc
    return _decode_meta(meta, path)


# ---------------------------------------------------------------- manifest


def dump_manifest(manifest: dict) -> str:
    """JSON with each shard entry on a line of its own (appending a shard adds one line)."""
    head = {k: v for k, v in manifest.items() if k != "shards"}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))},")
    shards = manifest.get("shards", [])
    lines.append('  "shards": [')
    for i, s in enumerate(shards):
        lines.append("    " + json.dumps(s, separators=(",", ":")) + ("," if i + 1 < len(shards) else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_manifest(directory: Path, manifest: dict) -> None:
    text = dump_manifest(manifest)
    atomic_write(directory / MANIFEST, lambda tmp: tmp.write_text(text))


def new_manifest(model: str, vocab_size: int) -> dict:
    return {"format": FORMAT,
            "config": {"store": 1, "model": model, "vocab_size": vocab_size},
            "prompts_done": 0, "skipped": 0, "sequences": 0, "tokens": 0, "reply_tokens": 0,
            "seconds": 0.0, "mix": {}, "skipped_hashes": [], "shards": []}


class Store:
    """An open store with its writer lock held (one writer at a time)."""

    def __init__(self, directory: str | Path, model: str, vocab_size: int, manifest: dict | None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / LOCK, "w")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock.close()
            raise CadenceError(f"{self.dir} is being written by another `cadence distill`") from exc
        if manifest is None:
            manifest = new_manifest(model, vocab_size)
        elif not is_store(manifest):
            self.close()
            raise CadenceError(f"{self.dir} holds data of another format (safetensors shards, made before "
                               "the store); train and calibrate still read it, but distill into a new --out")
        else:
            cfg = manifest["config"]
            if cfg.get("vocab_size") != vocab_size or cfg.get("model") != model:
                self.close()
                raise CadenceError(f"{self.dir} holds data of model {cfg.get('model')!r} (vocabulary "
                                   f"{cfg.get('vocab_size')}), not {model!r} ({vocab_size}); use another --out")
        for s in manifest["shards"]:  # older manifests repeated the shards' hashes
            s.pop("prompt_hashes", None)
        self.manifest = manifest
        self.vocab_size = vocab_size
        self._clean()

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _clean(self) -> None:
        """Delete temporary files and shards the manifest does not list (a writer died)."""
        listed = {s["file"] for s in self.manifest["shards"]}
        for p in self.dir.iterdir():
            if p.name.startswith(".") and ".tmp" in p.name or p.name.startswith("shard-") and p.suffix == SHARD_SUFFIX and p.name not in listed:
                p.unlink()

    def done_hashes(self) -> set[str]:
        """Prompt hashes already answered (or skipped as too long) in this store."""
        done = set(self.manifest.get("skipped_hashes", []))
        for s in self.manifest["shards"]:
            done.update(read_shard_meta(self.dir / s["file"]).get("prompt_hashes", []))
        return done

    def _next_name(self) -> str:
        idx = 0
        for s in self.manifest["shards"]:
            stem = Path(s["file"]).stem
            if stem.startswith("shard-") and stem[6:].isdigit():
                idx = max(idx, int(stem[6:]) + 1)
        return f"shard-{idx:05d}{SHARD_SUFFIX}"

    def append(self, split: str, seqs: list[list[int]], prompt_lens: list[int], keys: list[str],
               hashes: list[str], sources: list[str], settings: dict,
               topk: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               skipped: list[str] = (), seconds: float = 0.0) -> dict | None:
        """Write one shard (if ``seqs``) and the manifest; return the new entry."""
        m = self.manifest
        entry = None
        if seqs:
            meta = {"keys": keys, "prompt_hashes": hashes, "sources": sources, "settings": settings}
            name = self._next_name()
            write_store_shard(self.dir / name, encode_shard(seqs, prompt_lens, meta, self.vocab_size, topk))
            n_tok = sum(len(s) for s in seqs)
            n_reply = sum(len(s) - p for s, p in zip(seqs, prompt_lens))
            counts: dict[str, int] = {}
            for src in sources:
                counts[src] = counts.get(src, 0) + 1
            entry = {"file": name, "split": split, "sequences": len(seqs), "tokens": n_tok,
                     "reply_tokens": n_reply, "settings": settings, "sources": counts,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            m["shards"].append(entry)
            m["sequences"] += len(seqs)
            m["tokens"] += n_tok
            m["reply_tokens"] += n_reply
            for s, p, src in zip(seqs, prompt_lens, sources):
                mx = m["mix"].setdefault(src, {"prompts": 0, "reply_tokens": 0})
                mx["prompts"] += 1
                mx["reply_tokens"] += len(s) - p
            m["prompts_done"] += len(seqs)
        if skipped:
            m["skipped_hashes"] = sorted(set(m["skipped_hashes"]) | set(skipped))
            m["skipped"] = len(m["skipped_hashes"])
            m["prompts_done"] += len(skipped)
        m["seconds"] = round(m["seconds"] + seconds, 1)
        if entry is not None or skipped or seconds:
            write_manifest(self.dir, m)
        return entry


def verify_store(directory: str | Path) -> dict:
    """Read every shard of a store and check it against the manifest; return totals."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CadenceError(f"{directory / MANIFEST} is unreadable: {exc}") from exc
    if not is_store(manifest):
        raise CadenceError(f"{directory} is not a {FORMAT} store")
    seen: set[str] = set()
    total = 0
    for s in manifest["shards"]:
        data = read_store_shard(directory / s["file"], with_meta=True)
        n = data["prompt_lens"].numel()
        if n != s["sequences"] or int(data["tokens"].numel()) != s["tokens"]:
            raise CadenceError(f"shard {s['file']} does not match its manifest entry")
        hashes = data["meta"].get("prompt_hashes", [])
        if "prompt_hashes" in s and hashes != s["prompt_hashes"]:
            raise CadenceError(f"shard {s['file']}: prompt hashes differ from the manifest")
        dup = seen.intersection(hashes)
        if dup:
            raise CadenceError(f"shard {s['file']} repeats prompt {min(dup)}")
        seen.update(hashes)
        total += s["tokens"]
    return {"shards": len(manifest["shards"]), "sequences": len(seen), "tokens": total}
