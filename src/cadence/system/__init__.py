"""cadence and the machine it runs on: locks that die with their holder, what cadence keeps
on disk (``cache``), how a run ends on SIGTERM / SIGHUP (``signals``) and the environment
report of ``cadence env`` (``report``).

Knows: the operating system's side of a run (processes, files, signals).
Does not know: models, heads or decoding; nothing here imports them at module level.
"""
