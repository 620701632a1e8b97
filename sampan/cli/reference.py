"""The command-line reference, generated from the commands themselves: every command of
``sampan``, its usage, help, arguments and options with their types and defaults, as
Markdown (``python -m sampan.cli.reference docs/reference/cli.md`` writes the
documentation site's page; a test checks that the page matches the code)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from typing import Any

import typer

from sampan.cli import app
from sampan.config.reference import cell, write_page

COMMAND = "python -m sampan.cli.reference docs/reference/cli.md"


# typer's commands are click's (its own copy of click): known here by what they have
def _is_group(cmd: Any) -> bool:
    return hasattr(cmd, "list_commands")


def _is_argument(p: Any) -> bool:
    return getattr(p, "param_type_name", "") == "argument"


def commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any, Any]]:
    """``(path, command, context)`` of every command under ``cmd``, in --help's order."""
    ctx = cmd.context_class(cmd, info_name=" ".join(path))
    if _is_group(cmd):
        if path != ["sampan"] and cmd.help:
            yield path, cmd, ctx
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from commands(sub, [*path, name])
    else:
        yield path, cmd, ctx


def _help(text: str) -> str:
    """A command's help in Markdown: its indented example lines as one shell block."""
    out: list[str] = []
    block: list[str] = []
    for para in inspect.cleandoc(text).replace("\b\n", "").split("\n\n"):
        lines = para.split("\n")
        if all(ln.startswith("  ") for ln in lines):
            block += [ln.strip() for ln in lines]
            continue
        if block:
            out.append("```bash\n" + "\n".join(block) + "\n```")
            block = []
        out.append(para.strip())
    if block:
        out.append("```bash\n" + "\n".join(block) + "\n```")
    return "\n\n".join(p for p in out if p)


def _default(p: Any) -> str:
    if p.required:
        return "required"
    value = p.default
    if callable(value) or value is None or (getattr(p, "is_flag", False) and not value):
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) if value else ""
    return str(value)


def _kind(p: Any, ctx: Any) -> str:
    """An option's type as a user reads it: ``int``, ``int >= 1`` (a bounded one), ``flag``."""
    if getattr(p, "is_flag", False):
        return "flag"
    low, high = getattr(p, "min", None), getattr(p, "max", None)
    if low is not None and high is None:  # a bounded number (typer's min=)
        return f"{p.display_type(ctx).strip('<>').replace(' range', '')} >= {low}"
    return p.display_type(ctx).strip("<>")


def _name(p: Any) -> str:
    if _is_argument(p):
        return f"`{(p.metavar or p.name or '').upper()}`"
    names = [*p.opts, *p.secondary_opts]
    return ", ".join(f"`{n}`" for n in names)


def markdown() -> str:
    """The whole reference page."""
    root = typer.main.get_command(app)
    lines = ["# Command-line reference", "",
             f"Generated from the code (`{COMMAND}`). `sampan COMMAND --help` prints the "
             "same on the terminal.", ""]
    for path, cmd, ctx in commands(root, ["sampan"]):
        lines += [f"## `{' '.join(path)}`", ""]
        doc = _help(cmd.help or "")
        if doc:
            lines += [doc, ""]
        if _is_group(cmd):
            continue
        lines += ["```", cmd.get_usage(ctx).strip(), "```", ""]
        params = [p for p in cmd.params if not getattr(p, "hidden", False)
                  and p.name not in ("help",)]
        if not params:
            continue
        lines += ["| argument / option | type | default | meaning |", "|---|---|---|---|"]
        for p in params:
            kind = _kind(p, ctx)
            lines.append(f"| {_name(p)} | {cell(kind)} | {cell(_default(p))} | "
                         f"{cell(getattr(p, 'help', None) or '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    write_page(sys.argv[1:], markdown())
