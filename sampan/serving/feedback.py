"""The feedback log: served items joined with their events into labelled rows.

Two parts, as in ByteDance's Monolith (an online joiner of served features and user
actions):

- :class:`~sampan.serving.journal.JournalWriter`, one per serving process: what it
  served (every scored item of a response, with the features as the model saw them, its
  score, arm and model version) and the events it was sent, appended to
  ``dir/_journal/*.jsonl`` (see :mod:`sampan.serving.journal`);
- :class:`Joiner`, one per log: reads every journal from where it stopped, keeps each
  served item pending for ``window_seconds``, applies the events that name it, and writes
  the items whose window has closed as ``dir/YYYYMMDD/HH/part-<seq>.parquet`` (by the UTC
  hour served), with ``_SUCCESS`` once no row of the hour can still come. Its position is
  checkpointed (``dir/_journal/joiner.json``) after each part: a restarted joiner reads the
  journals again from the oldest pending item and skips what it already wrote, so a clean
  stop or a crash of the joiner loses nothing and writes nothing twice.

Events name ``(request_id, item)`` (``item``: the item's key in ``/v1/rank`` and
``/v1/recommend``; for ``/v1/predict`` the record's position as a string). The rule: a
served item's column for an event type is 1 when at least one event of that type arrived
within the window, and ``label`` is 1 when any of the ``label_events`` did. A repeat is
counted as a duplicate; an event after the window as late (not learned from); an event
naming nothing served within the window as unknown.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sampan.errors import SampanError
from sampan.serving.journal import JOURNAL, JournalWriter, json_ready, read_lines, served_items

__all__ = ["JOURNAL", "STATE", "UNSHOWN", "DeliveryError", "Joiner", "JoinerProcess",
           "JournalWriter", "KafkaSink", "LogBusy", "saved_failure", "saved_stats"]

UNSHOWN = "_unshown"
STATE = "joiner.json"


class LogBusy(SampanError):
    """Another joiner is writing this feedback log (one joiner per ``feedback.dir``)."""


def _lock(path: Path, wait: float) -> Any:
    """An exclusive lock on ``path`` (held while the returned file is open), waiting up to
    ``wait`` seconds for another holder to let go."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: one joiner per log is the user's to keep
        return None
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open: the lock
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.seek(0)
                holder = f.read().strip() or "?"
                f.close()
                raise LogBusy(f"another joiner (pid {holder}) is writing the feedback log "
                              f"{path.parent.parent}: one joiner per feedback.dir") from None
            time.sleep(0.05)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def saved_stats(root: str | Path) -> dict[str, Any]:
    """A feedback log's counts as its joiner saved them after its last pass (empty before
    the first): rows ``written``, ``late`` / ``duplicate`` / ``unknown`` events, ... and
    the items and events ``pending``."""
    st = _saved_state(root)
    return {**st.get("counts", {}), **st.get("pending", {})}


def saved_failure(root: str | Path) -> dict[str, Any] | None:
    """What made the joiner's last pass fail (``{"at": unix time, "error": text}``), or
    None when it succeeded (or none has run)."""
    return _saved_state(root).get("failure")


def _saved_state(root: str | Path) -> dict[str, Any]:
    """The joiner's saved state of the log at ``root`` ({} before its first pass)."""
    try:
        return json.loads((Path(root) / JOURNAL / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as a table with every column any of them has (arms whose models read
    different features share a part; a row without a column has null there)."""
    names = list(dict.fromkeys(c for r in rows for c in r))
    return pa.table({c: [r.get(c) for r in rows] for c in names})


def _hour(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y%m%d/%H")


class Joiner:
    """Turns the journals under ``root`` into labelled Parquet rows (see the module doc).
    :meth:`step` does one pass; :meth:`start` runs it every ``poll_seconds`` in a thread."""

    def __init__(self, root: str | Path, window_seconds: float = 300.0,
                 label_events: list[str] | tuple[str, ...] = ("click",),
                 event_types: list[str] | tuple[str, ...] = ("impression", "click",
                                                              "conversion"),
                 flush_seconds: float = 1.0, poll_seconds: float = 1.0,
                 sink: KafkaSink | None = None, lock_wait: float = 30.0):
        self.root = Path(root)
        self.sink = sink
        self.dir = self.root / JOURNAL
        self.dir.mkdir(parents=True, exist_ok=True)
        # one joiner per log, until stop() (or this object is gone): LogBusy after
        # lock_wait seconds
        self._held = _lock(self.dir / "joiner.lock", lock_wait)
        self.window = window_seconds
        self.label_events = list(label_events)
        self.event_types = list(event_types)
        self.flush_seconds = flush_seconds
        self.poll_seconds = poll_seconds
        self.pending: dict[tuple[str, str], dict[str, Any]] = {}
        self.orphans: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.recent: dict[tuple[str, str], float] = {}  # written items, for late events
        self.counts: Counter = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        st = self._load_state()
        self.read = st.get("read", {})  # journal -> byte offset read and counted up to
        self.written_until = st.get("written_until", -math.inf)  # served_at cut-off written
        self.seq = st.get("seq", 0)
        self.done_hours = set(st.get("done_hours", []))
        self.counts.update(st.get("counts", {}))
        self._finish(st.get("renames", []))
        self._replay(st.get("replay", {}), {(n, o) for n, o in st.get("orphans", [])})

    @classmethod
    def from_config(cls, fb: Any, lock_wait: float = 30.0) -> Joiner:
        """The joiner of a serve config's ``feedback`` section."""
        sink = KafkaSink(fb.kafka) if fb.kafka is not None else None
        return cls(fb.dir, fb.window_seconds, fb.label_events, fb.event_types,
                   fb.flush_seconds, sink=sink, lock_wait=lock_wait)

    # ------------------------------------------------------------------- state
    def _load_state(self) -> dict[str, Any]:
        p = self.dir / STATE
        return json.loads(p.read_text()) if p.exists() else {}

    def _save_state(self, replay: dict[str, int], renames: list[list[str]],
                    orphans: list[tuple[str, int]]) -> None:
        self._write_state({"read": self.read, "replay": replay, "renames": renames,
                           "orphans": orphans, "written_until": self.written_until,
                           "seq": self.seq, "done_hours": sorted(self.done_hours),
                           "counts": dict(self.counts),
                           "pending": {k: v for k, v in self.stats().items()
                                       if k in ("pending", "orphan_events")}})

    def _write_state(self, st: dict[str, Any]) -> None:
        """``st`` as the saved state, replaced whole (a crash leaves the old or the new)."""
        p = self.dir / STATE
        tmp = p.with_name(STATE + ".tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, p)

    def _save_failure(self, e: Exception) -> None:
        """After a failed pass: the last checkpoint as it was, with the count of failed
        passes and what failed (``failure``, until a pass succeeds), for /readyz and
        /metrics (the rest of the counts stay those of the checkpoint's lines)."""
        st = self._load_state()
        st.setdefault("counts", {})["errors"] = self.counts["errors"]
        st["failure"] = {"at": time.time(), "error": f"{type(e).__name__}: {e}"}
        self._write_state(st)

    def _replay(self, replay: dict[str, int], orphans: set[tuple[str, int]]) -> None:
        """After a restart: the items served after the last written cut-off, and the
        events for them, read again from the oldest pending item's (or waiting event's)
        line. Counters are not counted twice: they were checkpointed with ``read``; the
        events that were waiting for their item (``orphans``) had not been counted, and
        are counted when they join it or when their wait ends (``unknown``)."""
        for name, start in replay.items():
            path = self.dir / name
            if not path.exists():
                continue
            stop = self.read.get(name, 0)
            for off, _, rec in read_lines(path, start, stop):
                self._apply(name, off, rec, count=(name, off) in orphans)

    # ------------------------------------------------------------------- reading
    @staticmethod
    def _key(rec: dict[str, Any]) -> tuple[str, str]:
        item = rec.get("item")
        return (str(rec.get("request_id")),
                str(item) if item is not None else str(rec.get("position")))

    def _apply(self, name: str, off: int, rec: dict[str, Any] | None, count: bool) -> None:
        if rec is None:
            self.counts["bad_lines"] += count
            return
        if rec.get("k") == "r":
            for item in served_items(rec):
                self._apply(name, off, item, count)
            return
        if rec.get("k") == "s":
            if not count and rec["served_at"] <= self.written_until:
                return  # replayed after a restart: written before it
            key = self._key(rec)
            row = {**rec, "_at": (name, off), "_seen": set()}
            self.pending[key] = row
            self.counts["served"] += count
            for ev in self.orphans.pop(key, []):  # counted now, whenever it was read
                self._event(row, ev, ev["_count"])
            return
        key = self._key(rec)
        row = self.pending.get(key)
        if row is not None:
            self._event(row, rec, count)
        elif key in self.recent:
            self.counts["late"] += count
        else:  # its item may still be in another process's unflushed journal
            self.orphans.setdefault(key, []).append({**rec, "_got": time.time(),
                                                     "_count": count, "_at": (name, off)})

    def _event(self, row: dict[str, Any], ev: dict[str, Any], count: bool) -> None:
        kind = ev.get("type")
        if kind not in self.event_types:
            self.counts["unknown_type"] += count
            return
        t = ev.get("ts", ev.get("received_at", row["served_at"]))
        if t > row["served_at"] + self.window:
            self.counts["late"] += count
        elif kind in row["_seen"]:
            self.counts["duplicate"] += count
        else:
            row["_seen"].add(kind)
            self.counts[f"events_{kind}"] += count

    def _read_new(self) -> None:
        for path in sorted(self.dir.glob("*.jsonl")):
            start = self.read.get(path.name, 0)
            for off, nxt, rec in read_lines(path, start):
                self._apply(path.name, off, rec, count=True)
                self.read[path.name] = nxt
            self.read.setdefault(path.name, start)

    # ------------------------------------------------------------------- writing
    def _row(self, r: dict[str, Any]) -> dict[str, Any]:
        seen = r["_seen"]
        out = {"request_id": str(r["request_id"]), "position": int(r["position"]),
               "item": None if r.get("item") is None else str(r["item"]),
               "unit": None if r.get("unit") is None else str(r["unit"]),
               "variant": r.get("variant"), "model_version": r.get("model_version"),
               "forced": bool(r.get("forced", False)), "served_at": float(r["served_at"]),
               "score": float(r["score"]), "propensity": r.get("propensity"),
               "label": int(any(e in seen for e in self.label_events))}
        for e in self.event_types:
            out[e] = int(e in seen)
        return {**r.get("f", {}), **out}

    def step(self, now: float | None = None) -> int:
        """Read the journals, write the items whose window has closed; returns how many."""
        now = time.time() if now is None else now
        self._read_new()
        cut = now - self.window
        ready = [k for k, r in self.pending.items() if r["served_at"] <= cut]
        by_hour: dict[str, list[dict[str, Any]]] = {}
        for k in ready:
            r = self.pending[k]
            # candidates scored but not shown (exploration on): beside the log, for
            # off-policy evaluation; the report and the stream source skip "_" folders
            where = _hour(r["served_at"]) if r["position"] >= 0 else \
                f"{UNSHOWN}/{_hour(r['served_at'])}"
            by_hour.setdefault(where, []).append(self._row(r))
        if self.sink is not None and ready:  # delivered first: a failure changes nothing
            self.counts.update(self.sink.send([row for h, rows in by_hour.items()
                                               if not h.startswith(UNSHOWN) for row in rows]))
        for k in ready:
            self.recent[k] = self.pending.pop(k)["served_at"]
        tmp_parts = []
        for hour, rows in by_hour.items():
            d = self.root / hour
            d.mkdir(parents=True, exist_ok=True)
            final = d / f"part-{self.seq:06d}.parquet"
            tmp = d / f".part-{self.seq:06d}.parquet.tmp"
            pq.write_table(_table(rows), tmp)
            tmp_parts.append((tmp, final))
            self.seq += 1
            self.counts["written"] += len(rows)
        self._expire(now)  # the events whose wait is over: counted unknown, not replayed
        # the oldest line any pending item (or an orphan) came from: where a restart reads
        replay: dict[str, int] = {}
        orphans = [e["_at"] for evs in self.orphans.values() for e in evs]
        for name, off in [r["_at"] for r in self.pending.values()] + orphans:
            replay[name] = min(replay.get(name, off), off)
        for name in self.read:
            replay.setdefault(name, self.read[name])
        if ready:
            self.written_until = max(self.written_until, cut)
        self._mark_done(now)
        # the state that says these rows are written is saved first, naming the parts; then
        # they become visible (a restart in between finishes the renames)
        self._save_state(replay, [[str(t), str(f)] for t, f in tmp_parts], orphans)
        self._finish(tmp_parts)
        self._drop_read_journals(replay, now)
        return len(ready)

    def _finish(self, parts: list[tuple[Path, Path]] | list[list[str]]) -> None:
        for tmp, final in parts:
            if Path(tmp).exists():
                os.replace(tmp, final)

    def _expire(self, now: float) -> None:
        horizon = now - self.window - 4 * self.flush_seconds - self.poll_seconds
        for k, evs in list(self.orphans.items()):
            if all(e.get("ts", e["_got"]) < horizon for e in evs):
                self.counts["unknown"] += sum(e["_count"] for e in evs)
                del self.orphans[k]
        old = now - 10 * self.window
        self.recent = {k: t for k, t in self.recent.items() if t >= old}

    def _mark_done(self, now: float) -> None:
        """``_SUCCESS`` in each hour that no item can still join: its end is past the window
        and the journals' flush, and nothing of it is pending."""
        open_hours = {_hour(r["served_at"]) for r in self.pending.values()}
        for d in self.root.glob("[0-9]" * 8 + "/[0-9][0-9]"):
            hour = f"{d.parent.name}/{d.name}"
            if hour in self.done_hours or hour in open_hours:
                continue
            end = datetime.strptime(hour, "%Y%m%d/%H").replace(
                tzinfo=timezone.utc).timestamp() + 3600
            if end + self.window + 4 * self.flush_seconds + self.poll_seconds < now:
                (d / "_SUCCESS").touch()
                self.done_hours.add(hour)

    def _drop_read_journals(self, replay: dict[str, int], now: float) -> None:
        """A journal read to its end, with nothing pending in it, and untouched for longer
        than a window is removed (its writer has moved on or stopped)."""
        for name, off in list(self.read.items()):
            path = self.dir / name
            if not path.exists():
                del self.read[name]
                continue
            if replay.get(name, off) >= path.stat().st_size == off and \
                    path.stat().st_mtime < now - self.window - 60:
                path.unlink()
                del self.read[name]

    # ------------------------------------------------------------------- running
    def run(self, done: Any = None) -> None:
        """A pass every ``poll_seconds`` until :meth:`stop` (or ``done()`` is true); a
        pass that fails is counted (``errors``) and logged, and the next one retries."""
        while not self._stop.wait(self.poll_seconds) and not (done and done()):
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - kept running; the next pass retries
                self.counts["errors"] += 1
                self._save_failure(e)
                if isinstance(e, DeliveryError):
                    print(f"sampan-joiner: {e}", file=sys.stderr, flush=True)
                else:
                    traceback.print_exc()

    def start(self) -> Joiner:
        """:meth:`run` in a thread of this process (see :class:`JoinerProcess`)."""
        self._thread = threading.Thread(target=self.run, daemon=True, name="sampan-joiner")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the pass under way; everything pending stays in the journals and the
        next joiner takes it up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.sink is not None:
            self.sink.close()
        if self._held is not None:
            self._held.close()
            self._held = None

    def stats(self) -> dict[str, Any]:
        return {**dict(self.counts), "pending": len(self.pending),
                "orphan_events": sum(len(v) for v in self.orphans.values())}


def _join_until_gone(fb: dict[str, Any], stop: Any, parent: int) -> None:
    """The body of :class:`JoinerProcess`: wait for the log's lock, then join until told to
    stop (a message on ``stop``, the child's end of a pipe, or the pipe closed) or the
    serving process is gone."""
    from sampan.config.serve import FeedbackConfig

    try:  # background work: the serving processes come first for the cores
        os.nice(10)
    except (AttributeError, OSError):
        pass
    cfg = FeedbackConfig(**fb)

    def done() -> bool:
        return stop.poll() or os.getppid() != parent

    while True:
        if done():
            return
        try:
            joiner = Joiner.from_config(cfg, lock_wait=1.0)
            break
        except LogBusy:  # another server joins this log: this one journals only
            continue
    try:
        joiner.run(done)
    finally:
        joiner.stop()


class JoinerProcess:
    """The joiner of a serve config's ``feedback`` log in a process of its own, so that its
    passes never hold the serving process's interpreter lock (its threads share one; the
    joiner's Python work would otherwise lengthen the slowest responses). While another
    process's joiner holds the log (a second server on the same ``feedback.dir``), it
    waits, and takes over when that one stops; it stops with the server, or within a
    ``poll`` when the server is killed. Its counts: :func:`saved_stats`."""

    def __init__(self, fb: Any):
        self.fb = fb

    def start(self) -> JoinerProcess:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # nothing of the server's threads or sockets
        # a pipe, not an Event: no named semaphore for the resource tracker to miss at exit
        self._stop, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_join_until_gone, name="sampan-joiner",
                                   args=(self.fb.model_dump(), child_end, os.getpid()),
                                   daemon=True)
        self.process.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """After the pass under way (a pass that takes longer is cut short: the next
        joiner takes its rows up)."""
        try:
            self._stop.send("stop")
        except OSError:  # the joiner has gone already
            pass
        self._stop.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def stats(self) -> dict[str, Any]:
        return saved_stats(self.fb.dir)


class DeliveryError(RuntimeError):
    """Rows the Kafka sink could not deliver: the joiner's pass changes nothing, and the
    next pass sends them again."""


class KafkaSink:
    """Sends labelled rows to a Kafka topic (serve config ``feedback.kafka``): one JSON
    object per row, keyed ``request_id:item``, waiting for the broker's acknowledgement so
    that the joiner checkpoints only what was delivered (at least once)."""

    def __init__(self, cfg: Any, timeout: float = 30.0):
        try:
            import confluent_kafka as ck
        except ImportError:
            from sampan.errors import ConfigError

            raise ConfigError("feedback.kafka needs confluent-kafka: pip install "
                              "'sampan[stream]'") from None
        self.topic, self.brokers, self.timeout = cfg.topic, cfg.brokers, timeout
        self.producer = ck.Producer({"bootstrap.servers": cfg.brokers, "acks": "all",
                                     "linger.ms": 5, "log_level": 0, **cfg.options})
        self._delivered_now = 0

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is None:
            self._delivered_now += 1

    def send(self, rows: list[dict[str, Any]]) -> Counter:
        """Send ``rows`` and wait for them, ``timeout`` seconds at most in all:
        ``{"kafka_sent": n}``. Raises :class:`DeliveryError` when some were not delivered
        in time, after dropping this call's undelivered rows from the producer's queue (the
        joiner's pass fails before its checkpoint, and the next pass sends them again)."""
        self._delivered_now = 0
        deadline = time.monotonic() + self.timeout
        for r in rows:
            key = f"{r['request_id']}:{r['item'] if r['item'] is not None else r['position']}"
            while True:
                try:
                    self.producer.produce(self.topic, json.dumps(r, default=json_ready).encode(),
                                          key.encode(), on_delivery=self._delivered)
                    break
                except BufferError:  # the local queue is full: let it drain, in time
                    if time.monotonic() >= deadline:
                        self._give_up(len(rows))
                    self.producer.poll(0.1)
        self.producer.flush(max(0.0, deadline - time.monotonic()))
        if self._delivered_now < len(rows):
            self._give_up(len(rows))
        return Counter({"kafka_sent": len(rows)})

    def _give_up(self, n: int) -> None:
        missing = n - self._delivered_now
        self.producer.purge()  # what is queued goes: the next pass sends it again
        self.producer.poll(0)
        raise DeliveryError(f"feedback.kafka: {missing} of {n} rows were not delivered to "
                            f"topic {self.topic!r} at {self.brokers} within {self.timeout:g} "
                            "s; the log writes nothing until they are (the next pass sends "
                            "them again)")

    def close(self) -> None:
        self.producer.flush(self.timeout)
