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
import typing
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
        field = getattr(cls.Config, "model_fields", {}).get("name")
        allowed = () if field is None else typing.get_args(field.annotation) or (
            (field.default,) if isinstance(field.default, str) else ())  # (unresolved)
        if allowed and name not in allowed:
            raise ConfigError(f"model {cls.__qualname__} is registered as {name!r}, but its "
                              f"Config.name is Literal{list(allowed)}: make them the same")
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


# ------------------------------------------------------------------------- file formats
BUILTIN_FORMATS = ("auto", "csv", "tsv", "parquet", "jsonl", "libsvm", "slot", "synthetic")
_READERS: dict[str, Callable] = {}


def register_reader(name: str) -> Callable[[Callable], Callable]:
    """Function decorator that makes ``data.format: NAME`` read files with it.

    The function takes ``(path, options)`` (a :class:`pathlib.Path` and the config's
    ``data.reader_options`` dict) and yields :class:`pyarrow.Table` chunks of the file's
    records in file order, one column per field. Sampan then checks each chunk as it checks
    a Parquet file's: the columns the features name must be there, and a row whose value
    does not fit its feature (a label that is not a number, a numeric feature that is text)
    is rejected by reason into ``rejects.jsonl``, its line being the record's 1-based
    position in the file. Splits, side tables, the pipeline and ``sampan predict`` follow
    as for any built-in format."""

    def deco(fn: Callable) -> Callable:
        if name in BUILTIN_FORMATS:
            raise ConfigError(f"data format {name!r} is built in; give your reader another "
                              "name")
        if name in _READERS and _READERS[name] is not fn:
            old = _READERS[name]
            raise ConfigError(f"data format {name!r} is registered twice: by "
                              f"{old.__module__}.{old.__qualname__} and "
                              f"{fn.__module__}.{fn.__qualname__}; choose another name")
        _READERS[name] = fn
        return fn

    return deco


def get_reader(name: str) -> Callable:
    """The reader registered as ``name``."""
    if name not in _READERS:
        raise ConfigError(unknown_format(name))
    return _READERS[name]


def check_format(name: str) -> str:
    """``name`` when it is a built-in format or a registered reader, else a ConfigError
    naming the nearest one."""
    if name in BUILTIN_FORMATS or name in _READERS:
        return name
    raise ConfigError(unknown_format(name))


def unknown_format(name: str) -> str:
    known = [*BUILTIN_FORMATS, *sorted(_READERS)]
    near = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return (f"unknown data.format {name!r}.{hint} Known formats: {', '.join(known)} (a "
            "format of your own: a @register_reader function in a file listed under "
            "`plugins:`)")


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
