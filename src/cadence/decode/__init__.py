"""Decoding: the shared ``Engine`` and its settings (``engine``), one ``Request`` per
generation in flight (``request``: prefill, plan, draft, score, verify, commit), and
incremental detokenization with stop strings (``detok``)."""
