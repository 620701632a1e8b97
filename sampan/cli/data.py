"""``sampan data``: look at raw data, prepare it, build behaviour sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import typer.core

from sampan.cli.base import AddressOpt, EngineOpt, SetOpt, app, console, engine_sets, fail

data_app = typer.Typer(help="Look at raw data, prepare it, build behaviour sequences.",
                       no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(data_app, name="data")


@data_app.command("inspect")
def data_inspect(
    file: Annotated[Path, typer.Argument(help="CSV/TSV (gzip/zstd too), Parquet or JSON lines.")],
    rows: Annotated[int, typer.Option(help="Rows to look at (from the start).")] = 100_000,
    delimiter: Annotated[str | None, typer.Option(help="Field separator (default: guessed).")]
    = None,
    header: Annotated[bool | None, typer.Option("--header/--no-header",
                                                help="Whether line 1 names the columns "
                                                     "(default: guessed).")] = None,
) -> None:
    """Guess the schema of a raw file: per column the type, null rate, cardinality and
    sample values, plus the first rows. Use it to write the `data` and `features` config."""
    from rich.table import Table

    from sampan.data.inspect import inspect_file

    info = inspect_file(file, rows=rows, delimiter=delimiter, header=header)
    console.print(f"[bold]{file}[/]: format {info['format']}"
                  + (f", delimiter {info['delimiter']!r}" if info.get("delimiter") else "")
                  + (f", header {info['header']}" if info.get("header") is not None else "")
                  + f"; {info['rows']:,} rows read")
    t = Table(show_lines=False)
    for col in ("column", "type", "null %", "distinct", "top values"):
        t.add_column(col, justify="right" if col in ("null %", "distinct") else "left")
    for c in info["columns"]:
        t.add_row(c["name"], c["type"], f"{100 * c['null_rate']:.1f}",
                  f"{c['distinct']:,}" + ("+" if c["distinct_capped"] else ""),
                  ", ".join(str(v) for v in c["top"])[:60])
    console.print(t)
    s = Table(title="first rows")
    for c in info["columns"]:
        s.add_column(c["name"], overflow="fold")
    for r in info["sample"]:
        s.add_row(*["" if v is None else str(v)[:24] for v in r])
    console.print(s)


@data_app.command("prepare")
def data_prepare(
    config: Annotated[Path | None, typer.Argument(help="Experiment YAML (default: built-in).")]
    = None,
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the processed data "
                                                  "(default: OUTPUT_DIR/NAME/data).")] = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
) -> None:
    """Read, validate, split, fit the feature pipeline on train and write model-ready arrays,
    without training. Reports rows kept and rejected by reason, and every feature."""

    from sampan.config import load_config
    from sampan.data.store import build_store

    cfg = load_config(config, overrides=[*(set_ or []), *engine_sets(engine, address)])
    root = out or Path(cfg.output_dir) / cfg.name / "data"
    build_store(cfg, root, echo=console.print)
    console.print(f"processed data: {root}")


@data_app.command("build-sequences")
def data_build_sequences(
    events: Annotated[list[str], typer.Argument(help="Events file(s): one row per event.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet file to write.")],
    user: Annotated[str, typer.Option(help="User column.")] = "user_id",
    item: Annotated[str, typer.Option(help="Item column.")] = "item_id",
    category: Annotated[str | None, typer.Option(help="Item category column ('' for none).")]
    = "category_id",
    time: Annotated[str, typer.Option(help="Timestamp column (numbers).")] = "timestamp",
    action: Annotated[str | None, typer.Option(help="Action column ('' for none).")]
    = "behavior",
    positive: Annotated[str | None, typer.Option(
        help="Comma list of actions that are positives (default: every event).")] = None,
    history_actions: Annotated[str | None, typer.Option(
        help="Comma list of actions that enter histories (default: all).")] = None,
    targets: Annotated[str, typer.Option(help="'all' events become samples, or only "
                                              "'positive' ones.")] = "all",
    max_len: Annotated[int, typer.Option(help="Longest history kept (most recent).")] = 50,
    negatives: Annotated[int, typer.Option(help="Sampled negatives per positive.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the negative sampler.")] = 0,
    columns: Annotated[str | None, typer.Option(
        help="Comma list of column names for a file without header.")] = None,
    delimiter: Annotated[str | None, typer.Option(help="Field separator.")] = None,
    format: Annotated[str, typer.Option(
        help="auto (by extension), csv, tsv, parquet, jsonl, or sequence_lines: 'user item_1 "
             "item_2 ...' per line in time order (SASRec / S3-Rec files).")] = "auto",
) -> None:
    """Turn an events log into DIN-style samples: each target event with the user's history
    strictly before it (items and categories, most recent last), its label, and optional
    sampled negatives. Train on the output with a `sequence` feature sharing the item's
    vocabulary (see docs/guides/config.md, "Behaviour sequences from an events log")."""
    from sampan.data.behaviour import BuildOptions, build_sequences

    def split(v: str | None) -> list[str] | None:
        return [x for x in v.split(",") if x] if v else None

    opt = BuildOptions(user=user, item=item, category=category or None, time=time,
                       action=action or None, positive=split(positive),
                       history_actions=split(history_actions), targets=targets,
                       max_len=max_len, negatives=negatives, seed=seed,
                       header=columns is None, columns=split(columns), delimiter=delimiter,
                       format=format)
    if targets not in ("all", "positive"):
        fail(f"--targets must be 'all' or 'positive', got {targets!r}")
    r = build_sequences(events, out, opt)
    console.print(f"read {r.events:,} events ({r.rejected:,} rejected) of {r.users:,} users; "
                  f"wrote {r.samples:,} samples ({r.positives:,} positive, {r.negatives:,} "
                  f"negative), mean history {r.mean_history:.2f}, to {out}")
