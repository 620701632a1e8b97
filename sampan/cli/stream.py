"""``sampan stream``: online training from a Kafka topic or time-partitioned directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sampan.cli.base import SetOpt, app, console, fail

# what a stream config may set on top of a --from run's own config
STREAM_KEYS = ("stream", "data", "name", "output_dir")


@app.command()
def stream(
    config: Annotated[Path | None, typer.Argument(
        help="Experiment YAML with a stream: section. With --from, only its stream:, data:, "
        "name and output_dir are read; the model and features are the run's.")] = None,
    set_: SetOpt = None,
    from_run: Annotated[Path | None, typer.Option(
        "--from", metavar="RUN_DIR",
        help="Start from a batch-trained run: its weights, feature pipeline (numeric "
        "statistics and vocabularies stay frozen), model and features.")] = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", metavar="RUN_DIR",
        help="Continue a stream run from its last checkpoint, exactly after the last record "
        "it holds (uses the run's own config; --set may change where it reads and "
        "publishes: stream.kafka.brokers, stream.kafka.options, stream.directory.root, "
        "stream.publish, and when it stops).")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Write the run here instead of OUTPUT_DIR/NAME/TIMESTAMP.")] = None,
) -> None:
    """Train continuously on a stream, in windows of rows. Each window is scored before it is
    trained on (progressive validation: AUC and LogLoss per window and as a moving average,
    in metrics.jsonl and TensorBoard), then checkpointed together with the stream position:
    a run killed at any moment and resumed trains on every record exactly once. SIGTERM or
    Ctrl-C stops after the current window, with a checkpoint.

    Examples:

      sampan stream configs/stream_directory.yaml                 # from scratch

      sampan stream configs/stream_kafka.yaml --from runs/ctr/20261201-101500

      sampan stream --resume runs/stream/20261201-120000
    """
    import yaml

    from sampan.config import ConfigError, load_config
    from sampan.export.publish import Publisher
    from sampan.train.online import run_stream

    if resume is not None:
        if config is not None or from_run is not None:
            fail("--resume uses the run's saved config (and its --from); do not pass CONFIG "
                 "or --from with it (--set may change where the stream is read and "
                 "published: stream.kafka.brokers, say)")
        run_stream(None, run_dir=resume, resume=True, console=console,  # type: ignore[arg-type]
                   publisher=Publisher, overrides=set_ or [])
        return
    if from_run is not None:
        saved = from_run / "config.yaml"
        if not saved.exists():
            fail(f"--from {from_run}: not a run directory (no config.yaml)")
        raw = yaml.safe_load(saved.read_text()) or {}
        if config is not None:
            try:
                mine = yaml.safe_load(config.read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"{config}: cannot read it as YAML: {e}") from None
            raw.update({k: mine[k] for k in STREAM_KEYS if k in mine})
        cfg = load_config(raw=raw, overrides=set_ or [])
    else:
        if config is None:
            fail("give a config with a stream: section (or --from RUN_DIR with one)")
        cfg = load_config(config, overrides=set_ or [])
    if cfg.stream is None:
        fail("the config has no stream: section; see `sampan stream --help` and "
             "docs/guides/online-training.md")
    run_stream(cfg, run_dir=run_dir, from_run=from_run, console=console, publisher=Publisher)
