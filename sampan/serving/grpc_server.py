"""gRPC server: ``Predict``, ``Rank``, ``Recommend`` and ``Events``
(``protos/sampan_scoring.proto``) on the same
:class:`~sampan.serving.service.ServerState` as the HTTP routes.

The message classes are generated from the ``.proto`` when first needed
(``grpc.protos_and_services``, from grpcio-tools), so no generated code lives in the
repository. Requests are parsed inside the handlers, so that bytes that are not a valid
message are an ``INVALID_ARGUMENT`` like any other bad request; an unexpected exception is
``INTERNAL`` with its type in the message (the traceback goes to the server's stderr). Every
call is counted in ``/metrics`` as route ``grpc/Predict`` or ``grpc/Rank`` with the status
code's name.
"""

from __future__ import annotations

import functools
import math
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sampan.errors import ConflictError, RequestError
from sampan.serving.metrics import release_memory

PROTO = "sampan_scoring.proto"
SERVICE = "sampan.v1.Scoring"


@functools.cache
def stubs() -> tuple[Any, Any]:
    """``(messages, services)`` modules generated from the proto."""
    import grpc

    here = str(Path(__file__).parent / "protos")
    if here not in sys.path:
        sys.path.append(here)
    return grpc.protos_and_services(PROTO)


def value(v: Any, key: str = "") -> Any:
    """A ``google.protobuf.Value`` as the JSON value REST would receive (numbers as
    float); NaN and infinity, which JSON has no way to send, are refused naming ``key``."""
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        if not math.isfinite(v.number_value):
            raise RequestError(f"{key or 'a value'}: {v.number_value} is not a finite number "
                               "(REST refuses it too: JSON has no NaN or Infinity)", key or None)
        return v.number_value
    if kind == "string_value":
        return v.string_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return struct(v.struct_value, key)
    if kind == "list_value":
        return [value(x, f"{key}.{i}" if key else str(i))
                for i, x in enumerate(v.list_value.values)]
    return None  # null_value, or unset


def struct(s: Any, prefix: str = "") -> dict[str, Any]:
    """A ``google.protobuf.Struct`` as a dict (``MessageToDict`` would refuse NaN and
    infinity with a ValueError that names no field)."""
    return {k: value(v, f"{prefix}.{k}" if prefix else k) for k, v in s.fields.items()}


def start_grpc(state: Any, host: str, port: int, threads: int = 16):  # type: ignore
    """Start serving on ``host:port`` (0 picks a free port: see ``server.port``)."""
    import grpc
    from google.protobuf.message import DecodeError


    pb, _ = stubs()

    def parse(message_class: Any, data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            raise RequestError(f"the request is not a valid {message_class.__name__} "
                               f"message: {e}", "request") from None

    def predict(data: bytes, _: Any) -> Any:
        request = parse(pb.PredictRequest, data)
        records = [struct(r) for r in request.records]
        sub = state.predict_future(records, request.variant or None)
        predictor, scores = sub.predictor, sub.future.result()
        rid = state.request_id()
        state.log_records(rid, sub, scores, records)
        return pb.PredictResponse(
            probabilities=[pb.Scores(values=row) for row in scores.tolist()],
            labels=predictor.labels, model_version=predictor.version, request_id=rid,
            variant=sub.arm)

    defaults = {"n": 100, "k": 10}

    def counts(request: Any, *names: str) -> None:
        for name in names:
            if (v := getattr(request, name)) < 0:
                raise RequestError(f"{name} must be at least 1 (0 means {defaults[name]}), "
                                   f"got {v}" if name in defaults else
                                   f"{name} must be 0 or more, got {v}", name)

    def ranking(items: list[dict[str, Any]], predictor: Any, context: dict[str, Any],
                recommend: bool, arm: str, sub: Any = None, candidates: Any = None,
                retrieved: int = 0, scores: Any = None, task: int = 0,
                notes: list[str] | None = None) -> Any:
        rid = state.request_id()
        if sub is not None:
            state.log_ranked(rid, sub, candidates, items, context, scores, task)
        return pb.RankResponse(
            items=[pb.RankedItem(item=str(i["item"]), score=i["score"],
                                 retrieval_score=i.get("retrieval_score", 0.0))
                   for i in items], model_version=predictor.version,
            warnings=state.context_warnings(context, recommend) + (notes or []),
            retrieved=retrieved,
            request_id=rid, variant=arm)

    def rank(data: bytes, _: Any) -> Any:
        request = parse(pb.RankRequest, data)
        counts(request, "k", "task")
        candidates = list(request.candidates)
        context = struct(request.context)
        sub = state.rank_future(context, candidates, request.variant or None)
        scores = sub.future.result()
        return ranking(state.ranked(sub.predictor, scores, candidates, request.k or 10,
                                    request.task), sub.predictor, context, False, sub.arm,
                       sub, candidates, 0, scores, request.task,
                       state.count_warnings(candidates))

    def recommend(data: bytes, _: Any) -> Any:
        request = parse(pb.RecommendRequest, data)
        counts(request, "n", "k", "task")
        context = struct(request.context)
        found, sub, arm, _, notes = state.recommend_future(context, request.n or 100,
                                                           request.variant or None)
        notes = state.count_warnings(n=request.n or 100, k=request.k or 10) + notes
        if sub is None:
            return ranking([], state.current(arm)[0], context, True, arm, notes=notes)
        candidates = [i for i, _ in found]
        scores = sub.future.result()
        return ranking(state.ranked(sub.predictor, scores, candidates, request.k or 10,
                                    request.task, dict(found)),
                       sub.predictor, context, True, arm, sub, candidates, len(found), scores,
                       request.task, notes)

    def events_allowed(context: Any) -> None:
        """Events and feedback need the events token when one is set."""
        if state.events_token and not state.check_token(
                dict(context.invocation_metadata()).get("authorization"), state.events_token):
            raise _Unauthenticated("missing or wrong token: send the metadata "
                                   "'authorization: Bearer <events token>'", "authorization")

    def events(data: bytes, context: Any) -> Any:
        events_allowed(context)
        request = parse(pb.EventsRequest, data)
        out = state.record_events([struct(e) for e in request.events])
        state.events.inc(out["accepted"])
        return pb.EventsResponse(**out)

    def feedback(data: bytes, context: Any) -> Any:
        events_allowed(context)
        request = parse(pb.FeedbackRequest, data)
        for i, e in enumerate(request.events):
            if not e.request_id:
                raise RequestError(f"event {i}: request_id is empty", "request_id", i)
        n = state.record_feedback([{"request_id": e.request_id, "item": e.item,
                                    "type": e.type, "ts": e.ts or None}
                                   for e in request.events])
        return pb.FeedbackResponse(accepted=n)

    def handler(name: str, fn: Any, response_class: Any) -> Any:
        route = f"grpc/{name}"

        def call(data: bytes, context: Any) -> Any:
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            refused = state.admission.enter(route, len(data))
            if refused is not None:
                state.observe(route, "RESOURCE_EXHAUSTED", 0.0)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              state.admission.message(refused))
            try:
                return fn(data, context)
            except RequestError as e:
                code = grpc.StatusCode.FAILED_PRECONDITION if isinstance(
                    e, ConflictError) else grpc.StatusCode.UNAUTHENTICATED if isinstance(
                    e, _Unauthenticated) else grpc.StatusCode.INVALID_ARGUMENT
                context.abort(code, _text(e))
            except Exception as e:  # noqa: BLE001 - INTERNAL with a message, never UNKNOWN
                code = grpc.StatusCode.INTERNAL
                print(f"sampan serve: unexpected error in gRPC {name}:\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
                context.abort(code, f"internal error ({type(e).__name__}); the server log "
                                    "has the traceback")
            finally:
                state.observe(route, code.name, time.perf_counter() - t0)
                if state.admission.leave(len(data)):
                    release_memory()

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=None,  # raw bytes: parsed in the handler
            response_serializer=response_class.SerializeToString)

    class CountUnknown(grpc.ServerInterceptor):
        """Counts a call to a method the service does not have (``UNIMPLEMENTED``) as
        route ``grpc/other``, as the HTTP server counts an unknown path."""

        def intercept_service(self, continuation: Any, details: Any) -> Any:
            found = continuation(details)
            if found is None:
                state.observe("grpc/other", "UNIMPLEMENTED", 0.0)
            return found

    # messages as large as the HTTP bodies the server takes (gRPC's own default is 4 MiB)
    size = state.cfg.max_body_bytes
    server = grpc.server(ThreadPoolExecutor(max_workers=threads),
                         interceptors=[CountUnknown()],
                         options=[("grpc.max_receive_message_length", size),
                                  ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Predict": handler("Predict", predict, pb.PredictResponse),
        "Rank": handler("Rank", rank, pb.RankResponse),
        "Recommend": handler("Recommend", recommend, pb.RankResponse),
        "Events": handler("Events", events, pb.EventsResponse),
        "Feedback": handler("Feedback", feedback, pb.FeedbackResponse)}),))
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    server.port = bound
    return server


class _Unauthenticated(RequestError):
    pass


def _text(e: Any) -> str:
    return f"{e} (field: {e.field})" if getattr(e, "field", None) else str(e)
