"""One experiment: data -> features -> model -> training."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SerializeAsAny,
    field_validator,
    model_validator,
)

from sampan.config.base import _Strict
from sampan.config.data import DataConfig
from sampan.config.features import FeaturesConfig
from sampan.config.model import ModelConfig
from sampan.config.stream import StreamConfig
from sampan.config.train import TrainConfig
from sampan.config.tune import TuneConfig


# ----------------------------------------------------------------------------- experiment
class ExperimentConfig(_Strict):
    """One experiment: data -> features -> model -> training."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="the run folder's name under output_dir: letters, digits, "
                      ". _ - (no path)")
    seed: int = Field(42, ge=0, lt=2**32, description="0 to 2**32 - 1")
    output_dir: str = Field("runs", description="where runs are written: "
                            "output_dir/name/timestamp")
    preset: Literal["criteo"] | None = Field(None, description="criteo: fills the parsing and "
                                             "features of the Criteo TSV layout (the config "
                                             "file's keys win); null: none")
    # before `data` and `model`: fields validate in order, and the plugins register the
    # user's readers and models
    plugins: list[str] = Field(default_factory=list, description="Python files (my_models.py,"
                               " relative to the config file) or modules (my_pkg.rankers) "
                               "imported first: their @register_model classes can be named "
                               "in model.name, their @register_reader functions in "
                               "data.format")
    data: DataConfig = Field(DataConfig(format="synthetic"), description="where the raw rows "
                             "come from and how to parse them (default: the built-in "
                             "synthetic generator)")
    features: FeaturesConfig = Field(description="the labels, the feature columns and how "
                                     "they are encoded")
    model: SerializeAsAny[ModelConfig] = Field(ModelConfig(), description="the model "
                                               "named by model.name and its own options")
    train: TrainConfig = Field(TrainConfig(), description="the training loop: budget, "
                               "optimizers, schedule, early stopping, devices")
    stream: StreamConfig | None = Field(None, description="online training from a Kafka "
                                        "topic or time-partitioned directories (sampan "
                                        "stream)")
    tune: TuneConfig | None = Field(None, description="the search space and budget of "
                                    "sampan tune (sampan train ignores it)")

    _notices: list[str] = PrivateAttr(default_factory=list)

    @property
    def notices(self) -> list[str]:
        """What loading changed that the user did not write (printed by every run)."""
        return self._notices

    @model_validator(mode="after")
    def _has_source(self) -> ExperimentConfig:
        if self.data.format != "synthetic" and not self.data.train and self.stream is None:
            raise ValueError("data.train is required (a file path, a list of paths, or use "
                             "format: synthetic for the built-in generator; a stream: "
                             "section reads its records from the stream instead)")
        return self

    @model_validator(mode="after")
    def _metrics_reported(self) -> ExperimentConfig:
        """The metric early stopping and tuning follow is one the model's evaluation reports
        (else a run would fail at its first validation, a study at its first trial)."""
        from sampan.config.registry import get_model_class
        from sampan.metrics import metric_names

        kind = getattr(get_model_class(self.model.name), "task", "binary")
        names = metric_names(kind, getattr(self.model, "k", None), bool(self.features.group))
        for where, metric in (("train.early_stopping.metric", self.train.early_stopping.metric),
                              ("tune.metric", self.tune.metric if self.tune else None)):
            if metric is None or metric in names:
                continue
            why = (" (GAUC needs a group column: set features.group, e.g. to the user id)"
                   if metric == "gauc" and kind == "binary" else "")
            raise ValueError(f"{where} is {metric!r}, which model {self.model.name!r} "
                             f"(task: {kind}) does not report{why}; its validation metrics "
                             f"here: {', '.join(names)}")
        return self

    @field_validator("plugins", mode="after")
    @classmethod
    def _load_plugins(cls, v: list[str]) -> list[str]:
        from sampan.config.plugins import load_all

        return load_all(v)

    @field_validator("model", mode="before")
    @classmethod
    def _model_options(cls, v: Any) -> Any:
        """The model section is validated against the named model's own options, however
        the config is built (YAML, ``load_config``, or ``model_validate`` from Python): a
        misspelt or foreign key is an error, never dropped."""
        from sampan.config.registry import UnknownModelError, get_model_class

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
