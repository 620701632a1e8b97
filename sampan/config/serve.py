"""``sampan serve``'s config: bundle, ports, workers, limits, feature store."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from sampan.config.base import _Strict
from sampan.config.data import JoinConfig
from sampan.config.load import apply_override
from sampan.config.messages import format_validation_error
from sampan.errors import ConfigError


# -------------------------------------------------------------------------------- serving
class FeatureStoreConfig(_Strict):
    """Where requests find user and item features by key, and where users' live
    behaviour histories are kept.

    The tables are the bundle's feature tables (written at export: each item's and user's
    attributes), or for a bundle without them the run's ``data.joins``; ``tables`` replaces
    those with the same key. Live histories start from the bundle's user table
    (``bootstrap``) and grow with ``POST /v1/events``. With ``backend: redis`` the tables
    are loaded into Redis at ``url`` at start-up, the histories are kept there (shared by
    every worker and restart), and both are read from there per request.
    """

    backend: Literal["memory", "redis"] = Field(
        "memory", description="memory: tables and live histories in the server process; "
        "redis: in Redis at url, shared by every worker and kept across restarts")
    url: str = Field("redis://127.0.0.1:6379/0", description="the Redis server (backend "
                     "redis)")
    prefix: str = Field("sampan", description="backend redis: the start of every Redis key "
                        "the server writes (tables and live histories)")
    tables: list[JoinConfig] | None = Field(None, description="side tables in place of "
                                            "the bundle's feature tables with the same key")
    bootstrap: bool = Field(True, description="start each user's live histories from the "
                            "bundle's user table (their latest history in the training data)")
    ttl_seconds: float | None = Field(None, gt=0, description="forget a user's live "
                                      "histories this long after their last event")
    max_live_users: int = Field(1_000_000, gt=0, description="memory backend: users with "
                                "events held at most; the least recently active beyond it "
                                "go back to their bootstrapped history (Redis: use ttl)")
    events_token: str | None = Field(None, description="bearer token POST /v1/events "
                                     "needs (SAMPAN_EVENTS_TOKEN wins); open when unset")


class FeedbackKafkaConfig(_Strict):
    """A Kafka topic the joiner also sends each shown item's labelled row to (one JSON
    object per message, keyed ``request_id:item``), for ``sampan stream``'s Kafka source:
    rows reach training as their window closes, not when their hour does. Delivery is at
    least once (a joiner that crashes between sending and its checkpoint sends those rows
    again); the Parquet log stays the exact record."""

    brokers: str = Field(description="bootstrap servers, host:port[,host:port...]")
    topic: str = Field(description="the topic the rows are sent to")
    options: dict[str, str] = Field(default_factory=dict, description="more librdkafka "
                                    "producer settings (security.protocol, sasl.*, ...)")


class FeedbackConfig(_Strict):
    """The feedback log: every served item, joined with the events posted for it
    (``POST /v1/feedback``) into a labelled row when its window closes.

    Each serving process appends what it served and the events it received to its own
    journal under ``dir/_journal`` (flushed every ``flush_seconds``: a process killed
    outright loses at most that much); one joiner (a process of the server's own, one per
    ``dir``: a second server on the same ``dir`` journals, its joiner waiting to take over)
    turns the journals into labelled rows,
    ``dir/YYYYMMDD/HH/part-*.parquet`` by the hour served, with ``_SUCCESS`` once every row
    of the hour is written: the layout ``sampan stream``'s directory source reads. A served
    item's ``label`` is 1 when an event of a ``label_events`` type arrived within
    ``window_seconds`` of serving it, else 0; each type of ``event_types`` gets a 0/1 column
    the same way. Repeats of an event are counted as duplicates and change nothing; events
    after the window are counted as late and not learned from."""

    dir: str | None = Field(None, description="where the log goes; unset: no feedback log")
    window_seconds: float = Field(300.0, gt=0, description="how long a served item waits "
                                  "for its events before it becomes a labelled row")
    flush_seconds: float = Field(1.0, gt=0, description="how often each process writes "
                                 "its journal to disk (what a crash can lose)")
    label_events: list[str] = Field(["click"], min_length=1, description="event types that "
                                    "make the label 1")
    event_types: list[str] = Field(["impression", "click", "conversion"], description="event "
                                   "types accepted; each becomes a 0/1 column")
    kafka: FeedbackKafkaConfig | None = Field(None, description="also send the shown "
                                              "items' rows to this topic (needs the stream "
                                              "extra)")

    @model_validator(mode="after")
    def _labels_known(self) -> FeedbackConfig:
        unknown = [e for e in self.label_events if e not in self.event_types]
        if unknown:
            raise ValueError(f"label_events {unknown} are not among event_types "
                             f"{self.event_types}")
        return self


class ExploreConfig(_Strict):
    """Exploration of ``/v1/rank`` and ``/v1/recommend``'s first item, so that other
    policies can be evaluated on the logged traffic (``sampan experiment ope``): with
    ``epsilon``, a uniformly random candidate goes first with that probability, else the
    best; with ``softmax``, the first is drawn from the softmax of the scores' logits at
    ``temperature``. The rest follow by score. Every scored candidate is logged with the
    probability that it would have gone first (its propensity); those not shown go to
    ``feedback.dir/_unshown``, which the report and ``sampan stream`` leave out."""

    method: Literal["epsilon", "softmax"] = Field(
        "epsilon", description="epsilon: a uniformly random candidate first with probability "
        "epsilon, else the best; softmax: the first drawn from the softmax of the scores' "
        "logits")
    epsilon: float = Field(0.1, gt=0.0, le=1.0, description="epsilon method: the probability "
                           "that the first item is drawn uniformly from the candidates")
    temperature: float = Field(1.0, gt=0.0, description="softmax method: the temperature of "
                               "the softmax over the scores' logits (lower: the best first "
                               "more often)")


class VariantConfig(_Strict):
    """One arm of an A/B experiment: a bundle, or a model directory followed like
    ``watch`` (with both: the bundle until the directory publishes a newer version), and
    its share of the traffic (weights are relative)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="the arm's name: each response's variant, and the arm's "
                      "key in the log, the report and /v1/admin/weights")
    bundle: str | None = Field(None, description="the arm's bundle (with watch: served until "
                               "the directory publishes a newer version)")
    watch: str | None = Field(None, description="a model directory a stream run publishes "
                              "to: the arm serves its latest version and follows each new one")
    weight: float = Field(ge=0.0, description="the arm's share of the users, relative to the "
                          "other arms' weights; a saved allocation of the same arms (state) "
                          "wins")

    @model_validator(mode="after")
    def _a_source(self) -> VariantConfig:
        if self.bundle is None and self.watch is None:
            raise ValueError(f"variant {self.name!r}: give bundle or watch")
        return self


class ExperimentServeConfig(_Strict):
    """An A/B experiment: each unit (``unit_key``, the user) hashed with ``name`` into one
    of 10,000 buckets, each arm owning its weight's share of them (see
    :mod:`sampan.serving.variants`). The first variant is control. Weights changed at
    runtime (``POST /v1/admin/weights``) are saved to ``state`` (default
    ``feedback.dir/experiment.json``), which every worker follows and a restart reads."""

    name: str = Field(min_length=1, description="the experiment's name, also the salt of "
                      "the assignment hash (a new name reshuffles the users)")
    variants: list[VariantConfig] = Field(min_length=1, description="the arms, control "
                                          "first")
    state: str | None = Field(None, description="where the allocation is saved")

    @model_validator(mode="after")
    def _distinct(self) -> ExperimentServeConfig:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must differ; got {names}")
        if sum(v.weight for v in self.variants) <= 0:
            raise ValueError("variant weights add up to 0: give at least one a weight")
        return self


class ServeConfig(_Strict):
    """``sampan serve`` settings (CLI options override the file)."""

    bundle: str | None = Field(None, description="the bundle to serve (with watch: the "
                               "directory's latest version when not given)")
    watch: str | None = Field(None, description="a model directory a stream run publishes "
                              "to (stream.publish.dir): each new version is checked and "
                              "swapped in without a dropped request")
    watch_seconds: float = Field(1.0, gt=0, description="how often watch looks for a new "
                                 "version")
    host: str = Field("127.0.0.1", description="the address the HTTP (and gRPC) server binds")
    port: int = Field(8000, ge=0, le=65535, description="the HTTP port")
    grpc_port: int | None = Field(None, ge=0, le=65535, description="also serve gRPC on this "
                                  "port; null: HTTP only")
    workers: int = Field(1, ge=1, description="server processes, each loading the bundle and "
                         "binding the HTTP (and gRPC) port; live-history events then need "
                         "the redis backend")
    max_batch_rows: int = Field(4096, gt=0, description="rows per model call")
    max_wait_ms: float = Field(2.0, ge=0.0, description="how long a model call waits for "
                               "more requests to join it")
    max_records: int = Field(10_000, gt=0, description="records or candidates per request")
    max_body_bytes: int = Field(8 << 20, gt=0, description="the largest HTTP request body "
                                "accepted, in bytes; a larger one is refused with 413")
    max_inflight: int = Field(64, gt=0, description="requests one worker works on at once "
                              "on the routes that take a body (HTTP and gRPC alike); past it "
                              "a request is answered 503 with Retry-After (RESOURCE_EXHAUSTED "
                              "over gRPC) before its body is read, and counted in "
                              "sampan_overloaded")
    max_inflight_bytes: int = Field(32 << 20, gt=0, description="request body bytes one "
                                    "worker works on at once (a request's Content-Length, or "
                                    "max_body_bytes when it gives none): what bounds the "
                                    "memory of large concurrent requests; past it 503 as "
                                    "for max_inflight, except that a worker with nothing in "
                                    "flight always takes the request")
    item_key: str | None = Field(None, description="the raw column /v1/rank fills with "
                                 "the candidate ids; null: the column the bundle's item "
                                 "table is keyed by (features/items.parquet), else item_id")
    unit_key: str = Field("user_id", description="the request field (context or record) "
                          "that names the unit: the user, for the feedback log and A/B "
                          "assignment")
    retrieval_bundle: str | None = Field(None, description="a two_tower or next-item "
                                         "(sasrec, hstu) bundle: enables /v1/recommend (ANN "
                                         "candidates, then ranking); unset, a two_tower or "
                                         "next-item bundle served as `bundle` retrieves for "
                                         "itself")
    threads: int | None = Field(None, gt=0, description="ONNX Runtime intra-op threads of "
                                "the ranking model (default: 1 when a retrieval bundle is "
                                "served too, else ONNX Runtime's own)")
    admin_token: str | None = Field(None, description="bearer token of /v1/admin/reload; "
                                    "the SAMPAN_ADMIN_TOKEN environment variable wins")
    feature_store: FeatureStoreConfig = Field(
        FeatureStoreConfig(), description="where requests find user and item features, and "
        "users' live histories")
    feedback: FeedbackConfig = Field(FeedbackConfig(), description="the log of served items "
                                     "joined with their events into labelled rows")
    experiment: ExperimentServeConfig | None = Field(
        None, description="an A/B experiment between variants (bundle and watch stay unset); "
        "null: one model serves every request")
    explore: ExploreConfig | None = Field(
        None, description="explore the first item of /v1/rank and /v1/recommend, for "
        "off-policy evaluation; null: the best goes first")

    @model_validator(mode="after")
    def _has_bundle(self) -> ServeConfig:
        if self.experiment is not None:
            if self.bundle is not None or self.watch is not None:
                raise ValueError("with an experiment, each variant names its bundle or watch "
                                 "directory: leave bundle and watch unset")
            return self
        if self.bundle is None and self.watch is None:
            raise ValueError("bundle is required (a bundle directory from `sampan export`), "
                             "or watch: a model directory that `sampan stream` publishes to")
        return self


def load_serve_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      raw: dict[str, Any] | None = None) -> ServeConfig:
    """A :class:`ServeConfig` from a YAML file and/or ``key=value`` overrides."""
    if raw is None:
        raw = {}
        if path is not None:
            file = Path(path)
            if not file.exists():
                raise ConfigError(f"serve config {str(file)!r} does not exist")
            raw = yaml.safe_load(file.read_text()) or {}
            if not isinstance(raw, dict):
                raise ConfigError(f"{file}: top level must be a mapping")
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        apply_override(raw, item)
    try:
        return ServeConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, ServeConfig)) from None
