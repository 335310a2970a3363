"""Benchmark harness: tasks, runner, Spec-Bench-style metrics and reports (``cadence bench``).

Modules: ``tasks`` (prompt sets and scoring), ``execute`` (sandboxed-ish Python runs for
HumanEval), ``metrics`` (pure functions over records), ``peers`` (transformers / llama.cpp
baselines), ``runner`` (the interleaved, resumable measuring loop), ``report``
(results.json, report.md, plots, compare) and ``command`` (the CLI subcommand).
"""
