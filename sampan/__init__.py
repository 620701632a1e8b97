"""Sampan: recommender systems for PyTorch, from raw logs to a served top-K.

One YAML file describes an experiment: :func:`sampan.config.load_config` reads it,
:func:`sampan.train.experiment.run_experiment` prepares the data, trains and evaluates.
"""

__version__ = "0.1.0"
