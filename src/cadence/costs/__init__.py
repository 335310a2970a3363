"""What a step costs on this machine and which tree pays: the verify-latency curve
(``latency``), the tree of highest expected tokens/s for ``--tree`` (``tree_choice``), and
observed against predicted step costs (``step_costs``)."""
