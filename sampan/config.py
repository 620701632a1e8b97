"""Experiment configuration: YAML -> strict pydantic models.

Precedence, lowest to highest: package defaults (the field defaults below) < preset
(``preset: criteo``) < config file < ``--set key=value`` overrides. Unknown keys fail at load
time with the nearest valid key; wrong types name the expected type. The resolved config is
what :func:`dump_config` writes into every run directory and checkpoint.

Example::

    >>> cfg = load_config(None, overrides=["train.epochs=1"])   # the built-in default
    >>> cfg.model.name, cfg.train.epochs
    ('deepfm', 1)
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sampan.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


# ----------------------------------------------------------------------------------- data
class SplitConfig(_Strict):
    """How rows of ``data.train`` are divided when no separate valid/test files are given.

    ``sequential`` keeps file order (first ``train`` fraction, then ``valid``, then ``test``);
    ``random`` assigns each row independently with ``seed``.
    """

    method: Literal["sequential", "random", "time", "group"] = "sequential"
    train: float = Field(0.8, ge=0.0, le=1.0)
    valid: float = Field(0.1, ge=0.0, le=1.0)
    test: float = Field(0.1, ge=0.0, le=1.0)
    seed: int = 0
    column: str | None = Field(None, description="time: the timestamp column; group: the "
                               "column whose values never straddle two splits (e.g. user)")
    boundaries: tuple[float, float] | None = Field(
        None, description="time: explicit [valid_from, test_from] timestamps instead of "
        "fractions of the time range")

    @model_validator(mode="after")
    def _needs_column(self) -> SplitConfig:
        if self.method in ("time", "group") and not self.column:
            raise ValueError(f"split.method {self.method!r} needs split.column")
        if self.boundaries is not None and not self.boundaries[0] <= self.boundaries[1]:
            raise ValueError(f"split.boundaries must be increasing, got {list(self.boundaries)}")
        return self

    def check_fractions(self, own_files: list[str]) -> None:
        """The fractions of the roles carved from ``data.train`` must add up to 1; those of
        roles with their own files (``own_files``) are ignored and the rest renormalised."""
        if self.train <= 0:
            raise ConfigError("split.train must be > 0")
        if own_files:
            return
        total = self.train + self.valid + self.test
        if abs(total - 1.0) > 1e-6:
            raise ConfigError(
                f"split fractions train+valid+test must add up to 1.0, got {total:g} "
                f"({self.train:g}+{self.valid:g}+{self.test:g})"
            )


class SyntheticConfig(_Strict):
    """The built-in Criteo-shaped generator with a known labelling model (see data/synthetic.py)."""

    rows: int = Field(200_000, gt=0)
    seed: int = 2024
    zipf_a: float = Field(1.2, gt=1.0)
    missing_rate: float = Field(0.1, ge=0.0, lt=1.0)


class JoinConfig(_Strict):
    """A side table (user or item attributes) joined to every row on a key column.

    The table is read whole (side tables are small), keys must be unique, and rows without a
    match get missing values. Parsing options mean what they mean under ``data``.
    """

    path: str
    by: str = Field(description="key column of the main data (the side table key defaults to it)")
    key: str | None = Field(None, description="key column in the side table (default: by)")
    format: Literal["auto", "csv", "tsv", "parquet"] = "auto"
    delimiter: str | None = None
    header: bool = True
    columns: list[str] | None = None
    encoding: str = "utf-8"


class DataConfig(_Strict):
    """Where the raw rows come from and how to parse them."""

    train: str | list[str] | None = None
    valid: str | list[str] | None = None
    test: str | list[str] | None = None
    format: Literal["auto", "csv", "tsv", "parquet", "jsonl", "libsvm", "slot",
                    "synthetic"] = "auto"
    delimiter: str | None = None
    header: bool = True
    columns: list[str] | None = None
    encoding: str = "utf-8"
    block_size: int = Field(16 << 20, gt=0, le=1 << 30,
                            description="bytes parsed per chunk; also the longest line "
                            "read (a longer one is rejected as line_too_long)")
    split: SplitConfig = SplitConfig()
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    synthetic: SyntheticConfig = SyntheticConfig()
    oracle_column: str | None = None
    joins: list[JoinConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _has_source(self) -> DataConfig:
        if self.format != "synthetic" and not self.train:
            raise ValueError("data.train is required (a file path, a list of paths, or use "
                             "format: synthetic for the built-in generator)")
        if self.delimiter is not None and len(self.delimiter) != 1:
            raise ValueError(f"data.delimiter must be one character, got {self.delimiter!r}")
        self.split.check_fractions([r for r in ("valid", "test") if getattr(self, r)])
        return self


# ------------------------------------------------------------------------------- features
class CategoricalFeature(_Strict):
    """A categorical column mapped to ids of the fused embedding table.

    Ids: 0 is reserved (padding), 1 is the shared OOV id, vocabulary ids follow. Values seen
    fewer than ``min_count`` times in the train split, or beyond ``max_size``, are OOV. With
    ``hash_buckets > 0`` OOV values are spread over that many buckets by a stable hash instead
    of sharing one id; with ``vocab: false`` every value is hashed.
    """

    name: str
    column: str | None = None
    min_count: int = Field(1, ge=1, description="values seen fewer times in the train split "
                           "are OOV (features.categorical_defaults sets 3)")
    max_size: int | None = Field(None, gt=0)
    hash_buckets: int = Field(0, ge=0)
    vocab: bool = True
    bucketize: Literal["none", "log_squared", "quantile"] = Field(
        "none", description="for a numeric column used as a category: log_squared maps x > 2 "
        "to floor(ln(x)^2) (the Criteo winners' discretisation); quantile cuts at `buckets` "
        "quantiles fitted on the train split")
    buckets: int = Field(10, ge=2, description="number of quantile buckets")
    cross: list[str] | None = Field(
        None, description="columns whose values are crossed: the feature is a stable hash of "
        "the joined values into hash_buckets ids")

    @model_validator(mode="after")
    def _hash_or_vocab(self) -> CategoricalFeature:
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
    own vocabulary fitted with ``min_count`` / ``max_size`` / ``hash_buckets``.
    """

    name: str
    column: str | None = None
    flags: list[str] | None = Field(
        None, description="0/1 columns read as one bag: the names of the columns set to 1 "
        "(MovieLens-100k's genre flags)")
    kind: Literal["sequence", "bag", "text"] = "sequence"
    delimiter: str = ","
    max_len: int = Field(50, ge=1)
    share: str | None = None
    pooling: Literal["sum", "mean"] = "mean"
    tokenizer: Literal["latin", "jieba"] = "latin"
    min_count: int = Field(1, ge=1)
    max_size: int | None = Field(None, gt=0)
    hash_buckets: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ListFeature:
        if self.kind == "text" and self.share:
            raise ValueError(f"feature {self.name!r}: a text feature has its own vocabulary; "
                             "remove share")
        if not self.delimiter:
            raise ValueError(f"feature {self.name!r}: delimiter must not be empty")
        return self

    def as_categorical(self) -> CategoricalFeature:
        """The vocabulary settings of a list feature with its own vocabulary."""
        return CategoricalFeature(name=self.name, column=self.column, min_count=self.min_count,
                                  max_size=self.max_size, hash_buckets=self.hash_buckets)


class NumericFeature(_Strict):
    """A numeric column: fill missing -> clip -> signed log1p -> standardize (in that order)."""

    name: str
    column: str | None = None
    fill: float | Literal["mean"] = 0.0
    clip: tuple[float | None, float | None] | None = None
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

    name: str
    column: str | None = None
    threshold: float | None = None


# What every categorical / numeric entry gets unless it says otherwise: the package's
# defaults, documented in the README. `features.categorical_defaults` / `numeric_defaults`
# add to them (a key given there wins), and a feature's own keys win over both. A spec built
# directly in Python (CategoricalFeature(name=...)) is neutral: min_count 1, no transforms.
PACKAGE_FEATURE_DEFAULTS: dict[str, dict[str, Any]] = {
    # rare ids get no row of their own to overfit: they share the OOV row
    "categorical": {"min_count": 3},
    # counts are heavy-tailed: signed log1p, then standardize; the quantile-bucket twin
    # carries non-linear effects and what a missing value means
    "numeric": {"fill": 0.0, "log1p": True, "standardize": True, "buckets": 16},
}


class FeaturesConfig(_Strict):
    """Which columns are features and how they are encoded.

    Entries take :data:`PACKAGE_FEATURE_DEFAULTS`, then ``categorical_defaults`` /
    ``numeric_defaults``, then their own keys (plain column names take the first two only).
    """

    label: str | list[str | LabelSpec] = "label"
    label_threshold: float | None = Field(
        None, description="binarise labels given by name: value >= threshold is 1 (e.g. "
        "rating >= 4)")
    group: str | None = None
    categorical_defaults: dict[str, Any] = Field(
        default_factory=lambda: dict(PACKAGE_FEATURE_DEFAULTS["categorical"]))
    numeric_defaults: dict[str, Any] = Field(
        default_factory=lambda: dict(PACKAGE_FEATURE_DEFAULTS["numeric"]))
    categorical: list[CategoricalFeature] = Field(default_factory=list)
    numeric: list[NumericFeature] = Field(default_factory=list)
    lists: list[ListFeature] = Field(default_factory=list)

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
                    near = difflib.get_close_matches(key, list(model.model_fields), n=1)
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ValueError(f"features.{kind}_defaults: unknown key {key!r}{hint}")
            items = data.get(kind)
            if isinstance(items, list):
                data[kind] = [
                    {**defaults, "name": it} if isinstance(it, str)
                    else ({**defaults, **it} if isinstance(it, dict) else it)
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
        if not self.categorical:
            raise ValueError("features.categorical: declare at least one categorical feature "
                             "(every model embeds them; numbers can become categories with "
                             "bucketize, or numeric buckets > 0)")
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


# ---------------------------------------------------------------------------------- model
class ModelConfig(_Strict):
    """Options shared by every model; each model's nested ``Config`` adds its own."""

    name: str = "deepfm"
    embedding_dim: int = Field(16, gt=0)
    embedding_init_std: float = Field(1e-2, gt=0)


class MLPModelConfig(ModelConfig):
    """Options of models with an MLP over the fields."""

    mlp: list[PositiveInt] = Field(default_factory=lambda: [256, 128])
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    batch_norm: bool = False


# ---------------------------------------------------------------------------------- train
Auto = Literal["auto"]
PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]


class EarlyStoppingConfig(_Strict):
    metric: str | None = Field(
        None, description="validation metric to track: auc, logloss, gauc, or for retrieval "
        "recall@K, ndcg@K, hitrate@K, mrr (K = the model's k); default: auc (logloss when the "
        "validation split holds under 100 positives or negatives, where AUC is too noisy to "
        "steer by), or recall@K for retrieval models")
    patience: PosInt | Literal["auto"] = Field(
        "auto", description="evaluations without improvement before stop; auto: two epochs' "
        "worth (2 with one evaluation per epoch, 8 with four)")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str | None) -> str | None:
        if v is None or v in ("auc", "logloss", "gauc", "mrr") or re.fullmatch(
                r"(recall|ndcg|hitrate)@[1-9][0-9]*", v):
            return v
        raise ValueError(f"unknown metric {v!r}; expected auc, logloss, gauc, mrr, or "
                         "recall@K / ndcg@K / hitrate@K")
    min_delta: float = Field(1e-4, ge=0.0)
    enabled: bool = True


class TrainConfig(_Strict):
    """The training loop: optimisation, schedule, evaluation, checkpoints.

    ``auto`` values are sized from the training rows when training starts (see
    :func:`sampan.train.plan.plan_training`); the run prints what was chosen and why and
    writes it to ``schedule.json``. An explicit value always wins.
    """

    epochs: PosInt | Auto = Field("auto", description="auto: until validation stops improving "
                               "(early stopping), at most the epochs that give 30,000 steps "
                               "(3 to 30)")
    max_steps: int | None = Field(None, gt=0)
    batch_size: PosInt | Auto = Field("auto", description="auto: the power of two nearest "
                                   "sqrt(train rows), 64 to 4096")
    eval_batch_size: int = Field(16384, gt=0)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0.0)
    sparse_optimizer: Literal["adam", "adagrad", "rowwise_adagrad"] = "adam"
    sparse_lr: float | None = Field(None, gt=0, allow_inf_nan=False,
                                    description="defaults to lr")
    embedding_l2: NonNegFloat | Auto = Field(
        "auto", description="L2 on embedding rows used in a batch; auto: 0.1 / batch_size, "
        "the same regularisation per example at every batch size")
    schedule: Literal["constant", "cosine", "plateau"] = Field(
        "cosine", description="after linear warmup: constant, a half cosine to min_lr_ratio "
        "at the last step, or plateau: constant, halved at every evaluation that does not "
        "improve the early-stopping metric")
    warmup_steps: NonNegInt | Auto = Field("auto", description="auto: a tenth of an epoch, 10 to "
                                     "200 steps")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    clip_grad_norm: float | None = Field(None, gt=0)
    eval_every_steps: PosInt | Auto | None = Field(
        "auto", description="None: once per epoch; auto: once per epoch, or four times per "
        "epoch (at least 100 steps apart) when epochs are long")
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    on_divergence: Literal["recover", "stop"] = Field(
        "recover", description="a non-finite or exploding training loss, or a validation "
        "LogLoss far above the base rate's: recover restores the last good state and halves "
        "the learning rates (at most 3 times), stop ends the run with an error")
    init_output_bias: bool = Field(True, description="start the output bias at the training "
                                   "base rate's logit")
    first_order_warm_start: bool | Auto = Field(
        "auto", description="fit a logistic regression on the same rows first and start the "
        "model's first-order terms from it; auto: on for models with first-order terms and "
        "latent vectors (fm, deepfm, wide_deep, xdeepfm, fibinet, autoint) when there is a "
        "validation split")
    checkpoint_every_steps: int | None = Field(None, gt=0)
    shuffle: Literal["rows", "blocks", "none"] = "rows"
    amp: Literal["none", "bf16"] = "none"
    compile: bool = Field(False, description="torch.compile the dense layers (not the "
                          "embedding lookup); pays off on long runs")
    kernels: Literal["auto", "mkl", "onednn"] = Field(
        "auto", description="CPU GEMM path of the linear layers: auto times MKL and oneDNN "
        "at each layer's shape on this machine (cached) and takes the faster; mkl or onednn "
        "forces one")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto | cpu | cuda | cuda:N")
    embedding_placement: Literal["auto", "replicated", "row_sharded"] = Field(
        "auto", description="distributed runs: replicate every fused table, shard each one's "
        "rows over the processes, or shard those of shard_min_bytes or more (auto)")
    shard_min_bytes: int = Field(256 << 20, ge=0, description="auto placement: tables this "
                                 "large (weights) are row-sharded")
    sync_batch_norm: bool = Field(True, description="distributed runs: batch norm "
                                  "statistics over the global batch (False: per process)")
    threads: int | None = Field(None, gt=0)
    prefetch: int = Field(2, ge=0)
    log_every_steps: int = Field(50, gt=0)
    tensorboard: bool = True
    progress: bool = True


# ----------------------------------------------------------------------------- experiment
class ExperimentConfig(_Strict):
    """One experiment: data -> features -> model -> training."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="the run folder's name under output_dir: letters, digits, "
                      ". _ - (no path)")
    seed: int = Field(42, ge=0, lt=2**32, description="0 to 2**32 - 1")
    output_dir: str = "runs"
    preset: Literal["criteo"] | None = None
    data: DataConfig = DataConfig(format="synthetic")
    features: FeaturesConfig
    # before `model`: fields validate in order, and the plugins register the user's models
    plugins: list[str] = Field(default_factory=list, description="Python files (my_models.py,"
                               " relative to the config file) or modules (my_pkg.rankers) "
                               "imported first: their @register_model classes can be named "
                               "in model.name")
    model: SerializeAsAny[ModelConfig] = ModelConfig()
    train: TrainConfig = TrainConfig()

    _notices: list[str] = PrivateAttr(default_factory=list)

    @property
    def notices(self) -> list[str]:
        """What loading changed that the user did not write (printed by every run)."""
        return self._notices

    @model_validator(mode="after")
    def _gauc_needs_group(self) -> ExperimentConfig:
        if self.train.early_stopping.metric == "gauc" and not self.features.group:
            raise ValueError("train.early_stopping.metric is 'gauc' but features.group is not "
                             "set (GAUC needs a group column, e.g. the user id)")
        return self

    @field_validator("plugins", mode="after")
    @classmethod
    def _load_plugins(cls, v: list[str]) -> list[str]:
        from sampan.models.plugins import load_all

        return load_all(v)

    @field_validator("model", mode="before")
    @classmethod
    def _model_options(cls, v: Any) -> Any:
        """The model section is validated against the named model's own options, however
        the config is built (YAML, ``load_config``, or ``model_validate`` from Python): a
        misspelt or foreign key is an error, never dropped."""
        from sampan.models.registry import UnknownModelError, get_model_class

        if isinstance(v, ModelConfig):
            if type(v) is not ModelConfig:
                return v  # already a model's own Config
            v = v.model_dump()
        if not isinstance(v, dict):
            return v  # pydantic reports the type
        name = v.get("name", "deepfm")
        if not isinstance(name, str):
            raise ValueError(f"name: expected a model name, got {name!r}")
        try:
            model_cls = get_model_class(name)
        except UnknownModelError as e:
            raise ValueError(str(e)) from None
        return model_cls.Config.model_validate(v)


# ---------------------------------------------------------------------------- presets
def _criteo_preset() -> dict[str, Any]:
    ints = [f"I{i}" for i in range(1, 14)]
    cats = [f"C{i}" for i in range(1, 27)]
    return {
        "data": {"format": "tsv", "header": False, "columns": ["label", *ints, *cats]},
        "features": {
            "label": "label",
            "numeric_defaults": {"fill": 0.0, "clip": [0.0, None], "log1p": True,
                                 "standardize": True},
            "numeric": ints,
            "categorical_defaults": {"min_count": 3},
            # The counts also enter as categories, discretised as floor(ln(x)^2): the
            # Criteo winners' trick, worth about +0.01 AUC on small data.
            "categorical": cats + [{"name": f"{c}_bin", "column": c, "bucketize": "log_squared"}
                                   for c in ints],
        },
    }


PRESETS: dict[str, typing.Callable[[], dict[str, Any]]] = {"criteo": _criteo_preset}


# ---------------------------------------------------------------------------- loading
def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Merge ``over`` into a copy of ``base``: dicts merge recursively, other values replace."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML.

    List elements are addressed by index: ``features.categorical.0.min_count=5``.
    """
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML ({e})") from None
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            idx = _list_index(part, node, where)
            if isinstance(node[idx], str):  # shorthand feature entry "C1" -> {"name": "C1"}
                node[idx] = {"name": node[idx]}
            node = node[idx]
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[:i])!r} is not a mapping")
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(last, node, key)] = value
    else:
        node[last] = value


def _list_index(part: str, node: list[Any], where: str) -> int:
    if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
        raise ConfigError(f"--set {where}: {part!r} is not an index of a list of {len(node)}")
    return int(part)


def builtin_config_path(name: str = "default") -> Path:
    """Path of a config shipped inside the package (``sampan train`` uses ``default``)."""
    return Path(str(resources.files("sampan") / "configs" / f"{name}.yaml"))


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    raw: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """Load, merge and validate a config.

    ``path=None`` (and no ``raw``) loads the built-in default experiment (DeepFM on the
    synthetic Criteo-shaped data). Raises :class:`ConfigError` listing every problem.
    """
    base = None  # where relative plugin paths start: the config file's folder, else cwd
    if raw is None:
        file = Path(path) if path is not None else builtin_config_path()
        base = file.resolve().parent
        if not file.exists():
            raise ConfigError(f"config file {str(file)!r} does not exist")
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: top level must be a mapping, got {type(raw).__name__}")
    # The preset may itself be set by an override, so find it first; then merge preset < file
    # and apply the overrides last (they may address list items the preset created).
    probe = copy.deepcopy(raw)
    for item in overrides or []:
        apply_override(probe, item)
    preset = probe.get("preset")
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
        raw = deep_merge(PRESETS[preset](), raw)
    file_model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    file_model_name = file_model.get("name", "deepfm")
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        apply_override(raw, item)

    from sampan.models.registry import UnknownModelError, get_model_class

    # the user's own models first (they may be what model.name names), then the model
    # section, against the named model's own options (so a misspelt key gets that model's
    # nearest key), then everything else with it in place
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError(f"plugins: expected a list of .py files or module names, got "
                          f"{plugins!r}")
    from sampan.models.plugins import load_all

    raw["plugins"] = load_all(plugins, base=base)
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise ConfigError(f"model: expected a mapping, got {type(model_raw).__name__}")
    name = model_raw.get("name", "deepfm")
    if not isinstance(name, str):
        raise ConfigError(f"model.name: expected a model name (sampan models lists them), "
                          f"got {name!r}")
    try:
        model_cls = get_model_class(name)
    except UnknownModelError as e:
        raise ConfigError(f"model.name: {e}") from None
    notices = []
    if name != file_model_name and isinstance(file_model_name, str):
        # --set model.name=X on a config written for another model: options of the old
        # model that X lacks are dropped (with a notice); a key neither knows stays an error.
        try:
            old_fields = set(get_model_class(file_model_name).Config.model_fields)
        except UnknownModelError:
            old_fields = set()
        new_fields = set(model_cls.Config.model_fields)
        dropped = [k for k in model_raw if k in old_fields and k not in new_fields]
        if dropped:
            model_raw = {k: v for k, v in model_raw.items() if k not in dropped}
            notices.append(f"model.name is {name!r} (was {file_model_name!r} in the "
                           f"file): dropped the options {name!r} does not have: "
                           f"{', '.join(f'model.{k}' for k in dropped)}")
    try:
        raw["model"] = model_cls.Config.model_validate(model_raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model_cls.Config, prefix=("model",))) from None
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, ExperimentConfig)) from None
    cfg._notices = notices
    return cfg


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML (what runs and checkpoints record)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------- error messages
def format_validation_error(
    err: ValidationError, root: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> str:
    """Turn pydantic's errors into one line per problem, with the nearest valid key."""
    lines: list[str] = []
    # A value that fits no member of a union gets one error per member: one line for all.
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in err.errors():
        # union members appear in the location as tags ("literal['auto']", "constrained-int")
        raw_loc = tuple(e["loc"])
        keep_last = e["type"] == "extra_forbidden"  # the last part is the user's own key
        loc = tuple(x for i, x in enumerate(raw_loc) if not (
            isinstance(x, str) and ("[" in x or x.startswith("constrained-"))
            and not (keep_last and i == len(raw_loc) - 1)))
        if loc in merged and e["type"] not in ("extra_forbidden", "missing"):
            merged[loc]["msg"] += f", or {e['msg'][0].lower()}{e['msg'][1:]}"
            continue
        merged[loc] = {**e, "loc": loc}
    for e in merged.values():
        loc = e["loc"]
        where = _loc_str(prefix + loc)
        if e["type"] == "extra_forbidden":
            valid = _keys_at(root, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            parent = _loc_str(prefix + loc[:-1]) or "top level"
            lines.append(f"unknown key {loc[-1]!r} in {parent}: {hint}"
                         f"valid keys are: {', '.join(valid)}")
        elif e["type"] == "missing":
            lines.append(f"{where}: required key is missing")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{where or 'config'}: {e['msg']}{shown}")
    return "invalid config:\n  - " + "\n  - ".join(lines)


def _loc_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _keys_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the pydantic model reached by following ``loc`` from ``root``."""
    tp: Any = root
    for part in loc:
        tp = _unwrap(tp, want_item=isinstance(part, int))
        if isinstance(part, str) and isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part)
            if field is None:
                return []
            tp = field.annotation
    tp = _unwrap(tp, want_item=False)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _unwrap(tp: Any, want_item: bool) -> Any:
    """Strip Optional / Annotated / list[...] down to the model class inside."""
    for _ in range(6):
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            lists = [a for a in args if typing.get_origin(a) is list]
            tp = models[0] if models and not want_item else (lists[0] if lists else args[0])
        elif origin is list and want_item:
            tp = typing.get_args(tp)[0]
            want_item = False
        else:
            break
    return tp


# -------------------------------------------------------------------------------- serving
class FeatureStoreConfig(_Strict):
    """Where ``/v1/rank`` finds user and item features by key.

    ``tables`` default to the run's ``data.joins`` (the side tables it was trained with);
    with ``backend: redis`` they are loaded into Redis at ``url`` at start-up and read from
    there per request.
    """

    backend: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "sampan"
    tables: list[JoinConfig] | None = None


class ServeConfig(_Strict):
    """``sampan serve`` settings (CLI options override the file)."""

    bundle: str
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535)
    workers: int = Field(1, ge=1)
    max_batch_rows: int = Field(4096, gt=0, description="rows per model call")
    max_wait_ms: float = Field(2.0, ge=0.0, description="how long a model call waits for "
                               "more requests to join it")
    max_records: int = Field(10_000, gt=0, description="records or candidates per request")
    max_body_bytes: int = Field(8 << 20, gt=0)
    item_key: str = Field("item_id", description="the raw column /v1/rank fills with the "
                          "candidate ids")
    retrieval_bundle: str | None = Field(None, description="a two_tower bundle: enables "
                                         "/v1/recommend (ANN candidates, then ranking)")
    threads: int | None = Field(None, gt=0, description="ONNX Runtime intra-op threads")
    admin_token: str | None = Field(None, description="bearer token of /v1/admin/reload; "
                                    "the SAMPAN_ADMIN_TOKEN environment variable wins")
    feature_store: FeatureStoreConfig = FeatureStoreConfig()


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
