"""The HTTP server: FastAPI under uvicorn, ONNX Runtime behind a micro-batcher.

Routes: ``POST /v1/predict``, ``POST /v1/rank``, ``GET /healthz``, ``GET /readyz``,
``GET /metrics`` (Prometheus text), ``POST /v1/admin/reload`` (bearer token). Errors are JSON
``{"error": ..., "field": ..., "record": ...}`` with a 4xx status; an unexpected exception is
a JSON 500 (its traceback goes to the server's log), counted in ``/metrics`` like any other
status, and the connection stays open. :class:`Guard` is the outermost layer that does this
and limits request bodies as they stream in.

The server is split by concern: :mod:`~sampan.serving.service` (the transport-neutral
state), :mod:`~sampan.serving.http` (FastAPI, :class:`Guard`), :mod:`~sampan.serving.workers`
(``--workers N``) and :mod:`~sampan.serving.grpc_server`; this module keeps their names
importable from one place (and ``app_from_env``, the factory uvicorn's workers call).
"""

from sampan.serving.http import (
    ErrorResponse,
    Guard,
    PredictRequest,
    RankRequest,
    RecommendRequest,
    ReloadRequest,
    create_app,
    error,
)
from sampan.serving.service import ROUTES, ServerState, ServingBundleError
from sampan.serving.workers import ReloadSync, app_from_env, forget_dead_workers

__all__ = ["ROUTES", "ErrorResponse", "Guard", "PredictRequest", "RankRequest",
           "RecommendRequest", "ReloadRequest", "ReloadSync", "ServerState",
           "ServingBundleError", "app_from_env", "create_app", "error", "forget_dead_workers"]
