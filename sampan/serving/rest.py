"""The HTTP server: FastAPI under uvicorn, ONNX Runtime behind a micro-batcher.

Routes: ``POST /v1/predict``, ``POST /v1/rank``, ``GET /healthz``, ``GET /readyz``,
``GET /metrics`` (Prometheus text), ``POST /v1/admin/reload`` (bearer token). Errors are JSON
``{"error": ..., "field": ..., "record": ...}`` with a 4xx status; an unexpected exception is
a JSON 500 (its traceback goes to the server's log), counted in ``/metrics`` like any other
status, and the connection stays open. :class:`Guard` is the outermost layer that does this
and limits request bodies as they stream in.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sampan.config import ServeConfig
from sampan.errors import BundleError
from sampan.serving.predictor import Predictor, RequestError, top_k


class PredictRequest(BaseModel):
    """``{"records": [{raw feature: value, ...}, ...]}``"""

    model_config = ConfigDict(extra="forbid")
    records: list[dict[str, Any]] = Field(min_length=1)


class RankRequest(BaseModel):
    """``{"context": {...}, "candidates": [item ids], "k": 10, "task": 0}``"""

    model_config = ConfigDict(extra="forbid")
    context: dict[str, Any] = Field(default_factory=dict)
    candidates: list[str | int] = Field(min_length=1)
    k: int = Field(10, ge=1)
    task: int = Field(0, ge=0)


class RecommendRequest(BaseModel):
    """``{"context": {"user_id": ...}, "n": 100, "k": 10}``"""

    model_config = ConfigDict(extra="forbid")
    context: dict[str, Any] = Field(min_length=1)
    n: int = Field(100, ge=1, description="candidates retrieved by the ANN index")
    k: int = Field(10, ge=1, description="items returned after ranking")
    task: int = Field(0, ge=0)


class ServingBundleError(BundleError):
    """A bundle that cannot be served; ``field`` says which (bundle / retrieval_bundle)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ReloadRequest(BaseModel):
    """``{"bundle": ranking bundle}`` and/or ``{"retrieval_bundle": two-tower bundle}``."""

    model_config = ConfigDict(extra="forbid")
    bundle: str | None = None
    retrieval_bundle: str | None = None

    @field_validator("bundle", "retrieval_bundle")
    @classmethod
    def _plain_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        bad = next((c for c in v if ord(c) < 32 or ord(c) == 127 or
                    0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is not None:
            raise ValueError(f"the path holds the character U+{ord(bad):04X} (a control "
                             "character or a lone surrogate); give a plain path")
        return v


class ErrorResponse(JSONResponse):
    """A JSON error body that renders whatever the message echoes: non-ASCII (a lone
    surrogate included) is escaped, so rendering an error can never fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error(status: int, message: str, field: str | None = None,
          record: int | None = None) -> JSONResponse:
    """The error reply of every route: ``{"error", "field", "record"}``."""
    return ErrorResponse({"error": message, "field": field, "record": record},
                         status_code=status)


class _BodyTooLarge(Exception):
    pass


class Guard:
    """The outermost ASGI layer of the HTTP server.

    - Request bodies are limited to ``max_body_bytes`` as they arrive: a ``Content-Length``
      above it is refused before anything is read, and a chunked body is cut off (413) as
      soon as the bytes received pass it, so a client without a token cannot make the
      server buffer more than the limit.
    - Every request is counted in ``sampan_requests{route,status}`` and timed, whatever
      happened inside, unexpected exceptions included.
    - An unexpected exception becomes a JSON 500 naming the exception type (the traceback
      goes to the server's stderr); it does not reach uvicorn, which would drop the
      connection.
    """

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        limit = self.state.cfg.max_body_bytes
        status, seen, over = [0], [0], [False]

        async def send_out(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def send_app(message: dict) -> None:
            if not over[0]:  # the app's reply to a cut-off body is replaced by the 413
                await send_out(message)

        async def receive_limited() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    over[0] = True
                    raise _BodyTooLarge
            return message

        size = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if size.isdigit() and int(size) > limit:
            over[0] = True
        else:
            try:
                await self.app(scope, receive_limited, send_app)
            except Exception as e:  # noqa: BLE001 - every failure gets a JSON reply
                if not over[0]:
                    print(f"sampan serve: unexpected error in {scope.get('method')} "
                          f"{scope.get('path')}:\n{traceback.format_exc()}",
                          file=sys.stderr, flush=True)
                    if not status[0]:  # nothing sent yet: the client gets a JSON reply
                        await error(500, f"internal error ({type(e).__name__}); the server "
                                         "log has the traceback")(scope, receive, send_out)
        if over[0] and not status[0]:
            given = f"of {int(size)} bytes " if size.isdigit() else ""
            await error(413, f"request body {given}exceeds the limit of {limit} bytes",
                        "body")(scope, receive, send_out)
        route = scope.get("path", "")
        route = route if route in ROUTES else "other"
        self.state.requests.labels(route, str(status[0] or 500)).inc()
        self.state.latency.labels(route).observe(time.perf_counter() - t0)


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


class ReloadSync:
    """Keeps the worker processes of one ``sampan serve --workers N`` on the same bundles.

    The workers share a small JSON file: the served ``bundle`` and ``retrieval_bundle``,
    the ``generation`` (reloads so far) and, for each bundle, the generation that last
    loaded it (``bundle_gen``, ``retrieval_gen``: a bundle exported again to the same path
    and reloaded is loaded again everywhere). The worker that takes a reload loads the
    bundles first (so a bad bundle never reaches the file), then writes the next
    generation under an exclusive file lock; every worker polls the file every
    ``interval`` seconds and loads what a newer generation changed. Within a worker, a
    reload and the watcher take turns, so the file and what the worker serves never
    disagree for longer than one poll. A worker that uvicorn starts again later reads the
    file, so it serves the current bundles, not those of the command line.
    """

    def __init__(self, path: str | Path, state: ServerState, interval: float = 0.5):
        self.path = Path(path)
        self.state = state
        self.interval = interval
        self._lock = threading.Lock()
        self.seen = self.read()  # the file as this worker last applied it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sampan-reload-sync",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def create(path: str | Path, bundle: str, retrieval_bundle: str | None) -> None:
        """The file for a new server, at generation 0."""
        Path(path).write_text(json.dumps({
            "bundle": bundle, "retrieval_bundle": retrieval_bundle, "generation": 0,
            "bundle_gen": 0, "retrieval_gen": 0}))

    def read(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    def reload(self, bundle: str | None, retrieval_bundle: str | None
               ) -> tuple[Predictor | None, Any, int]:
        """Load the bundles here (``None`` leaves that one as it is), then tell the other
        workers: returns what :meth:`ServerState.load` does and the new generation."""
        with self._lock:  # one reload at a time in this worker, watcher included
            predictor, retriever = self.state.load(bundle, retrieval_bundle)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time among the workers
                current = self.read()
                g = current["generation"] + 1
                current["generation"] = g
                if bundle is not None:
                    current.update(bundle=bundle, bundle_gen=g)
                if retrieval_bundle is not None:
                    current.update(retrieval_bundle=retrieval_bundle, retrieval_gen=g)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(current))
                os.replace(tmp, self.path)  # atomic: readers see the old or the new file
            # What this worker serves now: what it just loaded, and for the other bundle
            # what it had before; if another worker changed that one meanwhile, the
            # watcher's next poll loads it.
            old = self.seen
            self.seen = {**current, **({} if bundle is not None else {
                "bundle": old["bundle"], "bundle_gen": old["bundle_gen"]}),
                **({} if retrieval_bundle is not None else {
                    "retrieval_bundle": old["retrieval_bundle"],
                    "retrieval_gen": old["retrieval_gen"]})}
        return predictor, retriever, g

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Load whatever the file's bundles changed since this worker last looked."""
        with self._lock:
            try:
                current = self.read()
            except (OSError, ValueError):
                return  # the server is shutting down
            seen = self.seen
            bundle = current["bundle"] if current["bundle_gen"] > seen["bundle_gen"] else None
            retrieval = current["retrieval_bundle"] \
                if current["retrieval_gen"] > seen["retrieval_gen"] else None
            if bundle is None and retrieval is None:
                return
            self.seen = current
            try:
                self.state.load(bundle, retrieval)
                self.state.reloads.labels("ok").inc()
            except Exception as e:  # noqa: BLE001 - keep serving the old model; say why
                self.state.reloads.labels("failed").inc()
                print(f"sampan worker {os.getpid()}: cannot load generation "
                      f"{current['generation']} ({current}): {e}", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        self._stop.set()


def create_app(state: ServerState):  # type: ignore[no-untyped-def]
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="Sampan", version="1", docs_url="/docs", redoc_url=None)
    app.state.sampan = state
    app.add_middleware(Guard, state=state)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):  # type: ignore
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # loc is ("body", character offset)
            where = first["loc"][-1]
            return error(422, f"the request body is not valid JSON: "
                              f"{first.get('ctx', {}).get('error', first['msg'])} at "
                              f"character {where} (counting from 0)", "body")
        loc = [str(x) for x in first["loc"] if x != "body"]
        return error(422, f"{'.'.join(loc) or 'body'}: "
                          f"{first['msg'].removeprefix('Value error, ')}",
                     ".".join(loc) or "body")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):  # type: ignore
        # FastAPI's own refusals (a body that is not UTF-8 JSON, an unknown route, a wrong
        # method) in the same JSON shape as every other error
        field = "body" if exc.status_code == 400 else "path" if exc.status_code in (
            404, 405) else None
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body is not valid JSON (UTF-8 text expected)"
        return error(exc.status_code, detail, field)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError):  # type: ignore
        return error(400, str(exc), exc.field, exc.record)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():  # type: ignore[no-untyped-def]
        if state.predictor is None:
            return error(503, "no model loaded")
        p = state.predictor
        return {"status": "ready", "model": p.bundle.manifest.get("model"),
                "version": p.version, "labels": p.labels, "worker": os.getpid()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():  # type: ignore[no-untyped-def]
        registry = state.registry
        if state.multiprocess:  # every worker's metrics, whichever worker answers
            from prometheus_client import CollectorRegistry
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return PlainTextResponse(generate_latest(registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/predict")
    async def predict(req: PredictRequest) -> dict[str, Any]:
        predictor, fut = await run_in_threadpool(state.predict_future, req.records)
        scores = await asyncio.wrap_future(fut)
        return {"probabilities": scores.tolist(), "labels": predictor.labels,
                "model_version": predictor.version}

    @app.post("/v1/rank")
    async def rank(req: RankRequest) -> dict[str, Any]:
        predictor, fut = await run_in_threadpool(state.rank_future, req.context,
                                                 req.candidates)
        scores = await asyncio.wrap_future(fut)
        if req.task >= scores.shape[1]:
            raise RequestError(f"task {req.task} does not exist; the model has "
                               f"{scores.shape[1]} label(s) {predictor.labels}", "task")
        items = top_k(req.candidates, scores[:, req.task], req.k)
        return {"items": [{"item": i, "score": s} for i, s in items],
                "model_version": predictor.version}

    @app.post("/v1/recommend")
    async def recommend(req: RecommendRequest) -> dict[str, Any]:
        found = await run_in_threadpool(state.retrieve, req.context, req.n)
        if not found:
            return {"items": [], "retrieved": 0, "model_version": state.predictor.version}
        cosine = dict(found)
        candidates = [item for item, _ in found]
        predictor, fut = await run_in_threadpool(state.rank_future, req.context, candidates)
        scores = await asyncio.wrap_future(fut)
        if req.task >= scores.shape[1]:
            raise RequestError(f"task {req.task} does not exist", "task")
        items = top_k(candidates, scores[:, req.task], req.k)
        return {"items": [{"item": i, "score": s, "retrieval_score": cosine[i]}
                          for i, s in items],
                "retrieved": len(candidates), "model_version": predictor.version}

    @app.post("/v1/admin/reload")
    async def reload(req: ReloadRequest, request: Request):  # type: ignore
        if not state.token:
            return error(403, "reload is disabled: set admin_token in the serve config or "
                              "SAMPAN_ADMIN_TOKEN", "authorization")
        if not state.check_token(request.headers.get("authorization")):
            return error(401, "missing or wrong token: send the header "
                              "'Authorization: Bearer <token>'", "authorization")
        if req.bundle is None and req.retrieval_bundle is None:
            return error(422, "give bundle (the ranking model) and/or retrieval_bundle",
                         "bundle")
        out: dict[str, Any] = {"status": "reloaded"}
        try:
            if state.sync is None:
                predictor, retriever = await run_in_threadpool(
                    state.load, req.bundle, req.retrieval_bundle)
            else:  # the other workers follow within sync.interval
                predictor, retriever, out["generation"] = await run_in_threadpool(
                    state.sync.reload, req.bundle, req.retrieval_bundle)
                out["workers"] = state.cfg.workers
        except ServingBundleError as e:  # the old bundles keep serving; say which one failed
            state.reloads.labels("failed").inc()
            return error(400, str(e), e.field)
        if predictor is not None:
            out.update(model=predictor.bundle.manifest.get("model"), version=predictor.version)
        if retriever is not None:
            out["retrieval_version"] = retriever.predictor.version
        state.reloads.labels("ok").inc()
        return out

    return app


def forget_dead_workers() -> list[int]:
    """Drop the live-only gauges (``sampan_model_info``) of workers that are gone, so that
    /metrics shows the models of running workers only; returns their pids. A worker that
    uvicorn starts in place of one that died calls this first. Counters and histograms of
    dead workers stay: their counts still belong in the totals."""
    from prometheus_client import multiprocess

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return []
    dead = set()
    for f in Path(path).glob("gauge_live*_*.db"):
        pid = f.stem.rsplit("_", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            dead.add(int(pid))
        except PermissionError:  # alive, another user's
            pass
    for pid in dead:
        try:
            multiprocess.mark_process_dead(pid, path)
        except FileNotFoundError:  # another new worker removed them first
            pass
    return sorted(dead)


def app_from_env():  # type: ignore[no-untyped-def]
    """uvicorn factory for ``--workers N``: the config comes in ``SAMPAN_SERVE_CONFIG``, the
    reload file shared by the workers (see :class:`ReloadSync`) in ``SAMPAN_SERVE_SYNC``."""
    cfg = ServeConfig.model_validate(json.loads(os.environ["SAMPAN_SERVE_CONFIG"]))
    sync_path = os.environ.get("SAMPAN_SERVE_SYNC")
    if sync_path:  # a worker started after a reload serves the current bundles
        current = json.loads(Path(sync_path).read_text())
        cfg = cfg.model_copy(update={"bundle": current["bundle"],
                                     "retrieval_bundle": current.get("retrieval_bundle")})
    forget_dead_workers()
    state = ServerState(cfg)
    if sync_path:
        state.sync = ReloadSync(sync_path, state)
    app = create_app(state)
    if cfg.grpc_port is not None and os.environ.get("SAMPAN_GRPC_IN_WORKER") == "1":
        from sampan.serving.grpc_server import start_grpc

        # every worker binds the port (gRPC sets SO_REUSEPORT); keep the server referenced
        app.state.grpc_server = start_grpc(state, cfg.host, cfg.grpc_port)
    return app
