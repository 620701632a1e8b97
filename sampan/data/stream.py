"""Stream sources: records that keep arriving, read with the same parsing, validation and
quarantine as batch files, in windows whose stream position can be checkpointed.

Two sources, one interface (:class:`DirectorySource`, :class:`KafkaSource`):

- ``poll(timeout)`` returns the next :class:`Chunk` of typed, validated rows (or ``None``
  when nothing arrived in time);
- ``advance(position, chunk, k)`` is the stream position after the first ``k`` rows of a
  chunk (a JSON-able dict, saved with the model);
- ``commit(position)`` tells the broker what the checkpoint holds (Kafka's group offsets;
  a no-op for directories).

A source is opened *at* a position: reading restarts exactly after the last row a
checkpoint holds, so each record is trained on once however often the trainer is killed.
:class:`WindowReader` cuts the chunks into windows of ``window_rows`` rows (or fewer when
``window_seconds`` pass first).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from sampan.config import DataConfig, StreamConfig
from sampan.data.io.paths import StreamInput
from sampan.data.joins import SideTable
from sampan.data.rejects import RejectLog
from sampan.data.roles import LINE_COLUMN, ColumnRoles
from sampan.data.sources import read_inputs
from sampan.errors import ConfigError, DataError


@dataclass
class Chunk:
    """Validated rows from one lane of a source (a Kafka partition, a directory partition):
    ``ends[i]`` is the lane's position after row ``i``, ``end`` the position after the whole
    chunk (past rejected records too). A chunk may hold no rows (it then only moves the
    position on, over rejected records or to a partition's end)."""

    table: pa.Table
    lane: str
    ends: np.ndarray
    end: int
    done: bool = False  # a directory partition read to its end


def parse_config(data: DataConfig, stream: StreamConfig) -> DataConfig:
    """The data section a stream's records are parsed with: ``stream.format``, and for
    message formats no header (a Kafka message is one record)."""
    update: dict[str, Any] = {"format": stream.format}
    if stream.source == "kafka":
        update["header"] = False
        if stream.format in ("csv", "tsv") and not data.columns:
            raise ConfigError(f"stream.format {stream.format} from Kafka: each message is one "
                              "line without a header, so data.columns must list the column "
                              "names in order")
    return data.model_copy(update=update)


# ---------------------------------------------------------------------------- directories
class DirectorySource:
    """Time-partitioned directories (``root/20261201/13/part-*``), each partition read once,
    in path order, when complete (its done-file, or ``quiet_seconds`` without a change).
    Files at the root are a partition of their own only when the root has no partition
    folders; folders whose name starts with ``_`` or ``.`` are skipped.

    The position is ``{"partition": path relative to root, "rows": usable rows of it
    read, "done": whether it was read to its end}``; partitions that sort before it are done. A
    partition that appears later but sorts before the position is reported once and
    skipped (it would break the time order)."""

    def __init__(self, stream: StreamConfig, data: DataConfig, roles: ColumnRoles,
                 log: RejectLog, position: dict[str, Any] | None = None):
        import pyarrow.fs as pafs

        d = stream.directory
        assert d is not None
        self.cfg, self.roles, self.log, self.d = data, roles, log, d
        root = d.root
        try:
            self.fs, self.root = pafs.FileSystem.from_uri(root)
        except (pa.ArrowInvalid, ValueError):  # a plain local path
            from pathlib import Path

            self.fs, self.root = pafs.LocalFileSystem(), str(Path(root).expanduser().resolve())
        info = self.fs.get_file_info(self.root)
        if info.type != pafs.FileType.Directory:
            raise DataError(f"stream.directory.root {root!r} is not a directory")
        self.sides = [SideTable(j, roles) for j in data.joins]
        self.position = dict(position or {"partition": "", "rows": 0, "done": False})
        self.known = {p for p, _, _ in self.partitions()}  # there when the stream opened
        self.late: list[str] = []  # appeared later, sorting before the cursor: skipped
        self._it = self._chunks()

    # -------------------------------------------------------------- the partitions
    def partitions(self) -> list[tuple[str, list[str], bool]]:
        """Every partition under the root, in order: (relative path, its data files in
        order, whether it is complete)."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
        folders: dict[str, list[Any]] = {}
        for f in infos:
            if f.type != pafs.FileType.File:
                continue
            rel = f.path[len(self.root):].lstrip("/")
            parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
            if any(p.startswith((".", "_")) for p in parent.split("/") if p):
                continue  # _temporary/ and hidden folders hold no partition
            folders.setdefault(parent, []).append(f)
        if len(folders) > 1:  # partition folders: files beside them at the root (a feedback
            folders.pop("", None)  # log's experiment.json) are no partition
        now = time.time()
        out = []
        for part in sorted(folders):
            files = folders[part]
            data = sorted(f.path for f in files if not f.base_name.startswith((".", "_")))
            marked = self.d.done_file is not None and any(
                f.base_name == self.d.done_file for f in files)
            quiet = self.d.quiet_seconds is not None and data and all(
                f.mtime is not None and now - f.mtime.timestamp() >= self.d.quiet_seconds
                for f in files)
            out.append((part, data, bool(marked or quiet)))
        return out

    def _next_partition(self) -> tuple[str, list[str]] | None:
        pos = self.position
        for part, files, complete in self.partitions():
            if part < pos["partition"] or (part == pos["partition"] and pos["done"]):
                if part not in self.known:
                    self.known.add(part)
                    self.late.append(part)
                continue
            if not complete:
                return None  # partitions are read in order: wait for this one
            return part, files
        return None

    def _chunks(self) -> Iterator[Chunk | None]:
        """Chunks from where the source has read to (``self.position``, a checkpoint's
        position when opened), ``None`` while no complete partition is waiting."""
        while True:
            nxt = self._next_partition()
            if nxt is None:
                yield None
                continue
            part, files = nxt
            skip = self.position["rows"] if part == self.position["partition"] else 0
            inputs = [StreamInput(f"{self.d.root.rstrip('/')}/{f[len(self.root):].lstrip('/')}",
                                  fs=self.fs, fs_path=f) for f in files]
            seen = 0
            for table in read_inputs(self.cfg, inputs, self.roles, self.log, self.sides):
                n = table.num_rows
                lo = min(n, max(0, skip - seen))  # rows a checkpoint already holds
                self.log.read -= lo  # ... which the run that trained them counted
                self.log.kept -= lo
                seen += n
                if lo < n:
                    self.position = {"partition": part, "rows": seen, "done": False}
                    yield Chunk(table.slice(lo), part, np.arange(seen - n + lo + 1, seen + 1),
                                seen)
            if seen < skip:
                raise DataError(f"stream partition {part!r} now has {seen:,} usable rows, "
                                f"but {skip:,} of it were already trained on: a partition "
                                "must not change once it is complete")
            self.position = {"partition": part, "rows": seen, "done": True}
            yield Chunk(_empty(self.roles), part, np.zeros(0, np.int64), seen, done=True)

    def poll(self, timeout: float) -> Chunk | None:
        deadline = time.monotonic() + timeout
        while True:
            got = next(self._it)
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self.d.poll_seconds, left))

    def advance(self, position: dict[str, Any], chunk: Chunk, k: int) -> dict[str, Any]:
        whole = k >= chunk.table.num_rows
        rows = chunk.end if whole else int(chunk.ends[k - 1])
        return {"partition": chunk.lane, "rows": rows, "done": bool(whole and chunk.done)}

    def seek(self, position: dict[str, Any]) -> None:
        """Read on from ``position`` (what the last checkpoint holds)."""
        self.position = dict(position)
        self._it = self._chunks()

    def commit(self, position: dict[str, Any]) -> None:
        """Nothing to tell: the checkpoint holds the cursor."""

    def close(self) -> None:
        pass


def _empty(roles: ColumnRoles) -> pa.Table:
    """A table with no rows (a chunk that only moves the position on)."""
    cols = {c: pa.array([], pa.float64() if c in roles.numeric or c in roles.labels else
                        pa.list_(pa.string()) if c in roles.lists else pa.string())
            for c in roles.all}
    cols[LINE_COLUMN] = pa.array([], pa.int64())
    return pa.table(cols)


# ---------------------------------------------------------------------------------- Kafka
class KafkaSource:
    """A Kafka topic read through ``confluent-kafka``, one record per message.

    The partitions the topic has when the stream starts are assigned to this consumer
    (no group rebalancing: one trainer reads the topic). The position is ``{"offsets":
    {partition: next offset}}``; the consumer seeks there on start, so the checkpoint, not
    the group's committed offsets, decides where reading resumes. Offsets are committed to
    the group only after a checkpoint holds them (lag monitoring sees trained records).
    Rejected messages are written to the rejects file as ``kafka:TOPIC/PARTITION`` with
    their offset as the line number."""

    def __init__(self, stream: StreamConfig, data: DataConfig, roles: ColumnRoles,
                 log: RejectLog, position: dict[str, Any] | None = None):
        try:
            import confluent_kafka as ck
        except ImportError:
            raise ConfigError("stream.source kafka needs confluent-kafka: pip install "
                              "'sampan[stream]'") from None
        k = stream.kafka
        assert k is not None
        self.ck, self.k, self.cfg, self.roles, self.log = ck, k, data, roles, log
        self.sides = [SideTable(j, roles) for j in data.joins]
        self._said: set[int] = set()
        # librdkafka logs each failed connection attempt (hundreds of lines while a broker
        # is down): its errors come through _on_error instead, each said once
        self.consumer = ck.Consumer({
            "bootstrap.servers": k.brokers, "group.id": k.group,
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": k.start, "log_level": 0, "error_cb": self._on_error,
            **k.options})
        meta = self._metadata()
        topic = meta.topics.get(k.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            self.consumer.close()
            raise DataError(f"stream.kafka.topic {k.topic!r} is not available on {k.brokers}"
                            + (f": {topic.error}" if topic is not None and topic.error else ""))
        self.partitions = sorted(topic.partitions)
        self.seek(position or {"offsets": {}})
        self._ready: list[Chunk] = []

    CONNECT_SECONDS = 30  # to get the topic's metadata at start
    DOWN_SECONDS = 10  # ... of which brokers that refuse every connection get this long

    def _metadata(self) -> Any:
        """The topic's metadata; a clear :class:`DataError` when the brokers cannot be
        reached (a broker that is down fails within ``DOWN_SECONDS``)."""
        ck, k = self.ck, self.k
        t0 = time.monotonic()
        while True:
            try:
                return self.consumer.list_topics(k.topic, timeout=2)
            except ck.KafkaException as e:
                err = e.args[0] if e.args else None
                waited = time.monotonic() - t0
                down = err is not None and err.code() == ck.KafkaError._TRANSPORT
                if waited < (self.DOWN_SECONDS if down else self.CONNECT_SECONDS):
                    continue
                self.consumer.close()
                why = err.str() if err is not None else str(e)
                raise DataError(
                    f"cannot reach the Kafka brokers {k.brokers} (stream.kafka.brokers) for "
                    f"topic {k.topic!r} after {waited:.0f} s: {why}; is the broker "
                    "running there?") from None

    def _on_error(self, err: Any) -> None:
        """librdkafka's errors while streaming (a broker gone, say): each kind said once
        on stderr; the stream itself waits (and stops after ``idle_stop_seconds``)."""
        if err.code() not in self._said:  # the text differs attempt by attempt
            self._said.add(err.code())
            print(f"kafka: {err.str()}", file=sys.stderr, flush=True)

    def seek(self, position: dict[str, Any]) -> None:
        ck = self.ck
        offsets = {int(p): int(o) for p, o in position.get("offsets", {}).items()}
        self.consumer.assign([ck.TopicPartition(
            self.k.topic, p, offsets.get(p, ck.OFFSET_BEGINNING if self.k.start == "earliest"
                                         else ck.OFFSET_END)) for p in self.partitions])
        self._ready = []

    def poll(self, timeout: float) -> Chunk | None:
        if not self._ready:
            msgs = self.consumer.consume(num_messages=10_000, timeout=timeout)
            self._ready = self._parse(msgs)
        return self._ready.pop(0) if self._ready else None

    def _parse(self, msgs: list[Any]) -> list[Chunk]:
        runs: list[tuple[int, int, list[bytes]]] = []  # partition, first offset, values
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == self.ck.KafkaError._PARTITION_EOF:
                    continue
                if err.fatal() or not err.retriable():
                    raise DataError(f"stream.kafka {self.k.topic!r}: {err.str()}")
                continue
            p, off = m.partition(), m.offset()
            value = (m.value() or b"").replace(b"\r", b" ").replace(b"\n", b" ")
            if runs and runs[-1][0] == p and runs[-1][1] + len(runs[-1][2]) == off:
                runs[-1][2].append(value)
            else:
                runs.append((p, off, [value]))
        chunks = []
        for p, first, values in runs:
            src = StreamInput(f"kafka:{self.k.topic}/{p}", data=b"\n".join(values) + b"\n",
                              first_line=first)
            end = first + len(values)
            tables = list(read_inputs(self.cfg, [src], self.roles, self.log, self.sides))
            for t in tables:
                lines = t.column(LINE_COLUMN).to_numpy()
                chunks.append(Chunk(t, str(p), lines + 1, int(lines[-1]) + 1))
            chunks.append(Chunk(_empty(self.roles), str(p), np.zeros(0, np.int64), end))
        return chunks

    def advance(self, position: dict[str, Any], chunk: Chunk, k: int) -> dict[str, Any]:
        offsets = dict(position.get("offsets", {}))
        if k >= chunk.table.num_rows:
            offsets[chunk.lane] = chunk.end
        elif k:
            offsets[chunk.lane] = int(chunk.ends[k - 1])
        return {"offsets": offsets}

    def commit(self, position: dict[str, Any]) -> None:
        ck = self.ck
        parts = [ck.TopicPartition(self.k.topic, int(p), int(o))
                 for p, o in position.get("offsets", {}).items()]
        if parts:
            try:
                self.consumer.commit(offsets=parts, asynchronous=False)
            except ck.KafkaException:  # the checkpoint, not the group, is the position
                pass

    def close(self) -> None:
        self.consumer.close()


def open_source(stream: StreamConfig, data: DataConfig, roles: ColumnRoles, log: RejectLog,
                position: dict[str, Any] | None = None) -> DirectorySource | KafkaSource:
    cls = KafkaSource if stream.source == "kafka" else DirectorySource
    return cls(stream, parse_config(data, stream), roles, log, position)


# -------------------------------------------------------------------------------- windows
@dataclass
class Window:
    """Consecutive rows of the stream and the position after them."""

    table: pa.Table
    position: dict[str, Any]
    opened: float  # time.time() when its first row arrived


class WindowReader:
    """Cuts a source's chunks into windows of ``window_rows`` rows, or fewer when
    ``window_seconds`` pass after a window's first row. Rows left over from a chunk start the
    next window. With ``idle_stop_seconds``, :meth:`next` returns ``None`` when no record
    arrived for that long; ``stop()`` (from a signal handler) ends the current wait."""

    def __init__(self, source: DirectorySource | KafkaSource, stream: StreamConfig,
                 position: dict[str, Any] | None):
        self.source, self.s = source, stream
        self.position = dict(position or {})
        self._pending: Chunk | None = None
        self._at = 0  # rows of the pending chunk already taken
        self._stop = False
        self.last_row = time.monotonic()

    def stop(self) -> None:
        self._stop = True

    @property
    def stopped(self) -> bool:
        return self._stop

    def next(self) -> Window | None:
        s = self.s
        parts: list[pa.Table] = []
        n, opened, opened_mono = 0, 0.0, 0.0
        while n < s.window_rows and not self._stop:
            if self._pending is None:
                wait = 0.5
                if n and s.window_seconds is not None:
                    wait = min(wait, max(0.0, opened_mono + s.window_seconds
                                         - time.monotonic()))
                chunk = self.source.poll(wait)
                if chunk is None:
                    if n and s.window_seconds is not None and \
                            time.monotonic() - opened_mono >= s.window_seconds:
                        break
                    if s.idle_stop_seconds is not None and \
                            time.monotonic() - self.last_row >= s.idle_stop_seconds:
                        break
                    continue
                self._pending, self._at = chunk, 0
            chunk = self._pending
            rows = chunk.table.num_rows
            take = min(s.window_rows - n, rows - self._at)
            if take:
                if not n:
                    opened, opened_mono = time.time(), time.monotonic()
                parts.append(chunk.table.slice(self._at, take))
                n += take
                self.last_row = time.monotonic()
            self._at += take
            self.position = self.source.advance(self.position, chunk, self._at)
            if self._at >= rows:
                self._pending = None
        if not n:
            return None
        return Window(pa.concat_tables(parts), dict(self.position), opened)
