"""cadence: self-speculative multi-token-prediction decoding on a frozen Hugging Face causal LM.

Packages follow the pipeline, bottom to top (each imports only from those above it in this
list; ``tests/test_imports.py`` checks it and ``docs/architecture.md`` draws it):
``errors`` / ``cliargs``, ``system`` (the machine, disk cache, files) / ``prompts``, ``trees``
(trees as data, the node budget), ``backbone`` (the frozen LM), ``fast`` (the CPU fast path),
``backbone.load`` (above the backends it picks), ``verify`` (the verify forward, acceptance
rules, sampling), ``heads`` (draft heads and their tables), ``draft`` (filling and growing
draft trees), ``costs`` (verify latency and the tree that pays), ``schedulers``, ``decode``
(the engine and its requests), ``methods`` (method names -> engines), ``batch``, ``bench``,
``training``, ``calibration``, ``server``, ``cli``.
"""
