"""Predictor: scores raw feature records with an exported bundle.

Records are JSON-like dicts keyed by the raw column names the run was trained on (the
columns of ``features`` and of joined side tables). They go through the same code path as
training data: text columns are typed and validated by :func:`sampan.data.sources.
validate_table`, then encoded by the bundle's fitted :class:`FeaturePipeline` (unseen
categorical values map to OOV exactly as in training), then scored by ONNX Runtime.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.bundle import Bundle, BundleKey
from sampan.data.io.lines import CellError, records_table
from sampan.data.rejects import RejectLog
from sampan.data.roles import ColumnRoles
from sampan.data.validate import validate_table
from sampan.errors import ConflictError, RequestError


class Predictor:
    """``Predictor(bundle).predict(records) -> [N, T]`` probabilities.

    A record carries the raw columns in ``columns`` (explicit ``null`` means a missing
    value, as an empty cell in a file), or the keys a feature store joins them on; keys
    outside ``columns`` are refused so that a misspelt feature never passes silently as
    missing.
    """

    def __init__(self, bundle: str | Path | Bundle, max_records: int = 10_000,
                 threads: int | None = None, key: BundleKey | bytes | str | None = None,
                 json_types: bool = False):
        """``key``: open only a bundle signed with it (None: the environment's key,
        ``SAMPAN_BUNDLE_KEY`` or ``SAMPAN_BUNDLE_KEY_FILE``, when one is set; see
        :mod:`sampan.bundle`). ``json_types``: numeric features must be numbers (the HTTP
        and gRPC contract, as the server's OpenAPI document says); without it, a string is
        typed as the same text in a CSV file would be (``"42"`` is 42)."""
        self.json_types = json_types
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle(bundle, key=key)
        self.pipeline = self.bundle.pipeline()
        self.roles = self.pipeline.roles(with_labels=False, with_extra=False)
        self.columns = list(self.roles.all)
        # features.group (the user, for training and evaluation) when no feature reads it:
        # a request may give it, and need not
        self.optional = set(self.columns) - set(self.pipeline.roles(
            with_labels=False, with_extra=False, with_group=False).all)
        self.max_records = max_records
        self.session = self.bundle.session(threads)
        self.labels = self.bundle.schema.labels
        self.name = f"model {self.bundle.manifest.get('model', '?')!r}"  # in its errors
        self.pipeline.prepare_lookups()  # vocabulary lookups ready before requests

    def known(self, store: Any = None) -> set[str]:
        """What a request may give this model: its raw features and the feature store's
        keys."""
        return set(self.columns) | set(store.keys if store is not None else [])

    def context_for(self, context: dict[str, Any], store: Any = None) -> dict[str, Any]:
        """The part of a request context this model reads (one context serves the
        retrieval and the ranking model; the caller reports keys no model reads)."""
        known = self.known(store)
        return {k: v for k, v in context.items() if k in known}

    @property
    def item_key(self) -> str:
        """The raw column a candidate id goes in: the column the bundle's item table is
        keyed by (``features/items.parquet``), else ``item_id``."""
        items = (self.bundle.manifest.get("feature_tables") or {}).get("items")
        key = items.get("key") if isinstance(items, dict) else None
        return key if isinstance(key, str) and key in self.columns else "item_id"

    @property
    def version(self) -> str:
        m = self.bundle.manifest
        return f"{m.get('model', '?')}@{m.get('created', '?')}"

    def table(self, records: list[dict[str, Any]], store: Any = None) -> pa.Table:
        """Records -> a typed, validated table (the step that can fail per request).

        Every record carries the same keys. Columns a record lacks are joined from
        ``store`` when the record holds that table's key (e.g. the user's attributes by
        ``user_id``); whatever is still missing is an error naming the feature.
        """
        check_objects(records, "record", self.max_records)
        known = self.known(store)
        keys = records[0].keys()
        for i, r in enumerate(records):
            unknown = [k for k in r if k not in known]
            if unknown:
                raise RequestError(f"record {i} has unknown feature(s) {unknown} for "
                                   f"{self.name}; known: {self.columns}", unknown[0], i)
            if r.keys() != keys:
                diff = sorted(set(keys) ^ set(r))
                raise RequestError(f"record {i} does not have the keys of record 0 "
                                   f"(differs in {diff}); send every feature in every "
                                   "record, null for a missing value", diff[0], i)
        given = [c for c in known if c in keys]
        t = _records_table(records, self._roles_of(given), "records")
        cols = {c: t.column(c).combine_chunks() for c in given}
        return self._validated(self._complete(cols, store))

    def user_table(self, context: dict[str, Any], store: Any,
                   absent: set[str]) -> pa.Table:
        """One validated row from the part of ``context`` this model reads (+ the feature
        store), with the columns in ``absent`` (e.g. item features for a user tower) as
        missing values."""
        unread = [k for k in context if k not in self.known(store)]
        context = self.context_for(context, store)
        t = _records_table([context], self._roles_of(context), "context")
        cols = {c: t.column(c).combine_chunks() for c in context}
        return self._validated(self._complete(cols, store, absent, unread))

    def _roles_of(self, given: Any) -> ColumnRoles:
        """The roles of the request keys ``given``: list features may come as arrays, the
        rest as scalars; with ``json_types``, numeric features as numbers (or null)."""
        numeric = [c for c in given if c in self.roles.numeric and c not in self.roles.lists
                   ] if self.json_types else []
        return ColumnRoles(numeric=numeric, categorical=[c for c in given if c not in numeric],
                           lists=[c for c in given if c in self.roles.lists])

    def _complete(self, cols: dict[str, pa.Array], store: Any,
                  absent: set[str] = frozenset(), unread: list[str] = ()) -> pa.Table:
        """Add the feature-store columns of every table whose key is among ``cols``; fail
        naming the first feature that is still missing (unless it is in ``absent``), and
        the keys the request gave that the model does not read (``unread``): a misspelt
        key is named with the feature it is nearest."""
        given = sorted(cols)  # what the request itself gave
        for by in (store.keys if store is not None else []):
            if by not in cols:
                continue  # a table keyed by something this request does not give
            values, _ = store.columns(by, cols[by])
            for c, v in values.items():
                if c in self.roles.all and c not in cols:
                    cols[c] = v
        n = len(next(iter(cols.values()))) if cols else 1
        for c in {*absent, *self.optional}:
            if c in self.roles.all and c not in cols:
                cols[c] = pa.nulls(n, pa.list_(pa.string()) if c in self.roles.lists
                                   else pa.string())
        missing = [c for c in self.columns if c not in cols]
        if store is not None:  # a missing join key explains the columns it would bring
            missing.sort(key=lambda c: c not in store.keys)
        if missing:
            tables = f"; the feature store joins on {store.keys}" if store is not None else ""
            # what the feature store brings with its key is not the request's to give
            brought = {c for cs in (store.provides() if store is not None else {}).values()
                       for c in cs}
            needs = [c for c in self.columns if c not in self.optional and c not in absent
                     and c not in brought]
            gave = f" (the request gave {given})" if given else " (the request gave none)"
            if unread:
                near = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(
                    k, missing, n=1, cutoff=0.75)) else repr(k) for k in unread[:5]]
                gave = gave[:-1] + f"; it gave {', '.join(near)}, which {self.name} does " \
                    "not read)"
            # a missing key is named, not each column it would have brought
            shown = [c for c in missing if c not in brought] or missing
            raise RequestError(f"{self.name}: feature(s) {shown} are missing{gave}: every "
                               f"request needs {needs} (null for a missing value){tables}",
                               missing[0], 0 if store is None else None)
        return pa.table({c: cols[c] for c in self.columns})

    def _validated(self, table: pa.Table) -> pa.Table:
        log = RejectLog(None)
        out = validate_table(table, self.roles, np.arange(table.num_rows), "request", log, ",")
        if log.rejected:
            ex = log.examples[0]
            raise RequestError(f"{self.name}: record {ex['line']}: feature {ex['column']!r}: "
                               f"{ex['reason'].replace('_', ' ')}", ex["column"], ex["line"])
        return out

    def score_table(self, table: pa.Table) -> np.ndarray:
        """A validated table -> probabilities ``[N, T]`` (pipeline, then the graph)."""
        arrays = self.pipeline.transform(table, with_labels=False)
        seqs = arrays.get("sequences") or {}
        return self.session.run((arrays["dense"].astype(np.float32, copy=False),
                                 arrays["sparse"].astype(np.int64, copy=False),
                                 *[seqs[s.name].astype(np.int64, copy=False)
                                   for s in self.bundle.schema.sequences]))

    def predict(self, records: list[dict[str, Any]], store: Any = None) -> np.ndarray:
        """Probabilities ``[N, T]`` (T = number of labels), in record order; any number
        of records, scored ``max_records`` at a time (the limit is a request's)."""
        n = self.max_records
        if len(records) <= n:
            return self.score_table(self.table(records, store))
        return np.concatenate([self.score_table(self.table(records[i:i + n], store))
                               for i in range(0, len(records), n)])

    # ------------------------------------------------------------------- ranking
    def candidates_table(self, context: dict[str, Any], candidates: list[Any],
                         item_key: str, store: Any = None) -> pa.Table:
        """One row per candidate: ``item_key`` = the candidate, the request's ``context``
        features repeated, and the columns of every feature-store table whose key the row
        holds (the item table by candidate, the user table and live histories by the
        context's user key). Context keys the model does not read are left out (see
        :meth:`context_for`)."""
        if not isinstance(candidates, list) or not candidates:
            raise RequestError("candidates must be a non-empty list of item ids", "candidates")
        if len(candidates) > self.max_records:
            raise RequestError(f"{len(candidates)} candidates exceed the limit of "
                               f"{self.max_records}", "candidates")
        if not isinstance(context, dict):
            raise RequestError("context must be an object of raw features", "context")
        if item_key not in self.known(store):
            raise ConflictError(f"{self.name} has no feature {item_key!r} to put candidates "
                               f"in; its raw features are {self.columns} (the serve config's "
                               "item_key names the column: sampan serve BUNDLE --set "
                               "item_key=COLUMN)", "candidates")
        if item_key in context:
            raise RequestError(f"{item_key!r} comes from candidates, not from context",
                               item_key)
        unread = [k for k in context if k not in self.known(store)]
        context = self.context_for(context, store)
        n = len(candidates)
        cols: dict[str, pa.Array] = {item_key: _records_table(
            [{item_key: c} for c in candidates], ColumnRoles(categorical=[item_key]),
            "candidates").column(item_key).combine_chunks()}
        if context:
            one = _records_table([context], self._roles_of(context), "context")
            zeros = pa.array(np.zeros(n, np.int64))
            for c in context:
                cols[c] = pc.take(one.column(c).combine_chunks(), zeros)
        return self._validated(self._complete(cols, store, unread=unread))


def check_objects(items: Any, what: str, limit: int) -> None:
    """A request's list of ``what`` (records, events): a non-empty list of at most
    ``limit`` JSON objects, else a :class:`RequestError` naming the one that is not."""
    field = f"{what}s"
    if not isinstance(items, list) or not items:
        raise RequestError(f"{field} must be a non-empty list of objects", field)
    if len(items) > limit:
        raise RequestError(f"{len(items)} {field} exceed the limit of {limit} per request",
                           field)
    for i, r in enumerate(items):
        if not isinstance(r, dict):
            raise RequestError(f"{what} {i} is {type(r).__name__}, expected an object",
                               field, i)


def _records_table(records: list[dict[str, Any]], roles: ColumnRoles, where: str
                   ) -> pa.Table:
    """:func:`records_table` of request values: an array or object where one value is
    expected, or a string that is not valid Unicode, is a :class:`RequestError` naming the
    feature (``where`` says which part of the request: records, context, candidates)."""
    try:
        return records_table(records, roles, scalars=True)
    except CellError as e:
        if where == "records":
            raise RequestError(str(e), e.column, e.record) from None
        if where == "candidates":
            raise RequestError(f"candidate {e.record} {e.problem}", "candidates",
                               e.record) from None
        raise RequestError(f"context feature {e.column!r} {e.problem}", e.column) from None


def top_k(candidates: list[Any], scores: np.ndarray, k: int) -> list[tuple[Any, float]]:
    """``(candidate, score)`` of the ``k`` highest scores, best first (stable on ties)."""
    order = np.argsort(-scores, kind="stable")[:max(k, 0)]
    return [(candidates[i], float(scores[i])) for i in order]
