"""Verification: one backbone forward over a compiled tree (``scorer``), acceptance rules
as pure functions (``rules``), and the sampling both rest on (``sampling``: temperature,
top-k / top-p, every random draw)."""
