"""Experiment configuration: YAML -> strict pydantic models.

Precedence, lowest to highest: package defaults (the field defaults of the sections) < preset
(``preset: criteo``) < config file < ``--set key=value`` overrides. Unknown keys fail at load
time with the nearest valid key; wrong types name the expected type. The resolved config is
what :func:`dump_config` writes into every run directory and checkpoint.

The sections live one per module (:mod:`~sampan.config.data`, ``features``, ``model``,
``train``, ``experiment``); :mod:`~sampan.config.load` reads YAML, presets and overrides,
:mod:`~sampan.config.messages` words the errors, :mod:`~sampan.config.serve` is ``sampan
serve``'s own config. Everything is importable from here.

Example::

    >>> cfg = load_config(None, overrides=["train.epochs=1"])   # the built-in default
    >>> cfg.model.name, cfg.train.epochs
    ('deepfm', 1)
"""

from sampan.config.base import Auto, NonNegFloat, NonNegInt, PosInt
from sampan.config.data import DataConfig, JoinConfig, SplitConfig, SyntheticConfig
from sampan.config.experiment import ExperimentConfig
from sampan.config.features import (
    PACKAGE_FEATURE_DEFAULTS,
    CategoricalFeature,
    FeaturesConfig,
    LabelSpec,
    ListFeature,
    NumericFeature,
)
from sampan.config.load import (
    PRESETS,
    apply_override,
    builtin_config_path,
    deep_merge,
    dump_config,
    load_config,
)
from sampan.config.messages import format_validation_error
from sampan.config.model import FieldWeightsConfig, MLPModelConfig, ModelConfig, NextItemConfig
from sampan.config.serve import (
    FeatureStoreConfig,
    FeedbackConfig,
    ServeConfig,
    load_serve_config,
)
from sampan.config.stream import DirectoryConfig, KafkaConfig, PublishConfig, StreamConfig
from sampan.config.train import EarlyStoppingConfig, TrainConfig
from sampan.config.tune import ParamSpec, TuneConfig
from sampan.errors import ConfigError

__all__ = [
    "PACKAGE_FEATURE_DEFAULTS", "PRESETS", "Auto", "CategoricalFeature", "ConfigError",
    "DataConfig", "DirectoryConfig", "EarlyStoppingConfig", "ExperimentConfig",
    "FeatureStoreConfig", "FeaturesConfig", "FeedbackConfig", "FieldWeightsConfig",
    "JoinConfig", "KafkaConfig",
    "LabelSpec", "ListFeature", "MLPModelConfig", "ModelConfig", "NextItemConfig", "NonNegFloat",
    "NonNegInt",
    "NumericFeature", "ParamSpec", "PosInt", "PublishConfig", "ServeConfig", "SplitConfig",
    "StreamConfig", "SyntheticConfig", "TrainConfig", "TuneConfig", "apply_override",
    "builtin_config_path", "deep_merge", "dump_config", "format_validation_error", "load_config",
    "load_serve_config",
]
