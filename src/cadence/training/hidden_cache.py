"""Hidden-state cache: the frozen backbone's outputs over a distilled data set, computed once.

Several head types (and losses, and K) can then be trained without running the backbone
again: heads need only the hidden states, the token ids, and the frozen embedding and LM
head. Per data shard ``shard-XXXXX.safetensors`` the cache holds a file of the same name:

    hidden   (N, d)  bfloat16 (or float16/float32)  last-layer state after each token
    entropy  (N,)    float32   backbone entropy (nats) at each position (for AdaMTP)
    argmax   (N,)    int32     backbone argmax at each position (target 'backbone')
    taps     (N, n, d)         optional: the residual stream after decoder layers ``taps``
                               (1-based, listed per shard in cache.json) for drafters that
                               read them (``HeadConfig.taps``)

aligned with the shard's flat ``tokens``. ``cache.json`` records the backbone (name and a
fingerprint of its weights), the data manifest's config, and per shard its token count and
a checksum of its tokens (and the taps its file holds). Opening the cache with another
backbone, or for other data, or asking for taps a shard lacks, is a CadenceError; building
with taps a shard lacks recomputes that shard's file with them (its earlier taps kept). Shards are added incrementally (the data set may grow): each cache file and
``cache.json`` are written atomically, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from cadence.errors import CadenceError
from cadence.system.atomic import atomic_write, atomic_write_json
from cadence.training.batches import sequence_features
from cadence.training.data import iter_sequences, load_manifest, read_shard

CACHE_JSON = "cache.json"
FORMAT = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def backbone_fingerprint(backbone) -> str:
    """Hash of the architecture and a sample of every weight (robust to fp32/bf16 loading)."""
    h = hashlib.sha1()
    h.update(f"{backbone.hidden_size}:{backbone.vocab_size}".encode())
    for name, p in backbone.model.state_dict().items():
        flat = p.detach().reshape(-1)
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(flat[:16].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def tokens_checksum(tokens: torch.Tensor) -> str:
    return hashlib.sha1(tokens.to(torch.int32).contiguous().numpy().tobytes()).hexdigest()[:16]


class HiddenCache:
    """An opened cache directory; ``read(shard, key, a, b)`` slices one array lazily."""

    def __init__(self, directory: str | Path, meta: dict):
        self.dir = Path(directory)
        self.meta = meta
        self.hidden_size = int(meta["hidden_size"])
        self.dtype = DTYPES[meta["dtype"]]
        self._handles: dict[str, object] = {}

    def read(self, shard: str, key: str, a: int, b: int) -> torch.Tensor:
        f = self._handles.get(shard)
        if f is None:
            path = self.dir / shard
            try:
                f = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CadenceError(f"hidden cache file {path} is missing or corrupt: {exc}") from exc
            self._handles[shard] = f
        return f.get_slice(key)[a:b]

    def tap_index(self, taps: tuple[int, ...]) -> dict[str, list[int]]:
        """Per shard, the columns of its ``taps`` array holding ``taps`` in that order.
        Example: a shard cached with taps [3, 9, 15] and taps (3, 15) -> [0, 2]."""
        out = {}
        for name, entry in self.meta["shards"].items():
            have = entry.get("taps", [])
            if all(j in have for j in taps):
                out[name] = [have.index(j) for j in taps]
        return out

    def __getstate__(self):  # DataLoader workers reopen their own handles
        return {**self.__dict__, "_handles": {}}


def _read_meta(directory: Path) -> dict | None:
    path = directory / CACHE_JSON
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CadenceError(f"{path} is corrupt ({exc.msg}); delete the cache directory to rebuild it") from exc
    if meta.get("format") != FORMAT:
        raise CadenceError(f"{path} has an unknown format; delete the cache directory to rebuild it")
    return meta


def _check(meta: dict, directory: Path, backbone, fingerprint: str, data_config: dict) -> None:
    if meta["backbone_fingerprint"] != fingerprint or meta["backbone"] != backbone.name:
        raise CadenceError(
            f"hidden cache {directory} was made by backbone {meta['backbone']!r} (fingerprint "
            f"{meta['backbone_fingerprint']}), not by {backbone.name!r} (fingerprint {fingerprint}); "
            "use another --cache-hidden directory")
    if meta["data_config"] != data_config:
        raise CadenceError(f"hidden cache {directory} was made for other data ({meta['data_dir']}); "
                           "use another --cache-hidden directory")


def open_cache(directory: str | Path, backbone, data_dir: str | Path, files: list[str],
               taps: tuple[int, ...] = ()) -> HiddenCache:
    """Open an existing cache, checking backbone, data and that it covers ``files`` (with ``taps``)."""
    directory, data_dir = Path(directory), Path(data_dir)
    meta = _read_meta(directory)
    if meta is None:
        raise CadenceError(f"{directory} is not a hidden cache (no {CACHE_JSON})")
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json")
    _check(meta, directory, backbone, backbone_fingerprint(backbone), manifest["config"])
    missing = [f for f in files if f not in meta["shards"]]
    if missing:
        raise CadenceError(f"hidden cache {directory} lacks {len(missing)} shard(s), e.g. {missing[0]}")
    untapped = [f for f in files if not set(taps) <= set(meta["shards"][f].get("taps", []))]
    if untapped:
        raise CadenceError(f"hidden cache {directory} lacks taps {list(taps)} for {len(untapped)} shard(s), "
                           f"e.g. {untapped[0]}; build it with them (cadence train --cache-only --taps ...)")
    return HiddenCache(directory, meta)


def build_cache(directory: str | Path, backbone, data_dir: str | Path, files: list[str] | None = None,
                dtype: str = "bfloat16", batch_size: int = 8, progress: bool = True,
                taps: tuple[int, ...] = ()) -> HiddenCache:
    """Create or extend the cache for ``files`` (default: every shard in the manifest), each
    shard's file holding at least ``taps``."""
    directory, data_dir = Path(directory), Path(data_dir)
    if dtype not in DTYPES:
        raise CadenceError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json (not a distilled data directory)")
    if files is None:
        files = [s["file"] for s in manifest["shards"]]
    fp = backbone_fingerprint(backbone)
    meta = _read_meta(directory)
    if meta is None:
        meta = {"format": FORMAT, "backbone": backbone.name, "backbone_fingerprint": fp,
                "hidden_size": backbone.hidden_size, "vocab_size": backbone.vocab_size,
                "dtype": dtype, "data_dir": str(data_dir.resolve()), "data_config": manifest["config"],
                "shards": {}}
    else:
        _check(meta, directory, backbone, fp, manifest["config"])

    todo = []  # (shard, its data, the taps its new file holds)
    for name in files:
        data = read_shard(data_dir / name)
        entry = meta["shards"].get(name)
        if entry is not None:
            if entry["checksum"] != tokens_checksum(data["tokens"]):
                raise CadenceError(f"{data_dir / name} changed since the hidden cache {directory} was made; "
                                   "use another --cache-hidden directory")
            if set(taps) <= set(entry.get("taps", [])):
                continue
        todo.append((name, data, tuple(sorted(set(taps) | set((entry or {}).get("taps", []))))))
    if not todo:
        return HiddenCache(directory, meta)
    n_tok = sum(int(d["tokens"].numel()) for _, d, _ in todo)
    bar = tqdm(total=n_tok, desc="cache hidden", unit="tok", disable=not progress)
    for name, data, tp in todo:
        seqs = [ids for ids, _ in iter_sequences(data)]
        N = int(data["tokens"].numel())
        hidden = torch.zeros(N, backbone.hidden_size, dtype=DTYPES[dtype])
        entropy = torch.zeros(N, dtype=torch.float32)
        argmax = torch.zeros(N, dtype=torch.int32)
        tapped = torch.zeros(N, len(tp), backbone.hidden_size, dtype=DTYPES[dtype]) if tp else None
        off = data["offsets"].tolist()
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].numel())
        for j in range(0, len(order), batch_size):
            group = [i for i in order[j:j + batch_size] if seqs[i].numel() > 0]
            if not group:
                continue
            feats = sequence_features(backbone, [seqs[i] for i in group], True, True, taps=tp)
            for i, (h, ent, arg, tv) in zip(group, feats):
                hidden[off[i]:off[i + 1]] = h.to(DTYPES[dtype]).cpu()
                if tp:
                    tapped[off[i]:off[i + 1]] = tv.to(DTYPES[dtype]).cpu()
                entropy[off[i]:off[i + 1]] = ent.cpu()
                argmax[off[i]:off[i + 1]] = arg.to(torch.int32).cpu()
                bar.update(seqs[i].numel())
        tensors = {"hidden": hidden, "entropy": entropy, "argmax": argmax}
        if tp:
            tensors["taps"] = tapped
        atomic_write(directory / name, lambda tmp: save_file(tensors, str(tmp)))
        meta["shards"][name] = {"tokens": N, "checksum": tokens_checksum(data["tokens"]),
                                **({"taps": list(tp)} if tp else {})}
        atomic_write_json(directory / CACHE_JSON, meta)
    bar.close()
    return HiddenCache(directory, meta)
