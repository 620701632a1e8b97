"""The feedback journal: what a serving process served and the events it was sent.

:class:`JournalWriter`, one per serving process, appends JSON lines to
``dir/_journal/<host>-<pid>-<ms>.jsonl``: one per response (``"k": "r"``: request id,
unit, arm, model version, forced, ``served_at``; its items' ``item``, ``position``,
``score`` and ``propensity`` as columns under ``items``; the features as the model saw
them as columns under ``f``) and one per event (``"k": "e"``). A background thread writes
every ``flush_seconds`` (a process killed outright loses at most the lines of one
interval); requests only hand over references, and the encoding happens in that thread,
a chunk of responses at a time. :func:`read_lines` and :func:`served_items` read them back
(for :class:`~sampan.serving.feedback.Joiner`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

JOURNAL = "_journal"


def json_ready(v: Any) -> Any:
    """A JSON-ready value (NumPy scalars and arrays, as the feature tables give them)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _columns(features: pa.Table | list[dict[str, Any]] | None) -> dict[str, list[Any]]:
    """A response's features as JSON-ready columns: a NaN is null; ``_`` columns are
    bookkeeping, left out."""
    if features is None:
        return {}
    if isinstance(features, pa.Table):
        out = {}
        for name, col in zip(features.column_names, features.columns, strict=True):
            if name.startswith("_"):
                continue
            if pa.types.is_floating(col.type):
                col = pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)
            out[name] = col.to_pylist()
        return out
    names = dict.fromkeys(c for r in features for c in r)
    return {c: [json_ready(r.get(c)) for r in features] for c in names}


def served_items(rec: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The served items of a journal line: a response's (``"k": "r"``), or one item."""
    if rec.get("k") != "r":
        yield rec
        return
    items, f = rec["items"], rec.get("f") or {}
    meta = {k: v for k, v in rec.items() if k not in ("k", "items", "f")}
    for i in range(len(items["item"])):
        yield {"k": "s", **meta, **{k: v[i] for k, v in items.items()},
               "f": {c: v[i] for c, v in f.items()}}


def read_lines(path: Path, start: int, stop: int | None = None):  # type: ignore
    """``(offset, next offset, record)`` of each whole line from byte ``start`` (to
    ``stop``); a line still being written (no newline yet) waits for the next pass."""
    with open(path, "rb") as f:
        f.seek(start)
        off = start
        for line in f:
            if not line.endswith(b"\n") or (stop is not None and off >= stop):
                return
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # whole lines are written, so this is damage:
                rec = None                # skipped and counted
            yield off, off + len(line), rec
            off += len(line)


class JournalWriter:
    """Appends served items and events to this process's journal (see the module doc)."""

    CHUNK = 16  # responses encoded at a time (the interpreter is let go between them)

    def __init__(self, root: str | Path, flush_seconds: float = 1.0):
        self.dir = Path(root) / JOURNAL
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}.jsonl"
        self.path = self.dir / name
        self.flush_seconds = flush_seconds
        self._buf: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self.written = Counter()  # what reached the disk: served items, events
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="sampan-feedback-journal")
        self._thread.start()

    def served(self, meta: dict[str, Any], items: list[dict[str, Any]],
               features: pa.Table | list[dict[str, Any]] | None) -> None:
        """One response: ``meta`` (request_id, unit, variant, model_version, forced,
        served_at), ``items`` (item, position, score, propensity) and the features of
        each item in the same order (a table or records)."""
        with self._lock:
            self._buf.append(("s", (meta, items, features)))

    def events(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            self._buf.append(("e", events))

    def _lines(self, batch: list[tuple[str, Any]]) -> tuple[list[str], Counter]:
        """One line per response (its items and their features as columns: one JSON
        encoding per response, not per item) and one per event."""
        out, n = [], Counter()
        # the feature tables of one schema are made JSON-ready together, then cut apart
        groups: dict[pa.Schema, list[int]] = {}
        for i, (kind, payload) in enumerate(batch):
            if kind == "s" and isinstance(payload[2], pa.Table):
                groups.setdefault(payload[2].schema, []).append(i)
        features_of: dict[int, dict[str, list[Any]]] = {}
        for rows in groups.values():
            cols, at = _columns(pa.concat_tables([batch[i][1][2] for i in rows])), 0
            for i in rows:
                size = batch[i][1][2].num_rows
                features_of[i] = {c: v[at:at + size] for c, v in cols.items()}
                at += size
        for i, (kind, payload) in enumerate(batch):
            if kind == "s":
                meta, items, features = payload
                cols = {k: [it.get(k) for it in items]  # an item's own keys win over meta's
                        for k in dict.fromkeys(k for it in items for k in it)}
                f = features_of[i] if i in features_of else _columns(features)
                out.append(json.dumps({"k": "r", **meta, "items": cols, "f": f},
                                      default=json_ready))
                n["served"] += len(items)
            else:
                for e in payload:
                    out.append(json.dumps({"k": "e", **e}, default=json_ready))
                n["events"] += len(payload)
        return out, n

    def flush(self) -> None:
        with self._lock:
            batch, self._buf = self._buf, []
        if not batch:
            return
        lines, n = [], Counter()
        for i in range(0, len(batch), self.CHUNK):
            if i:  # let the serving threads have the interpreter between chunks
                time.sleep(0)
            got, k = self._lines(batch[i:i + self.CHUNK])
            lines += got
            n.update(k)
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.written.update(n)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            self.flush()

    def close(self) -> None:
        """Write what is left (a clean stop loses nothing)."""
        self._stop.set()
        self._thread.join()
        self.flush()
        self._file.close()
