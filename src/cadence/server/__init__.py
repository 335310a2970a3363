"""``cadence serve``: an OpenAI-compatible HTTP server over a multi-request engine.

Modules: ``config`` (the command's settings), ``protocol`` (OpenAI's request / response
shapes), ``options`` (request -> engine settings), ``worker`` (the thread that owns the
engine), ``metrics`` (Prometheus), ``app`` (FastAPI routes), ``command`` (the CLI).
FastAPI, uvicorn and prometheus-client are the ``serve`` extra: only ``config`` and
``command`` may be imported without them.
"""
