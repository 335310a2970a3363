"""The frozen causal LM: its interface and transformers forward (``base``), the KV cache
interface (``kv_cache``), and loading a model onto the fast path or transformers (``load``,
which sits above ``cadence.fast``)."""
