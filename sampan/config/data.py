"""The ``data`` section: files, format, splits, side tables."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sampan.config.base import _Strict
from sampan.errors import ConfigError


# ----------------------------------------------------------------------------------- data
class SplitConfig(_Strict):
    """How rows of ``data.train`` are divided when no separate valid/test files are given.

    ``sequential`` keeps file order (first ``train`` fraction, then ``valid``, then ``test``);
    ``random`` assigns each row independently with ``seed``.
    """

    method: Literal["sequential", "random", "time", "group", "leave_one_out"] = Field(
        "sequential", description="sequential: file order; random: a seeded hash of the row "
        "index; time: by the timestamps in column; group: by a hash of column; "
        "leave_one_out: each user's (column's) last row is test and the one before it "
        "valid, in the order of order (else file order); users with fewer than 3 rows "
        "train only (the fractions do not apply)")
    train: float = Field(0.8, ge=0.0, le=1.0, description="the share of data.train kept for "
                         "training (must be > 0)")
    valid: float = Field(0.1, ge=0.0, le=1.0, description="the share of data.train carved out "
                         "for validation (ignored when data.valid names its own files)")
    test: float = Field(0.1, ge=0.0, le=1.0, description="the share of data.train carved out "
                        "for testing (ignored when data.test names its own files)")
    seed: int = Field(0, description="seed of the hash that assigns rows (random) or groups "
                      "(group) to splits")
    column: str | None = Field(None, description="time: the timestamp column; group: the "
                               "column whose values never straddle two splits (e.g. user); "
                               "leave_one_out: the user column")
    order: str | None = Field(None, description="leave_one_out: the column that orders each "
                              "user's rows (a timestamp); null: file order")
    boundaries: tuple[float, float] | None = Field(
        None, description="time: explicit [valid_from, test_from] timestamps instead of "
        "fractions of the time range")

    @model_validator(mode="after")
    def _needs_column(self) -> SplitConfig:
        if self.method in ("time", "group", "leave_one_out") and not self.column:
            raise ValueError(f"split.method {self.method!r} needs split.column"
                             + (" (the user column)" if self.method == "leave_one_out" else ""))
        if self.order is not None and self.method != "leave_one_out":
            raise ValueError("split.order orders each user's rows for method leave_one_out; "
                             f"method {self.method!r} does not use it")
        if self.boundaries is not None and not self.boundaries[0] <= self.boundaries[1]:
            raise ValueError(f"split.boundaries must be increasing, got {list(self.boundaries)}")
        return self

    def check_fractions(self, own_files: list[str]) -> None:
        """The fractions of the roles carved from ``data.train`` must add up to 1; those of
        roles with their own files (``own_files``) are ignored and the rest renormalised."""
        if self.method == "leave_one_out":
            if own_files:
                raise ConfigError(f"split.method leave_one_out takes valid and test rows from "
                                  f"data.train; remove data.{' and data.'.join(own_files)}")
            return
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

    rows: int = Field(200_000, gt=0, description="number of rows generated")
    seed: int = Field(2024, description="seed of the labelling model and the rows (the same "
                      "config gives the same rows on every machine)")
    zipf_a: float = Field(1.2, gt=1.0, description="Zipf exponent of the categorical ids' "
                          "frequencies (larger: more rows go to the most popular ids)")
    missing_rate: float = Field(0.1, ge=0.0, lt=1.0, description="share of numeric values "
                                "left missing; categorical values go missing at half this rate")
    drift: float = Field(0.0, ge=0.0, le=20.0, description="0: the same distribution in every row. "
                         "d > 0: popularity moves as the rows go by: by the last row each "
                         "field's popular ids are d x its vocabulary further on, so ids "
                         "keep appearing that earlier rows never had (rows in time order, "
                         "with their position in column t, 0 to 1)")
    churn: float = Field(0.0, ge=0.0, le=20.0, description="0: the same ids throughout. c > 0: ids "
                         "come and go: the id at each popularity rank is replaced by a "
                         "never-seen one c times over the rows (spread over the ranks), as "
                         "new items take over from retired ones (rows in time order, with "
                         "their position in column t; combines with drift)")


class JoinConfig(_Strict):
    """A side table (user or item attributes) joined to every row on a key column.

    The table is read whole (side tables are small), keys must be unique, and rows without a
    match get missing values. Parsing options mean what they mean under ``data``.
    """

    path: str = Field(description="the side table's file, glob or directory")
    by: str = Field(description="key column of the main data (the side table key defaults to it)")
    key: str | None = Field(None, description="key column in the side table (default: by)")
    format: Literal["auto", "csv", "tsv", "parquet", "json_map"] = Field(
        "auto", description="the side table's format; auto: by file extension; json_map: "
        "one JSON object {key: value or [values]} (e.g. S3-Rec's item2attributes.json), "
        "its two columns named by columns (default: key and by's name + '_value')")
    delimiter: str | None = Field(None, description="what separates the fields, one or more "
                                  "characters (MovieLens-1M: '::'); default: tab for tsv, "
                                  "comma for csv")
    header: bool = Field(True, description="whether a csv / tsv side table starts with a "
                         "header line; false: names come from columns")
    columns: list[str] | None = Field(None, description="the side table's column names in file "
                                      "order (required when header: false)")
    encoding: str = Field("utf-8", description="the text encoding of a csv / tsv side table")


class DataConfig(_Strict):
    """Where the raw rows come from and how to parse them."""

    train: str | list[str] | None = Field(
        None, description="the training rows: a file, a glob, a directory, or a list of them; "
        "also as URIs read through pyarrow's filesystems (s3://bucket/logs/, "
        "hdfs://host/path/*.csv, file:///data/x.csv) (not needed with format: synthetic or "
        "a stream)")
    valid: str | list[str] | None = Field(
        None, description="the validation split's own files (as for train); null: carved "
        "from train by split")
    test: str | list[str] | None = Field(
        None, description="the test split's own files (as for train); null: carved from "
        "train by split")
    format: str = Field(
        "auto", description="how the files are read: auto (by file extension), csv, tsv, "
        "parquet, jsonl, libsvm, slot, synthetic (no files: rows from the built-in "
        "generator, see synthetic), or the name of a reader of your own (@register_reader "
        "in a file listed under plugins)")
    reader_options: dict[str, Any] = Field(default_factory=dict, description="passed as "
                                           "they are to a reader of your own (format: NAME)")
    delimiter: str | None = Field(None, description="what separates the fields, one or more "
                                  "characters (MovieLens-1M: '::'); default: tab for tsv, "
                                  "comma for csv; slot: what separates the tokens "
                                  "(default: whitespace)")
    header: bool = Field(True, description="whether csv / tsv files start with a header line; "
                         "false: names come from columns")
    columns: list[str] | None = Field(
        None, description="column names in file order: required when header is false, "
        "rename the header when it is true; libsvm: the label, then the features by "
        "position; slot: the values each line starts with, by position, before its "
        "slot:value tokens")
    encoding: str = Field("utf-8", description="the text encoding of csv / tsv files")
    block_size: int = Field(16 << 20, gt=0, le=1 << 30,
                            description="bytes parsed per chunk; also the longest line "
                            "read (a longer one is rejected as line_too_long)")
    split: SplitConfig = Field(SplitConfig(), description="how valid and test rows are carved "
                               "from train when they have no files of their own")
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0, description="the run stops when the "
                                    "share of rejected rows is above this")
    synthetic: SyntheticConfig = Field(SyntheticConfig(), description="the built-in "
                                       "generator's settings, used with format: synthetic")
    oracle_column: str | None = Field(None, description="a column of true probabilities, "
                                      "whose AUC is reported as oracle_auc (format: "
                                      "synthetic uses oracle_p)")
    joins: list[JoinConfig] = Field(default_factory=list, description="side tables (user or "
                                    "item attributes) joined to every row on a key column")
    engine: Literal["local", "ray"] = Field(
        "local", description="what prepares the data: local (this process, Arrow's "
        "threads) or ray (tasks on a Ray cluster: each input file read, and the fit and "
        "the transform run, in parallel; the same processed data; pip install "
        "'sampan[ray]')")
    ray_address: str | None = Field(
        None, description="engine ray: the cluster to join (auto: the one started on "
        "this machine with ray start; ray://HOST:10001 for a remote one); null: Ray's "
        "default (the cluster RAY_ADDRESS names, else a Ray of this machine's cores "
        "started for the preparation and stopped after)")

    @field_validator("engine", mode="after")
    @classmethod
    def _ray_installed(cls, v: str, info: ValidationInfo) -> str:
        import importlib.util

        finished = (info.context or {}).get("finished")  # a finished run, opened to use
        if v == "ray" and not finished and importlib.util.find_spec("ray") is None:
            raise ValueError("data.engine: ray needs Ray, which is not installed; install "
                             "it with pip install 'sampan[ray]' (from a checkout: pip "
                             "install -e '.[ray]'), or use engine: local")
        return v

    @field_validator("format", mode="after")
    @classmethod
    def _known_format(cls, v: str) -> str:
        from sampan.config.registry import check_format

        return check_format(v)

    @model_validator(mode="after")
    def _has_source(self) -> DataConfig:
        # data.train itself is required by the experiment (a stream needs no files)
        if self.delimiter is not None and (not self.delimiter or any(
                c in self.delimiter for c in "\r\n")):
            raise ValueError(f"data.delimiter must be one or more characters other than a "
                             f"line break, got {self.delimiter!r}")
        self.split.check_fractions([r for r in ("valid", "test") if getattr(self, r)])
        return self
