"""Kafka at hand: a local Kafka-protocol broker to try a stream on, and a replay of a log file
into a topic.

:class:`LocalBroker` is librdkafka's mock cluster, inside the ``confluent-kafka`` wheel: a
real Kafka-protocol broker (producers and consumers speak to it over TCP as to any broker)
that lives in this process, keeps about the last 5 MB of each partition in memory, and
creates a topic, with 4 partitions, the first time something is produced to it. It is for
trying things and for tests; a production stream reads a real cluster.

:func:`replay` sends the records of a CSV / TSV / JSON-lines / Parquet file to a topic, one
JSON object per message, optionally keyed by a column and at a steady rate: a backfill, or
yesterday's log played as if it were arriving now."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from sampan.errors import ConfigError, DataError


def import_kafka(what: str) -> Any:
    """``confluent_kafka``, or a ConfigError saying how to install it."""
    try:
        import confluent_kafka as ck
    except ImportError:
        raise ConfigError(f"{what} needs confluent-kafka: pip install 'sampan[stream]'") \
            from None
    return ck


class LocalBroker:
    """A Kafka-protocol broker on 127.0.0.1 (librdkafka's mock cluster), alive until
    :meth:`close`; ``brokers`` is its ``host:port``."""

    def __init__(self) -> None:
        ck = import_kafka("a local Kafka broker")
        self._owner = ck.Producer({"test.mock.num.brokers": 1, "bootstrap.servers": "",
                                   "log_level": 0})
        meta = self._owner.list_topics(timeout=10)
        self.brokers = ",".join(f"{b.host}:{b.port}" for b in meta.brokers.values())

    def create(self, topic: str) -> None:
        """Create ``topic`` now (4 partitions), before anything is sent to it: a stream
        reads the partitions a topic has when it starts."""
        self._owner.list_topics(topic, timeout=10)

    def close(self) -> None:
        if self._owner is not None:
            self._owner.flush(1)
            self._owner = None

    def __enter__(self) -> LocalBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _records(path: Path, fmt: str, columns: list[str] | None, header: bool,
             delimiter: str | None) -> Iterator[list[dict[str, Any]]]:
    """The file's records as dicts, a block at a time, values typed as Arrow infers them."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from sampan.data.io.paths import detect_format

    fmt = detect_format(path, fmt)
    if fmt == "parquet":
        for batch in pq.ParquetFile(path).iter_batches(batch_size=65536, columns=columns):
            yield batch.to_pylist()
    elif fmt == "jsonl":
        from sampan.data.io.lines import iter_lines

        for lines, line_no, too_long in iter_lines(path, 16 << 20):  # 16 MB at a time
            if too_long is not None:
                raise DataError(f"{path}, line {line_no}: longer than 16 MB")
            try:
                yield [json.loads(x) for x in lines.to_pylist() if x.strip()]
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: a line from {line_no} on is not JSON: {e}") \
                    from None
    elif fmt in ("csv", "tsv"):
        if not header and not columns:
            raise ConfigError(f"{path}: a file without a header needs --columns")
        delimiter = delimiter or ("\t" if fmt == "tsv" else ",")
        if len(delimiter) > 1:  # MovieLens-1M's '::': newline-aligned blocks, as training
            from sampan.data.io.delimited import one_byte_delimiter, raw_blocks, read_header

            names = columns or read_header(path, delimiter, "utf-8")
            for k, (block, _, too_long) in enumerate(raw_blocks(path, 16 << 20)):
                if too_long is not None:
                    raise DataError(f"{path}: a line is longer than 16 MB")
                if k == 0 and header:  # the header line is no record
                    block = block[block.find(b"\n") + 1 or len(block):]
                data, sep = one_byte_delimiter(block, delimiter)
                if data.strip():
                    yield pacsv.read_csv(pa.BufferReader(data), read_options=pacsv.ReadOptions(
                        column_names=names), parse_options=pacsv.ParseOptions(
                        delimiter=sep, quote_char=False)).to_pylist()
            return
        # with a header and columns, the header line is skipped and the columns rename it
        read = pacsv.ReadOptions(column_names=columns, skip_rows=1 if header and columns else 0,
                                 block_size=16 << 20)
        parse = pacsv.ParseOptions(delimiter=delimiter)
        with pacsv.open_csv(pa.input_stream(str(path), compression="detect"),
                            read_options=read, parse_options=parse) as reader:
            for batch in reader:
                yield batch.to_pylist()
    else:
        raise ConfigError(f"{path}: replay reads csv, tsv, jsonl or parquet files, not {fmt}")


def replay(path: Path, brokers: str, topic: str, *, fmt: str = "auto",
           columns: list[str] | None = None, header: bool = True,
           delimiter: str | None = None, key: str | None = None, rate: float | None = None,
           limit: int | None = None, stamp: str | None = None,
           options: dict[str, Any] | None = None) -> int:
    """Send the records of ``path`` to ``topic``, one JSON object per message, and wait
    until the broker has them all. ``key``: the column whose value keys each message (a
    user's events stay in one partition, in order); ``rate``: messages per second (default:
    as fast as the broker takes them); ``limit``: the first records only; ``stamp``: a
    column set to the send time, in epoch seconds (the stream's ``time_column``, so its lag
    is measured from now). Returns the number of messages sent."""
    ck = import_kafka("sampan kafka produce")
    producer = ck.Producer({"bootstrap.servers": brokers, "linger.ms": 20, "log_level": 0,
                            **(options or {})})
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    sent, t0 = 0, time.monotonic()
    for block in _records(path, fmt, columns, header, delimiter):
        for rec in block:
            if limit is not None and sent >= limit:
                break
            if key is not None and key not in rec:
                raise DataError(f"--key {key!r} is not a column of {path}; it has "
                                f"{list(rec)}")
            if stamp is not None:
                rec[stamp] = round(time.time(), 3)
            value = json.dumps(rec, default=str).encode()
            k = None if key is None else str(rec[key]).encode()
            while True:
                try:
                    producer.produce(topic, value, key=k, on_delivery=delivered)
                    break
                except BufferError:  # the local queue is full: let the broker catch up
                    producer.poll(0.1)
            sent += 1
            if rate is not None:
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            producer.poll(0)
        if limit is not None and sent >= limit:
            break
    left = producer.flush(60)
    if left or failed:
        raise DataError(f"{left + len(failed)} of {sent} messages did not reach {topic!r} on "
                        f"{brokers}" + (f": {failed[0]}" if failed else " within 60 s"))
    return sent
