"""The server's Prometheus metrics, on a registry of its own (so two servers in one process do not collide).

Gauges are read when scraped (queue depth, running requests, KV pages); histograms and counters are fed by
the thread that routes the engine's outputs (Streams), as tokens arrive (time to first token, inter-token
latency, end-to-end latency, prompt and generated tokens, finished requests by reason). Names follow vLLM's, with the `chunkwise_` prefix.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a millisecond (a GPU decode step) to minutes (a long queue on CPU).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str, waiting: Callable[[], float], running: Callable[[], float],
                 kv_pages_used: Callable[[], float], kv_pages_total: int):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, list(label), registry=r).labels(**label).set_function(read)

        gauge("chunkwise_num_requests_waiting", "Requests waiting to be admitted (the server's queue included).",
              waiting)
        gauge("chunkwise_num_requests_running", "Requests the scheduler is running.", running)
        gauge("chunkwise_kv_pages_used", "KV cache pages held by requests.", kv_pages_used)
        gauge("chunkwise_kv_pages_total", "KV cache pages in the pool.", lambda: kv_pages_total)

        def hist(name: str, doc: str):
            return Histogram(name, doc, list(label), buckets=_LATENCY_BUCKETS, registry=r).labels(**label)

        self.ttft = hist("chunkwise_time_to_first_token_seconds", "From arrival to the first generated token.")
        self.itl = hist("chunkwise_inter_token_latency_seconds", "Between consecutive tokens of a request.")
        self.e2e = hist("chunkwise_e2e_request_latency_seconds", "From arrival to the last token.")
        self.prompt_tokens = Counter("chunkwise_prompt_tokens", "Prompt tokens of admitted requests.",
                                     list(label), registry=r).labels(**label)
        self.generation_tokens = Counter("chunkwise_generation_tokens", "Generated tokens.", list(label),
                                         registry=r).labels(**label)
        self._finished = Counter("chunkwise_request_success", "Finished requests, by finish reason.",
                                 [*label, "finished_reason"], registry=r)
        self._label = label

    def finished(self, reason: str) -> None:
        self._finished.labels(**self._label, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
