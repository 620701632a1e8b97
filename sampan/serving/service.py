"""The serving process, transport-neutral: predictor, feature store, micro-batcher and
metrics, shared by the HTTP and gRPC front ends; reloads swap bundles atomically."""

from __future__ import annotations

import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

from sampan.config import ServeConfig
from sampan.errors import BundleError
from sampan.serving.predictor import Predictor, RequestError

if TYPE_CHECKING:
    from sampan.serving.workers import ReloadSync


class ServingBundleError(BundleError):
    """A bundle that cannot be served; ``field`` says which (bundle / retrieval_bundle)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field



ROUTES = ("/v1/predict", "/v1/rank", "/v1/recommend", "/v1/admin/reload", "/healthz",
          "/readyz", "/metrics")


class ServerState:
    """The serving process: predictor, feature store, batcher and metrics, shared by the
    HTTP and gRPC front ends. :meth:`reload` swaps the predictor atomically."""

    def __init__(self, cfg: ServeConfig):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from sampan.serving.batcher import MicroBatcher

        self.cfg = cfg
        self.token = os.environ.get("SAMPAN_ADMIN_TOKEN") or cfg.admin_token
        self.registry = CollectorRegistry()
        self.requests = Counter("sampan_requests", "Requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("sampan_request_seconds", "Request latency by route",
                                 ["route"], registry=self.registry,
                                 buckets=(.0005, .001, .002, .004, .006, .008, .01, .015, .02,
                                          .03, .05, .1, .25, .5, 1, 2.5))
        self.batch_rows = Histogram("sampan_batch_rows", "Rows per model call",
                                    registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024,
                                             2048, 4096, 8192))
        self.batch_requests = Histogram("sampan_batch_requests", "Requests per model call",
                                        registry=self.registry,
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        # With --workers N every worker writes its metrics to PROMETHEUS_MULTIPROC_DIR and
        # /metrics adds them up (prometheus_client's multiprocess mode); the model gauge
        # then has a pid label per worker, and a replaced model reads 0 (labels cannot be
        # removed in that mode).
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.model_info = Gauge("sampan_model_info", "The model being served (value 1)",
                                ["model", "version", "bundle"], registry=self.registry,
                                multiprocess_mode="liveall")
        self.reloads = Counter("sampan_reloads", "Bundle reloads by outcome", ["outcome"],
                               registry=self.registry)
        self.batcher = MicroBatcher(cfg.max_batch_rows, cfg.max_wait_ms, self._on_batch)
        self._lock = threading.Lock()
        self.sync: ReloadSync | None = None  # set in each worker of `--workers N`
        self.predictor: Predictor | None = None
        self.store: Any = None
        self.retriever: Any = None
        self.retrieval_store: Any = None
        self.load(cfg.bundle, cfg.retrieval_bundle)

    def _on_batch(self, requests: int, rows: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_rows.observe(rows)

    def _store_for(self, predictor: Predictor) -> Any:
        from sampan.config import JoinConfig
        from sampan.serving.feature_store import MemoryFeatureStore, RedisFeatureStore

        fs = self.cfg.feature_store
        joins = fs.tables if fs.tables is not None else [
            JoinConfig.model_validate(j)
            for j in predictor.bundle.manifest["config"]["data"].get("joins", [])]
        if not joins:
            return None
        memory = MemoryFeatureStore(joins, predictor.roles)
        if fs.backend == "redis":
            return RedisFeatureStore.load(fs.url, memory, prefix=fs.prefix)
        return memory

    def load(self, bundle: str | None, retrieval_bundle: str | None = None
             ) -> tuple[Predictor | None, Any]:
        """Open the given bundles (a ranking bundle, a two-tower bundle for
        ``/v1/recommend``, each with its feature store), then serve them together. If one
        fails to open, nothing changes and :class:`ServingBundleError` names it."""
        from sampan.serving.retrieval import Retriever

        predictor = retriever = store = rstore = None
        field = "bundle"
        try:
            if bundle is not None:
                predictor = Predictor(bundle, max_records=self.cfg.max_records,
                                      threads=self.cfg.threads)
                store = self._store_for(predictor)
            if retrieval_bundle is not None:
                field = "retrieval_bundle"
                retriever = Retriever(retrieval_bundle, self.cfg.max_records)
                rstore = self._store_for(retriever.predictor)
        except Exception as e:  # noqa: BLE001 - reported with the bundle that failed
            path = bundle if field == "bundle" else retrieval_bundle
            raise ServingBundleError(field, f"cannot load {field} {path!r}: {e}") from e
        with self._lock:
            if predictor is not None:
                old = self.predictor
                self.predictor, self.store = predictor, store
                if old is not None and self.multiprocess:
                    self.model_info.labels(*self._info(old)).set(0)
                elif old is not None:
                    self.model_info.remove(*self._info(old))
                self.model_info.labels(*self._info(predictor)).set(1)
            if retriever is not None:
                self.retriever, self.retrieval_store = retriever, rstore
        return predictor, retriever

    @staticmethod
    def _info(p: Predictor) -> tuple[str, str, str]:
        return (p.bundle.manifest.get("model", "?"), p.version, str(p.bundle.path))

    def current(self) -> tuple[Predictor, Any]:
        with self._lock:
            if self.predictor is None:
                raise RuntimeError("no model loaded")
            return self.predictor, self.store

    # the two request kinds, shared by HTTP and gRPC -----------------------------------
    def predict_future(self, records: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
        predictor, store = self.current()
        return predictor, self.batcher.submit(predictor, predictor.table(records, store))

    def rank_future(self, context: dict[str, Any], candidates: list[Any]):  # type: ignore
        predictor, store = self.current()
        table = predictor.candidates_table(context, candidates, self.cfg.item_key, store)
        return predictor, self.batcher.submit(predictor, table)

    def retrieve(self, context: dict[str, Any], n: int) -> list[tuple[str, float]]:
        with self._lock:
            retriever, store = self.retriever, self.retrieval_store
        if retriever is None:
            raise RequestError("no retrieval bundle is configured (serve with --set "
                               "retrieval_bundle=PATH of an exported two_tower run, or "
                               "reload one)", "retrieval_bundle")
        return retriever.search(context, n, store)

    def check_token(self, header: str | None) -> bool:
        if not self.token:
            return False  # reload is disabled without a configured token
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # RFC 6750: "Authorization: Bearer <token>"
            return False
        return secrets.compare_digest(given.strip().encode(), self.token.encode())

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.batcher.close()
