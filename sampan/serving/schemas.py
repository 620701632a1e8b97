"""The HTTP API's request and response bodies (pydantic), with the examples ``/docs``
shows for every route."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)


def _json_number(v: Any) -> Any:
    """A JSON number as JSON Schema reads one: true/false and "5" are not numbers (pydantic
    alone would take them as 1/0 and 5)."""
    if isinstance(v, (bool, str)):
        raise ValueError(f"expected a number, got {type(v).__name__} {str(v)[:40]!r}")
    return v


# integers and numbers of a request body: 10 and 10.0 are integers, true and "10" are not
JsonInt = Annotated[int, BeforeValidator(_json_number)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]


def _examples(*examples: Any) -> ConfigDict:
    return ConfigDict(extra="forbid", json_schema_extra={"examples": list(examples)})


class PredictRequest(BaseModel):
    """``{"records": [{raw feature: value, ...}, ...]}``: each record gives the model's raw
    features (null for a missing value), or the keys a feature table joins them by."""

    model_config = _examples({"records": [{"user_id": "1000011", "item_id": "3993081"}]})
    records: list[dict[str, Any]] = Field(min_length=1, description="one object per record: "
                                          "the model's raw features (null for a missing "
                                          "value), or the keys its feature tables join them by")
    variant: str | None = Field(None, description="QA: serve with this arm (the request is "
                                "marked forced and left out of the analysis; the header "
                                "X-Sampan-Variant does the same)")


class RankRequest(BaseModel):
    """``{"context": {...}, "candidates": [item ids], "k": 10, "task": 0}``: the context
    gives the user (and any request-time feature); user and item features come from the
    feature store. Context keys the model does not read are ignored and said in
    ``warnings``."""

    model_config = _examples({"context": {"user_id": "1000011"},
                              "candidates": ["3993081", "1686875", "5023031"], "k": 2})
    context: dict[str, Any] = Field(default_factory=dict, description="the user and any "
                                    "request-time feature (e.g. {\"user_id\": \"1000011\"})")
    candidates: list[StrictStr | StrictInt] = Field(
        min_length=1, description="item ids (strings or integers); one named twice is "
        "ranked once")
    k: JsonInt = Field(10, ge=1, description="items returned")
    task: JsonInt = Field(0, ge=0, description="which label's probability ranks (multi-task)")
    variant: str | None = Field(None, description="QA: serve with this arm (the request is "
                                "marked forced and left out of the analysis; the header "
                                "X-Sampan-Variant does the same)")


class RecommendRequest(BaseModel):
    """``{"context": {"user_id": ...}, "n": 100, "k": 10}``: ``n`` candidates retrieved by
    the two-tower model's ANN index, ranked by the ranking model; each model reads the
    part of one context it knows."""

    model_config = _examples({"context": {"user_id": "1000011"}, "n": 100, "k": 10})
    context: dict[str, Any] = Field(min_length=1, description="the user (its id, for the user "
                                    "tower and the live history) and any request-time feature")
    n: JsonInt = Field(100, ge=1, description="candidates retrieved by the ANN index")
    k: JsonInt = Field(10, ge=1, description="items returned after ranking")
    task: JsonInt = Field(0, ge=0, description="which label's probability ranks (multi-task)")
    variant: str | None = Field(None, description="QA: serve with this arm (the request is "
                                "marked forced and left out of the analysis; the header "
                                "X-Sampan-Variant does the same)")


class EventsRequest(BaseModel):
    """``{"events": [{"user_id": ..., "item_id": ...}, ...]}``: behaviour events, appended
    in order to each user's live histories (``category_id`` and the like are taken from the
    item table when not given)."""

    model_config = _examples({"events": [{"user_id": "1000011", "item_id": "3993081"},
                                         {"user_id": "1000011", "item_id": "1686875",
                                          "category_id": "590997"}]})
    events: list[dict[str, Any]] = Field(min_length=1, description="each with the user id "
                                         "and the item id (category_id and the like come from "
                                         "the item table when not given)")


class ErrorBody(BaseModel):
    """Every error: what is wrong, the request field it concerns, the record's index."""

    model_config = _examples({"error": "record 0 has unknown feature(s) ['agee'] for model "
                                       "'din'; known: ['user_id', 'item_id']",
                              "field": "agee", "record": 0})
    error: str = Field(description="what was wrong, and what was expected")
    field: str | None = Field(None, description="the request field at fault")
    record: int | None = Field(None, description="the index of the record at fault")


SERVED = {"request_id": Field(description="this response's id: feedback events name it "
                                            "(POST /v1/feedback)"),
          "variant": Field(description="the arm that served it (default: no experiment)")}


class PredictResponse(BaseModel):
    model_config = _examples({"probabilities": [[0.0713]], "labels": ["label"],
                              "model_version": "din@2026-12-01T22:28:29+0000",
                              "request_id": "5f0c8e9a2b7d4c1e9f3a6b2d8c4e7f10",
                              "variant": "default"})
    probabilities: list[list[float]] = Field(description="one row per record, one column per label")
    labels: list[str] = Field(description="the labels, in the columns' order")
    model_version: str = Field(description="the version of the model that scored")
    request_id: str = SERVED["request_id"]
    variant: str = SERVED["variant"]


class ScoredItem(BaseModel):
    item: str | int = Field(description="the item id, as the request named it")
    score: float = Field(description="the probability of the ranking label")
    retrieval_score: float | None = Field(None, description="the two-tower cosine "
                                          "(/v1/recommend only)")


class RankResponse(BaseModel):
    model_config = _examples({"items": [{"item": "3993081", "score": 0.41},
                                        {"item": "5023031", "score": 0.12}],
                              "model_version": "din@2026-12-01T22:28:29+0000",
                              "warnings": [], "request_id": "5f0c8e9a2b7d4c1e9f3a6b2d8c4e7f10",
                              "variant": "default"})
    items: list[ScoredItem] = Field(description="the best k, best first")
    model_version: str = Field(description="the version of the model that ranked")
    request_id: str = SERVED["request_id"]
    variant: str = SERVED["variant"]
    warnings: list[str] = Field(default_factory=list, description="context keys no "
                                "served model reads (ignored)")


class RecommendResponse(RankResponse):
    model_config = _examples({"items": [{"item": "3993081", "score": 0.41,
                                         "retrieval_score": 0.83}],
                              "retrieved": 100, "model_version": "din@2026-12-01T22:28:29+0000",
                              "warnings": []})
    retrieved: int = Field(description="candidates the retrieval returned before ranking")


class FeedbackEvent(BaseModel):
    """What a user did with a served item: ``type`` (one of the serve config's
    ``feedback.event_types``: impression, click, conversion by default) on ``item`` of the
    response ``request_id`` (for ``/v1/predict``, the record's position), at ``ts`` (unix
    seconds; default: when the server receives it)."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128, description="the request_id of the "
                            "response that served the item")
    item: str | int = Field(description="the item (for /v1/predict: the record's position)")
    type: str = Field(min_length=1, max_length=64, description="one of the serve config's "
                      "feedback.event_types (impression, click, conversion by default)")
    ts: float | None = Field(None, description="when it happened, in epoch seconds (default: when "
                             "received); an event after the window is late")


class FeedbackRequest(BaseModel):
    model_config = _examples({"events": [{"request_id": "5f0c8e9a2b7d4c1e9f3a6b2d8c4e7f10",
                                          "item": "3993081", "type": "click"}]})
    events: list[FeedbackEvent] = Field(min_length=1, description="what users did with served "
                                        "items")


class FeedbackResponse(BaseModel):
    model_config = _examples({"accepted": 1})
    accepted: int = Field(description="events taken for the feedback log")


class WeightsRequest(BaseModel):
    """New relative weights of the experiment's arms, every arm named."""

    model_config = _examples({"weights": {"control": 80, "candidate": 20}})
    weights: dict[str, JsonFloat] = Field(
        min_length=1, description="every arm's new relative weight",
        json_schema_extra={"additionalProperties": {"type": "number", "minimum": 0}})

    @field_validator("weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not w >= 0}
        if bad:
            raise ValueError(f"weights must be 0 or more; got {bad}")
        return v


class EventsResponse(BaseModel):
    model_config = _examples({"accepted": 2, "users": 1})
    accepted: int = Field(description="events appended")
    users: int = Field(description="users whose histories they changed")
    warnings: list[str] = Field(default_factory=list, description="values a feature table "
                                "was asked for and does not hold (an item never seen: its "
                                "category goes into the history as unknown)")


# a path without control characters, not all blank (what ReloadRequest's check takes)
PLAIN_PATH = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"


class ReloadRequest(BaseModel):
    """``{"bundle": ranking bundle}`` and/or ``{"retrieval_bundle": two-tower bundle}``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"bundle": "bundles/din-2026-12-01"}],
        "anyOf": [{"required": [k], "properties": {k: {"type": "string"}}}
                  for k in ("bundle", "retrieval_bundle")]})
    bundle: str | None = Field(None, description="the ranking bundle to serve",
                               json_schema_extra={"pattern": PLAIN_PATH})
    retrieval_bundle: str | None = Field(None, description="the two-tower bundle of "
                                         "/v1/recommend", json_schema_extra={
                                             "pattern": PLAIN_PATH})
    variant: str | None = Field(None, description="the arm whose bundle this is (default: "
                                "control, the only one without an experiment)")

    @model_validator(mode="after")
    def _one_bundle(self) -> ReloadRequest:
        if self.bundle is None and self.retrieval_bundle is None:
            raise ValueError("give bundle (the ranking model) and/or retrieval_bundle")
        return self

    @field_validator("bundle", "retrieval_bundle")
    @classmethod
    def _plain_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("the path is empty; give a bundle directory (or leave the key "
                             "out)")
        bad = next((c for c in v if ord(c) < 32 or ord(c) == 127 or
                    0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is not None:
            raise ValueError(f"the path holds the character U+{ord(bad):04X} (a control "
                             "character or a lone surrogate); give a plain path")
        return v
