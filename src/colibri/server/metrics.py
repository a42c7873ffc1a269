"""/metrics: Prometheus text from prometheus-client, one registry per server.

Histograms and request counters are fed by the engine thread as requests finish. The levels (sequences, queue,
KV pool, disk) are read at scrape time from the snapshot the engine thread publishes after each step, never
from the engine itself. Every numeric key of `Engine.counters()`, of the weight store's counters and of the KV
space's counters is exported as a gauge (`colibri_engine_<key>`, `colibri_store_<key>`, `colibri_kv_<key>`), so
a counter added there shows up here without an edit.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("colibri_request_duration_seconds", "Request arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("colibri_engine_step_seconds", "Wall time of one engine step (forward pass)",
                                   buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8), registry=r)
        self.requests = Counter("colibri_requests", "Finished engine requests by finish reason", ["reason"],
                                registry=r)
        self.http = Counter("colibri_http_responses", "HTTP responses by route and status", ["route", "status"],
                            registry=r)
        self.prompt_tokens = Counter("colibri_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prefix_tokens = Counter("colibri_prompt_tokens_reused",
                                     "Prompt tokens served from cached KV (prefix reuse), not recomputed",
                                     registry=r)
        self.generated = Counter("colibri_generated_tokens", "Tokens generated", registry=r)
        self.worker = None

    def step(self, seconds: float, tokens: int) -> None:
        self.step_time.observe(seconds)
        self.generated.inc(tokens)

    def finished(self, reason: str, seconds: float, metrics) -> None:
        self.requests.labels(reason=reason).inc()
        if reason not in ("abort", "error"):
            self.latency.observe(seconds)
        if metrics is not None:
            self.prompt_tokens.inc(metrics.prompt_tokens)
            self.prefix_tokens.inc(metrics.prefix_tokens)

    def attach(self, worker) -> None:
        """Export the worker's state and snapshot at scrape time."""
        self.worker = worker
        self.registry.register(_Levels(worker))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Levels:
    """A prometheus-client collector over the engine thread's published snapshot."""

    def __init__(self, worker):
        self.worker = worker

    def describe(self):
        return []  # collected at scrape time only (the set of generic gauges is not fixed)

    def collect(self):
        w = self.worker
        snap = w.snapshot
        ready = GaugeMetricFamily("colibri_model_ready", "1 once the model is loaded and serving", labels=["state"])
        ready.add_metric([w.state], 1.0 if w.state == "ready" else 0.0)
        yield ready
        if not snap:
            return
        tokens_s, gbs = w.rates()
        yield GaugeMetricFamily("colibri_generated_tokens_per_second",
                                "Tokens generated per second, all requests, over the last 10 s", value=tokens_s)
        yield GaugeMetricFamily("colibri_queue_depth", "Requests waiting for a sequence slot", value=snap["queued"])
        yield GaugeMetricFamily("colibri_requests_in_flight", "Requests accepted and not yet answered (running,"
                                " queued or being admitted), read live", value=w.in_flight())
        cap = snap["kv_pool_capacity_bytes"]
        if cap:
            yield GaugeMetricFamily("colibri_kv_pool_capacity_bytes",
                                    "RAM the KV pool may hold now, beside a decode pass of the running sequences",
                                    value=cap)
            used = snap["engine"].get("kv_pool_used_bytes", 0)
            yield GaugeMetricFamily("colibri_kv_pool_usage_ratio", "KV pool RAM in use / its budget",
                                    value=used / cap)
        store = snap["store"]
        if store:
            yield CounterMetricFamily("colibri_disk_read_bytes", "Weight bytes read from disk",
                                      value=store.get("bytes_read", 0))
            yield GaugeMetricFamily("colibri_disk_read_gb_per_second",
                                    "Achieved weight read bandwidth (bytes / time with a read in flight), last 10 s",
                                    value=gbs)
            uses = sum(store.get(k, 0) for k in ("expert_hits", "expert_misses", "expert_pinned_uses"))
            if "expert_hits" in store:
                yield GaugeMetricFamily("colibri_expert_hit_rate",
                                        "Routed expert uses served without a read (cache hits and pinned)",
                                        value=(store.get("expert_hits", 0) + store.get("expert_pinned_uses", 0))
                                        / uses if uses else 0.0)
            by_layer = store.get("lookahead_recall_by_layer") or []
            if any(r is not None for r in by_layer):
                recall = GaugeMetricFamily("colibri_lookahead_recall_by_layer",
                                           "MoE router lookahead: routed experts that had been guessed, per layer",
                                           labels=["layer"])
                for i, r in enumerate(by_layer):
                    if r is not None:
                        recall.add_metric([str(i)], r)
                yield recall
        for prefix, values in (("engine", snap["engine"]), ("store", store), ("kv", snap["kv"])):
            for key, value in sorted(values.items()):
                if _numeric(value):
                    name = key if key.startswith(prefix + "_") else f"{prefix}_{key}"
                    yield GaugeMetricFamily(f"colibri_{name}", f"{prefix} counter {key}", value=float(value))
