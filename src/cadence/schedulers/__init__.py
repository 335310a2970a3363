"""--scheduler NAME: how much to speculate each step. ``base`` is the interface a scheduler
implements (``choose`` a plan, ``observe`` its outcome) and registers through; ``registry`` finds
them by name."""
