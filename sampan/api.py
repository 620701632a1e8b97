"""The Python API: one experiment, from a YAML file or from Python objects, run end to end.

>>> from sampan import Experiment
>>> exp = Experiment.from_yaml("configs/criteo_deepfm.yaml", overrides=["train.lr=0.01"])
>>> results = exp.run()                                    # doctest: +SKIP
>>> results["test"]["auc"], exp.run_dir                     # doctest: +SKIP

The object form, for notebooks, takes the config's sections as keyword arguments (or one
mapping) and checks them exactly as a YAML file is checked: an unknown key fails with the
nearest valid one, whatever the model::

    exp = Experiment(data={"train": "clicks.parquet"},
                     features={"categorical": ["user", "item"], "numeric": ["price"]},
                     model={"name": "deepfm", "mlp": [128, 64]})
    exp.run(quiet=True)
    exp.evaluate("test")            # metrics of the best model on a split or raw files
    exp.predict(["new_rows.csv"])   # probabilities [N, T] through the saved feature pipeline
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from sampan.config import ExperimentConfig, dump_config, load_config
from sampan.errors import MissingPathError, not_a_run
from sampan.train.experiment import RunArtifacts, run_experiment


class Experiment:
    """A validated experiment config, and after :meth:`run` its run directory and results.

    ``Experiment(config)`` takes a mapping (the YAML's content) or an
    :class:`~sampan.config.ExperimentConfig`; ``Experiment(**sections)`` takes the sections
    (``data=``, ``features=``, ``model=``, ``train=``, ``name=``, ...). ``overrides`` are
    ``--set`` strings (``"train.lr=0.01"``), applied last.
    """

    def __init__(self, config: ExperimentConfig | dict[str, Any] | None = None, *,
                 overrides: list[str] | tuple[str, ...] = (), **sections: Any):
        if isinstance(config, ExperimentConfig):
            if sections or overrides:
                raise TypeError("pass either an ExperimentConfig or sections/overrides, not both")
            self.config = config
        else:
            raw = {**(config or {}), **sections}
            self.config = load_config(raw=raw, overrides=list(overrides))
        self.run_dir: Path | None = None
        self.results: dict[str, Any] | None = None
        self._artifacts: RunArtifacts | None = None

    @classmethod
    def from_yaml(cls, path: str | Path | None = None,
                  overrides: list[str] | tuple[str, ...] = ()) -> Experiment:
        """The experiment a YAML file describes (``None``: the built-in one), as
        ``sampan train PATH --set ...`` would load it."""
        return cls(load_config(path, overrides=list(overrides)))

    @classmethod
    def resume(cls, run_dir: str | Path, quiet: bool = False) -> Experiment:
        """Continue an interrupted run from its last checkpoint, with its saved config."""
        run = Path(run_dir)
        if not (run / "config.yaml").exists():
            raise not_a_run(run)
        exp = cls(load_config(run / "config.yaml"))
        exp._start(run, resume=True, quiet=quiet)
        return exp

    @classmethod
    def open(cls, run_dir: str | Path) -> Experiment:
        """A finished run, to evaluate or predict with (nothing is trained)."""
        run = Path(run_dir)
        if not (run / "config.yaml").exists():
            raise not_a_run(run)
        exp = cls(load_config(run / "config.yaml", finished=True))
        exp.run_dir = run
        return exp

    def run(self, run_dir: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
        """Prepare the data, train, evaluate on the test split; returns ``results.json``'s
        content (plus ``run_dir``). ``run_dir`` defaults to ``OUTPUT_DIR/NAME/TIMESTAMP``;
        ``quiet`` prints nothing."""
        return self._start(run_dir, resume=False, quiet=quiet)

    def _start(self, run_dir: str | Path | None, resume: bool, quiet: bool) -> dict[str, Any]:
        self.results = run_experiment(self.config, run_dir=run_dir, resume=resume,
                                      console=Console(quiet=quiet))
        self.run_dir = Path(self.results["run_dir"])
        self._artifacts = None
        return self.results

    @property
    def artifacts(self) -> RunArtifacts:
        """The finished run's best model, pipeline and data (see
        :class:`~sampan.train.experiment.RunArtifacts`)."""
        if self.run_dir is None:
            raise MissingPathError("this experiment has not run yet: call run() first, or "
                                   "Experiment.open(run_dir)")
        if self._artifacts is None:
            self._artifacts = RunArtifacts(self.run_dir)
        return self._artifacts

    def evaluate(self, split_or_files: str | list[str] = "test",
                 bootstrap: int = 0) -> dict[str, Any]:
        """Metrics of the best model on a processed split or on raw files."""
        return self.artifacts.evaluate(split_or_files, bootstrap=bootstrap)

    def predict(self, files: str | list[str]) -> Any:
        """Probabilities ``[N, T]`` for raw rows, through the run's saved feature pipeline."""
        return self.artifacts.predict(files)

    def to_yaml(self) -> str:
        """The full config, every default written out (what the run saves as config.yaml)."""
        return dump_config(self.config)

    def __repr__(self) -> str:
        where = f", run_dir={str(self.run_dir)!r}" if self.run_dir else ""
        return f"Experiment(name={self.config.name!r}, model={self.config.model.name!r}{where})"
