"""PIPO (Pair-In, Pair-Out; arXiv 2605.27255): a latent compressor that folds two input tokens
into one backbone position, an MTP head that unfolds one hidden state into a second output
token, and a confidence head that decides whether that token is kept. LOSSY and opt-in.

Layout: ``config`` (typed settings), ``groups`` (how a token sequence becomes pair and plain
positions), ``student`` (compressor, LoRA adapter on a weight-sharing copy of the backbone,
pair-out and confidence heads; save/load), ``decode`` (the two decoding modes), ``train``
(on-policy distillation from the unmodified backbone), ``command`` (``cadence train-pipo`` and
the ``generate --pipo`` flags). Nothing here changes plain or speculative decoding: the backbone
passed in keeps its own modules; the adapter lives on a copy that shares its weights.
Method: docs/pipo.md.
"""
