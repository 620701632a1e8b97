"""``sampan kafka``: a local Kafka broker to try a stream on, and a log file replayed into a
topic."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from sampan.cli.base import app, console

kafka_app = typer.Typer(help="A local Kafka broker to try a stream on, and a log file "
                        "replayed into a topic (needs pip install 'sampan[stream]').",
                        no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(kafka_app, name="kafka")


@kafka_app.command("broker")
def kafka_broker(
    address_file: Annotated[Path | None, typer.Option(
        help="Also write the broker's address (host:port) to this file, for scripts; "
        "removed at start and when the broker stops.")]
    = None,
) -> None:
    """Run a Kafka-protocol broker on 127.0.0.1 until Ctrl-C or SIGTERM, and print its
    address. It is librdkafka's mock cluster (inside the confluent-kafka wheel: no Java, no
    Docker): real clients speak to it over TCP, but it keeps only about the last 5 MB of
    each partition, in memory, and creates a topic with 4 partitions the first time
    something is sent to it. For trying `sampan stream` and for tests, not for production.

    Example:

      sampan kafka broker --address-file broker.txt &
    """
    from sampan.data.kafka import LocalBroker

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if address_file is not None:  # an earlier broker's address is no longer true
        address_file.unlink(missing_ok=True)
    with LocalBroker() as broker:
        if address_file is not None:
            tmp = address_file.with_name(address_file.name + ".tmp")
            tmp.write_text(broker.brokers + "\n")
            tmp.replace(address_file)  # a reader never sees half an address
        console.print(f"Kafka broker at [bold]{broker.brokers}[/] (in memory; Ctrl-C stops "
                      "it)", soft_wrap=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            if address_file is not None:  # ... nor is this one's, once it stops
                address_file.unlink(missing_ok=True)


@kafka_app.command("produce")
def kafka_produce(
    file: Annotated[Path, typer.Argument(help="CSV / TSV (gzip, zstd too), JSON lines or "
                                         "Parquet.")],
    brokers: Annotated[str, typer.Option(help="host:port[,host:port...] of the cluster.")],
    topic: Annotated[str, typer.Option(help="The topic to send to.")],
    format: Annotated[str, typer.Option(
        "--format", help="auto (by extension), csv, tsv, jsonl or parquet.")] = "auto",
    columns: Annotated[str | None, typer.Option(
        help="Comma-separated column names, in file order: needed with --no-header; with a "
        "header they rename it.")] = None,
    header: Annotated[bool, typer.Option("--header/--no-header",
                                         help="Whether a CSV / TSV file's first line names "
                                         "the columns.")] = True,
    delimiter: Annotated[str | None, typer.Option(
        help="One character (default: tab for tsv, comma for csv).")] = None,
    key: Annotated[str | None, typer.Option(
        help="Key each message by this column (a user's events stay in one partition, in "
        "order).")] = None,
    rate: Annotated[float | None, typer.Option(
        min=0.001, help="Messages per second (default: as fast as the broker takes them).")]
    = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Send only the first N records.")]
    = None,
    stamp: Annotated[str | None, typer.Option(
        help="Set this column to the send time in epoch seconds (the stream's time_column, "
        "so that its lag counts from now).")] = None,
) -> None:
    """Send a file's records to a Kafka topic, one JSON object per message (what
    `stream.format: jsonl` reads), and wait until the broker has them all.

    Example:

      sampan kafka produce clicks.csv --brokers localhost:9092 --topic clicks --key user_id
    """
    from sampan.data.kafka import replay

    n = replay(file, brokers, topic, fmt=format, header=header, delimiter=delimiter,
               columns=columns.split(",") if columns else None, key=key, rate=rate,
               limit=limit, stamp=stamp)
    console.print(f"sent {n:,} records of {file} to {topic!r} on {brokers}", soft_wrap=True)
