"""Serving metrics beyond prometheus_client's own: latency percentiles per route, and the
admission of work in flight."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np


class LatencyWindow:
    """Latency percentiles per route over each route's last ``size`` requests, as the
    Prometheus gauge ``sampan_request_latency_seconds{route, quantile}`` (p50, p95, p99;
    with ``--workers N`` those of the worker answering ``/metrics``, labelled with its
    pid). The ``sampan_request_seconds`` histogram next to it covers every request."""

    QUANTILES = (0.5, 0.95, 0.99)

    def __init__(self, size: int = 2048):
        self.size = size
        self._data: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, route: str, seconds: float) -> None:
        with self._lock:
            buf = self._data.get(route)
            if buf is None:
                buf = self._data[route] = np.zeros(self.size)
                self._count[route] = 0
            buf[self._count[route] % self.size] = seconds
            self._count[route] += 1

    def percentiles(self) -> dict[str, dict[float, float]]:
        with self._lock:
            out = {}
            for route, buf in self._data.items():
                n = min(self._count[route], self.size)
                out[route] = dict(zip(self.QUANTILES, np.quantile(buf[:n], self.QUANTILES)
                                      .tolist(), strict=True))
            return out

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import GaugeMetricFamily

        worker = [str(os.getpid())] if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else []
        g = GaugeMetricFamily("sampan_request_latency_seconds", "Latency percentiles of "
                              f"each route's last {self.size} requests",
                              labels=["route", "quantile", *(["worker"] if worker else [])])
        for route, qs in self.percentiles().items():
            for q, v in qs.items():
                g.add_metric([route, str(q), *worker], v)
        yield g


class FeedbackCounts:
    """The feedback log as Prometheus metrics (serve config ``feedback.dir`` set):

    - ``sampan_feedback_journal_total{kind}``: served items and events this process wrote
      to its journal (with ``--workers N``, the answering worker's, labelled with its pid);
    - ``sampan_feedback_rows_total{outcome}``: the log's joiner's counts since the log
      began: ``written`` rows, ``late``, ``duplicate``, ``unknown`` and ``unknown_type``
      events, ``kafka_sent``, failed passes (``errors``), ``events_click`` and the like;
    - ``sampan_feedback_pending{what}``: served items waiting for their window to close,
      and events waiting for their item.

    The joiner runs in a process of its own: these are the counts it saved after its last
    pass (every ``poll`` second)."""

    def __init__(self, service: object):
        self.service = service

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from sampan.serving.feedback import saved_stats

        s = self.service
        journal = getattr(s, "journal", None)
        if journal is None:
            return
        worker = [str(os.getpid())] if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else []
        c = CounterMetricFamily("sampan_feedback_journal", "Served items and events written "
                                "to this process's feedback journal",
                                labels=["kind", *(["worker"] if worker else [])])
        for kind in ("served", "events"):
            c.add_metric([kind, *worker], journal.written.get(kind, 0))
        yield c
        stats = saved_stats(s.cfg.feedback.dir)
        pending = {"items": stats.pop("pending", 0), "events": stats.pop("orphan_events", 0)}
        rows = CounterMetricFamily("sampan_feedback_rows", "The feedback joiner's counts: "
                                   "rows written, late / duplicate / unknown events, rows "
                                   "sent to Kafka, failed passes", labels=["outcome"])
        for outcome, n in sorted(stats.items()):
            rows.add_metric([outcome], n)
        yield rows
        g = GaugeMetricFamily("sampan_feedback_pending", "Served items waiting for their "
                              "window to close, and events waiting for their item",
                              labels=["what"])
        for what, n in pending.items():
            g.add_metric([what], n)
        yield g


class Admission:
    """The work one worker has in flight on the routes that take a body: requests, and
    their body bytes (HTTP: the ``Content-Length``, else ``max_body_bytes``; gRPC: the
    message). :meth:`enter` refuses past ``max_inflight`` requests or ``max_inflight_bytes``
    (a worker with nothing in flight takes any request), counting the refusal in
    ``sampan_overloaded{route,limit}``; :meth:`leave` says when a burst has ended (nothing
    left in flight after ``TRIM_AFTER`` bytes), the moment to hand freed memory back to
    the system (:func:`release_memory`)."""

    TRIM_AFTER = 16 << 20

    def __init__(self, max_requests: int, max_bytes: int, registry: Any):
        from prometheus_client import Counter

        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = self.bytes = self.since_trim = 0
        self._lock = threading.Lock()
        self.refused = Counter("sampan_overloaded", "Requests refused (HTTP 503, gRPC "
                               "RESOURCE_EXHAUSTED) because the worker was at max_inflight "
                               "or max_inflight_bytes", ["route", "limit"], registry=registry)

    def enter(self, route: str, cost: int) -> str | None:
        """Take a request of ``cost`` bytes, or return the limit it would pass."""
        with self._lock:
            if self.requests >= self.max_requests:
                limit = "max_inflight"
            elif self.requests and self.bytes + cost > self.max_bytes:
                limit = "max_inflight_bytes"
            else:
                self.requests += 1
                self.bytes += cost
                return None
        self.refused.labels(route, limit).inc()
        return limit

    def leave(self, cost: int) -> bool:
        with self._lock:
            self.requests -= 1
            self.bytes -= cost
            self.since_trim += cost
            if self.requests or self.since_trim < self.TRIM_AFTER:
                return False
            self.since_trim = 0
            return True

    def message(self, limit: str) -> str:
        what = f"{self.max_requests} requests" if limit == "max_inflight" else \
            f"{self.max_bytes} body bytes"
        return (f"the server is at its limit of work in flight ({limit}: {what}); "
                "retry shortly")


def release_memory() -> None:
    """Hand memory freed after a burst of large requests back to the system: Arrow's pool
    and glibc's heap (which keeps freed pages otherwise)."""
    import ctypes
    import ctypes.util

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
