"""Prometheus metrics: per-session memory state, pool state, token reuse, request latency.

A scrape shows the sessions of one owner (an API key's) or of all (an admin key's, or a server without
keys); the pool-wide figures (pool bytes, session count, token totals, latency) are the same for everyone.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvos.server import collector_pauses
from kvos.server.service import ChatService

SESSION_GAUGES = {
    "active_tokens": "tokens the session's budget counts as resident in the KV pool",
    "resident_tokens": "tokens in the KV pool (each KV head may keep fewer of them)",
    "cached_tokens": "tokens resident or restorable from the chunk store",
    "history_tokens": "tokens in the session's logical history",
    "saved_ram_bytes": "bytes of saved chunks in host RAM",
    "saved_disk_bytes": "bytes of saved chunks on disk",
    "resident_bytes_per_token": "K/V bytes a resident token takes in the pool (what its KV heads keep)",
    "saved_bytes_per_token": "K/V bytes a saved token takes in the chunk store, as encoded (0: none saved)",
    "recurrent_bytes": "a hybrid model's recurrent state and checkpoints, in the pool's cap (0: none)",
}
SESSION_COUNTERS = {
    "evictions": "chunks paged out",
    "recoveries_restore": "chunks spliced back from the store",
    "recoveries_recompute": "chunks re-prefilled from their tokens",
}

TIER_COUNTERS = {
    "errors": "calls to the shared tier that failed (unreachable or failing)",
    "conflicts": "snapshots not published: another replica wrote the session meanwhile",
    "missing_blobs": "files of a session the shared tier no longer held, or held damaged (recomputed)",
}


class ServiceCollector(Collector):
    """Reads the service's state at scrape time: the sessions of ``owner`` (None: every owner's), labelled
    ``owner/session``, and the pool-wide figures."""

    def __init__(self, service: ChatService, owner: str | None = None) -> None:
        self.service, self.owner = service, owner

    def collect(self) -> Iterator[Metric]:
        service = self.service
        with service.registry.cond:
            entries = list(service.registry.entries.items())
        stats = [(who, sid, e.session.stats()) for (who, sid), e in entries if self.owner in (None, who)]
        for key, doc in SESSION_GAUGES.items():
            family = GaugeMetricFamily(f"kvos_session_{key}", doc, labels=["session"])
            for who, sid, s in stats:
                family.add_metric([f"{who}/{sid}"], s[key])
            yield family
        for key, doc in SESSION_COUNTERS.items():
            counter = CounterMetricFamily(f"kvos_session_{key}", doc, labels=["session"])
            for who, sid, s in stats:
                counter.add_metric([f"{who}/{sid}"], s[key])
            yield counter
        pool = service.manager.engine.pool
        yield GaugeMetricFamily("kvos_pool_bytes", "bytes of the KV pool", value=pool.nbytes)
        yield GaugeMetricFamily(
            "kvos_pool_live_bytes", "bytes of allocated pool blocks", value=pool.live_bytes
        )
        if pool.slides:
            yield GaugeMetricFamily(
                "kvos_pool_window_live_bytes",
                "of the live bytes, the sliding-window layers' (held for the tokens inside their window)",
                value=pool.window_live_bytes,
            )
        yield CounterMetricFamily("kvos_pool_resizes", "times the pool grew", value=pool.resizes)
        yield GaugeMetricFamily("kvos_sessions", "sessions known to the server", value=len(entries))
        for key in ("reused_tokens", "decoded_tokens", "requests"):
            yield CounterMetricFamily(
                f"kvos_{key}", f"{key.replace('_', ' ')} over all requests", value=service.totals[key]
            )
        yield from _tier_metrics(service)
        yield from _scheduler_metrics(service)
        yield from _collector_metrics()


def _scheduler_metrics(service: ChatService) -> Iterator[Metric]:
    """Where the scheduler's time goes: its steps' forward passes, and the sessions' turns between them
    (sampling, streaming, bookkeeping: the work a step waits on outside the model)."""
    scheduler = service.registry.scheduler
    if scheduler is None:
        return
    stats = scheduler.stats
    yield CounterMetricFamily("kvos_scheduler_steps", "batched forward steps run", value=stats.steps)
    yield CounterMetricFamily(
        "kvos_scheduler_forward_seconds", "seconds of the steps' forward passes", value=stats.forward_s
    )
    yield CounterMetricFamily(
        "kvos_scheduler_turn_seconds",
        "seconds of the sessions' turns between steps (sampling, streaming, bookkeeping)",
        value=stats.turns_s,
    )


def _collector_metrics() -> Iterator[Metric]:
    """Python's garbage collector: each generation's collections and their pauses (the interpreter lock
    held: no stream moves; :mod:`kvos.server.collector_pauses`)."""
    pauses = collector_pauses.watch()
    count = CounterMetricFamily("kvos_gc_collections", "garbage collections", labels=["generation"])
    seconds = CounterMetricFamily(
        "kvos_gc_pause_seconds", "seconds of garbage collection (every thread paused)", labels=["generation"]
    )
    for generation in range(3):
        count.add_metric([str(generation)], pauses.collections[generation])
        seconds.add_metric([str(generation)], pauses.seconds[generation])
    yield count
    yield seconds
    yield GaugeMetricFamily("kvos_gc_pause_longest_seconds", "the longest collection", value=pauses.longest)


def _tier_metrics(service: ChatService) -> Iterator[Metric]:
    """The shared tier's health (``kvos serve --store``): nothing without one."""
    state = service.registry.state
    tier = state.tier if state is not None else None
    if tier is None:
        return
    yield GaugeMetricFamily("kvos_store_tier_up", "1 while the shared tier answers", value=int(tier.up))
    for key, doc in TIER_COUNTERS.items():
        yield CounterMetricFamily(f"kvos_store_tier_{key}", doc, value=getattr(tier, key))


class Metrics:
    """The server's metrics: the request latency histogram, and scrapes scoped to an owner."""

    def __init__(self, service: ChatService) -> None:
        self.service = service
        self.latency = Histogram(
            "kvos_request_seconds",
            "request latency",
            ["endpoint"],
            registry=None,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def scrape(self, owner: str | None) -> str:
        """The Prometheus text of a scrape that sees the sessions of ``owner`` (None: all)."""
        return generate_latest(_Scrape(ServiceCollector(self.service, owner), self.latency)).decode()


class _Scrape(Collector):
    """The collectors of one scrape."""

    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            yield from collector.collect()
