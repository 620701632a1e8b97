"""The configuration reference, generated from the pydantic models themselves.

Every key of an experiment config (``sampan train``, ``stream``, ``tune``), of each
model's options and of a serve config, with its type, default, allowed range and
description, as Markdown: ``python -m sampan.config.reference docs/reference/config.md``
writes the documentation site's page (a test checks that the page matches the code and
that no key lacks a description)."""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from sampan.config.experiment import ExperimentConfig
from sampan.config.model import ModelConfig
from sampan.config.registry import get_model_class, model_names
from sampan.config.serve import ServeConfig

COMMAND = "python -m sampan.config.reference docs/reference/config.md"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (directly, optional, in a list)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += [m for m in _models_in(arg) if m not in out]
    return out


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return True
    return any(_is_list(a) for a in typing.get_args(annotation)
               if typing.get_origin(annotation) in (typing.Union, types.UnionType))


def type_name(annotation: Any) -> str:
    """A reader's name of a type: ``int``, ``list[str]``, ``"a" | "b"``, ``float | null``."""
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin in (list, tuple, set):
        return f"list[{' | '.join(dict.fromkeys(type_name(a) for a in args if a is not ...))}]"
    if origin is dict:
        return f"map[{type_name(args[0])}, {type_name(args[1])}]" if args else "map"
    if annotation is Any:
        return "any"
    if getattr(annotation, "__supertype__", None) is not None:  # NewType
        return type_name(annotation.__supertype__)
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: FieldInfo) -> str:
    words = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    out = []
    each = [m for a in typing.get_args(info.annotation) for m in getattr(a, "__metadata__", ())]
    for m, prefix in [(m, "") for m in info.metadata] + [(m, "each ") for m in each]:
        for attr, word in words.items():
            if getattr(m, attr, None) is not None:
                out.append(f"{prefix}{word} {getattr(m, attr)}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"{prefix}at least {m.min_length} long")
        if getattr(m, "max_length", None) is not None:
            out.append(f"{prefix}at most {m.max_length} long")
        if getattr(m, "pattern", None) is not None:
            out.append(f"{prefix}matches `{m.pattern}`")
    return ", ".join(dict.fromkeys(out))


def default_text(info: FieldInfo) -> str:
    """The default as YAML would say it; "required" when there is none."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def cell(text: object) -> str:
    """Text for a Markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _doc(obj: type) -> str:
    """The first paragraph of a class's own docstring (none inherited), in Markdown."""
    doc = inspect.cleandoc(obj.__dict__.get("__doc__") or "")
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def sections(model: type[BaseModel], path: str = "", skip: tuple[str, ...] = (),
             above: tuple[type[BaseModel], ...] = ()
             ) -> Iterator[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """``(path, model, fields)`` of a model and of every section under it, depth first (a
    section that holds itself is listed once)."""
    fields = [(n, f) for n, f in model.model_fields.items() if n not in skip]
    yield path, model, fields
    for name, info in fields:
        if path == "" and model is ExperimentConfig and name == "model":
            continue  # the models' options have their own part
        for sub in _models_in(info.annotation):
            if sub in (*above, model):
                continue
            key = f"{path}.{name}" if path else name
            yield from sections(sub, key + ("[]" if _is_list(info.annotation) else ""),
                                above=(*above, model))


def missing_descriptions() -> list[str]:
    """Keys without a description (the reference needs one for every key)."""
    out = []
    for _, path, _, fields in _all():
        out += [f"{path + '.' if path else ''}{n}" for n, f in fields if not f.description]
    return out


def _all() -> Iterator[tuple[str, str, type, list[tuple[str, FieldInfo]]]]:
    """Every part: ``(part, path, what it documents, fields)``."""
    for path, model, fields in sections(ExperimentConfig):
        yield "experiment", path, model, fields
    common = tuple(ModelConfig.model_fields)
    yield "model", "model", ModelConfig, list(ModelConfig.model_fields.items())
    for name in model_names():
        cls = get_model_class(name)
        for i, (path, model, fields) in enumerate(sections(cls.Config, f"model: {name}",
                                                           skip=(*common, "name"))):
            yield "models", path, cls if i == 0 else model, fields
    for path, model, fields in sections(ServeConfig):
        yield "serve", path, model, fields


PARTS = {
    "experiment": ("Experiment config", "The YAML file of `sampan train CONFIG` (also "
                   "`sampan stream` and `sampan tune`). `--set key.sub=value` overrides any "
                   "key; an unknown key fails at load time with the nearest valid one."),
    "model": ("Model options", "`model.name` picks a registered model (`sampan models` "
              "lists them); these options are every model's, and each model adds its "
              "own below."),
    "models": (None, None),
    "serve": ("Serve config", "The YAML file of `sampan serve --config FILE`; the command "
              "line's options and `--set` override it."),
}


def markdown() -> str:
    """The whole reference page."""
    lines = ["# Configuration reference", "",
             f"Generated from the code (`{COMMAND}`): every key, its type, default, allowed "
             "values and meaning. A section's keys are written under its name in YAML; "
             "`[]` marks a list of such sections.", ""]
    part = None
    for p, path, model, fields in _all():
        if p != part and PARTS[p][0] is not None:
            lines += [f"## {PARTS[p][0]}", "", PARTS[p][1], ""]
        part = p
        if not fields:
            continue
        lines += [f"### `{path}`" if path else "### Top level", ""]
        if _doc(model):
            lines += [_doc(model), ""]
        lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for name, info in fields:
            lines.append(f"| `{name}` | {cell(type_name(info.annotation))} | "
                         f"{cell(default_text(info))} | {cell(_constraints(info))} | "
                         f"{cell(info.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def write_page(argv: list[str], text: str) -> None:
    """A generated page to the file ``argv[0]`` names, or to standard output."""
    if not argv:
        sys.stdout.write(text)
        return
    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[0]).write_text(text)
    print(f"wrote {argv[0]}")


if __name__ == "__main__":
    write_page(sys.argv[1:], markdown())
