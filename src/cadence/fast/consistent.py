"""Row-consistent bf16 forwards on oneDNN CPUs: a token's logits do not depend on what
else is in the forward.

Speculative decoding is lossless only if the verify forward over a tree of n nodes gives
every accepted node the logits plain decoding's one-token forward gives it. In fp32 the
two differ by about 1e-5 (a greedy divergence is then a near-tie); in bf16 they differed
by up to 0.5 logits on the Zen 5 EPYC, so bf16 speculation was not lossless there, though
a bf16 verify over 8 nodes costs only 1.04 one-token forwards. Three kernels take a
different path for small or ragged shapes (``benchmarks/kernels/consistency.py`` finds them):

1. oneDNN GEMMs at M = 1 row against M >= 2 (the down projection, K = 1536), and on an
   AMX Xeon at M <= 32 against M >= 33 (rows scattered through the call); the tile GEMM
   that replaces oneDNN on AMX CPUs (``native/gemm_amx.cpp``, kind ``amx``) and the
   int8/int4 kernels compute each row alone, so their projections are never padded or blocked;
2. PyTorch's CPU attention with fewer than 4 query rows against 4 or more;
3. attention over a key count that is not a multiple of the kernel's key block (the
   last, partial block is reduced another way).

The cure costs almost nothing in bf16, where 2 rows are no slower than 1: GEMM inputs are
padded to ``MIN_ROWS`` rows and split into calls of at most ``MAX_ROWS``, queries to ``MIN_QUERIES`` (repeats of the last row, their
outputs dropped), keys to a multiple of ``KEY_BLOCK`` (entries masked out, read from the
cache's preallocated, zero-initialised buffer). A single-sequence forward of fewer than
``MIN_QUERIES`` rows is padded up front (``pad_rows``), so none of its calls pads again
(2% faster one-token forwards on the EPYC, same bits).

Keys are sized from the context alone (``keys_for``: room for a tree of up to ``KEY_ROOM``
nodes), so a tree whose nodes reach into the next 64-key block attends over the same blocks
as the one-token forward at the same context.

In a branching tree a node's ancestors sit at scattered cache slots; with the gaps masked
the real keys still land in other lanes of the kernel's reductions. Where the C++ extension
is built, decode and verify forwards therefore attend through its ``listed_attention``
(``native/attention.cpp``): each row over the keys it lists (the context, then its
ancestors), reduced in list order whatever their slots, rows or thread count, so plain
decoding and any tree give a token the same bits in one call per layer (``key_lists``
makes the lists); the padding and key rounding below are then not needed for attention.
Without the extension each root-to-leaf path attends in turn from the slots plain
decoding gives it (``PathAttention``): one attention call per path and layer (about 4 ms
per extra path for SmolLM2 on the EPYC), so backbones in that mode grow chains only
(``Backbone.chains_only``).

Measured with the shipped SmolLM2 in bf16, 2 threads (``benchmarks/kernels/consistency.py``: root
logits of a 1-token forward against trees of 2-33 nodes on random contexts of 50-400
tokens): 82 of 100 differed (up to 0.50) without the padding; 2 of 100 with keys rounded
per forward; 0 with keys sized from the context. Every node of a branching 9-node tree
(``--tree``): 19 of 140 branch nodes differed before ``PathAttention``, 0 of 270 nodes after.

Knows: the padding rules, when they are on, and how a tree's nodes are covered by paths.
Does not know models or caches beyond the key/value buffers it is handed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

MIN_ROWS = 2  # GEMM rows
MAX_ROWS = 32  # GEMM rows per call: oneDNN on AMX takes another bf16 kernel from 33 rows on
MIN_QUERIES = 4  # attention query rows
KEY_BLOCK = 64  # attention keys are padded to a multiple of this
KEY_ROOM = 64  # a forward at context ``past`` attends to key_length(past + KEY_ROOM) keys, whatever its n <= KEY_ROOM


def wanted(kernel: str, dtype: torch.dtype) -> bool:
    """On for bf16 CPU kernels (oneDNN, AMX: attention still needs it; AMX GEMMs need no
    padding). fp32 is left alone: there a 2-row GEMM costs 1.1 one-row GEMMs on the EPYC, and
    the differences are near-ties of about 1e-5."""
    return (kernel.startswith("onednn") or kernel == "amx") and dtype == torch.bfloat16


def key_length(length: int, capacity: int) -> int:
    """Keys attended to when ``length`` are real: rounded up to a multiple of KEY_BLOCK, at
    most ``capacity``. Example: 200 -> 256; 256 -> 256; 1000 with capacity 1000 -> 1000."""
    return min(-(-length // KEY_BLOCK) * KEY_BLOCK, capacity)


def keys_for(position: int, limit: int) -> int:
    """Keys a query at ``position`` attends to, whatever else is in its forward: sized from
    its position alone (room for the KEY_ROOM cache slots a tree of up to KEY_ROOM nodes may
    put before it), at most ``limit``. A one-token forward and a tree forward then reduce
    attention over the same key blocks for every node at the same position. Example:
    position 186 -> 256 keys alone and as the root of 8 nodes (rounding 187 and 194
    separately gave 192 and 256: the root's bf16 logits differed by 0.156 on SmolLM2); its
    child at 187 -> 256, a node at 192 -> 320."""
    return key_length(position + 1 + KEY_ROOM, limit)


def row_groups(positions: list[int], limit: int) -> list[tuple[list[int], int]]:
    """Rows of a forward grouped by their key count (``keys_for``), each group attended in
    one call. Example: positions [190, 191, 191, 192] -> [([0, 1, 2], 256), ([3], 320)]."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(positions):
        groups.setdefault(keys_for(p, limit), []).append(i)
    return [(rows, keys) for keys, rows in sorted(groups.items())]


def attend_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool,
                  groups: list[tuple[list[int], int]], memo: Folded | None = None, tag: tuple = ()) -> torch.Tensor:
    """``attend`` per row group (``row_groups``): rows ``rows`` over the first ``keys`` keys.
    q: (b, H, n, d); k, v: (b, KV, L, d) with L >= every group's keys; mask: (n, L).
    memo: the forward's ``Folded`` masks (every layer attends with the same ones); ``tag``
    tells apart the calls of one forward that share ``memo`` (``PathAttention``'s paths)."""
    if len(groups) == 1:
        keys = groups[0][1]
        return attend(q, k[:, :, :keys], v[:, :, :keys], mask[:, :keys], gqa, memo, tag + (keys,))
    out = q.new_empty(q.shape)
    for rows, keys in groups:
        idx = torch.tensor(rows, device=q.device)
        out[:, :, idx] = attend(q[:, :, idx], k[:, :, :keys], v[:, :, :keys], mask[idx, :keys], gqa, memo,
                                tag + (tuple(rows), keys))
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool,
           memo: Folded | None = None, key: tuple = ()) -> torch.Tensor:
    """Attention with at least MIN_QUERIES query rows. q: (b, H, n, d); k, v: (b, KV, L, d);
    mask: (n, L) or (b, 1, n, L) bool (True = may attend) -> (b, H, n, d). ``memo``
    (optional): folded masks of this forward, ``key`` naming this call's (``Folded``)."""
    n = q.shape[2]
    if n < MIN_QUERIES:
        extra = MIN_QUERIES - n
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
        if memo is None or key not in memo:
            mask = pad_mask_rows(mask)
    folded = None if memo is None else memo.get(key, mask)
    if gqa:
        return grouped_sdpa(q, k, v, mask, folded)[:, :, :n]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if folded is None else folded)[:, :, :n]


def pad_mask_rows(mask: torch.Tensor) -> torch.Tensor:
    """A mask of fewer than MIN_QUERIES query rows with its last row repeated up to
    MIN_QUERIES, as ``attend`` pads the queries. mask: (n, L) or (b, 1, n, L). Example:
    [[T, F]] -> [[T, F]] * 4."""
    extra = MIN_QUERIES - mask.shape[-2]
    return torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], extra, -1)], dim=-2)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 folded: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention with the query heads that share a key/value head folded into
    the query rows: one work item of the CPU kernel per key/value head instead of one per
    query head. Same bits as ``enable_gqa=True`` (``tests/test_consistent.py``) for key counts
    in whole ``KEY_BLOCK``s (on the AMX Xeon, 200 keys with 22+ queries gave other bits).

    q: (b, H, n, d); k, v: (b, KV, L, d); mask: (n, L) or (b, 1, n, L) bool -> (b, H, n, d).
    folded: ``fold_mask(mask, H // KV, q.dtype)`` when the caller already has it (``Folded``).
    Example: H 9, KV 3, n 4 -> q as (b, 3, 12, d); rows 0-3 of kv head 0 are query head 0's
    four queries, rows 4-7 head 1's, rows 8-11 head 2's, so mask rows repeat 3 times (row
    r takes mask row r % n).
    """
    b, h, n, d = q.shape
    kv = k.shape[1]
    if folded is None:
        folded = fold_mask(mask, h // kv, q.dtype)
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv * n, d), k, v, attn_mask=folded)
    return out.view(b, h, n, d)


def fold_mask(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as ``grouped_sdpa`` hands it to the kernel: query rows repeated ``g``
    times (row r takes row r % n) and additive in ``dtype`` (0 where allowed, -inf
    elsewhere), the form SDPA itself converts a bool mask to on every call (same bits).
    mask: (n, L) or (b, 1, n, L) -> (g * n, L) or (b, 1, g * n, L). Example: g 3, rows
    [[T, F]] -> [[0, -inf]] * 3."""
    rows = mask.repeat(g, 1) if mask.dim() == 2 else mask.repeat(1, 1, g, 1)
    return torch.zeros(rows.shape, dtype=dtype, device=mask.device).masked_fill_(~rows, float("-inf"))


class Folded:
    """The folded masks of one forward (``fold_mask``), made at its first layer and reused by
    the others instead of a repeat and SDPA's own bool-to-additive conversion per layer.
    A key names one attention call of the forward (its rows and key count)."""

    def __init__(self, g: int, dtype: torch.dtype):
        self.g, self.dtype = g, dtype  # g: query heads per key/value head (1 without GQA)
        self.masks: dict[tuple, torch.Tensor] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self.masks

    def get(self, key: tuple, mask: torch.Tensor) -> torch.Tensor:
        """The folded ``mask`` stored under ``key``; ``mask`` (bool) is folded on a miss."""
        out = self.masks.get(key)
        if out is None:
            out = self.masks[key] = fold_mask(mask, self.g, self.dtype)
        return out


def key_lists(trees: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys each row of a decode or verify forward attends to, as ``listed_attention``
    takes them: the committed entries [0, start) of its sequence, then the new slots its tree
    row allows, in slot order (its ancestors, then itself).

    trees: (b, n, n) bool, row j of sequence s may see new entry l; starts: b committed
    lengths (new entry l of sequence s sits at slot starts[s] + l) -> prefix (b, n), extra
    (b, n, n) and count (b, n), int32 on the CPU; extra[s, j, :count[s, j]] are the slots,
    the rest is padding (the first slot). Example: start 100, tree 0 -> (1, 2): row 2 ->
    prefix 100, extra [100, 102, 100], count 2.
    """
    b, n, _ = trees.shape
    trees = trees.to("cpu", torch.bool)
    cols = torch.arange(n).expand(b, n, n)
    order = torch.where(trees, cols, n).sort(dim=-1).values  # allowed columns first, ascending
    count = trees.sum(dim=-1, dtype=torch.int32)
    base = torch.tensor(starts, dtype=torch.int32).view(b, 1, 1)
    extra = torch.where(order < n, order, 0).to(torch.int32) + base
    prefix = base.view(b, 1).expand(b, n).contiguous()
    return prefix, extra.contiguous(), count


def chain_lists(n: int, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``key_lists`` of a causal chain (new row j sees new entries 0..j: plain decoding, a
    prompt chunk) without building its mask: the same tensors from a few calls (a one-token
    forward's lists 38 -> 10 us on the Zen 4 EPYC, hot; about 0.1 ms of a 5-6 ms decode step in
    place, where caches are cold). Example: n 2,
    start 100 -> prefix [[100, 100]], extra [[[100, 100], [100, 101]]], count [[1, 2]]."""
    rel, count = _chain_offsets(n)
    b = len(starts)
    base = torch.tensor(starts, dtype=torch.int32).view(b, 1, 1)
    return base.view(b, 1).expand(b, n).contiguous(), rel + base, count.expand(b, n).clone()


@lru_cache(maxsize=64)
def _chain_offsets(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of n rows relative to its start: extra (n, n) int32 (row j: 0..j, then 0s as
    padding) and count (n,) int32 (j + 1). Shared: callers add to them, never write them."""
    cols = torch.arange(n, dtype=torch.int32)
    return torch.where(cols[None, :] <= cols[:, None], cols[None, :], 0), cols + 1


def tree_paths(ancestors: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Cover a tree's nodes with root-to-leaf paths, each node attended on exactly one.

    ancestors[i]: the tree nodes node i sees, itself included, root first (its row of the
    tree mask). Returns (path, rows): ``path`` the nodes root..leaf, ``rows`` the nodes
    attended while ``path`` sits in the cache slots right after the context, as plain
    decoding would have put it. Leaves are taken in node order; a path whose nodes were all
    attended on an earlier one is dropped. Example: 0 -> (1, 2), 1 -> 3: ancestors
    [[0], [0, 1], [0, 2], [0, 1, 3]] -> [([0, 2], [0, 2]), ([0, 1, 3], [1, 3])].
    """
    inner = {a for anc in ancestors for a in anc[:-1]}
    done: set[int] = set()
    out = []
    for leaf, path in enumerate(ancestors):
        if leaf in inner:
            continue
        rows = [node for node in path if node not in done]
        done.update(rows)
        if rows:
            out.append((list(path), rows))
    return out


def is_laid_out(ancestors: list[list[int]]) -> bool:
    """True when every node's ancestors sit in the slots plain decoding gives them (node i
    at depth d has ancestors [0, 1, ..., d - 1]: a chain, or no tree at all)."""
    return all(anc == list(range(len(anc))) for anc in ancestors)


class _Part(NamedTuple):
    path: torch.Tensor  # (m,) node ids root..leaf
    rows: torch.Tensor  # nodes attended on this path
    mask: torch.Tensor  # (len(rows), keys) bool over the cache slots
    groups: list  # ``row_groups`` of the rows (indices into ``rows``)
    in_place: bool  # the path already sits in node order after the context (no copy)


class PathAttention:
    """Tree attention in which every node reduces over its keys in plain decoding's order.

    In a branching tree, node i's ancestors sit at scattered cache slots (the tree's nodes
    are written in node order after the ``past`` committed entries); the masked gaps move
    the real keys to other lanes of the attention kernel's reductions, and bf16 logits then
    differ from plain decoding by up to 0.6 (``benchmarks/kernels/consistency.py --tree``). Here
    each path of ``tree_paths`` is copied to slots [past, past + len(path)) in turn and its
    rows attend there, over ``keys_for`` keys, as a chain would; the tree's own entries are
    written back in node order afterwards (compaction reads them there). Costs one small
    copy and one or two attention calls per path and layer.

    Rows past ``len(ancestors)`` (a batch row's padding nodes) are not attended: their
    output is 0, finite, and never read.

    Worked example: past 100, tree 0 -> (1, 2), 1 -> 3. Path [0, 2]: slots 100, 101 hold
    nodes 0, 2; rows 0 and 2 attend keys [0, 101) and [0, 102) of 192 (the rest masked).
    Path [0, 1, 3]: slots 100-102 hold nodes 0, 1, 3; rows 1 and 3 attend [0, 102) and
    [0, 103). Then slots 100-103 get nodes 0-3 again.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int,
                 ancestors: list[list[int]], limit: int):
        """k_cache, v_cache: (layers, b, KV, capacity, head_dim), room for every key read."""
        self.k_cache, self.v_cache, self.past = k_cache, v_cache, past
        self.size = len(ancestors)  # nodes attended; any further rows of a call are padding (output 0)
        dev = k_cache.device
        self.parts = []
        for path, rows in tree_paths(ancestors):
            depths = [len(ancestors[r]) - 1 for r in rows]
            groups = row_groups([past + d for d in depths], limit)
            keys = groups[-1][1]
            mask = torch.zeros(len(rows), keys, dtype=torch.bool, device=dev)
            mask[:, :past] = True
            for j, d in enumerate(depths):
                mask[j, past:past + d + 1] = True
            in_place = path == list(range(len(path)))  # already where node order puts it
            self.parts.append(_Part(torch.tensor(path, device=dev), torch.tensor(rows, device=dev), mask, groups,
                                    in_place))
        self.parts.sort(key=lambda part: not part.in_place)  # in-place paths first, before any copy
        self.copies = not all(part.in_place for part in self.parts)
        self.memo: Folded | None = None  # the parts' folded masks, made at the first layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """q: (b, H, n, d); k, v: (b, KV, n, d) of the tree's nodes -> (b, H, n, d). The
        cache slots [past, past + n) hold the nodes in node order on return."""
        K, V, past, n = self.k_cache[layer], self.v_cache[layer], self.past, k.shape[2]
        if self.memo is None:
            self.memo = Folded(q.shape[1] // k.shape[1] if gqa else 1, q.dtype)
        K[:, :, past:past + n] = k
        V[:, :, past:past + n] = v
        if len(self.parts) == 1 and not self.copies and self.size == n:  # a chain: one call
            return attend_groups(q, K, V, self.parts[0].mask, gqa, self.parts[0].groups, self.memo)
        out = q.new_zeros(q.shape) if self.size < n else q.new_empty(q.shape)
        for i, part in enumerate(self.parts):
            if not part.in_place:
                m = part.path.numel()
                K[:, :, past:past + m] = k.index_select(2, part.path)
                V[:, :, past:past + m] = v.index_select(2, part.path)
            out[:, :, part.rows] = attend_groups(q.index_select(2, part.rows), K, V, part.mask, gqa, part.groups,
                                                 self.memo, (i,))
        if self.copies:  # node order again, for compaction
            K[:, :, past:past + n] = k
            V[:, :, past:past + n] = v
        return out


def pad_rows(input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
             rows: int = MIN_QUERIES):
    """A forward of n < MIN_QUERIES rows padded up front to MIN_QUERIES, so that no GEMM or
    attention call inside it needs padding of its own: each extra row repeats the last one
    (token, position, the keys it sees; not itself), so its outputs equal the last row's
    and are dropped. Its key and value land in cache slots past the real rows, where no
    real row looks. input_ids, positions: (b, n); tree_mask: (n, n) bool or None (causal)
    -> the same, with ``rows`` rows (and columns; MIN_QUERIES by default, MIN_ROWS where
    attention needs no padding). Example: n = 1 -> rows 1-3 repeat row 0; mask
    [[T, F, F, F]] * 4."""
    b, n = input_ids.shape
    extra = rows - n
    ids = torch.cat([input_ids, input_ids[:, -1:].expand(b, extra)], dim=1)
    pos = torch.cat([positions, positions[:, -1:].expand(b, extra)], dim=1)
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril_()
    mask = torch.zeros(rows, rows, dtype=torch.bool, device=input_ids.device)
    mask[:n, :n] = tree_mask.to(device=input_ids.device, dtype=torch.bool)
    mask[n:, :n] = mask[n - 1, :n]
    return ids, pos, mask
