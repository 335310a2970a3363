"""Prometheus metrics of ``cadence serve`` (``GET /metrics``), named like vLLM's.

Knows: one ``prometheus_client`` registry per app (tests run several apps in one
process), the metric names and what feeds them: HTTP answers (from the routes), engine
events and queue sizes (from the worker thread; prometheus-client is thread-safe).
Does not know engines or HTTP routing.

Names (counters get ``_total`` in the exposition):
- ``cadence:http_requests_total{endpoint,status}``: answers by route and HTTP status
- ``cadence:request_success_total{finished_reason}``: requests ended by stop / length / abort / error
- ``cadence:num_requests_running``, ``cadence:num_requests_waiting``: the engine's batch and queue
- ``cadence:batch_size``: histogram of requests advanced per engine step
- ``cadence:prompt_tokens_total``, ``cadence:generation_tokens_total``
- ``cadence:time_to_first_token_seconds``, ``cadence:e2e_request_latency_seconds``: histograms
- ``cadence:spec_decode_num_drafts_total``: steps that verified at least one draft token
- ``cadence:spec_decode_num_draft_tokens_total``: draft tokens verified
- ``cadence:spec_decode_num_accepted_tokens_total``: of those, accepted
- ``cadence:spec_decode_num_accepted_tokens_per_pos_total{position}``: accepted at depth 0, 1, ...
  (position 0 = the first draft after the backbone's own token, as in vLLM)
- ``cadence:online_store_ngrams``, ``cadence:online_store_replies``: with ``--online-store``, the
  n-grams it keeps now and the replies it has learnt (read when scraped)
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from cadence.batch.api import Event

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no ``*_created`` series (process-wide, as vLLM does)


class Metrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model
        self.http = Counter("cadence:http_requests", "HTTP answers by route and status",
                            lab + ["endpoint", "status"], registry=r)
        self.success = Counter("cadence:request_success", "finished requests by finish reason",
                               lab + ["finished_reason"], registry=r)
        self.running = Gauge("cadence:num_requests_running", "requests decoding now", lab, registry=r)
        self.waiting = Gauge("cadence:num_requests_waiting", "requests waiting for a slot", lab, registry=r)
        self.batch = Histogram("cadence:batch_size", "requests advanced per engine step", lab,
                               buckets=BATCH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cadence:prompt_tokens", "prompt tokens admitted", lab, registry=r)
        self.generation_tokens = Counter("cadence:generation_tokens", "tokens generated", lab, registry=r)
        self.ttft = Histogram("cadence:time_to_first_token_seconds", "from admission to the first token",
                              lab, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("cadence:e2e_request_latency_seconds", "from admission to the last token",
                             lab, buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("cadence:spec_decode_num_drafts", "steps that verified draft tokens", lab, registry=r)
        self.draft_tokens = Counter("cadence:spec_decode_num_draft_tokens", "draft tokens verified", lab,
                                    registry=r)
        self.accepted = Counter("cadence:spec_decode_num_accepted_tokens", "draft tokens accepted", lab,
                                registry=r)
        self.accepted_pos = Counter("cadence:spec_decode_num_accepted_tokens_per_pos",
                                    "draft tokens accepted at each depth (0 = first draft)",
                                    lab + ["position"], registry=r)

    def watch_online_store(self, store) -> None:
        """Expose an online store's size (``draft.online_store.OnlineStore``), read at each scrape."""
        lab = ["model_name"]
        for name, what, read in (("cadence:online_store_ngrams", "n-grams the online store keeps", lambda: len(store)),
                                 ("cadence:online_store_replies", "replies the online store learnt",
                                  lambda: store.replies)):
            Gauge(name, what, lab, registry=self.registry).labels(model_name=self.model).set_function(read)

    def answer(self, path: str, status: int) -> None:
        if path not in ENDPOINTS:
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        self.http.labels(self.model, path, str(status)).inc()

    def queues(self, running: int, waiting: int) -> None:
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)

    def step(self, events: list[Event]) -> None:
        """One engine step's events."""
        m = self.model
        if events:
            self.batch.labels(m).observe(len({e.rid for e in events}))
        for e in events:
            if e.tokens:
                self.generation_tokens.labels(m).inc(len(e.tokens))
            if e.drafted:
                self.drafts.labels(m).inc()
                self.draft_tokens.labels(m).inc(e.drafted)
                self.accepted.labels(m).inc(e.accepted)
                for pos, hit in enumerate(e.accepted_at):
                    if hit:
                        self.accepted_pos.labels(m, str(pos)).inc(hit)

    def finished(self, reason: str) -> None:
        self.success.labels(self.model, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
