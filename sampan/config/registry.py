"""Model registry: strings become model classes only through here.

It sits in the config layer, below the models: the ``model:`` section of a config is
validated against the named model's own options wherever a config is built, so the config
needs the registry, and the registry needs no model. Every model file registers itself with
``@register_model("<name>")``; the name equals the file stem. The built-in models register
when ``sampan.models`` is imported, which the first lookup does by name (as it imports a
user's ``plugins:``). A model class carries a nested pydantic ``Config`` (subclass of
:class:`sampan.config.ModelConfig`) holding its hyper-parameters, so the YAML ``model:`` section
is validated against exactly the options that model understands.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import TypeVar

from sampan.errors import ConfigError, UnknownModelError

T = TypeVar("T")

_MODELS: dict[str, type] = {}


def register_model(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator that makes a model buildable by ``name`` from a config."""

    def deco(cls: type[T]) -> type[T]:
        if name in _MODELS and _MODELS[name] is not cls:
            old = _MODELS[name]
            raise ConfigError(f"model name {name!r} is registered twice: by "
                              f"{old.__module__}.{old.__qualname__} and "
                              f"{cls.__module__}.{cls.__qualname__}; choose another name")
        if not hasattr(cls, "Config"):
            raise TypeError(f"model {cls.__name__} must define a nested pydantic `Config` class")
        cls.name = name  # type: ignore[attr-defined]
        _MODELS[name] = cls
        return cls

    return deco


def get_model_class(name: str) -> type:
    """Return the model class registered as ``name``; unknown names list the known ones."""
    _load_builtin_models()
    if name not in _MODELS:
        near = difflib.get_close_matches(name, list(_MODELS), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise UnknownModelError(
            f"unknown model {name!r}.{hint} Known models: {', '.join(sorted(_MODELS))} (a "
            "model of your own: list its file under `plugins:`)"
        )
    return _MODELS[name]


def model_names() -> list[str]:
    """Names of every registered model, sorted."""
    _load_builtin_models()
    return sorted(_MODELS)


def _load_builtin_models() -> None:
    # Importing the package runs every model file's @register_model; by name, like a
    # plugin: the models sit above this layer and import it
    importlib.import_module("sampan.models")


def check_embeds_something(name: str, embeds: bool) -> None:
    """A model that embeds categorical features needs one: only the models marked
    ``numeric_only = True`` (an MLP over the numeric vector) take numeric features alone."""
    if embeds or getattr(get_model_class(name), "numeric_only", False):
        return
    takes = ", ".join(n for n in model_names() if getattr(_MODELS[n], "numeric_only", False))
    raise ConfigError(f"model {name!r} embeds categorical features and the data has numeric "
                      "ones only: declare a categorical feature (numbers become categories "
                      "with numeric buckets > 0, or bucketize), or use a model that takes "
                      f"numeric features alone: {takes}")
