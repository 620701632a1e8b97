"""Serving metrics beyond prometheus_client's own: latency percentiles per route."""

from __future__ import annotations

import os
import threading

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
