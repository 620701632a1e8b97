"""The ``tune`` section: the search space and budget of ``sampan tune``.

Keys of ``space`` are dotted config paths, exactly as ``--set`` takes them; each holds a
range (``low``/``high``, with ``log`` and ``step``: integers when both ends are integers) or
``choices``. A choice may open more parameters with ``when`` (only the chosen branch's are
sampled)::

    tune:
      trials: 30
      space:
        train.lr: {low: 3.0e-4, high: 1.0e-2, log: true}
        model.embedding_dim: {choices: [8, 16, 32]}
        model.name:
          choices: [deepfm, dcn_v2]
          when:
            dcn_v2: {model.cross_layers: {low: 1, high: 4}}

Whether every key names a real option, and every value is one it accepts, is checked when
``sampan tune`` loads the config (see :func:`sampan.tune.space.check_space`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sampan.config.base import _Strict
from sampan.config.train import known_metric

Number = int | float  # int first: `1` stays an integer, `0.5` is a float


class ParamSpec(_Strict):
    """One searched value: a range or a list of choices."""

    low: Number | None = Field(None, description="the range's lower end (inclusive)")
    high: Number | None = Field(None, description="the range's upper end (inclusive)")
    log: bool = Field(False, description="sample the range on a log scale (low > 0)")
    step: Number | None = Field(None, gt=0, description="only values low + k * step")
    choices: list[Any] | None = Field(None, min_length=1, description="the values to choose "
                                      "from (any YAML value: numbers, names, lists)")
    when: dict[str, dict[str, ParamSpec]] | None = Field(
        None, description="per choice, the parameters that only that choice has")

    @field_validator("when", mode="before")
    @classmethod
    def _choice_keys(cls, v: Any) -> Any:
        # `when: {8: {...}}` names the choice 8: keys are matched as text
        return {str(k): x for k, x in v.items()} if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _one_kind(self) -> ParamSpec:
        ranged = self.low is not None or self.high is not None
        if self.choices is not None:
            if ranged or self.log or self.step is not None:
                raise ValueError("give either choices or a range (low/high), not both")
            labels = [choice_label(c) for c in self.choices]
            if len(set(labels)) != len(labels):
                raise ValueError(f"choices repeat a value: {labels}")
            for key in self.when or {}:
                if key not in [str(x) for x in labels]:
                    raise ValueError(f"when: {key!r} is not one of the choices {labels}")
            return self
        if self.when is not None:
            raise ValueError("when: needs choices (it opens parameters per choice)")
        if self.low is None or self.high is None:
            raise ValueError("a range needs both low and high (or give choices)")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0, got {self.low}")
        if self.log and self.step is not None:
            raise ValueError("log and step do not go together")
        return self

    @property
    def is_int(self) -> bool:
        return self.choices is None and all(
            isinstance(v, int) and not isinstance(v, bool)
            for v in (self.low, self.high, self.step) if v is not None)


def choice_label(value: Any) -> str | int | float | bool | None:
    """How a choice is stored in the study: scalars as they are, anything else (a list such
    as an MLP's widths) as its YAML flow text, ``[256, 128]``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip()


class TuneConfig(_Strict):
    """What ``sampan tune`` searches, for how long, and how it judges a trial."""

    space: dict[str, ParamSpec] = Field(min_length=1, description="dotted config path -> "
                                        "range or choices")
    trials: int = Field(30, gt=0, description="finished trials (completed or pruned) the "
                        "study ends with, across all its processes and restarts")
    timeout_minutes: float | None = Field(None, gt=0, description="stop starting trials "
                                          "after this long (running ones finish)")
    metric: str | None = Field(None, description="validation metric to optimise (of the "
                               "best model of each trial); default: train.early_stopping."
                               "metric, else auc (recall@K for retrieval models)")
    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str | None) -> str | None:
        return known_metric(v)

    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="default: minimize for logloss, maximize otherwise")
    sampler: Literal["tpe", "random", "grid"] = Field(
        "tpe", description="grid: every combination once (ranges need a step)")
    pruner: Literal["median", "hyperband", "none"] = Field(
        "median", description="stop trials whose validation curve falls behind")
    startup_trials: int = Field(8, ge=0, description="trials drawn at random before TPE "
                                "models the space, and finished before the pruner prunes")
    seed: int | None = Field(None, ge=0, description="the sampler's seed; default: the "
                             "experiment's seed")
    storage: str | None = Field(None, description="an SQLAlchemy URL (sqlite:///study.db, "
                                "postgresql://...) that every process of the study shares; "
                                "default: study.db in the study folder")
