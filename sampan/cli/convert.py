"""``sampan convert``: another tool's config as a Sampan config, with what became of each
key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sampan.cli.base import app, console

convert_app = typer.Typer(help="Turn another tool's config into a Sampan config.",
                          no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(convert_app, name="convert")


@convert_app.command("paddlerec")
def convert_paddlerec(
    config: Annotated[Path, typer.Argument(help="A PaddleRec model folder's config.yaml "
                                           "(or config_bigdata.yaml).")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write the Sampan config here (default: print the table only).")]
    = None,
) -> None:
    """Convert a PaddleRec config: print what became of every key (mapped, and to what;
    ignored, and why; or not supported) and the Sampan settings chosen to train as
    PaddleRec does, and with --out write the Sampan config. The converted config's keys
    and values are checked as `sampan train` loads them; a data file it names that does
    not exist (yet) is said, not refused.

    Examples:

      sampan convert paddlerec PaddleRec/models/rank/dnn/config.yaml --out dnn.yaml

      sampan train dnn.yaml          # the same run as: sampan train .../rank/dnn/config.yaml
    """
    from rich.markup import escape
    from rich.table import Table

    from sampan.compat.paddlerec import IGNORED, UNSUPPORTED, convert, write_yaml
    from sampan.config import load_config

    conv = convert(config)
    load_config(raw=conv.config)  # a converted config that does not load is a bug: say so
    style = {IGNORED: "yellow", UNSUPPORTED: "bold red"}
    t = Table(title=escape(conv.summary()), title_justify="left", show_lines=False)
    for col in ("PaddleRec key", "value", "", "Sampan", "why"):
        t.add_column(col, overflow="fold")
    for r in conv.rows:
        value = repr(r.value)
        value = value if len(value) <= 40 else value[:37] + "..."
        t.add_row(escape(r.key), escape(value), f"[{style.get(r.status, 'green')}]"
                  f"{r.status}[/]", escape(r.target), escape(r.why))
    console.print(t)
    if conv.settings:
        console.print("Sampan settings that train as PaddleRec does:")
        for key, why in conv.settings:
            console.print(f"  {escape(key)}: {escape(why)}", highlight=False)
    for path in _absent_data(conv.config.get("data") or {}):
        console.print(f"note: data path {path} does not exist (yet): sampan train will look "
                      "for it there", highlight=False)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(write_yaml(conv, config.resolve()), encoding="utf-8")
        console.print(f"wrote {out}; train it with: sampan train {out}", highlight=False)


def _absent_data(data: dict) -> list[str]:
    """The converted config's data paths (files, folders or globs) that match nothing."""
    import glob

    out = []
    for key in ("train", "valid", "test"):
        for path in ([data[key]] if isinstance(data.get(key), str) else data.get(key) or []):
            if not glob.glob(str(path)):
                out.append(str(path))
    return out
