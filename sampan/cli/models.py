"""``sampan models``: the registered models and their options."""

from __future__ import annotations

import sys

from sampan.cli.base import app, console


@app.command()
def models() -> None:
    """List the registered models (the values `model.name` accepts), what each is, and
    the options each takes with their defaults."""
    from rich.markup import escape

    from sampan.config import ModelConfig
    from sampan.models import get_model_class, model_names

    def options(fields: dict, skip: set[str]) -> str:
        return ", ".join(f"{k}={f.get_default(call_default_factory=True)!r}"
                         for k, f in fields.items() if k not in skip)

    shared = set(ModelConfig.model_fields)
    console.print("Every model takes " + escape(options(ModelConfig.model_fields, {"name"}))
                  + ".\nPick one with `model: {name: NAME, option: value}` or "
                  "--set model.name=NAME.\n")
    for name in model_names():
        cls = get_model_class(name)
        doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip()
        summary = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
        console.print(f"[bold]{name}[/]: {escape(summary)}")
        own = options(cls.Config.model_fields, shared)
        console.print(f"  options: {escape(own) if own else '(only the shared ones)'}\n")
