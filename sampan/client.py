"""A Python client for ``sampan serve``, over HTTP or gRPC, with typed results.

::

    from sampan.client import Client, GrpcClient

    with Client("http://127.0.0.1:8000") as c:
        c.events([{"user_id": "1000011", "item_id": "3993081"}])
        top = c.recommend({"user_id": "1000011"}, k=10)
        for it in top.items:
            print(it.item, it.score)
        c.feedback([{"request_id": top.request_id, "item": top.ids[0], "type": "click"}])

    with GrpcClient("127.0.0.1:50051") as g:       # the same calls and results
        g.rank({"user_id": "1000011"}, ["3993081", "1686875"], k=1)

Both take the context first: ``recommend(context, n=100, k=10)`` and ``rank(context,
candidates, k=10)``.

A refused request raises :class:`ServingError` with the server's message, the field it
names and the record index. The HTTP client keeps one connection open (reopened when the
server closed it) and serialises calls on it: use one client per thread for parallel
requests. Only the standard library is needed for HTTP; gRPC needs ``grpcio`` (the
``serve`` extra).
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Client", "EventsResult", "GrpcClient", "Prediction", "Ranking", "ScoredItem",
           "ServingError"]


FEEDBACK_FIELDS = ("request_id", "item", "type", "ts")  # ts optional, the others required


def _feedback_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` when each is a feedback event (the fields the server's /v1/feedback
    takes); else the :class:`ServingError` the server would answer, naming the field."""
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ServingError("INVALID_ARGUMENT", f"events.{i}: expected an object with "
                               f"{list(FEEDBACK_FIELDS)}, got {type(e).__name__}", f"events.{i}",
                               i)
        for key in [k for k in FEEDBACK_FIELDS[:3] if e.get(k) in (None, "")] + \
                [k for k in e if k not in FEEDBACK_FIELDS]:
            what = "is required" if key in FEEDBACK_FIELDS else "is not a feedback field"
            raise ServingError("INVALID_ARGUMENT", f"events.{i}.{key} {what}: a feedback "
                               "event gives request_id (of the response that served the "
                               "item), item and type, and may give ts", f"events.{i}.{key}", i)
    return events


class ServingError(Exception):
    """A request the server refused: ``status`` (HTTP status, or the gRPC code's name),
    ``message``, the request ``field`` it concerns and the ``record`` index, when said."""

    def __init__(self, status: int | str, message: str, field: str | None = None,
                 record: int | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.field, self.record = status, message, field, record


@dataclass(frozen=True)
class ScoredItem:
    item: str | int
    score: float
    retrieval_score: float | None = None  # the two-tower cosine (recommend only)


@dataclass(frozen=True)
class Ranking:
    """``/v1/rank`` and ``/v1/recommend``: items best first."""

    items: list[ScoredItem]
    model_version: str
    warnings: list[str] = field(default_factory=list)  # context keys no model reads
    retrieved: int | None = None  # candidates the retrieval model gave (recommend only)
    request_id: str = ""  # what feedback events name (see Client.feedback)
    variant: str = ""  # the A/B arm that served it

    @property
    def ids(self) -> list[str | int]:
        return [i.item for i in self.items]


@dataclass(frozen=True)
class Prediction:
    probabilities: list[list[float]]  # one row per record, one column per label
    labels: list[str]
    model_version: str
    request_id: str = ""  # what feedback events name (the item: a record's position)
    variant: str = ""  # the A/B arm that served it


@dataclass(frozen=True)
class EventsResult:
    accepted: int
    users: int
    warnings: tuple[str, ...] = ()  # an item no feature table holds, say


def _ranking(body: dict[str, Any]) -> Ranking:
    return Ranking([ScoredItem(i["item"], float(i["score"]), i.get("retrieval_score"))
                    for i in body["items"]], body["model_version"],
                   list(body.get("warnings", [])), body.get("retrieved"),
                   body.get("request_id", ""), body.get("variant", ""))


def _rank_arguments(context: Any, candidates: Any) -> tuple[dict[str, Any], list[Any]]:
    """``rank``'s arguments checked: the context (a mapping, or None) first, then the
    candidate items (a list)."""
    if isinstance(context, (list, tuple)) and isinstance(candidates, dict):
        raise TypeError("rank(context, candidates): the context comes first, then the "
                        "candidate items, as in recommend(context); e.g. "
                        "rank({'user_id': 'u1'}, ['i1', 'i2'])")
    if context is not None and not isinstance(context, dict):
        raise TypeError(f"rank: context must be a mapping of feature to value (or None), "
                        f"got {type(context).__name__}")
    if isinstance(candidates, (str, bytes, dict)) or not hasattr(candidates, "__iter__"):
        raise TypeError(f"rank: candidates must be a list of item ids, got "
                        f"{type(candidates).__name__}")
    return dict(context or {}), list(candidates)


class Client:
    """``sampan serve`` over HTTP (``url``: e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 10.0,
                 admin_token: str | None = None, events_token: str | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url {url!r} is not an http(s) URL such as "
                             "http://127.0.0.1:8000")
        self._conn_class = (http.client.HTTPSConnection if parts.scheme == "https"
                            else http.client.HTTPConnection)
        self._host, self._port = parts.hostname, parts.port
        self._base = parts.path.rstrip("/")
        self.timeout = timeout
        self.admin_token, self.events_token = admin_token, events_token
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _call(self, method: str, path: str, body: Any = None,
              token: str | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        with self._lock:
            for attempt in (0, 1):  # once more on a connection the server had closed
                if self._conn is None:
                    self._conn = self._conn_class(self._host, self._port,
                                                  timeout=self.timeout)
                try:
                    self._conn.request(method, self._base + path, body=data, headers=headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                    break
                except (http.client.RemoteDisconnected, BrokenPipeError,
                        ConnectionResetError):
                    self._conn.close()
                    self._conn = None
                    if attempt:
                        raise
        text = raw.decode("utf-8", "replace")
        if resp.status >= 400:
            try:
                err = json.loads(text)
            except ValueError:
                err = {"error": text}
            raise ServingError(resp.status, err.get("error", text), err.get("field"),
                               err.get("record"))
        ctype = resp.getheader("content-type", "")
        return json.loads(text) if ctype.startswith("application/json") else text

    def predict(self, records: list[dict[str, Any]]) -> Prediction:
        b = self._call("POST", "/v1/predict", {"records": records})
        return Prediction(b["probabilities"], b["labels"], b["model_version"],
                          b.get("request_id", ""), b.get("variant", ""))

    def rank(self, context: dict[str, Any] | None, candidates: list[str | int],
             k: int = 10, task: int = 0) -> Ranking:
        """The ``k`` best of ``candidates`` (item ids) for ``context`` (the user's
        features or keys; ``None``: none), as :meth:`recommend` takes its context."""
        context, candidates = _rank_arguments(context, candidates)
        return _ranking(self._call("POST", "/v1/rank", {
            "context": context, "candidates": candidates, "k": k, "task": task}))

    def recommend(self, context: dict[str, Any], n: int = 100, k: int = 10,
                  task: int = 0) -> Ranking:
        return _ranking(self._call("POST", "/v1/recommend", {
            "context": context, "n": n, "k": k, "task": task}))

    def events(self, events: list[dict[str, Any]]) -> EventsResult:
        b = self._call("POST", "/v1/events", {"events": events}, self.events_token)
        return EventsResult(b["accepted"], b["users"], tuple(b.get("warnings", ())))

    def feedback(self, events: list[dict[str, Any]]) -> int:
        """What users did with served items, for the feedback log: each event names a
        response's ``request_id``, the ``item`` and its ``type`` (``click``, ...; ``ts``
        optional). Returns how many were accepted."""
        return self._call("POST", "/v1/feedback", {"events": events},
                          self.events_token)["accepted"]

    def ready(self) -> dict[str, Any]:
        """``/readyz``: the model served (raises :class:`ServingError` 503 before)."""
        return self._call("GET", "/readyz")

    def metrics(self) -> str:
        return self._call("GET", "/metrics")

    def reload(self, bundle: str | None = None,
               retrieval_bundle: str | None = None) -> dict[str, Any]:
        body = {k: v for k, v in (("bundle", bundle), ("retrieval_bundle", retrieval_bundle))
                if v is not None}
        return self._call("POST", "/v1/admin/reload", body, self.admin_token)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class GrpcClient:
    """``sampan serve --grpc-port`` over gRPC (``target``: e.g. ``127.0.0.1:50051``)."""

    def __init__(self, target: str, timeout: float = 10.0, events_token: str | None = None):
        import grpc

        from sampan.serving.grpc_server import stubs

        self._grpc = grpc
        self._pb, services = stubs()
        self._channel = grpc.insecure_channel(target)
        self._stub = services.ScoringStub(self._channel)
        self.timeout = timeout
        self.events_token = events_token

    def _struct(self, value: dict[str, Any]) -> Any:
        from google.protobuf.struct_pb2 import Struct

        s = Struct()
        s.update(value)
        return s

    def _call(self, method: str, request: Any, token: str | None = None) -> Any:
        meta = [("authorization", f"Bearer {token}")] if token else None
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=meta)
        except self._grpc.RpcError as e:
            message = e.details() or ""
            fld = None
            if message.endswith(")") and " (field: " in message:
                message, _, fld = message[:-1].rpartition(" (field: ")
            raise ServingError(e.code().name, message, fld) from None

    @staticmethod
    def _ranking(r: Any, recommend: bool) -> Ranking:
        return Ranking([ScoredItem(i.item, i.score, i.retrieval_score if recommend else None)
                        for i in r.items], r.model_version, list(r.warnings),
                       r.retrieved if recommend else None, r.request_id, r.variant)

    def predict(self, records: list[dict[str, Any]]) -> Prediction:
        r = self._call("Predict", self._pb.PredictRequest(
            records=[self._struct(x) for x in records]))
        return Prediction([list(p.values) for p in r.probabilities], list(r.labels),
                          r.model_version, r.request_id, r.variant)

    def rank(self, context: dict[str, Any] | None, candidates: list[str | int],
             k: int = 10, task: int = 0) -> Ranking:
        """As :meth:`Client.rank`."""
        context, candidates = _rank_arguments(context, candidates)
        r = self._call("Rank", self._pb.RankRequest(
            context=self._struct(context), candidates=[str(c) for c in candidates],
            k=k, task=task))
        return self._ranking(r, False)

    def recommend(self, context: dict[str, Any], n: int = 100, k: int = 10,
                  task: int = 0) -> Ranking:
        r = self._call("Recommend", self._pb.RecommendRequest(
            context=self._struct(context), n=n, k=k, task=task))
        return self._ranking(r, True)

    def events(self, events: list[dict[str, Any]]) -> EventsResult:
        r = self._call("Events", self._pb.EventsRequest(
            events=[self._struct(e) for e in events]), self.events_token)
        return EventsResult(r.accepted, r.users, tuple(r.warnings))

    def feedback(self, events: list[dict[str, Any]]) -> int:
        """As :meth:`Client.feedback`."""
        r = self._call("Feedback", self._pb.FeedbackRequest(events=[self._pb.FeedbackEvent(
            request_id=e["request_id"], item=str(e["item"]), type=e["type"],
            ts=float(e.get("ts") or 0.0)) for e in _feedback_events(events)]), self.events_token)
        return r.accepted

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
