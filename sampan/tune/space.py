"""The search space of a ``tune:`` section: a trial's values, the grid, and the check that
every key and value is one the config accepts.

A trial's values become ``--set`` overrides (``train.lr=0.003``), applied to the config file
the way ``sampan train CONFIG --set ...`` applies them: changing ``model.name`` drops the old
model's options that the new one lacks, and anything else the config refuses is an error.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sampan.config import ConfigError, ExperimentConfig, load_config
from sampan.config.tune import ParamSpec, choice_label

Space = dict[str, ParamSpec]


def sample(trial: Any, space: Space) -> dict[str, Any]:
    """The config values an Optuna trial draws from ``space`` (a chosen branch's ``when``
    parameters included): dotted key -> value."""
    values: dict[str, Any] = {}
    for key, spec in space.items():
        if spec.choices is not None:
            labels = [choice_label(c) for c in spec.choices]
            pick = trial.suggest_categorical(key, labels)
            values[key] = spec.choices[labels.index(pick)]
            if spec.when and str(pick) in spec.when:
                values.update(sample(trial, spec.when[str(pick)]))
        elif spec.is_int:
            values[key] = trial.suggest_int(key, int(spec.low), int(spec.high),
                                            step=int(spec.step or 1), log=spec.log)
        else:
            values[key] = trial.suggest_float(key, float(spec.low), float(spec.high),
                                              step=spec.step, log=spec.log)
    return values


def as_overrides(values: dict[str, Any]) -> list[str]:
    """``--set`` strings for ``values`` (each value as YAML flow text)."""
    def text(v: Any) -> str:  # a scalar's dump ends in "\n...\n"
        return yaml.safe_dump(v, default_flow_style=True).split("\n...")[0].strip()

    return [f"{k}={text(v)}" for k, v in values.items()]


def _points(spec: ParamSpec, key: str) -> list[Any]:
    if spec.choices is not None:
        return list(spec.choices)
    if spec.is_int:
        return list(range(int(spec.low), int(spec.high) + 1, int(spec.step or 1)))
    if spec.step is None:
        raise ConfigError(f"tune.space.{key}: sampler grid needs choices or a step for a "
                          f"float range ({spec.low} .. {spec.high})")
    n = int(np.floor((spec.high - spec.low) / spec.step + 1e-9)) + 1
    return [round(float(spec.low + i * spec.step), 12) for i in range(n)]


def grid(space: Space) -> list[dict[str, Any]]:
    """Every combination of the space's values, as Optuna params (choices by their label);
    a choice's ``when`` parameters multiply only that choice's branch."""
    branches: list[list[dict[str, Any]]] = []
    for key, spec in space.items():
        options = []
        for v in _points(spec, key):
            label = choice_label(v) if spec.choices is not None else v
            sub = spec.when.get(str(label)) if spec.when else None
            options += [{key: label, **rest} for rest in (grid(sub) if sub else [{}])]
        branches.append(options)
    return [dict(itertools.chain.from_iterable(p.items() for p in combo))
            for combo in itertools.product(*branches)]


def _probes(space: Space, fixed: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(what is probed, values): each parameter at each end of its range and each choice,
    with the other top-level parameters at their first value."""
    first = {k: (s.choices[0] if s.choices is not None else s.low) for k, s in space.items()}
    for key, spec in space.items():
        ends = spec.choices if spec.choices is not None else [spec.low, spec.high]
        for v in ends:
            yield f"{key}={v!r}", {**first, **fixed, key: v}
            label = str(choice_label(v))
            if spec.when and label in spec.when:
                yield from _probes(spec.when[label], {**fixed, key: v})


def check_space(config: str | Path | None, overrides: list[str], space: Space) -> int:
    """Load the config with each probe of :func:`_probes` (a parameter's ends and choices):
    a key the config does not have, or a value it refuses, fails here, at load time, as
    ``tune.space: KEY=VALUE: ...`` with the config's own message. Returns the probes made."""
    n = 0
    for what, values in _probes(space, {}):
        for key in values:
            if key == "tune" or key.startswith("tune."):
                raise ConfigError(f"tune.space: {key!r}: the tune section cannot tune itself")
        try:
            load_config(config, overrides=[*overrides, *as_overrides(values)])
        except ConfigError as e:
            raise ConfigError(f"tune.space: {what}: {e}") from None
        n += 1
    return n


def trial_config(config: str | Path | None, overrides: list[str],
                 values: dict[str, Any]) -> ExperimentConfig:
    """The experiment one trial runs: the file, its ``--set``, then the trial's values;
    without the ``tune`` section (a trial is a plain run)."""
    cfg = load_config(config, overrides=[*overrides, *as_overrides(values)])
    notices = cfg.notices
    cfg = cfg.model_copy(update={"tune": None})
    cfg._notices = notices
    return cfg
