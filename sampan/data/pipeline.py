"""FeaturePipeline: raw typed columns -> the model's tensors. Used by training AND prediction.

``fit`` streams over the train split once (vocabularies and statistics); ``transform`` turns a
table into the arrays of the Batch contract. The fitted state is saved as ``pipeline.json``
plus one ``.npy`` per vocabulary, and loading it back gives byte-identical transforms.

Example::

    >>> from sampan.config import FeaturesConfig
    >>> fc = FeaturesConfig(categorical=["c"], numeric=["x"], categorical_defaults={
    ...     "min_count": 1}, numeric_defaults={"log1p": False, "standardize": False,
    ...     "buckets": 0})                    # the package defaults switched off
    >>> pipe = FeaturePipeline(fc)
    >>> _ = pipe.fit([pa.table({"label": [1.0, 0.0], "c": ["a", "b"], "x": [1.0, None]})])
    >>> out = pipe.transform(pa.table({"label": [1.0], "c": ["b"], "x": [3.0]}))
    >>> out["sparse"].tolist(), out["dense"].tolist(), out["labels"].tolist()
    ([[3]], [[3.0]], [[1.0]])
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import FeaturesConfig
from sampan.data.hashing import stable_hash
from sampan.data.lists import ListEncoder
from sampan.data.sources import ColumnRoles, DataError
from sampan.data.times import time_part
from sampan.data.transforms import CategoricalEncoder, NotFittedError, NumericEncoder
from sampan.schema import DataSchema, DynamicSpec, SequenceFeatureSpec, SparseFeatureSpec

PIPELINE_FILE = "pipeline.json"
FORMAT_VERSION = 1


class FeaturePipeline:
    """Ordered categorical and numeric encoders plus label / group extraction."""

    def __init__(self, features: FeaturesConfig, extra_numeric: list[str] | None = None,
                 extra_categorical: list[str] | None = None,
                 extra_required: list[str] | None = None):
        self.features = features
        self.categorical = [CategoricalEncoder(f) for f in features.categorical]
        self.numeric = [NumericEncoder(f) for f in features.numeric]
        by_name = {e.spec.name: e for e in self.categorical}
        self.lists = [ListEncoder(f, by_name[f.share] if f.share else None)
                      for f in features.lists]
        # Columns carried through untransformed (oracle, split keys).
        self.extra_numeric = list(extra_numeric or [])
        self.extra_categorical = list(extra_categorical or [])
        self.extra_required = list(extra_required or [])
        self.fitted_rows_ = 0
        self.is_fitted_ = False

    # -- which raw columns are needed
    def roles(self, with_labels: bool = True, with_extra: bool = True,
              with_group: bool = True) -> ColumnRoles:
        """Raw columns to read; ``with_extra=False`` leaves out pass-through columns such as
        the synthetic oracle, which new data does not have; ``with_group=False`` the
        ``features.group`` column unless a feature reads it."""
        specs = self.features.label_specs if with_labels else []
        labels = list(dict.fromkeys(s.column or s.name for s in specs))
        numeric = labels + [f.column or f.name for f in self.features.numeric]
        numeric += self.extra_numeric if with_extra else []
        # Categories binned from numbers are read (and validated) as numbers.
        numeric += [f.column or f.name for f in self.features.categorical
                    if f.bucketize != "none"]
        cats = [c for f in self.features.categorical if f.bucketize == "none"
                for c in (f.cross or [f.column or f.name])]
        if self.features.group and with_group:
            cats.append(self.features.group)
        cats += self.extra_categorical if with_extra else []
        required = labels + (self.extra_required if with_extra else [])
        numeric += [c for f in self.features.lists for c in (f.flags or [])]
        return ColumnRoles(numeric=numeric, categorical=cats, required=required,
                           lists=[f.column or f.name for f in self.features.lists
                                  if not f.flags],
                           # thresholded label columns may hold any number
                           labels=[c for c in labels if all(
                               (s.column or s.name) != c or s.threshold is None for s in specs)])

    @staticmethod
    def _input(table: pa.Table, spec: Any) -> pa.Array:
        """The raw column of a feature; for a crossed feature its columns joined by \\x1f;
        for a flags bag, the names of its 0/1 columns that are set."""
        if getattr(spec, "flags", None):
            on = np.stack([pc.fill_null(_col(table, c), 0.0).to_numpy(zero_copy_only=False) != 0
                           for c in spec.flags], axis=1)
            rows, cols = np.nonzero(on)
            offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=len(on)))])
            return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                            pa.array(spec.flags).take(pa.array(cols)))
        if getattr(spec, "cross", None):
            parts = [pc.fill_null(_col(table, c).cast(pa.string()), "") for c in spec.cross]
            return pc.binary_join_element_wise(*parts, "\x1f")
        if getattr(spec, "time", None):
            return time_part(_col(table, spec.column or spec.name), spec.time, spec.timezone)
        return _col(table, spec.column or spec.name)

    # -- fitting
    def partial_fit(self, table: pa.Table) -> None:
        list(_pool().map(lambda enc: enc.partial_fit(self._input(table, enc.spec)),
                         self.categorical))
        for enc in self.numeric:
            enc.partial_fit(_col(table, enc.spec.column or enc.spec.name))
        for lenc in self.lists:
            lenc.partial_fit(self._input(table, lenc.spec))
        self.fitted_rows_ += table.num_rows

    def reseed(self, part: int) -> None:
        """Give the samples of this part of a fit keys of its own (see :meth:`merge`)."""
        encoders = self.categorical + [e.vocab for e in self.lists if e.owns_vocab]
        for enc in encoders:
            if enc._sample is not None:
                enc._sample.reseed((0, part))

    def merge(self, other: FeaturePipeline) -> None:
        """Add the partial fit of ``other``, the same pipeline fitted on the rows after
        this one's: vocabularies, counts and moments come out as one fit over both would
        give them; quantile samples, as a uniform sample of both."""
        for mine, theirs in zip(self.categorical + self.numeric + self.lists,
                                other.categorical + other.numeric + other.lists, strict=True):
            mine.merge(theirs)
        self.fitted_rows_ += other.fitted_rows_

    def finalize(self) -> None:
        for enc in self.categorical:
            enc.finalize()
        for lenc in self.lists:  # after the categorical ones whose vocabulary they share
            lenc.finalize()
        for enc in self.numeric:
            enc.finalize()
        self.is_fitted_ = True

    def fit(self, tables: Iterable[pa.Table]) -> FeaturePipeline:
        for t in tables:
            self.partial_fit(t)
        self.finalize()
        return self

    def feature_report(self) -> list[dict[str, Any]]:
        """One entry per fitted feature: its kind, the settings that shaped it, its
        vocabulary size and the share of training values that fell out of the vocabulary
        (or its statistics, for numbers). Every run prints it and saves it in the data
        manifest."""
        rows = max(self.fitted_rows_, 1)
        out: list[dict[str, Any]] = []
        for e in self.categorical:
            sp = e.spec
            if sp.dynamic is not None:
                d = sp.dynamic
                how = (f"dynamic: keys to {d.capacity:,} rows, admitted at "
                       f"{d.admit.min_count} sighting(s), evicted by {d.evict.policy}")
            elif sp.cross:
                how = f"cross of {'+'.join(sp.cross)}, hashed into {sp.hash_buckets:,}"
            elif getattr(sp, "time", None):
                how = f"{sp.time} of {sp.column or sp.name} ({sp.timezone})"
            elif sp.bucketize != "none":
                how = f"{sp.buckets} quantile buckets" if sp.bucketize == "quantile" \
                    else f"bucketize {sp.bucketize}"
            elif not sp.vocab:
                how = f"hashed into {sp.hash_buckets:,}"
            else:
                how = f"vocab, min_count {sp.min_count}" + (
                    f", max_size {sp.max_size:,}" if sp.max_size else "") + (
                    f", OOV hashed into {sp.hash_buckets:,}" if sp.hash_buckets else "")
            vocab = sp.vocab and sp.bucketize == "none" and not sp.cross and not sp.dynamic
            out.append({"feature": sp.name, "kind": "categorical", "min_count": sp.min_count,
                        "transform": how, "ids": e.cardinality,
                        "oov_share": round(e.oov_count_ / rows, 4) if vocab else None})
        for e in self.numeric:
            sp = e.spec
            lo, hi = sp.clip if sp.clip else (None, None)
            clip = "" if not sp.clip else "clip to " + (
                f"[{lo:g}, {hi:g}]" if lo is not None and hi is not None else
                f">= {lo:g}" if lo is not None else f"<= {hi:g}")
            steps = [f"fill {sp.fill:g}" if sp.fill != "mean" else "fill mean", clip] \
                + (["log1p"] if sp.log1p else []) + (["standardize"] if sp.standardize else [])
            out.append({"feature": sp.name, "kind": "numeric",
                        "transform": ", ".join(x for x in steps if x),
                        "mean": e.mean_, "std": e.std_,
                        "missing_share": round(e.missing_rate_, 4)})
        for le in self.lists:
            sp = le.spec
            out.append({"feature": sp.name, "kind": sp.kind,
                        "transform": (f"ids of {sp.share}" if sp.share else
                                      f"own dynamic table of {sp.dynamic.capacity:,} rows"
                                      if sp.dynamic is not None else
                                      f"own vocabulary, min_count {sp.min_count}")
                        + f", max_len {sp.max_len}", "ids": le.cardinality,
                        "length_mean": round(le.lengths_["mean"], 2)})
        return out

    # -- transforming
    def prepare_lookups(self, rows: int = 1) -> None:
        """Build the vocabulary indexes that transforming ``rows`` rows at a time will use
        (a server calls this at start-up, so its first request does not pay for them)."""
        vocabs = [e for e in self.categorical if e.boundaries_ is None]
        vocabs += [e.vocab for e in self.lists if e.owns_vocab]
        for enc in vocabs:
            enc.index.prepare(rows)

    PARALLEL_ROWS = 4096  # tables at least this long encode their columns in threads

    def transform(self, table: pa.Table, with_labels: bool = True) -> dict[str, np.ndarray]:
        """Arrays for ``table``: ``dense [n, Nd] f32``, ``sparse [n, F] i64``,
        ``labels [n, T] f32`` (when ``with_labels``), ``group [n] i64`` (when configured),
        and each extra numeric column ``[n] f64`` by name."""
        if not self.is_fitted_:
            raise NotFittedError("FeaturePipeline.transform called before fit")
        n = table.num_rows
        out: dict[str, np.ndarray] = {}
        sparse = np.empty((n, len(self.categorical)), dtype=np.int64)

        def encode(j: int) -> None:
            sparse[:, j] = self.categorical[j].transform(
                self._input(table, self.categorical[j].spec))

        # Arrow kernels release the GIL: the columns of a chunk are encoded on all cores;
        # a request's few rows are encoded here (handing them to threads costs more)
        if n >= self.PARALLEL_ROWS:
            list(_pool().map(encode, range(len(self.categorical))))
        else:
            for j in range(len(self.categorical)):
                encode(j)
        dense = np.empty((n, len(self.numeric)), dtype=np.float32)
        for j, enc in enumerate(self.numeric):
            dense[:, j] = enc.transform(_col(table, enc.spec.column or enc.spec.name))
        out["sparse"], out["dense"] = sparse, dense
        if self.lists:
            out["sequences"] = {e.spec.name: e.transform(self._input(table, e.spec))
                                for e in self.lists}
        if with_labels:
            labels = np.empty((n, len(self.features.labels)), dtype=np.float32)
            for j, spec in enumerate(self.features.label_specs):
                name = spec.column or spec.name
                y = _col(table, name).to_numpy(zero_copy_only=False)
                if spec.threshold is not None:
                    y = (y >= spec.threshold).astype(np.float32)
                bad = ~((y >= 0) & (y <= 1))
                if bad.any():
                    raise DataError(f"label {name!r} must be in [0, 1]; found {float(y[bad][0]):g} "
                                    f"({int(bad.sum())} rows)")
                labels[:, j] = y
            out["labels"] = labels
        if self.features.group:
            out["group"] = stable_hash(_col(table, self.features.group)).view(np.int64)
        for name in self.extra_numeric:
            if name in table.column_names:
                out[name] = _col(table, name).to_numpy(zero_copy_only=False).astype(np.float64)
        return out

    def schema(self) -> DataSchema:
        return DataSchema(
            dense=[e.spec.name for e in self.numeric],
            sparse=[SparseFeatureSpec(e.spec.name, e.cardinality, dynamic_spec(e.spec),
                                      binned=e.spec.bucketize != "none")
                    for e in self.categorical],
            labels=self.features.labels,
            has_group=self.features.group is not None,
            sequences=[SequenceFeatureSpec(e.spec.name, e.spec.max_len, e.spec.share or e.spec.name,
                                           None if e.spec.kind == "sequence" else e.spec.pooling)
                       for e in self.lists],
            own_tables=[SparseFeatureSpec(e.spec.name, e.cardinality, dynamic_spec(e.spec))
                        for e in self.lists if e.owns_vocab],
        )

    # -- persistence
    def save(self, directory: str | Path) -> Path:
        if not self.is_fitted_:
            raise NotFittedError("cannot save an unfitted FeaturePipeline")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {
            "format_version": FORMAT_VERSION,
            "features": self.features.model_dump(mode="json"),
            "extra_numeric": self.extra_numeric,
            "fitted_rows": self.fitted_rows_,
            "categorical": [e.state(d) for e in self.categorical],
            "numeric": [e.state(d) for e in self.numeric],
            "lists": [e.state(d) for e in self.lists],
            "schema": self.schema().to_json(),
        }
        path = d / PIPELINE_FILE
        path.write_text(json.dumps(state, indent=1))
        return path

    def relabel(self, features: FeaturesConfig) -> str | None:
        """Read the labels from the columns ``features`` names (its ``label`` and
        ``label_threshold``), the features as fitted: a model trained on ratings can keep
        learning from a log whose label is a click. The labels keep their names (the
        model's outputs), so their number must stay. Returns what changed, for the run's
        header, or None."""
        from sampan.config import LabelSpec

        def read(s: LabelSpec) -> tuple[str, float | None]:
            return s.column or s.name, s.threshold

        old, new = self.features.label_specs, features.label_specs
        if [read(s) for s in old] == [read(s) for s in new]:
            return None
        if len(old) != len(new):
            from sampan.errors import ConfigError

            raise ConfigError(f"features.label: {len(new)} label(s) "
                              f"({', '.join(s.name for s in new)}), but the model was "
                              f"trained for {len(old)} ({', '.join(s.name for s in old)}); "
                              "expected as many")
        self.features = self.features.model_copy(update={"label_threshold": None, "label": [
            LabelSpec(name=o.name, column=read(n)[0], threshold=n.threshold)
            for o, n in zip(old, new, strict=True)]})

        def said(specs: list[LabelSpec]) -> str:
            return ", ".join(repr(read(s)[0]) + (f" >= {s.threshold:g}" if s.threshold
                                                  is not None else "") for s in specs)
        return f"labels read from {said(new)} (the run was trained on {said(old)})"

    @classmethod
    def load(cls, directory: str | Path) -> FeaturePipeline:
        d = Path(directory)
        state: dict[str, Any] = json.loads((d / PIPELINE_FILE).read_text())
        if state.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{d / PIPELINE_FILE}: format_version {state.get('format_version')} "
                             f"is not supported (expected {FORMAT_VERSION})")
        pipe = cls(FeaturesConfig.model_validate(state["features"], context={"saved": True}),
                   state["extra_numeric"])
        pipe.categorical = [CategoricalEncoder.from_state(s, d) for s in state["categorical"]]
        pipe.numeric = [NumericEncoder.from_state(s, d) for s in state["numeric"]]
        by_name = {e.spec.name: e for e in pipe.categorical}
        pipe.lists = [ListEncoder.from_state(s, d, by_name.get(s["spec"]["share"]))
                      for s in state.get("lists", [])]
        pipe.fitted_rows_ = state["fitted_rows"]
        pipe.is_fitted_ = True
        return pipe


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads for column-parallel encoding (one per core, shared by all pipelines)."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2,
                              thread_name_prefix="sampan-encode")


def _col(table: pa.Table, name: str) -> pa.Array:
    if name not in table.column_names:
        raise DataError(f"column {name!r} is missing; available: {table.column_names}")
    return table.column(name).combine_chunks()


def dynamic_spec(spec: Any) -> DynamicSpec | None:
    """The schema's description of a categorical feature's dynamic table, if it has one."""
    d = spec.dynamic
    if d is None:
        return None
    return DynamicSpec(d.capacity, d.admit.min_count, d.admit.probability, d.evict.policy,
                       d.evict.ttl_steps, d.evict.fraction)
