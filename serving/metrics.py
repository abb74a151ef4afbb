"""Prometheus metrics: recorded where they happen, merged where they are scraped.

A ModelServer replica records its requests (TTFT, inter-token latency, end-to-end latency, queue
time, token and finish-reason counters) in its own registry and reads its engine's gauges
(running, waiting, KV-cache usage) at collection time. The gateway records HTTP statuses. Under
Ray Serve those registries live in different processes, so each replica publishes a snapshot of
its metric families to a MetricsHub every `metrics_push_interval_s`; the gateway's /metrics
merges the hub's snapshots (every replica of every model and every gateway replica, told apart by
the `replica` label) with its own live registry. In-process (no Ray) the gateway collects the
model registries directly. Metric families are plain picklable objects, so no text is re-parsed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

disable_created_metrics()  # *_created samples double the output and no dashboard uses them

PREFIX = "shardserve_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               300.0, 600.0)


class ReplicaMetrics:
    """Metrics of one ModelServer replica (or of the in-process model backend)."""

    def __init__(self, model: str, replica: str, stats: Callable[[], dict[str, float]], weight_dtype: str = "",
                 dtype: str = ""):
        self.labels = {"model": model, "replica": replica}
        self.registry = CollectorRegistry(auto_describe=False)
        names = ["model", "replica"]
        r = self.registry
        # an info series (always 1) carries what describes the replica, so the other series keep their labels
        Gauge(PREFIX + "model_info", "The replica's model: weight storage (fp8 or the compute dtype) and compute "
              "dtype, as labels.", [*names, "weight_dtype", "dtype"], registry=r).labels(
            **self.labels, weight_dtype=weight_dtype or "unknown", dtype=dtype or "unknown").set(1)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, names, registry=r, buckets=buckets).labels(**self.labels)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival at the replica to the first token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a completion.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival at the replica to the last token.",
                        E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before its first engine step.",
                          E2E_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", names,
                                     registry=r).labels(**self.labels)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", names,
                                         registry=r).labels(**self.labels)
        self._finished = Counter(PREFIX + "requests_finished", "Finished completions by finish reason "
                                 "(stop, length, abort, timeout, error).", [*names, "finish_reason"], registry=r)
        self._rejected = Counter(PREFIX + "requests_rejected", "Requests refused before they ran, by reason "
                                 "(overloaded, ttft_slo: given up waiting for a first token that could "
                                 "not come within the SLO, invalid, unavailable).", [*names, "reason"], registry=r)
        # every reason exported from the start at 0, so rate() and dashboards see a series before the first event
        for reason in ("stop", "length", "abort", "timeout", "error"):
            self._finished.labels(**self.labels, finish_reason=reason)
        for reason in ("overloaded", "ttft_slo", "invalid", "unavailable"):
            self._rejected.labels(**self.labels, reason=reason)
        self.registry.register(_EngineGauges(self.labels, stats))

    def finished(self, reason: str, count: int = 1) -> None:
        self._finished.labels(**self.labels, finish_reason=reason).inc(count)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(**self.labels, reason=reason).inc()

    def families(self) -> list[Metric]:
        return list(self.registry.collect())


class _EngineGauges:
    """Reads the engine's counters at collection time, so a scrape is never staler than one step."""

    def __init__(self, labels: dict[str, str], stats: Callable[[], dict[str, float]]):
        self.labels = labels
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        for key, name, doc in (
                ("num_running", "num_requests_running", "Sequences in the engine's running batch."),
                ("num_waiting", "num_requests_waiting", "Sequences queued in the engine."),
                ("num_admitted", "num_sequences_admitted", ("Sequences admitted by the replica (running, "
                                                            "queued, or not yet handed to the engine).")),
                ("kv_cache_usage", "kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, float(s.get(key, 0.0)))
            yield g
        for key, name, doc in (
                ("num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks."),
                ("num_steps", "engine_steps", "Engine steps that ran work."),
                ("busy_seconds", "engine_busy_seconds", ("Wall time of the engine's working steps (schedule, "
                                                         "model, sampling, outputs); over elapsed time: how "
                                                         "busy the engine loop is.")),
                ("prefix_cache_queries", "prefix_cache_queries", ("Tokens looked up in the prefix cache when "
                                                                  "sequences were admitted (prompt, plus the output "
                                                                  "so far of a resumed preempted one).")),
                ("prefix_cache_hits", "prefix_cache_hits", ("Of prefix_cache_queries, tokens whose KV blocks "
                                                            "came from the cache; the hit rate is "
                                                            "rate(hits) / rate(queries)."))):
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, float(s.get(key, 0)))
            yield c


class GatewayMetrics:
    def __init__(self, replica: str):
        self.replica = replica
        self.registry = CollectorRegistry(auto_describe=False)
        self.http = Counter(PREFIX + "http_requests", "HTTP responses by route, model and status code.",
                            ["replica", "route", "model", "status"], registry=self.registry)

    def observe(self, route: str, model: str, status: int) -> None:
        self.http.labels(replica=self.replica, route=route, model=model, status=str(status)).inc()

    def families(self) -> list[Metric]:
        return list(self.registry.collect())


class MetricsHub:
    """Latest metric snapshot of every publishing replica; a source silent for `ttl_s` is dropped
    (its replica is gone, and Prometheus treats the vanished series like a restarted target)."""

    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self._snapshots: dict[str, tuple[float, list[Metric]]] = {}

    def publish(self, source: str, families: list[Metric]) -> None:
        self._snapshots[source] = (time.monotonic(), families)

    def remove(self, source: str) -> None:
        self._snapshots.pop(source, None)

    def sources(self) -> list[str]:
        return list(self._snapshots)

    def snapshot(self, exclude: str | None = None) -> list[list[Metric]]:
        now = time.monotonic()
        for src in [s for s, (t, _) in self._snapshots.items() if now - t > self.ttl_s]:
            del self._snapshots[src]
        return [fams for src, (_, fams) in self._snapshots.items() if src != exclude]


def merge(sources: Iterable[list[Metric]]) -> list[Metric]:
    """One family per metric name, with the samples of every source (their labels tell them apart)."""
    merged: dict[str, Metric] = {}
    for families in sources:
        for fam in families:
            m = merged.get(fam.name)
            if m is None:
                m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            m.samples.extend(fam.samples)
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric]) -> bytes:
    """Prometheus text exposition format."""
    return generate_latest(_Families(families))  # type: ignore[arg-type]
