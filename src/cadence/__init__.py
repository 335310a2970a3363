"""cadence: self-speculative multi-token-prediction decoding on a frozen Hugging Face causal LM.

Packages follow the pipeline, bottom to top (each imports only from those above it in this
list; ``tests/test_imports.py`` checks it and ``docs/architecture.md`` draws it):
``system`` (the machine, disk cache, files), ``trees`` (trees as data, the node budget),
``backbone`` (the frozen LM; ``backbone.load`` sits above ``fast``, the CPU fast path it
picks), ``verify`` (the verify forward, acceptance rules, sampling), ``heads`` (draft heads
and their tables), ``draft`` (filling and growing draft trees), ``costs`` (verify latency and
the tree that pays), ``schedulers``, ``decode`` (the engine and its requests), ``methods``
(method names -> engines), ``batch``, ``training``, ``calibration``, ``bench``, ``server``,
``cli``.
"""
