"""The serving process, transport-neutral: predictor, feature store, live histories,
micro-batcher and metrics, shared by the HTTP and gRPC front ends; reloads swap bundles
atomically (:mod:`~sampan.serving.watcher` follows a published model directory)."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sampan.config import ServeConfig
from sampan.errors import BundleError, ConfigError, ConflictError
from sampan.serving.feature_store import bundle_tables
from sampan.serving.live import live_spec
from sampan.serving.predictor import Predictor, RequestError, top_k
from sampan.serving.variants import BUCKETS, Allocation

if TYPE_CHECKING:
    from sampan.serving.watcher import ModelWatcher
    from sampan.serving.workers import ReloadSync


def _first_of_each(candidates: list[Any]) -> np.ndarray:
    """Positions of each distinct candidate's first occurrence, in order."""
    seen: set[Any] = set()
    return np.array([i for i, c in enumerate(candidates) if not (c in seen or seen.add(c))],
                    dtype=np.int64)



MAX_WARNINGS = 20  # warnings listed one by one in a reply; the rest are counted


def _short(text: str, limit: int = 200) -> str:
    """A value from a request as an error or a warning quotes it: at most ``limit``
    characters (a reply never echoes a client's megabyte back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"

def _unreachable(e: BaseException) -> bool:
    """Whether ``e`` is the Redis client failing to reach its server."""
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:
        return False
    return isinstance(e, (RedisConnectionError, RedisTimeoutError))


def _no_bundle_at(path: str | None) -> bool:
    """Whether ``path`` holds no bundle at all (no manifest.json; a name the system cannot
    even look up, such as one too long)."""
    if not path:
        return False
    try:
        return not (Path(path) / "manifest.json").is_file()
    except (OSError, ValueError):
        return True


class ServingBundleError(BundleError):
    """A bundle that cannot be served; ``field`` says which (bundle / retrieval_bundle);
    ``missing``: there is no bundle at that path (HTTP 404), rather than a bundle that
    cannot be served (400)."""

    def __init__(self, field: str, message: str, missing: bool = False):
        super().__init__(message)
        self.field, self.missing = field, missing



ROUTES = ("/v1/predict", "/v1/rank", "/v1/recommend", "/v1/events", "/v1/feedback",
          "/v1/admin/reload", "/v1/admin/rollback", "/v1/admin/weights", "/healthz",
          "/readyz", "/metrics")
VARIANT = "default"  # the one arm of a server that runs no experiment


@dataclass
class Arm:
    """One arm of the server: a name, the predictor it serves with its feature store, and
    the watcher of its model directory, if it follows one. A server without an experiment
    has one arm (``default``) that every request goes to."""

    name: str
    predictor: Predictor | None = None
    store: Any = None
    watcher: ModelWatcher | None = None


class Submitted(NamedTuple):
    """A request handed to the batcher: who scores it, its features, the scores to come."""

    predictor: Predictor
    table: Any
    future: Any
    arm: str
    forced: bool


def allocation_path(cfg: Any) -> Path | None:
    """Where a serve config's experiment keeps its allocation (``experiment.state``, else
    ``feedback.dir/experiment.json``; None without an experiment or a place for it)."""
    exp = cfg.experiment
    if exp is None:
        return None
    if exp.state:
        return Path(exp.state)
    return Path(cfg.feedback.dir) / "experiment.json" if cfg.feedback.dir else None


class ServerState:
    """The serving process: its arms (each a predictor and feature store, reloadable and
    watched), the experiment's assignment of users to arms, batcher, metrics and feedback
    journal, shared by the HTTP and gRPC front ends. :meth:`load` swaps an arm's predictor
    atomically."""

    def __init__(self, cfg: ServeConfig):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from sampan.serving.batcher import MicroBatcher

        self.cfg = cfg
        self.token = os.environ.get("SAMPAN_ADMIN_TOKEN") or cfg.admin_token
        self.events_token = os.environ.get("SAMPAN_EVENTS_TOKEN") or \
            cfg.feature_store.events_token
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
        self.events = Counter("sampan_events", "Behaviour events appended to live histories",
                              registry=self.registry)
        from sampan.serving.metrics import LatencyWindow

        self.window = LatencyWindow()
        self.registry.register(self.window)
        from sampan.serving.metrics import Admission

        self.admission = Admission(cfg.max_inflight, cfg.max_inflight_bytes, self.registry)
        self.batcher = MicroBatcher(cfg.max_batch_rows, cfg.max_wait_ms, self._on_batch)
        self._lock = threading.Lock()
        self.sync: ReloadSync | None = None  # set in each worker of `--workers N`
        self.retriever: Any = None
        self.retrieval_store: Any = None
        self.retrieval_own = False  # the retriever is control's own bundle
        self.live: Any = None  # users' behaviour histories, shared by both bundles
        self.variant_requests = Counter("sampan_variant_requests", "Scoring requests by arm "
                                        "and whether the request forced it",
                                        ["variant", "forced"], registry=self.registry)
        exp = cfg.experiment
        specs = [(v.name, v.bundle, v.watch) for v in exp.variants] if exp is not None \
            else [(VARIANT, cfg.bundle, cfg.watch)]
        self.arms: dict[str, Arm] = {name: Arm(name) for name, _, _ in specs}
        self.control = specs[0][0]
        for i, (name, bundle, watch) in enumerate(specs):
            arm = self.arms[name]
            if watch is not None:
                from sampan.serving.watcher import ModelWatcher

                arm.watcher = ModelWatcher(self, watch, cfg.watch_seconds, arm=name)
                bundle = arm.watcher.adopt(bundle)
            self.load(bundle, cfg.retrieval_bundle if i == 0 else None, arm=name)
        for arm in self.arms.values():
            if arm.watcher is not None:
                arm.watcher.start()
        self.allocation: Allocation | None = None
        self.allocation_path = allocation_path(cfg)
        self._follow: threading.Thread | None = None
        self._stop_follow = threading.Event()
        if exp is not None:
            self._start_experiment(exp)
        self.journal: Any = None  # the feedback journal of this process
        self.joiner: Any = None  # one per server: here unless this is one of N workers
        fb = cfg.feedback
        if fb.dir is not None:
            from sampan.serving.feedback import JoinerProcess, JournalWriter
            from sampan.serving.metrics import FeedbackCounts

            self.journal = JournalWriter(fb.dir, fb.flush_seconds)
            if not os.environ.get("SAMPAN_SERVE_SYNC"):  # `--workers N`: the parent joins
                self.joiner = JoinerProcess(fb).start()
            self.feedback_counts = FeedbackCounts(self)
            self.registry.register(self.feedback_counts)

    # the experiment ------------------------------------------------------------------
    @property
    def predictor(self) -> Predictor | None:
        """Control's predictor (the only one without an experiment)."""
        return self.arms[self.control].predictor

    @property
    def store(self) -> Any:
        return self.arms[self.control].store

    @property
    def watcher(self) -> ModelWatcher | None:
        return self.arms[self.control].watcher

    def _start_experiment(self, exp: Any) -> None:
        """The allocation: the saved one (weights changed at runtime survive a restart and
        reach every worker) when it is for these arms, else one from the weights."""
        arms = [(v.name, v.weight) for v in exp.variants]
        self.allocation = Allocation.load_or_start(self.allocation_path, arms)
        path = self.allocation_path
        if path is None:
            return
        if not path.exists():
            self._save_allocation(self.allocation)
        self._seen = path.stat().st_mtime_ns

        def follow() -> None:  # another worker's (or process's) weight change
            while not self._stop_follow.wait(0.5):
                try:
                    m = path.stat().st_mtime_ns
                    if m != self._seen:
                        self._seen = m
                        self.allocation = Allocation.load_or_start(path, arms)
                except (OSError, ValueError):
                    continue  # replaced under us: the next look reads it whole

        self._follow = threading.Thread(target=follow, daemon=True, name="sampan-allocation")
        self._follow.start()

    def _save_allocation(self, alloc: Allocation) -> None:
        assert self.allocation_path is not None and self.cfg.experiment is not None
        alloc.save(self.allocation_path)
        data = json.loads(self.allocation_path.read_text())  # with the experiment's name
        data["experiment"] = self.cfg.experiment.name
        data["unit_key"] = self.cfg.unit_key
        tmp = self.allocation_path.with_name(self.allocation_path.name + ".name")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.allocation_path)

    def set_weights(self, weights: dict[str, float]) -> dict[str, Any]:
        """New weights for the arms (admin): only the buckets that must move, from the
        arms that shrink to those that grow; saved for the other workers and restarts."""
        if self.allocation is None:
            raise ConflictError("this server runs no experiment (serve with --variant)",
                                "weights")
        try:
            new = self.allocation.reweighted(weights)
        except ConfigError as e:
            raise RequestError(str(e), "weights") from None
        moved = int((new.owner != self.allocation.owner).sum())
        if self.allocation_path is not None:
            self._save_allocation(new)
            self._seen = self.allocation_path.stat().st_mtime_ns
        elif self.cfg.workers > 1:
            raise ConflictError("with --workers N a weight change needs a place all workers "
                                "read: set feedback.dir or experiment.state", "weights")
        self.allocation = new
        return {"weights": dict(zip(new.names, new.weights, strict=True)),
                "buckets": new.counts(), "moved_buckets": moved}

    def assign(self, unit: Any, forced: str | None = None) -> tuple[str, bool]:
        """``(arm, forced)`` of a request: the one it forces (QA: marked, and left out of
        the analysis), else the unit's sticky arm; a request without a unit gets a bucket of
        its own (counted in ``sampan_variant_requests`` like any other)."""
        if forced is not None:
            if forced not in self.arms:
                raise RequestError(f"variant {forced!r} is not an arm of this server; its "
                                   f"arms: {list(self.arms)}", "variant")
            return forced, True
        if self.allocation is None or self.cfg.experiment is None:
            return self.control, False
        if unit is None or unit == "":
            return self.allocation.arm_of_bucket(secrets.randbelow(BUCKETS)), False
        return self.allocation.arm_of(self.cfg.experiment.name, str(unit)), False

    def observe(self, route: str, status: str, seconds: float) -> None:
        """Count and time one request (every route, HTTP and gRPC, whatever happened)."""
        self.requests.labels(route, status).inc()
        self.latency.labels(route).observe(seconds)
        self.window.observe(route, seconds)

    def _on_batch(self, requests: int, rows: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_rows.observe(rows)

    def _tables_for(self, predictor: Predictor) -> Any:
        """The feature tables of a bundle: its own (written at export), with any the serve
        config names in place of those with the same key; for a bundle without any, the
        run's ``data.joins`` side tables (read from their files); None without any (then
        :meth:`load` keeps the arm's)."""
        from sampan.config import JoinConfig
        from sampan.data.joins import SideTable
        from sampan.serving.feature_store import MemoryTables, RedisTables

        fs = self.cfg.feature_store
        tables = {t.by: t for t in bundle_tables(predictor.bundle)}
        if tables or fs.tables is not None:
            joins = fs.tables or []
        else:
            joins = [JoinConfig.model_validate(j) for j in
                     predictor.bundle.manifest["config"]["data"].get("joins", [])]
        tables |= {j.by: SideTable(j, predictor.roles) for j in joins}
        if not tables:
            return None
        memory = MemoryTables(list(tables.values()))
        if fs.backend == "redis":
            return RedisTables.load(fs.url, memory, prefix=fs.prefix)
        return memory

    def _live_for(self, bundles: list[Any]) -> Any:
        """The live histories the bundles read (one state for all of them, kept across
        reloads): created and started from the first bundle's user table on first use."""
        from sampan.serving.live import LiveHistories, RedisLiveHistories

        # the user table is read only to start the state (a reload keeps the live one)
        specs = [s for s in (live_spec(b, self.live is None) for b in bundles)
                 if s is not None]
        if not specs:
            return self.live
        fs = self.cfg.feature_store
        if self.live is None:
            key, hist, _ = specs[0]
            live = RedisLiveHistories(fs.url, key, hist, fs.ttl_seconds, fs.prefix) \
                if fs.backend == "redis" else LiveHistories(key, hist, fs.ttl_seconds,
                                                            fs.max_live_users)
            for _, more, _ in specs[1:]:
                live.extend(more)
            start = next((t for _, _, t in specs if t is not None), None)
            if fs.bootstrap and start is not None:
                live.bootstrap(start.column(key), {c: start.column(c) for c in
                                                   start.column_names if c != key})
            return live
        for key, hist, _ in specs:
            if key == self.live.key:
                self.live.extend(hist)
        return self.live

    def _threads(self, retrieval_bundle: str | None) -> int | None:
        """The ranking session's threads: the config's; else one when a retrieval bundle
        is served too (its user tower and the ranker would each keep a pool spinning on
        the same cores: measured in benchmarks/serve_load.py --taobao), else ONNX
        Runtime's default."""
        if self.cfg.threads is not None:
            return self.cfg.threads
        both = retrieval_bundle or self.cfg.retrieval_bundle or self.retriever is not None
        return 1 if both else None

    def load(self, bundle: str | None, retrieval_bundle: str | None = None,
             check: Any = None, arm: str | None = None) -> tuple[Predictor | None, Any]:
        """Open the given bundles (a ranking bundle for ``arm``, default control; a
        two-tower bundle for ``/v1/recommend``; each with its feature store), then serve
        them together. If one fails to open (or ``check(predictor)`` raises for the
        ranking one), nothing changes and :class:`ServingBundleError` names it."""
        target = self.arms[arm or self.control]
        from sampan.serving.feature_store import FeatureStore
        from sampan.serving.retrieval import Retriever

        predictor = retriever = tables = rtables = None
        field = "bundle"
        try:
            if bundle is not None:
                predictor = Predictor(bundle, max_records=self.cfg.max_records, json_types=True,
                                      threads=self._threads(retrieval_bundle))
                if check is not None:
                    check(predictor)
                tables = self._tables_for(predictor)
                if tables is None and target.store is not None:
                    # a bundle without feature tables or joins (a version `sampan stream`
                    # published from a log that holds the joined features): the arm's stay
                    tables = target.store.tables
            if retrieval_bundle is not None:
                field = "retrieval_bundle"
                retriever = Retriever(retrieval_bundle, self.cfg.max_records)
                rtables = self._tables_for(retriever.predictor)
            elif self._retrieves_itself(predictor, target):
                # a next-item (or two-tower) model served alone retrieves its own candidates
                retriever, rtables = Retriever(bundle, predictor=predictor), tables
            field = "feature_store"
            live = self._live_for([p.bundle for p in (predictor, retriever and
                                                      retriever.predictor) if p is not None])
        except Exception as e:  # noqa: BLE001 - reported with the bundle that failed
            if _unreachable(e):  # Redis down: the bundle is not at fault
                raise ServingBundleError("feature_store", "cannot reach the Redis feature "
                                         f"store at {self.cfg.feature_store.url} "
                                         f"(feature_store.url): {e}") from e
            path = {"bundle": bundle, "retrieval_bundle": retrieval_bundle}.get(field)
            what = f"{field} {path!r}" if path else "the live user histories"
            raise ServingBundleError(field, f"cannot load {what}: {e}",
                                     _no_bundle_at(path)) from e
        store = FeatureStore(tables, live)
        rstore = FeatureStore(rtables, live)
        with self._lock:
            self.live = live
            for a in self.arms.values():  # kept: give them the live state
                if a.predictor is not None and (a is not target or predictor is None):
                    a.store = FeatureStore(a.store.tables if a.store else None, live)
            if predictor is not None:
                old = target.predictor
                target.predictor, target.store = predictor, store
                if old is not None and self.multiprocess:
                    self.model_info.labels(*self._info(old)).set(0)
                elif old is not None:
                    self.model_info.remove(*self._info(old))
                self.model_info.labels(*self._info(predictor)).set(1)
            if retriever is not None:
                self.retriever, self.retrieval_store = retriever, rstore
                self.retrieval_own = retrieval_bundle is None
            elif self.retriever is not None:
                self.retrieval_store = FeatureStore(self.retrieval_store.tables, live)
        return predictor, retriever

    def _retrieves_itself(self, predictor: Predictor | None, target: Arm) -> bool:
        """Whether control's new ``predictor`` also serves ``/v1/recommend``: it has a user
        tower and item index, and no retrieval bundle of its own was given (one from an
        earlier version of control is replaced)."""
        return (predictor is not None and target.name == self.control
                and bool(predictor.bundle.manifest.get("retrieval"))
                and (self.retriever is None or self.retrieval_own))

    @staticmethod
    def _info(p: Predictor) -> tuple[str, str, str]:
        return (p.bundle.manifest.get("model", "?"), p.version, str(p.bundle.path))

    def current(self, arm: str | None = None) -> tuple[Predictor, Any]:
        with self._lock:
            a = self.arms[arm or self.control]
            if a.predictor is None:
                raise RuntimeError("no model loaded")
            return a.predictor, a.store

    # the two request kinds, shared by HTTP and gRPC -----------------------------------
    def predict_future(self, records: list[dict[str, Any]],
                       variant: str | None = None) -> Submitted:
        """Raw records to the arm of their first record's unit (or the forced
        ``variant``)."""
        key = self.cfg.unit_key
        arm, forced = self.assign(records[0].get(key) if records and isinstance(
            records[0], dict) else None, variant)
        predictor, store = self.current(arm)
        table = predictor.table(records, store)
        self.variant_requests.labels(arm, str(forced).lower()).inc()
        return Submitted(predictor, table, self.batcher.submit(predictor, table), arm, forced)

    def item_key(self, predictor: Predictor | None = None) -> str:
        """The column /v1/rank puts candidates in: the serve config's ``item_key``, else
        the one ``predictor``'s bundle names (the control arm's by default)."""
        predictor = predictor or self.predictor
        if self.cfg.item_key is not None or predictor is None:
            return self.cfg.item_key or "item_id"
        return predictor.item_key

    def rank_future(self, context: dict[str, Any], candidates: list[Any],
                    variant: str | None = None, assigned: tuple[str, bool] | None = None
                    ) -> Submitted:
        """A context's candidates to the arm of its unit (or the forced ``variant``)."""
        arm, forced = assigned or self.assign(context.get(self.cfg.unit_key)
                                              if isinstance(context, dict) else None, variant)
        predictor, store = self.current(arm)
        table = predictor.candidates_table(context, candidates, self.item_key(predictor),
                                           store)
        self.variant_requests.labels(arm, str(forced).lower()).inc()
        return Submitted(predictor, table, self.batcher.submit(predictor, table), arm, forced)

    # the feedback log ------------------------------------------------------------------
    @staticmethod
    def request_id() -> str:
        return uuid.uuid4().hex

    @staticmethod
    def _meta(request_id: str, sub: Submitted, unit: Any) -> dict[str, Any]:
        return {"request_id": request_id, "unit": None if unit is None else str(unit),
                "variant": sub.arm, "model_version": sub.predictor.version,
                "forced": sub.forced, "served_at": time.time()}

    def log_records(self, request_id: str, sub: Submitted, scores: np.ndarray,
                    records: list[dict[str, Any]]) -> None:
        """``/v1/predict``'s records as served items (the item: its position)."""
        if self.journal is None:
            return
        key = self.cfg.unit_key
        items = [{"item": None, "position": i, "score": float(scores[i, 0]),
                  "propensity": None, **({"unit": str(r[key])} if r.get(key) is not None
                                         else {})} for i, r in enumerate(records)]
        self.journal.served(self._meta(request_id, sub, None), items, sub.table)

    def log_ranked(self, request_id: str, sub: Submitted, candidates: list[Any],
                   ranked: list[dict[str, Any]], context: dict[str, Any],
                   scores: np.ndarray | None = None, task: int = 0) -> None:
        """The items a ranking response returned, in its order, with their features; with
        ``explore`` (and the ``scores`` of every candidate), every scored candidate with
        its propensity, those not returned at position -1."""
        if self.journal is None or not ranked:
            return
        first = _first_of_each(candidates)
        at = {candidates[i]: i for i in first}
        rows = [int(at[r["item"]]) for r in ranked]
        items = [{"item": str(r["item"]), "position": p, "score": r["score"],
                  "propensity": None} for p, r in enumerate(ranked)]
        if self.cfg.explore is not None and scores is not None:
            s = scores[:, task]
            prop = np.zeros(len(s))
            prop[first] = self.first_probabilities(s[first])
            for it, row in zip(items, rows, strict=True):
                it["propensity"] = float(prop[row])
            shown = set(rows)
            unshown = [int(i) for i in first if i not in shown]
            items += [{"item": str(candidates[i]), "position": -1, "score": float(s[i]),
                       "propensity": float(prop[i])} for i in unshown]
            rows += unshown
        self.journal.served(self._meta(request_id, sub, context.get(self.cfg.unit_key)),
                            items, sub.table.take(rows))

    def record_feedback(self, events: list[dict[str, Any]]) -> int:
        """Events on served items, for the joiner; returns how many were taken."""
        if self.journal is None:
            raise ConflictError("no feedback log is configured (serve with --set "
                                "feedback.dir=PATH)", "feedback")
        types = self.cfg.feedback.event_types
        for i, e in enumerate(events):
            if e["type"] not in types:
                raise RequestError(f"event {i}: type {e['type']!r} is not one of "
                                   f"feedback.event_types {types}", "type", i)
        now = time.time()
        self.journal.events([{**e, "item": str(e["item"]), "received_at": now,
                              "ts": now if e.get("ts") is None else e["ts"]} for e in events])
        return len(events)

    def ranked(self, predictor: Predictor, scores: np.ndarray, candidates: list[Any], k: int,
               task: int, retrieval: dict[Any, float] | None = None) -> list[dict[str, Any]]:
        """The ``k`` best candidates by label ``task``'s probability, best first; with
        ``explore``, the first one drawn by its policy (see :meth:`first_probabilities`).
        A candidate named twice is ranked once (its first occurrence)."""
        if task >= scores.shape[1]:
            raise RequestError(f"task {task} does not exist; the model has "
                               f"{scores.shape[1]} label(s) {predictor.labels}", "task")
        s = scores[:, task]
        first = _first_of_each(candidates)
        if len(first) < len(candidates):
            candidates, s = [candidates[i] for i in first], s[first]
        if self.cfg.explore is None or len(candidates) < 2:
            picked = top_k(candidates, s, k)
        else:
            p = self.first_probabilities(s)
            first = int(np.searchsorted(np.cumsum(p), secrets.randbelow(2**53) / 2**53,
                                        side="right"))
            first = min(first, len(s) - 1)
            rest = [i for i in np.argsort(-s, kind="stable") if i != first][:max(k - 1, 0)]
            picked = [(candidates[i], float(s[i])) for i in [first, *rest]][:k]
        return [{"item": i, "score": v, **({"retrieval_score": retrieval[i]} if retrieval
                                           is not None else {})} for i, v in picked]

    def first_probabilities(self, s: np.ndarray) -> np.ndarray:
        """Each candidate's probability of going first under ``explore``."""
        ex = self.cfg.explore
        assert ex is not None
        n = len(s)
        if ex.method == "softmax":
            z = np.log(np.clip(s, 1e-7, 1 - 1e-7) / (1 - np.clip(s, 1e-7, 1 - 1e-7)))
            e = np.exp((z - z.max()) / ex.temperature)
            return e / e.sum()
        top = s == s.max()
        return (1 - ex.epsilon) * top / top.sum() + ex.epsilon / n

    def context_warnings(self, context: dict[str, Any], recommend: bool = False) -> list[str]:
        """One warning per context key that no model of the request reads (it is ignored,
        not an error: one context may serve several models)."""
        with self._lock:
            models = [(self.predictor, self.store)]
            if recommend:
                models.append((self.retriever and self.retriever.predictor,
                               self.retrieval_store))
        models = [(p, st) for p, st in models if p is not None]
        known = set().union(*(p.known(st) for p, st in models)) if models else set()
        names = " and ".join(p.name for p, _ in models)
        unread = [k for k in (context if isinstance(context, dict) else {}) if k not in known]
        # one warning a key, up to a few; a context of thousands of keys gets one more line
        out = [f"context feature {_short(k)!r} is read by no served model ({names}); it was "
               "ignored" for k in unread[:MAX_WARNINGS]]
        if len(unread) > MAX_WARNINGS:
            out.append(f"... and {len(unread) - MAX_WARNINGS:,} more context features no "
                       "served model reads (ignored)")
        return out + self._absent_keys(context, models)

    @staticmethod
    def count_warnings(candidates: list[Any] | None = None, n: int | None = None,
                       k: int | None = None) -> list[str]:
        """What a rank or recommend request's counts change about its reply: candidates
        named more than once (each is ranked once), or asking ``n`` retrieved items for a
        top ``k`` larger than ``n``."""
        out = []
        # the candidates were scored: scalar ids, so hashable
        if candidates and len(set(candidates)) < len(candidates):
            twice = {c: m for c, m in Counter(candidates).items() if m > 1}
            c, m = next(iter(twice.items()))
            more = f" and {len(twice) - 1:,} more" if len(twice) > 1 else ""
            out.append(f"candidate {_short(str(c))!r} was given {m} times{more}: each "
                       "candidate is ranked once, at its first place")
        if n is not None and k is not None and n < k:
            out.append(f"n {n} is smaller than k {k}: at most {n} items come back (n is how "
                       "many the retrieval model finds for ranking)")
        return out

    @staticmethod
    def _absent_keys(context: Any, models: list[tuple[Predictor, Any]]) -> list[str]:
        """One warning per feature-table key the context gives (the user, say) that its
        table does not hold: the features it would bring are missing values, which is
        right for a new user and a mistake for a mistyped or wrongly formatted id."""
        out: list[str] = []
        if not isinstance(context, dict):
            return out
        for _, store in models:
            tables = store.tables if store is not None else None
            for by, cols in (tables.provides() if tables is not None else {}).items():
                value = context.get(by)
                cols = [c for c in cols if c not in context]  # a new user's own attributes
                if value is None or isinstance(value, (dict, list)) or not cols:
                    continue
                try:
                    found = store.in_table(by, value)  # as the request's lookup found it
                except Exception:  # noqa: BLE001 - a warning never fails the request
                    continue
                note = (f"{by} {_short(str(value))!r} is not in the feature table keyed by "
                        f"{by}: its features ({', '.join(cols[:4])}"
                        f"{', ...' if len(cols) > 4 else ''}) were scored as missing values")
                if not found and note not in out:
                    out.append(note)
        return out

    def record_events(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """Append behaviour events to users' live histories (see
        :func:`sampan.serving.live.append_events`)."""
        from sampan.serving.live import append_events

        if self.live is not None and not self.live.shared and self.cfg.workers > 1:
            raise ConflictError("events need the redis feature store with --workers > 1 "
                                "(each worker process has its own memory): set "
                                "feature_store.backend=redis", "feature_store")
        with self._lock:
            tables = [st.tables for st in (self.store, self.retrieval_store)
                      if st is not None and st.tables is not None]
        return append_events(self.live, events, tables, self.cfg.max_records)

    def retrieve(self, context: dict[str, Any], n: int
                 ) -> tuple[list[tuple[str, float]], list[str]]:
        """The retrieval model's ``n`` candidates for ``context``, and its warnings."""
        with self._lock:
            retriever, store = self.retriever, self.retrieval_store
        if retriever is None:
            raise ConflictError("no retrieval bundle is configured (serve with --set "
                               "retrieval_bundle=PATH of an exported two_tower, sasrec "
                               "or hstu run, or reload one)", "retrieval_bundle")
        return retriever.search_with_notes(context, n, store)

    def recommend_future(self, context: dict[str, Any], n: int, variant: str | None = None
                         ) -> tuple[list[tuple[str, float]], Submitted | None, str, bool,
                                    list[str]]:
        """Retrieve ``n`` candidates, then submit them for ranking to the unit's arm:
        ``(found, submitted or None when nothing was retrieved, arm, forced, warnings)``."""
        arm, forced = self.assign(context.get(self.cfg.unit_key)
                                  if isinstance(context, dict) else None, variant)
        found, notes = self.retrieve(context, n)
        if not found:
            return found, None, arm, forced, notes
        return (found, self.rank_future(context, [item for item, _ in found],
                                        assigned=(arm, forced)), arm, forced, notes)

    def check_token(self, header: str | None, token: str | None = None) -> bool:
        """Whether an ``Authorization`` header carries ``token`` (default: the admin
        token; False when none is configured: the admin routes are then disabled)."""
        token = token or self.token
        if not token:
            return False
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # RFC 6750: "Authorization: Bearer <token>"
            return False
        return secrets.compare_digest(given.strip().encode(), token.encode())

    def close(self) -> None:
        if self.journal is not None:  # a clean stop: every served item reaches the journal
            self.journal.close()
        if self.joiner is not None:
            self.joiner.stop()
        self._stop_follow.set()
        for arm in self.arms.values():
            if arm.watcher is not None:
                arm.watcher.stop()
        if self.sync is not None:
            self.sync.close()
        self.batcher.close()
