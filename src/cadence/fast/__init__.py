"""The fast path: a lean decoder forward for Llama-family backbones.

Modules, one idea each:
- ``arch``: which configs the fast decoder supports, and why others are refused.
- ``kernels``: matrix products that suit the device (prepacked oneDNN on CPU).
- ``cache``: the preallocated KV cache with in-place compaction.
- ``rope``: RoPE from a precomputed table indexed by position ids.
- ``quant``: ``--quant``, which weight format the projections run on.
- ``model``: ``FastBackbone``, the forward itself (``rows``: many requests' trees in one pass).
- ``report``: ``cadence env`` and ``cadence cache``.
- ``native``: its layer loop in C++ (same ATen calls, same bits) and fused RMSNorm / RoPE
  kernels, built once per machine at the first forward (Python loop when it cannot build).

The CPU's features are read by ``cadence.system.machine``; ``cadence.backbone.load.make_fast``
wraps a loaded backbone in a ``FastBackbone``.
"""
