"""The typer app every command registers on, its one error handler, and the shared
options and consoles."""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
import typer.core
from rich.console import Console
from rich.markup import escape

from sampan.errors import SampanError


class _Commands(typer.core.TyperGroup):
    """The one error handler of every command: a :class:`SampanError` (or a full disk) is
    ``error: <message>`` and exit code 2; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SampanError as e:
            fail(str(e))
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            fail(f"no space left on the device ({e.filename or e}); free some space and "
                  "run the command again (a training run resumes with --resume RUN_DIR: its "
                  "last checkpoint is intact)")


app = typer.Typer(
    cls=_Commands,
    help="Sampan: train, evaluate and use recommender models from one YAML file.\n\n"
         "Start with `sampan train` (DeepFM on the built-in synthetic data), then try "
         "`sampan train configs/criteo_deepfm.yaml` on a real Criteo file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
# written to a file or a pipe (a log), a line stays one line, whatever its length: a
# terminal wraps it, and tables are drawn to the width either way
console = Console(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())

SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", metavar="KEY=VALUE",
                 help="Override a config value, e.g. --set train.epochs=2 --set model.mlp=[64,32]."
                      " Values are parsed as YAML. Repeatable; applied after the file."),
]
EngineOpt = Annotated[
    str | None,
    typer.Option("--engine", metavar="local|ray",
                 help="What prepares the data (data.engine): local, or ray (tasks on a Ray "
                 "cluster; pip install 'sampan[ray]')."),
]
AddressOpt = Annotated[
    str | None,
    typer.Option("--address", metavar="ADDR",
                 help="With --engine ray, the cluster to join (data.ray_address): auto for "
                 "the one `ray start --head` made on this machine, ray://HOST:10001 for a "
                 "remote one. Default: a Ray of this machine's cores, for the preparation."),
]


def engine_sets(engine: str | None, address: str | None) -> list[str]:
    """``--engine`` / ``--address`` as ``--set`` overrides."""
    if address is not None and engine not in (None, "ray"):
        fail(f"--address joins a Ray cluster: it needs --engine ray, not --engine {engine}")
    out = [f"data.engine={engine or 'ray'}"] if engine is not None or address is not None else []
    return out + ([f"data.ray_address={address}"] if address is not None else [])


def fail(msg: str, code: int = 2) -> None:
    # not wrapped to the terminal's width: an error stays whole when it is logged or grepped
    # the message is text, not markup: "pip install 'sampan[ray]'" keeps its brackets
    err.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(code)


KeyFileOpt = Annotated[
    Path | None,
    typer.Option("--key-file", metavar="PATH",
                 help="A file holding the secret bundle key (HMAC-SHA256; at least 16 bytes, "
                      "surrounding whitespace ignored). Or set SAMPAN_BUNDLE_KEY (the key) or "
                      "SAMPAN_BUNDLE_KEY_FILE (its file); never give the key itself on the "
                      "command line."),
]
