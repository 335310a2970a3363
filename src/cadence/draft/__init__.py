"""Drafting: filling a compiled tree from the heads (``head_drafter``), growing an EAGLE-2
dynamic tree from their confidence (``grow``), the context copy alone (``copy_drafter``), the
request's n-gram index (``context_copy``) and its tokens outside the draft vocabulary
(``context_vocab``)."""
