"""Prometheus metrics: per-session memory state, pool state, token reuse, request latency."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvos.server.service import ChatService

SESSION_GAUGES = {
    "active_tokens": "tokens resident in the KV pool",
    "cached_tokens": "tokens resident or restorable from the block store",
    "history_tokens": "tokens in the session's logical history",
    "saved_ram_bytes": "bytes of saved blocks in host RAM",
    "saved_disk_bytes": "bytes of saved blocks on disk",
}
SESSION_COUNTERS = {
    "evictions": "blocks paged out",
    "recoveries_restore": "blocks spliced back from the store",
    "recoveries_recompute": "blocks re-prefilled from their tokens",
}


class ServiceCollector(Collector):
    """Reads the service's state at scrape time."""

    def __init__(self, service: ChatService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        service = self.service
        with service.registry.cond:
            stats = [(owner, sid, e.session.stats()) for (owner, sid), e in service.registry.entries.items()]
        for key, doc in SESSION_GAUGES.items():
            family = GaugeMetricFamily(f"kvos_session_{key}", doc, labels=["session"])
            for owner, sid, s in stats:
                family.add_metric([f"{owner}/{sid}"], s[key])
            yield family
        for key, doc in SESSION_COUNTERS.items():
            counter = CounterMetricFamily(f"kvos_session_{key}", doc, labels=["session"])
            for owner, sid, s in stats:
                counter.add_metric([f"{owner}/{sid}"], s[key])
            yield counter
        pool = service.manager.engine.pool
        yield GaugeMetricFamily("kvos_pool_bytes", "bytes of the KV pool", value=pool.nbytes)
        yield GaugeMetricFamily(
            "kvos_pool_live_bytes", "bytes of allocated pool blocks", value=pool.live_bytes
        )
        yield CounterMetricFamily("kvos_pool_resizes", "times the pool grew", value=pool.resizes)
        yield GaugeMetricFamily("kvos_sessions", "sessions known to the server", value=len(stats))
        for key in ("reused_tokens", "decoded_tokens", "requests"):
            yield CounterMetricFamily(
                f"kvos_{key}", f"{key.replace('_', ' ')} over all requests", value=service.totals[key]
            )


def make_registry(service: ChatService) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    registry.register(ServiceCollector(service))
    latency = Histogram(
        "kvos_request_seconds",
        "request latency",
        ["endpoint"],
        registry=registry,
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    )
    return registry, latency
