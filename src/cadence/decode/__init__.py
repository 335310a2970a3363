"""Decoding: the shared ``Engine`` (``engine``), one ``Request`` per generation in flight
(``request``: prefill, plan, draft, score, verify, commit), a generation's settings and
results (``generation``: ``GenerationConfig``, ``Stats``, ``Generation``), and incremental
detokenization with stop strings (``detok``)."""
