"""Sampan: recommender systems for PyTorch, from raw logs to a served top-K.

One YAML file describes an experiment; from Python::

    from sampan import Experiment
    results = Experiment.from_yaml("cfg.yaml", overrides=["train.lr=0.01"]).run()

(see :mod:`sampan.api`). Underneath, :func:`sampan.config.load_config` reads the config and
:func:`sampan.train.experiment.run_experiment` prepares the data, trains and evaluates.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Experiment", "__version__"]


def __getattr__(name: str) -> Any:
    # `import sampan.models` (or the serving path) must not pull in the data and training
    # stack: the API is imported on first use of `sampan.Experiment`, not with the package
    if name == "Experiment":
        from sampan.api import Experiment

        return Experiment
    raise AttributeError(f"module 'sampan' has no attribute {name!r}")
