"""The HTTP front end: FastAPI under uvicorn, JSON errors, and :class:`Guard`, the outermost
layer that limits request bodies as they stream in and turns an unexpected exception into
a counted JSON 500."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from sampan.errors import ConflictError, RequestError
from sampan.serving.metrics import release_memory
from sampan.serving.openapi import merge, request_examples, request_schemas
from sampan.serving.schemas import (
    ErrorBody,
    EventsRequest,
    EventsResponse,
    FeedbackRequest,
    FeedbackResponse,
    PredictRequest,
    PredictResponse,
    RankRequest,
    RankResponse,
    RecommendRequest,
    RecommendResponse,
    ReloadRequest,
    WeightsRequest,
)
from sampan.serving.service import ROUTES, ServerState, ServingBundleError

# the routes whose work is admitted against max_inflight / max_inflight_bytes
ADMITTED = frozenset({"/v1/predict", "/v1/rank", "/v1/recommend", "/v1/events",
                      "/v1/feedback"})


class ErrorResponse(JSONResponse):
    """A JSON error body that renders whatever the message echoes: non-ASCII (a lone
    surrogate included) is escaped, so rendering an error can never fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error(status: int, message: str, field: str | None = None,
          record: int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error reply of every route: ``{"error", "field", "record"}``; a message or field
    that quotes a long input is cut (a reply never echoes a client's megabyte back)."""
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... (message cut at {MAX_ERROR_CHARS:,} of " \
                  f"{len(message):,} characters)"
    if field is not None and len(field) > 200:
        field = field[:200] + "..."
    return ErrorResponse({"error": message, "field": field, "record": record},
                         status_code=status, headers=headers)


MAX_ERROR_CHARS = 2000


try:  # uvicorn's HTTP/1.1 parser: httptools when installed (uvicorn[standard]), else h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPProtocol
except ImportError:  # pragma: no cover - without httptools
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTPProtocol


class JSONErrorsProtocol(_HTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol, answering a request it cannot parse (a malformed request
    line or header, a Content-Length that does not match the body, Content-Length twice
    or with Transfer-Encoding, a URL or headers too long to parse) with the same JSON error
    body as every other refusal, instead of a plain-text line. The application never sees
    such a request: it is not counted in ``sampan_requests_total``, and the connection
    is closed."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": "the request is not valid HTTP/1.1 (a malformed request "
                                    "line or header, a Content-Length that does not match "
                                    "the body or is given with Transfer-Encoding, or a URL "
                                    "or headers too long to parse)",
                           "field": None, "record": None}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (len(body), body))
        self.transport.close()


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
        route = scope.get("path", "")
        route = route if route in ROUTES else "other"
        cost = int(size) if size.isdigit() else limit
        admitted = False
        if size.isdigit() and int(size) > limit:
            over[0] = True
        elif scope.get("method") == "POST" and route in ADMITTED and (
                refused := self.state.admission.enter(route, cost)) is not None:
            await error(503, self.state.admission.message(refused), refused,
                        headers={"Retry-After": "1"})(scope, receive, send_out)
        else:
            admitted = scope.get("method") == "POST" and route in ADMITTED
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
        self.state.observe(route, str(status[0] or 500), time.perf_counter() - t0)
        if admitted and self.state.admission.leave(cost):
            from starlette.concurrency import run_in_threadpool

            await run_in_threadpool(release_memory)  # after the reply: no latency



class BodyError(Exception):
    """A request body that is JSON a client should not send: its reply is a 422 naming why
    (or a 415 for a body that is not JSON at all)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise BodyError(f"the request body repeats the key {k[:100]!r} in one object; "
                            "each key may appear once")
        out[k] = v
    return out


def _no_constant(name: str) -> float:
    raise BodyError(f"the request body holds {name}, which is not a JSON number (JSON has "
                    "no NaN or Infinity)")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise BodyError(f"the request body holds the number {text[:40]}, which is too large "
                        "for a 64-bit float")
    return v


def strict_json(body: bytes, content_type: str | None) -> Any:
    """A request body as the server accepts it: ``application/json`` (or ``+json``, the
    header required) in UTF-8 without a byte-order mark, no key repeated in an object, no
    NaN / Infinity and no number beyond a 64-bit float, nested at most 64 deep; anything
    else a :class:`BodyError` that says which rule the body broke."""
    media, _, params = (content_type or "").partition(";")
    media = media.strip().lower()
    if not media:
        raise BodyError("the request body must be JSON: send the header content-type: "
                        "application/json (the request had no content-type)", 415)
    if media != "application/json" and not media.endswith("+json"):
        raise BodyError(f"the request body must be JSON (content-type: application/json), "
                        f"got content-type {media[:100]!r}", 415)
    charset = params.strip().lower().removeprefix("charset=").strip('" ') \
        if "charset=" in params.lower() else "utf-8"
    if charset not in ("utf-8", "utf8"):
        raise BodyError(f"the request body must be UTF-8 JSON, got charset {charset[:40]!r}",
                        415)
    if body.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise BodyError("the request body starts with a byte-order mark: send UTF-8 JSON "
                        "without one")
    if body.count(b"[") + body.count(b"{") > 64 and _depth(body) > 64:
        raise BodyError("the request body nests arrays or objects more than 64 deep")
    try:
        return json.loads(body, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_float=_finite_float)
    except UnicodeDecodeError:
        raise BodyError("the request body is not valid JSON (UTF-8 text expected)") from None
    except json.JSONDecodeError as e:
        raise BodyError(f"the request body is not valid JSON: {e.msg} at character {e.pos} "
                        "(counting from 0)") from None
    except ValueError as e:  # int() of a number with thousands of digits
        if "digits" in str(e):
            raise BodyError("the request body holds an integer of more than 4,300 digits") \
                from None
        raise


def _depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects (strings skipped), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in body:  # error path only: bodies with more than 64 brackets
        if in_string:
            if escaped:
                escaped = False
            elif ch == 0x5C:
                escaped = True
            elif ch == 0x22:
                in_string = False
        elif ch == 0x22:
            in_string = True
        elif ch in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > 64:
                return deepest
        elif ch in (0x5D, 0x7D):
            depth -= 1
    return deepest


def create_app(state: ServerState):  # type: ignore[no-untyped-def]
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.routing import APIRoute
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class StrictRequest(Request):
        async def json(self) -> Any:
            if not hasattr(self, "_json"):
                self._json = strict_json(await self.body(), self.headers.get("content-type"))
            return self._json

    class StrictRoute(APIRoute):
        """Routes whose JSON bodies go through :func:`strict_json`."""

        def get_route_handler(self):  # type: ignore[no-untyped-def]
            handler = super().get_route_handler()

            async def strict(request: Request) -> Response:
                if request.method == "POST":
                    # every body is parsed as JSON, whatever its content type says (FastAPI
                    # would hand a text/plain body to validation as bytes)
                    request = StrictRequest(request.scope, request.receive)
                    await request.json() if await request.body() else None
                return await handler(request)

            return strict

    app = FastAPI(title="Sampan", version="1", docs_url="/docs", redoc_url=None)
    app.router.route_class = StrictRoute
    app.state.sampan = state
    app.add_middleware(Guard, state=state)
    generic_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, written for the served bundles (see
        :mod:`sampan.serving.openapi`)."""
        if app.openapi_schema is None:
            doc = generic_openapi()
            schemas = doc.get("components", {}).get("schemas", {})
            for name, more in request_schemas(state).items():
                if name in schemas:
                    merge(schemas[name], more)
            for name, body in request_examples(state).items():
                if name in schemas:
                    schemas[name]["examples"] = [body]
            arms = list(state.arms) if state is not None and state.arms else None
            for p in doc["paths"].get("/v1/admin/rollback", {}).get("post", {}).get(
                    "parameters", []) if arms else []:
                if p["name"] == "variant":
                    p["schema"] = {"anyOf": [{"enum": arms}, {"type": "null"}]}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):  # type: ignore
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # loc is ("body", character offset)
            where = first["loc"][-1]
            return error(422, f"the request body is not valid JSON: "
                              f"{first.get('ctx', {}).get('error', first['msg'])} at "
                              f"character {where} (counting from 0)", "body")
        # union members ("str", "int", "function-after[...]") are how pydantic found the
        # error, not where: the field is the path without them
        loc = [str(x) for x in first["loc"] if x != "body" and not (
            isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x))]
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
        reply = error(exc.status_code, detail, field)
        for name, value in (exc.headers or {}).items():  # a 405's Allow, and the like
            reply.headers[name] = value
        return reply

    @app.exception_handler(BodyError)
    async def bad_body(_: Request, exc: BodyError):  # type: ignore
        return error(exc.status, str(exc), "body")

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError):  # type: ignore
        return error(409 if isinstance(exc, ConflictError) else 400, str(exc), exc.field,
                     exc.record)

    errors = {400: {"model": ErrorBody, "description": "a bad request, naming the field"},
              413: {"model": ErrorBody, "description": "a body over max_body_bytes"},
              415: {"model": ErrorBody, "description": "a body that is not UTF-8 JSON"},
              422: {"model": ErrorBody, "description": "a body of the wrong shape, or JSON "
                    "the server does not take (a repeated key, NaN, ...), saying which"},
              503: {"model": ErrorBody, "description": "the worker is at max_inflight or "
                    "max_inflight_bytes (header Retry-After: 1); or no model is loaded"}}
    admin = {**{c: errors[c] for c in (400, 413, 415, 422)},
             401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
             403: {"model": ErrorBody, "description": "no admin token is configured: the "
                   "admin routes are disabled"}}

    def doc(model: Any, more: dict[int, Any] | None = None) -> dict[str, Any]:
        return {"response_model": None, "responses": {200: {"model": model}, **errors,
                                                      **(more or {})}}

    def example(value: Any, media: str = "application/json",
                more: dict[int, Any] | None = None) -> dict[str, Any]:
        return {"response_model": None, "responses": {200: {"content": {media: {
            "example": value}}}, **(more or {})}}

    @app.get("/healthz", **example({"status": "ok"}))
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", **example({"status": "ready", "model": "din",
                                   "version": "din@2026-12-01T22:28:29+0000",
                                   "labels": ["label"], "worker": 4242},
                                  more={503: {"model": ErrorBody,
                                              "description": "no model loaded yet"}}))
    async def readyz():  # type: ignore[no-untyped-def]
        """A model is loaded and answering (503 before); with --watch, the published
        version served; with a feedback log, its counts."""
        if state.predictor is None:
            return error(503, "no model loaded")
        p = state.predictor
        out = {"status": "ready", "model": p.bundle.manifest.get("model"),
               "version": p.version, "labels": p.labels, "worker": os.getpid()}
        if state.allocation is not None and state.cfg.experiment is not None:
            out["experiment"] = {
                "name": state.cfg.experiment.name, "control": state.control,
                "variants": {a.name: {"model": a.predictor.bundle.manifest.get("model"),
                                      "version": a.predictor.version}
                             for a in state.arms.values() if a.predictor is not None},
                "buckets": state.allocation.counts()}
        if state.journal is not None:  # this process's journal; the log's joiner's counts
            from sampan.serving.feedback import saved_failure, saved_stats

            out["feedback"] = {"journal": dict(state.journal.written),
                               "joiner": saved_stats(state.cfg.feedback.dir)}
            failure = saved_failure(state.cfg.feedback.dir)
            if failure is not None:  # the last pass failed: nothing written since
                out["feedback"]["failure"] = failure
        if state.watcher is not None and state.watcher.serving is not None:
            w = state.watcher
            out["published"] = {"version": w.serving["version"],
                                "position": w.serving.get("position"),
                                "refused": sorted(w.refused), "errors": w.errors[-3:]}
        return out

    @app.get("/metrics", response_class=PlainTextResponse, **example(
        'sampan_requests_total{route="/v1/rank",status="200"} 1042.0\n'
        'sampan_request_latency_seconds{quantile="0.99",route="/v1/rank"} 0.0061\n',
        "text/plain"))
    async def metrics():  # type: ignore[no-untyped-def]
        """Prometheus text: requests by route and status, latency histograms and
        percentiles per route, batch sizes, reloads, events, the model served."""
        registry = state.registry
        if state.multiprocess:  # every worker's metrics, whichever worker answers
            from prometheus_client import CollectorRegistry
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(state.window)
            if state.journal is not None:
                registry.register(state.feedback_counts)
        return PlainTextResponse(generate_latest(registry),
                                 media_type=CONTENT_TYPE_LATEST)

    def served(response: Response, request_id: str, arm: str) -> dict[str, str]:
        """The fields (and header) every scoring response carries."""
        response.headers["X-Sampan-Variant"] = arm
        return {"request_id": request_id, "variant": arm}

    def forced(request: Request, body_variant: str | None) -> str | None:
        """The arm a request forces (QA): the body's ``variant`` (an empty one too, which
        names no arm and is refused) or the header."""
        if body_variant is not None:
            return body_variant
        return request.headers.get("x-sampan-variant") or None

    @app.post("/v1/predict", **doc(PredictResponse))
    async def predict(req: PredictRequest, request: Request,
                      response: Response) -> dict[str, Any]:
        """Raw feature records -> one row of probabilities per record (one per label)."""
        sub = await run_in_threadpool(state.predict_future, req.records,
                                      forced(request, req.variant))
        scores = await asyncio.wrap_future(sub.future)
        rid = state.request_id()
        state.log_records(rid, sub, scores, req.records)
        return {"probabilities": scores.tolist(), "labels": sub.predictor.labels,
                "model_version": sub.predictor.version, **served(response, rid, sub.arm)}

    @app.post("/v1/rank", **doc(RankResponse, {409: {
        "model": ErrorBody, "description": "the model has no item feature (item_key)"}}))
    async def rank(req: RankRequest, request: Request, response: Response) -> dict[str, Any]:
        """A context and candidate item ids -> the k best candidates, best first."""
        sub = await run_in_threadpool(state.rank_future, req.context, req.candidates,
                                      forced(request, req.variant))
        scores = await asyncio.wrap_future(sub.future)
        items = state.ranked(sub.predictor, scores, req.candidates, req.k, req.task)
        rid = state.request_id()
        state.log_ranked(rid, sub, req.candidates, items, req.context, scores, req.task)
        return {"items": items, "model_version": sub.predictor.version,
                "warnings": state.context_warnings(req.context)
                + state.count_warnings(req.candidates),
                **served(response, rid, sub.arm)}

    @app.post("/v1/recommend", **doc(RecommendResponse, {409: {
        "model": ErrorBody, "description": "no retrieval model is served"}}))
    async def recommend(req: RecommendRequest, request: Request,
                        response: Response) -> dict[str, Any]:
        """A context (the user) -> n candidates from the retrieval model's index, ranked
        by the ranking model; the k best, best first."""
        found, sub, arm, _, notes = await run_in_threadpool(
            state.recommend_future, req.context, req.n, forced(request, req.variant))
        # after the lookups: the unknown-user warning reads what they found
        warnings = state.context_warnings(req.context, recommend=True) \
            + state.count_warnings(n=req.n, k=req.k) + notes
        rid = state.request_id()
        if sub is None:
            return {"items": [], "retrieved": 0, "model_version": state.current(arm)[0].version,
                    "warnings": warnings, **served(response, rid, arm)}
        scores = await asyncio.wrap_future(sub.future)
        candidates = [i for i, _ in found]
        items = state.ranked(sub.predictor, scores, candidates, req.k, req.task, dict(found))
        state.log_ranked(rid, sub, candidates, items, req.context, scores, req.task)
        return {"items": items, "retrieved": len(found),
                "model_version": sub.predictor.version, "warnings": warnings,
                **served(response, rid, arm)}

    @app.post("/v1/feedback", **doc(FeedbackResponse, {
        401: {"model": ErrorBody, "description": "events_token is set and not given"},
        409: {"model": ErrorBody, "description": "no feedback log is configured"}}))
    async def feedback(req: FeedbackRequest, request: Request):  # type: ignore
        """What users did with served items (impression, click, conversion, ...), named by
        the response's request_id and the item: joined into the feedback log's labelled
        rows when each item's window closes (serve config ``feedback``)."""
        if state.events_token and not state.check_token(
                request.headers.get("authorization"), state.events_token):
            return error(401, "missing or wrong token: send the header "
                              "'Authorization: Bearer <events token>'", "authorization")
        try:
            n = state.record_feedback([e.model_dump() for e in req.events])
        except ConflictError as e:
            return error(409, str(e), e.field)
        return {"accepted": n}

    @app.post("/v1/events", **doc(EventsResponse, {
        401: {"model": ErrorBody, "description": "events_token is set and not given"},
        409: {"model": ErrorBody, "description": "no served model reads behaviour "
              "histories, or per-worker memory with --workers N"}}))
    async def events(req: EventsRequest, request: Request):  # type: ignore
        """Behaviour events -> appended to each user's live histories, which the next
        request of that user reads (same encoding and max_len as training)."""
        if state.events_token and not state.check_token(
                request.headers.get("authorization"), state.events_token):
            return error(401, "missing or wrong token: send the header "
                              "'Authorization: Bearer <events token>'", "authorization")
        try:
            out = await run_in_threadpool(state.record_events, req.events)
        except ConflictError as e:
            return error(409, str(e), e.field)
        state.events.inc(out["accepted"])
        return out

    def admin_denied(request: Request, what: str) -> Any:
        """The error answer to an admin call without the right bearer token, else None."""
        if not state.token:
            return error(403, f"{what} is disabled: set admin_token in the serve config or "
                              "SAMPAN_ADMIN_TOKEN", "authorization")
        if not state.check_token(request.headers.get("authorization")):
            return error(401, "missing or wrong token: send the header "
                              "'Authorization: Bearer <token>'", "authorization")
        return None

    @app.post("/v1/admin/rollback", **example(
        {"status": "rolled back", "version": 6, "model_version": "din@2026-12-01T22:28:29"},
        more={**admin, 409: {"model": ErrorBody, "description": "no watched model "
                             "directory, or no earlier version to go back to"}}))
    async def rollback(request: Request, variant: str | None = None):  # type: ignore
        """Back to the version served before (with --watch; ``?variant=`` for an arm of an
        experiment, default control); it is held until a newer version than the one
        rolled back from is published."""
        if (denied := admin_denied(request, "rollback")) is not None:
            return denied
        arm = state.arms.get(variant or state.control)
        if arm is None:
            return error(400, f"variant {variant!r} is not an arm of this server; its arms: "
                              f"{list(state.arms)}", "variant")
        if arm.watcher is None:
            return error(409, "rollback needs a watched model directory (serve --watch DIR)",
                         "watch")
        try:
            back = await run_in_threadpool(arm.watcher.rollback)
        except ServingBundleError as e:
            return error(409, str(e), e.field)
        return {"status": "rolled back", "version": back["version"],
                "model_version": arm.predictor.version if arm.predictor else None}

    @app.post("/v1/admin/weights", **example(
        {"weights": {"control": 80.0, "candidate": 20.0},
         "buckets": {"control": 8000, "candidate": 2000}, "moved_buckets": 1000},
        more={**admin, 409: {"model": ErrorBody, "description": "no experiment is "
                             "served, or the weights do not name its arms"}}))
    async def weights(req: WeightsRequest, request: Request):  # type: ignore
        """New weights for the experiment's arms (bearer token): only the users of the
        buckets that must move change arm, from the arms that shrink to those that grow;
        every worker follows within a second, and a restart keeps them."""
        if (denied := admin_denied(request, "weights")) is not None:
            return denied
        try:
            return await run_in_threadpool(state.set_weights, req.weights)
        except ConflictError as e:
            return error(409, str(e), e.field)

    @app.post("/v1/admin/reload", **example(
        {"status": "reloaded", "model": "din", "version": "din@2026-12-01T22:28:29+0000"},
        more={**admin, 404: {"model": ErrorBody, "description": "no bundle at that path"},
              409: {"model": ErrorBody, "description": "an arm other than control with "
                    "--workers N"}}))
    async def reload(req: ReloadRequest, request: Request):  # type: ignore
        """Swap in other bundles between two model calls (bearer token)."""
        if (denied := admin_denied(request, "reload")) is not None:
            return denied
        if req.variant is not None and req.variant not in state.arms:
            return error(400, f"variant {req.variant!r} is not an arm of this server; its "
                              f"arms: {list(state.arms)}", "variant")
        other_arm = req.variant not in (None, state.control)
        if other_arm and state.sync is not None:
            return error(409, "with --workers N only control's bundle is reloaded for every "
                              "worker: give the arm a watched directory instead", "variant")
        out: dict[str, Any] = {"status": "reloaded"}
        try:
            if state.sync is None or other_arm:
                predictor, retriever = await run_in_threadpool(
                    state.load, req.bundle, req.retrieval_bundle, None, req.variant)
            else:  # the other workers follow within sync.interval
                predictor, retriever, out["generation"] = await run_in_threadpool(
                    state.sync.reload, req.bundle, req.retrieval_bundle)
                out["workers"] = state.cfg.workers
        except ServingBundleError as e:  # the old bundles keep serving; say which one failed
            state.reloads.labels("failed").inc()
            return error(404 if e.missing else 400, str(e), e.field)
        if predictor is not None:
            out.update(model=predictor.bundle.manifest.get("model"), version=predictor.version)
        if retriever is not None:
            out["retrieval_version"] = retriever.predictor.version
        app.openapi_schema = None  # its examples follow the bundle
        state.reloads.labels("ok").inc()
        return out

    return app
