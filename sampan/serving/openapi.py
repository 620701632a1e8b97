"""The OpenAPI document of a running server, written for the bundles it serves: each body's
schema names the served model's own features with the JSON types the server takes, which of
them a request must give (the rest come from the feature tables and live histories), the
experiment's arms, and an example built from the bundle's vocabularies. A client generated
from it sends what the model reads; Schemathesis (``tests/fuzz/test_schemathesis.py``) finds
no request it describes that the server refuses, nor one it refuses to describe that the
server takes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sampan.serving.feature_store import MemoryTables

if TYPE_CHECKING:
    from sampan.serving.predictor import Predictor
    from sampan.serving.service import ServerState

# what a categorical feature takes: one JSON scalar (a number or boolean is read as its text)
SCALAR = ["string", "number", "boolean"]


def value_schema(predictor: Predictor, column: str, nullable: bool = True) -> dict[str, Any]:
    """The JSON Schema of one raw feature's value in a request."""
    roles = predictor.roles
    null = ["null"] if nullable and column not in roles.required else []
    if column in roles.lists:
        return {"type": ["array", *SCALAR, *null], "items": {"type": [*SCALAR, "null"]},
                "description": "a list feature: an array of values (or one delimited "
                "string); a null element is a missing value"}
    if column in roles.numeric:
        return {"type": ["number", *null], "description": "a numeric feature"}
    return {"type": [*SCALAR, *null], "description": "a categorical feature"}


def record_schema(predictor: Predictor, store: Any, elsewhere: set[str] = frozenset(),
                  ) -> tuple[dict[str, Any], list[str]]:
    """``(properties, required)`` of a request record for ``predictor``: every raw feature
    it reads that no feature table or live history brings, and the key of each table that
    brings the others (``elsewhere``: columns the request gives in another field, such as
    the item of a ranking, and those a model reads as missing). A /v1/predict record may
    give a table's feature too (overriding it) when every record gives it: the schema
    cannot say "the same keys in every record", so it lists only what each must give."""
    brought: dict[str, str] = {}
    for by, cols in (store.provides() if store is not None else {}).items():
        for c in cols:
            brought.setdefault(c, by)
    props: dict[str, Any] = {}
    for c in predictor.columns:
        if c in predictor.optional or c in elsewhere:
            continue
        key = brought.get(c, c)
        if key not in elsewhere and key not in props:
            props[key] = value_schema(predictor, key)
    return props, list(props)


def _object(props: dict[str, Any], required: list[str], more: bool) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": more}


def request_schemas(state: ServerState | None) -> dict[str, dict[str, Any]]:
    """JSON Schema fragments merged into the generic request schemas of the document
    (``components.schemas``), for what ``state`` serves now."""
    predictor = state.arms[state.control].predictor if state is not None else None
    if predictor is None:
        return {}
    cfg, store = state.cfg, state.arms[state.control].store
    arms = {"anyOf": [{"enum": list(state.arms)}, {"type": "null"}],
            "description": "QA: serve with this arm (marked forced, left out of the analysis)"}
    task = {"type": "integer", "minimum": 0, "maximum": len(predictor.labels) - 1,
            "default": 0, "description": f"which label ranks: 0..{len(predictor.labels) - 1} "
            f"of {predictor.labels}"}
    records, required = record_schema(predictor, store)
    out: dict[str, dict[str, Any]] = {
        "PredictRequest": {"properties": {
            "records": {"type": "array", "minItems": 1, "maxItems": cfg.max_records,
                        "items": _object(records, required, False),
                        "description": "one object per record: the features below (null for "
                        "a missing value), the same keys in every record; a feature a table "
                        "or live history brings may be given too, overriding it"},
            "variant": arms}}}
    item = state.item_key(predictor)
    context, need = record_schema(predictor, store, {item})
    candidates = {"type": "array", "minItems": 1, "maxItems": cfg.max_records,
                  "items": {"type": ["string", "integer"]},
                  "description": f"item ids ({item!r}); one named twice is ranked once"}
    out["RankRequest"] = {"properties": {
        "context": {**_object(context, need, True), "propertyNames": {"not": {"const": item}},
                    "description": "the user and request-time features (any other key is "
                    "ignored, with a warning)"},
        "candidates": candidates, "task": task, "variant": arms},
        "required": ["candidates", "context"] if need else ["candidates"]}
    if state.retriever is not None:
        r = state.retriever
        rprops, rneed = record_schema(r.predictor, state.retrieval_store, r.item_columns)
        props = {**rprops, **context}
        out["RecommendRequest"] = {"properties": {
            "context": {**_object(props, list(dict.fromkeys([*rneed, *need])), True),
                        "propertyNames": {"not": {"const": item}}, "minProperties": 1,
                        "description": "the user (for the retrieval model and the ranking "
                        "model; any other key is ignored, with a warning)"},
            "task": task, "variant": arms}}
    else:  # 409 whatever the context: only the arm is checked first
        out["RecommendRequest"] = {"properties": {"variant": arms}}
    if state.live is not None:
        fields = state.live.event_values
        event = {state.live.key: {"type": SCALAR, "description": "the user"},
                 **{f: {"type": [*SCALAR, "null"]} for f in fields}}
        out["EventsRequest"] = {"properties": {"events": {
            "type": "array", "minItems": 1, "maxItems": cfg.max_records,
            "items": {**_object(event, [state.live.key], False), "anyOf": [
                {"required": [f], "properties": {f: {"type": SCALAR}}} for f in fields]},
            "description": f"each with the user and what it did ({fields}: at least one; "
            "the others come from the item table)"}}}
    out["ReloadRequest"] = {"properties": {"variant": {
        **arms, "description": "the arm whose bundle this is (default: control)"}}}
    if state.allocation is not None:
        names = list(state.arms)
        out["WeightsRequest"] = {"properties": {"weights": {
            **_object({a: {"type": "number", "minimum": 0} for a in names}, names, False),
            "anyOf": [{"properties": {a: {"exclusiveMinimum": 0}}} for a in names],
            "description": "every arm's new relative weight (at least one above 0)"}}}
    return out


def merge(schema: dict[str, Any], more: dict[str, Any]) -> None:
    """Merge ``more`` into ``schema``: its properties one by one, the rest replaced."""
    for key, value in more.items():
        if key == "properties":
            for name, prop in value.items():
                schema.setdefault("properties", {})[name] = {
                    k: v for k, v in schema.get("properties", {}).get(name, {}).items()
                    if k in ("title", "default")} | prop
        else:
            schema[key] = value


def _value_of(vocab: Any, i: int = 0) -> str | None:
    return str(vocab[i].as_py()) if vocab is not None and len(vocab) > i else None


def request_examples(state: ServerState | None) -> dict[str, dict[str, Any]]:
    """Request bodies for the served bundle's own features (what ``/docs`` and the OpenAPI
    document show): the features a request must give (a value of each vocabulary, a
    typical number, a key of each feature table), candidates and events of real ids."""
    predictor = state.arms[state.control].predictor if state is not None else None
    if predictor is None:  # no bundle (the reference page): the generic examples
        return {}
    pipe, store = predictor.pipeline, state.arms[state.control].store
    value: dict[str, Any] = {}
    for e in pipe.categorical:
        for c in e.spec.cross or [e.spec.column or e.spec.name]:
            value[c] = _value_of(getattr(e, "vocab_", None)) if not e.spec.cross else "a"
            if e.spec.bucketize != "none":
                value[c] = 1.0
    for n in pipe.numeric:
        value[n.spec.column or n.spec.name] = round(float(n.fill_ or 0.0), 4)
    for li in pipe.lists:
        for c in li.spec.flags or [li.spec.column or li.spec.name]:
            first = _value_of(getattr(li.vocab, "vocab_", None))
            value[c] = 1.0 if li.spec.flags else [first] if first is not None else []
    tables = store.tables if store is not None else None
    for by in tables.keys if tables is not None else []:
        if value.get(by) is None and isinstance(tables, MemoryTables) and tables.size(by):
            value[by] = str(tables.tables[by].keys[0].as_py())
    if state.live is not None and value.get(state.live.key) is None:
        value[state.live.key] = "user-1"

    def example(props: dict[str, Any]) -> dict[str, Any]:
        return {c: value.get(c) for c in props}

    item_key, unit_key = state.item_key(predictor), state.cfg.unit_key
    out: dict[str, dict[str, Any]] = {
        "PredictRequest": {"records": [example(record_schema(predictor, store)[0])]}}
    context = example(record_schema(predictor, store, {item_key})[0])
    items = next((getattr(e, "vocab_", None) for e in pipe.categorical
                  if (e.spec.column or e.spec.name) == item_key), None)
    if items is not None and len(items) > 1:
        out["RankRequest"] = {"context": context, "candidates": [
            _value_of(items, 0), _value_of(items, 1)], "k": 2}
        if state.live is not None:
            out["EventsRequest"] = {"events": [{state.live.key: value[state.live.key],
                                                item_key: _value_of(items)}]}
    if state.retriever is not None:
        r = state.retriever
        props = record_schema(r.predictor, state.retrieval_store, r.item_columns)[0]
        out["RecommendRequest"] = {"context": {**example(props), **context}, "n": 100, "k": 10}
    elif value.get(unit_key) is not None:
        out["RecommendRequest"] = {"context": {unit_key: value[unit_key]}, "n": 100, "k": 10}
    return out
