"""gRPC server: ``Predict`` and ``Rank`` (``protos/sampan_scoring.proto``) on the same
:class:`~sampan.serving.rest.ServerState` as the HTTP routes.

The message classes are generated from the ``.proto`` when first needed
(``grpc.protos_and_services``, from grpcio-tools), so no generated code lives in the
repository.
"""

from __future__ import annotations

import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROTO = "sampan_scoring.proto"


@functools.cache
def stubs() -> tuple[Any, Any]:
    """``(messages, services)`` modules generated from the proto."""
    import grpc

    here = str(Path(__file__).parent / "protos")
    if here not in sys.path:
        sys.path.append(here)
    return grpc.protos_and_services(PROTO)


def start_grpc(state: Any, host: str, port: int, threads: int = 16):  # type: ignore
    """Start serving on ``host:port`` (0 picks a free port: see ``server.port``)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from sampan.serving.predictor import RequestError, top_k

    pb, svc = stubs()

    class Scoring(svc.ScoringServicer):
        def Predict(self, request, context):  # noqa: N802 - gRPC method name
            try:
                records = [MessageToDict(r) for r in request.records]
                predictor, fut = state.predict_future(records)
                scores = fut.result()
            except RequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _text(e))
            return pb.PredictResponse(
                probabilities=[pb.Scores(values=row) for row in scores.tolist()],
                labels=predictor.labels, model_version=predictor.version)

        def Rank(self, request, context):  # noqa: N802
            try:
                ctx = MessageToDict(request.context)
                candidates = list(request.candidates)
                predictor, fut = state.rank_future(ctx, candidates)
                scores = fut.result()
                if not 0 <= request.task < scores.shape[1]:
                    raise RequestError(f"task {request.task} does not exist; the model has "
                                       f"{scores.shape[1]} label(s)", "task")
            except RequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _text(e))
            items = top_k(candidates, scores[:, request.task], request.k or 10)
            return pb.RankResponse(items=[pb.RankedItem(item=str(i), score=s)
                                          for i, s in items],
                                   model_version=predictor.version)

    server = grpc.server(ThreadPoolExecutor(max_workers=threads))
    svc.add_ScoringServicer_to_server(Scoring(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    server.port = bound
    return server


def _text(e: Any) -> str:
    return f"{e} (field: {e.field})" if getattr(e, "field", None) else str(e)
