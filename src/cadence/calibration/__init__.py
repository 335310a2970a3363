"""``cadence calibrate``: acceptance measured on held-out data (``acceptance``), per-task
entropy profiles and their plots (``entropy_profiles``), and the command (``command``).
What it writes is read at run time by ``cadence.heads`` (``tables``, ``profiles``)."""
