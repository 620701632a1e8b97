"""The serving process, transport-neutral: predictor, feature store, micro-batcher and
metrics, shared by the HTTP and gRPC front ends; reloads swap bundles atomically."""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

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
        self.watcher: ModelWatcher | None = None
        bundle = cfg.bundle
        if cfg.watch is not None:
            self.watcher = ModelWatcher(self, cfg.watch, cfg.watch_seconds)
            bundle = self.watcher.adopt(bundle)
        self.load(bundle, cfg.retrieval_bundle)
        if self.watcher is not None:
            self.watcher.start()

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

    def load(self, bundle: str | None, retrieval_bundle: str | None = None,
             check: Any = None) -> tuple[Predictor | None, Any]:
        """Open the given bundles (a ranking bundle, a two-tower bundle for
        ``/v1/recommend``, each with its feature store), then serve them together. If one
        fails to open (or ``check(predictor)`` raises for the ranking one), nothing changes
        and :class:`ServingBundleError` names it."""
        from sampan.serving.retrieval import Retriever

        predictor = retriever = store = rstore = None
        field = "bundle"
        try:
            if bundle is not None:
                predictor = Predictor(bundle, max_records=self.cfg.max_records,
                                      threads=self.cfg.threads)
                if check is not None:
                    check(predictor)
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
        if self.watcher is not None:
            self.watcher.stop()
        if self.sync is not None:
            self.sync.close()
        self.batcher.close()


class ModelWatcher:
    """Follows a model directory that a stream run publishes to
    (:mod:`sampan.export.publish`): every ``interval`` seconds it reads ``versions.json``,
    and a newer version is checked (the bundle's checksums, its recorded export parity,
    one scored record) and swapped in by :meth:`ServerState.load`, between two model
    calls: no request is dropped. A version that fails its checks is refused (and
    counted) and the current one keeps serving. :meth:`rollback` goes back to the
    version served before and holds there until a version newer than the one rolled back
    from is published."""

    MAX_PARITY = 1e-4

    def __init__(self, state: ServerState, directory: str, interval: float):
        self.state, self.dir, self.interval = state, Path(directory), interval
        self.serving: dict[str, Any] | None = None  # the versions.json entry being served
        self.previous: list[dict[str, Any]] = []  # served before, most recent last
        self.refused: set[int] = set()
        self.hold_until = 0  # after a rollback: versions up to this one are not applied
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def _versions(self) -> dict[str, Any]:
        from sampan.export.publish import read_versions

        return read_versions(self.dir)

    def adopt(self, bundle: str | None) -> str:
        """The bundle to start with: ``bundle`` (a version of the directory, or any
        bundle), else the directory's latest version."""
        v = self._versions()
        if bundle is not None:
            name = Path(bundle).resolve()
            self.serving = next((e for e in v["versions"]
                                 if (self.dir / e["path"]).resolve() == name), None)
            return bundle
        entry = next((e for e in v["versions"] if e["version"] == v["latest"]), None)
        if entry is None:
            raise ServingBundleError("watch", f"{self.dir} holds no published version yet "
                                     "(start `sampan stream` with stream.publish.dir there)")
        self.serving = entry
        return str(self.dir / entry["path"])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sampan-watch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the server keeps serving; said in /metrics
                self.errors.append(str(e))
                del self.errors[:-10]

    def poll(self) -> dict[str, Any] | None:
        """Apply the newest version if it is new and passes its checks; returns it."""
        v = self._versions()
        latest = int(v.get("latest", 0))
        current = self.serving["version"] if self.serving else 0
        if latest <= max(current, self.hold_until) or latest in self.refused:
            return None
        entry = next((e for e in v["versions"] if e["version"] == latest), None)
        if entry is None:
            return None
        return self._apply(entry)

    def _check(self, entry: dict[str, Any]) -> Any:
        def check(p: Predictor) -> None:
            m = p.bundle.manifest  # its files matched their checksums when it opened
            if entry.get("manifest_sha256") and m.get("manifest_sha256") != \
                    entry["manifest_sha256"]:
                raise ServingBundleError("bundle", "its manifest is not the one "
                                         "versions.json names")
            diff = m.get("parity", {}).get("max_abs_diff")
            if diff is None or not diff <= self.MAX_PARITY:
                raise ServingBundleError("bundle", f"its export parity {diff} is above "
                                         f"{self.MAX_PARITY}")
            # every feature missing: the graph must still score
            probs = p.predict([dict.fromkeys(p.columns)])
            if not bool(np.isfinite(probs).all()):
                raise ServingBundleError("bundle", "it scores a record as non-finite")
        return check

    def _apply(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        path = str(self.dir / entry["path"])
        try:
            self.state.load(path, check=self._check(entry))
        except ServingBundleError as e:
            self.refused.add(int(entry["version"]))
            self.state.reloads.labels("refused").inc()
            self.errors.append(f"version {entry['version']}: {e}")
            return None
        self.state.reloads.labels("ok").inc()
        if self.serving is not None:
            self.previous.append(self.serving)
            del self.previous[:-5]
        self.serving = entry
        return entry

    def rollback(self) -> dict[str, Any]:
        """Back to the version served before this one (raises
        :class:`ServingBundleError` when there is none, or it can no longer be opened)."""
        if not self.previous:
            raise ServingBundleError("watch", "no earlier version was served to roll back to")
        back = self.previous[-1]
        rolled_from = self.serving["version"] if self.serving else 0
        self.state.load(str(self.dir / back["path"]), check=self._check(back))
        self.previous.pop()
        self.serving = back
        self.hold_until = max(self.hold_until, rolled_from)
        return back
