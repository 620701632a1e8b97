"""The ``features`` section: labels, categorical, numeric and list features, and the
package's feature defaults."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sampan.config.base import _Strict
from sampan.config.messages import nearest_key


# ------------------------------------------------------------------------------- features
class DynamicAdmit(_Strict):
    """When a new key gets a row: after ``min_count`` sightings, then with ``probability``."""

    min_count: int = Field(1, ge=1, description="sightings before a key gets a row (counted "
                           "in a sketch of 8 to 16 counters a row of capacity, 64 KB to 16 "
                           "MB, halved whenever a quarter of it is in use: in a stream of "
                           "ever new keys old counts fade); a run over a file counts its "
                           "first pass over the training rows only, not later epochs")
    probability: float = Field(1.0, gt=0.0, le=1.0, description="chance a key that passed "
                               "min_count gets its row at a sighting")


class DynamicEvict(_Strict):
    """Which rows give way when the table is full."""

    policy: Literal["lfu", "lru", "ttl"] = Field(
        "lfu", description="lfu: the fewest uses (then the least recent); lru: the least "
        "recently seen; ttl: as lru, and rows unseen for ttl_steps are freed even when the "
        "table is not full")
    ttl_steps: int | None = Field(None, ge=1, description="ttl: training steps a row may go "
                                  "unseen")
    fraction: float = Field(0.01, gt=0.0, le=0.5, description="share of the capacity freed "
                            "at a time when the table is full")

    @model_validator(mode="after")
    def _ttl_needs_steps(self) -> DynamicEvict:
        if self.policy == "ttl" and self.ttl_steps is None:
            raise ValueError("evict.policy ttl needs evict.ttl_steps")
        if self.policy != "ttl" and self.ttl_steps is not None:
            raise ValueError(f"evict.ttl_steps {self.ttl_steps} is read only with policy ttl "
                             f"(the policy is {self.policy}): set policy: ttl, or drop "
                             "ttl_steps")
        return self


class DynamicTable(_Strict):
    """A dynamic embedding table: no vocabulary is fitted; each value becomes a stable 64-bit
    key, and a key gets a row of its own among ``capacity`` when it is admitted, losing it
    to eviction when the table is full. Keys without a row share one default row."""

    capacity: int = Field(..., ge=1, description="rows for keys (plus one default row)")
    admit: DynamicAdmit = Field(default_factory=DynamicAdmit, description="when a new key "
                                "gets a row: {min_count, probability}")
    evict: DynamicEvict = Field(default_factory=DynamicEvict, description="which rows give "
                                "way when the table is full: {policy, ttl_steps, fraction}")


class CategoricalFeature(_Strict):
    """A categorical column mapped to ids of the fused embedding table.

    Ids: 0 is reserved (padding), 1 is the shared OOV id, vocabulary ids follow. Values seen
    fewer than ``min_count`` times in the train split, or beyond ``max_size``, are OOV. With
    ``hash_buckets > 0`` OOV values are spread over that many buckets by a stable hash instead
    of sharing one id; with ``vocab: false`` every value is hashed. With ``dynamic`` nothing
    is fitted: the table admits and evicts values while it trains (see :class:`DynamicTable`).
    """

    name: str = Field(description="the feature's name, unique among all features")
    column: str | None = Field(None, description="the column it is read from (default: name)")
    min_count: int = Field(1, ge=1, description="values seen fewer times in the train split "
                           "are OOV (features.categorical_defaults sets 3)")
    max_size: int | None = Field(None, gt=0, description="the most frequent values kept in "
                                 "the vocabulary, the rest OOV; null: no limit")
    hash_buckets: int = Field(0, ge=0, description="OOV values are spread over this many ids "
                              "by a stable hash instead of sharing id 1 (with vocab: false or "
                              "cross, every value); 0: one OOV id")
    vocab: bool = Field(True, description="false: no vocabulary is fitted, every value is "
                        "hashed into hash_buckets ids (needs hash_buckets > 0)")
    bucketize: Literal["none", "log_squared", "quantile"] = Field(
        "none", description="for a numeric column used as a category: log_squared maps x > 2 "
        "to floor(ln(x)^2) (the Criteo winners' discretisation); quantile cuts at `buckets` "
        "quantiles fitted on the train split")
    buckets: int = Field(10, ge=2, description="number of quantile buckets")
    cross: list[str] | None = Field(
        None, description="columns whose values are crossed: the feature is a stable hash of "
        "the joined values into hash_buckets ids")
    dynamic: DynamicTable | None = Field(
        None, description="a dynamic table instead of a fitted vocabulary: {capacity: N, "
        "admit: {min_count, probability}, evict: {policy, ttl_steps, fraction}}")
    time: Literal["hour", "weekday", "day_of_month", "month"] | None = Field(
        None, description="a category from a timestamp column (epoch seconds or ISO 8601): "
        "its hour (0-23), weekday (0 Monday - 6), day of the month or month, in timezone")
    timezone: str = Field("UTC", description="with time: the IANA timezone the hour / day "
                          "is read in (Asia/Shanghai, Europe/Berlin, ...); also the zone of "
                          "ISO times written without an offset")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, v: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(v)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            near = difflib.get_close_matches(v, sorted(zoneinfo.available_timezones()), n=1)
            raise ValueError(f"timezone {v!r} is not an IANA timezone name"
                             + (f"; did you mean {near[0]!r}?" if near else
                                " (e.g. UTC, Asia/Shanghai, America/New_York)")) from None
        return v

    @model_validator(mode="after")
    def _hash_or_vocab(self) -> CategoricalFeature:
        if self.time is not None and (self.bucketize != "none" or self.cross is not None):
            raise ValueError(f"feature {self.name!r}: time cannot be combined with "
                             "bucketize or cross")
        if self.dynamic is not None:
            fitted = [k for k, off in (("min_count", self.min_count == 1),
                                       ("max_size", self.max_size is None),
                                       ("hash_buckets", self.hash_buckets == 0),
                                       ("vocab", self.vocab), ("cross", self.cross is None),
                                       ("bucketize", self.bucketize == "none")) if not off]
            if fitted:
                hint = " (the admission count is dynamic.admit.min_count)" \
                    if "min_count" in fitted else ""
                raise ValueError(f"feature {self.name!r}: dynamic tables fit no vocabulary, "
                                 f"so {', '.join(fitted)} cannot be set with dynamic{hint}")
        if self.cross is not None:
            if len(self.cross) < 2:
                raise ValueError(f"feature {self.name!r}: cross needs two or more columns")
            if self.hash_buckets <= 0:
                raise ValueError(f"feature {self.name!r}: cross needs hash_buckets > 0")
            self.vocab = False
        if not self.vocab and self.hash_buckets <= 0:
            raise ValueError(f"feature {self.name!r}: vocab: false needs hash_buckets > 0")
        return self


class ListFeature(_Strict):
    """A column holding several values per row: a delimited string (``"a|b|c"``) or a list.

    * ``sequence``: behaviour history, most recent last; keeps the last ``max_len`` values,
      left-padded with 0. Models attend over it (DIN, DIEN, BST).
    * ``bag``: an unordered set (genres, tags), pooled by ``pooling`` into one field.
    * ``text``: a bag of tokens from free text (``tokenizer``: ``latin`` splits on whitespace
      and punctuation, lower-cased; ``jieba`` segments Chinese, needs ``pip install jieba``).

    With ``share: <categorical feature>`` the values are ids of that feature's vocabulary and
    embedding rows (e.g. ``hist_item_id`` shares ``item_id``); otherwise the feature has its
    own vocabulary fitted with ``min_count`` / ``max_size`` / ``hash_buckets``, or, with
    ``dynamic``, its own dynamic table (see :class:`DynamicTable`).
    """

    name: str = Field(description="the feature's name, unique among all features")
    column: str | None = Field(None, description="the column it is read from (default: name)")
    flags: list[str] | None = Field(
        None, description="0/1 columns read as one bag: the names of the columns set to 1 "
        "(MovieLens-100k's genre flags)")
    kind: Literal["sequence", "bag", "text"] = Field(
        "sequence", description="sequence: a behaviour history, most recent last; bag: an "
        "unordered set pooled into one field; text: free text tokenised into a bag")
    delimiter: str = Field(",", description="what separates the values of a string column "
                           "(sequence, bag; a list column needs none)")
    max_len: int = Field(50, ge=1, description="values kept per row (the last max_len, or "
                         "the first with keep: first), left-padded with 0")
    keep: Literal["last", "first"] = Field(
        "last", description="which max_len values a longer row keeps: the last (the most "
        "recent of a sequence) or, for a bag, the first (PaddleRec's ESMM reader)")
    share: str | None = Field(None, description="a categorical feature whose vocabulary and "
                              "embedding rows the values use (e.g. item_id); null: a "
                              "vocabulary of its own")
    pooling: Literal["sum", "mean"] = Field("mean", description="bag, text: how the values' "
                                            "embeddings are pooled into one field")
    tokenizer: Literal["latin", "jieba"] = Field(
        "latin", description="text: latin lower-cases and splits on anything but letters, "
        "digits and _; jieba segments Chinese (pip install jieba)")
    min_count: int = Field(1, ge=1, description="without share: values seen fewer times in "
                           "the train split are OOV")
    max_size: int | None = Field(None, gt=0, description="without share: the most frequent "
                                 "values kept in the vocabulary, the rest OOV; null: no limit")
    hash_buckets: int = Field(0, ge=0, description="without share: OOV values are spread over "
                              "this many ids by a stable hash; 0: one OOV id")
    dynamic: DynamicTable | None = Field(
        None, description="its own dynamic table instead of a fitted vocabulary (not with "
        "share, which reads the shared feature's table)")

    @model_validator(mode="after")
    def _check(self) -> ListFeature:
        if self.dynamic is not None and self.share:
            raise ValueError(f"feature {self.name!r}: share reads {self.share!r}'s table; "
                             "dynamic gives the list a table of its own: choose one (make "
                             f"{self.share!r} dynamic to share a dynamic table)")
        if self.kind == "text" and self.share:
            raise ValueError(f"feature {self.name!r}: a text feature has its own vocabulary; "
                             "remove share")
        if not self.delimiter:
            raise ValueError(f"feature {self.name!r}: delimiter must not be empty")
        if self.keep == "first" and self.kind != "bag":
            raise ValueError(f"feature {self.name!r}: keep: first is for bags; a {self.kind} "
                             "keeps its last max_len values")
        return self

    def as_categorical(self) -> CategoricalFeature:
        """The vocabulary settings of a list feature with its own vocabulary."""
        return CategoricalFeature(name=self.name, column=self.column, min_count=self.min_count,
                                  max_size=self.max_size, hash_buckets=self.hash_buckets,
                                  dynamic=self.dynamic)


class NumericFeature(_Strict):
    """A numeric column: fill missing -> clip -> signed log1p -> standardize (in that order)."""

    name: str = Field(description="the feature's name, unique among all features")
    column: str | None = Field(None, description="the column it is read from (default: name)")
    fill: float | Literal["mean"] = Field(
        0.0, description="what a missing value becomes: a number, or mean: the value at the "
        "mean of the train values after clip and log1p (0 once standardized)")
    clip: tuple[float | None, float | None] | None = Field(
        None, description="[low, high] bounds applied after fill, a null end unbounded (e.g. "
        "[0, null]); null: no clipping")
    log1p: bool = Field(False, description="signed log1p: tames heavy-tailed counts; "
                        "monotone, so it loses little for other numbers")
    standardize: bool = Field(False, description="(x - mean) / std of the train split")
    buckets: int = Field(0, ge=0, description="the column also enters as a categorical "
                         "feature <name>_bucket cut at this many train quantiles, missing "
                         "values an id of their own: lets every model learn a non-linear "
                         "effect and what a missing value means; 0: numeric only")


class LabelSpec(_Strict):
    """A label read from ``column`` (default: ``name``); with ``threshold`` it becomes
    ``value >= threshold`` (so one rating column can give both "liked" and "loved")."""

    name: str = Field(description="the label's name (the column read unless column is given)")
    column: str | None = Field(None, description="the column it is read from (default: name)")
    threshold: float | None = Field(None, description="the label is value >= threshold (1 or "
                                    "0); null: the column's values, which must be in [0, 1]")


# What every categorical / numeric entry gets unless it says otherwise: the package's
# defaults, documented in the README. `features.categorical_defaults` / `numeric_defaults`
# add to them (a key given there wins), and a feature's own keys win over both. A spec built
# directly in Python (CategoricalFeature(name=...)) is neutral: min_count 1, no transforms.
PACKAGE_FEATURE_DEFAULTS: dict[str, dict[str, Any]] = {
    # every id seen in training gets its row: the exact LR of the warm start shrinks a rare
    # id's weight by its evidence, as a tuned LR with a column per value does
    "categorical": {"min_count": 1},
    # counts are heavy-tailed: signed log1p, then standardize; a missing value enters at
    # the mean (0), and the quantile-bucket twin carries non-linear effects and what a
    # missing value means
    "numeric": {"fill": "mean", "log1p": True, "standardize": True, "buckets": 16},
}


def _defaults_for(defaults: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """The defaults an entry takes: a dynamic table fits no vocabulary, so it takes none of
    the vocabulary's (min_count, max_size, hash_buckets, vocab)."""
    if item.get("dynamic") is None:
        return defaults
    return {k: v for k, v in defaults.items()
            if k not in ("min_count", "max_size", "hash_buckets", "vocab")}


class FeaturesConfig(_Strict):
    """Which columns are features and how they are encoded.

    Entries take :data:`PACKAGE_FEATURE_DEFAULTS`, then ``categorical_defaults`` /
    ``numeric_defaults``, then their own keys (plain column names take the first two only).
    """

    label: str | list[str | LabelSpec] = Field(
        "label", description="the label column, or a list of labels (names or {name, column, "
        "threshold}) for multi-task models")
    label_threshold: float | None = Field(
        None, description="binarise labels given by name: value >= threshold is 1 (e.g. "
        "rating >= 4)")
    group: str | None = Field(None, description="the column rows are grouped by (e.g. the "
                              "user id) for GAUC and per-group ranking metrics; null: none")
    categorical_defaults: dict[str, Any] = Field(
        default_factory=lambda: dict(PACKAGE_FEATURE_DEFAULTS["categorical"]),
        description="keys every categorical entry takes unless it gives its own; added to "
        "the package's {min_count: 1}")
    numeric_defaults: dict[str, Any] = Field(
        default_factory=lambda: dict(PACKAGE_FEATURE_DEFAULTS["numeric"]),
        description="keys every numeric entry takes unless it gives its own; added to the "
        "package's {fill: mean, log1p: true, standardize: true, buckets: 16}")
    categorical: list[CategoricalFeature] = Field(
        default_factory=list, description="categorical features: a column name or a mapping "
        "of options")
    numeric: list[NumericFeature] = Field(
        default_factory=list, description="numeric features: a column name or a mapping of "
        "options; each also enters as a category <name>_bucket unless buckets is 0")
    lists: list[ListFeature] = Field(default_factory=list, description="list features: "
                                     "behaviour sequences, bags and text")
    fit_rows: int | None = Field(
        None, gt=0, description="fit vocabularies and statistics on the first N rows of the "
        "train split only (a vocabulary fixed at launch); the model still trains on all of "
        "it. null: the whole train split")

    @model_validator(mode="before")
    @classmethod
    def _expand_shorthand(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        # a fitted pipeline's saved features are complete: nothing is added to them (an
        # older save keeps the defaults of its day)
        saved = bool(info.context and info.context.get("saved"))
        for kind, model in (("categorical", CategoricalFeature), ("numeric", NumericFeature)):
            given = data.get(f"{kind}_defaults") or {}
            if not isinstance(given, dict):
                continue  # reported by field validation
            defaults = given if saved else {**PACKAGE_FEATURE_DEFAULTS[kind], **given}
            data[f"{kind}_defaults"] = defaults
            for key in defaults:
                if key not in model.model_fields or key == "name":
                    near = nearest_key(key, list(model.model_fields))
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ValueError(f"features.{kind}_defaults: unknown key {key!r}{hint}")
            items = data.get(kind)
            if isinstance(items, list):
                data[kind] = [
                    {**defaults, "name": it} if isinstance(it, str)
                    else ({**_defaults_for(defaults, it), **it} if isinstance(it, dict) else it)
                    for it in items
                ]
        return data

    @model_validator(mode="after")
    def _bucket_twins(self) -> FeaturesConfig:
        # A numeric column with `buckets` also enters as a quantile-bucketed category, unless
        # a categorical feature of that name exists (a saved config has it already) or the
        # column is bucketized as a category already.
        names = {f.name for f in self.categorical}
        binned = {f.column or f.name for f in self.categorical if f.bucketize != "none"}
        for f in self.numeric:
            col = f.column or f.name
            if f.buckets and f"{f.name}_bucket" not in names and col not in binned:
                self.categorical.append(CategoricalFeature(
                    name=f"{f.name}_bucket", column=col, bucketize="quantile",
                    buckets=f.buckets))
                binned.add(col)
        return self

    @model_validator(mode="after")
    def _unique(self) -> FeaturesConfig:
        names = [f.name for f in self.categorical] + [f.name for f in self.numeric] \
            + [f.name for f in self.lists]
        cats = {f.name: f for f in self.categorical}
        for f in self.lists:
            if f.share and f.share not in cats:
                raise ValueError(f"features.lists: {f.name!r} shares {f.share!r}, which is not "
                                 f"a categorical feature; known: {sorted(cats)}")
            if f.share and (cats[f.share].cross or cats[f.share].bucketize != "none"):
                raise ValueError(f"features.lists: {f.name!r} cannot share {f.share!r}, a "
                                 "crossed or bucketized feature has no vocabulary of values")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"feature names must be unique; repeated: {', '.join(dup)}")
        if not names:
            raise ValueError("features: declare at least one categorical, numeric or list "
                             "feature")
        return self

    @property
    def label_specs(self) -> list[LabelSpec]:
        items = [self.label] if isinstance(self.label, str) else list(self.label)
        return [LabelSpec(name=x, threshold=self.label_threshold) if isinstance(x, str) else x
                for x in items]

    @property
    def labels(self) -> list[str]:
        """The label names, in the column order of ``Batch.labels``."""
        return [s.name for s in self.label_specs]
