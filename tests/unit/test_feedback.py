"""The feedback journal and joiner: labels by the documented rule, late / duplicate /
unknown events counted, hours closed with _SUCCESS, nothing lost or written twice across a
restart, and a killed writer loses at most one flush interval."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest

from sampan.experiment.log import read_log
from sampan.serving.feedback import JOURNAL, Joiner, JoinerProcess, JournalWriter, LogBusy

WINDOW = 60.0


def serve(w: JournalWriter, rid: str, t: float, items=("a", "b", "c"), unit="u1"):
    w.served({"request_id": rid, "unit": unit, "variant": "control", "model_version": "m@1",
              "forced": False, "served_at": t},
             [{"item": it, "position": i, "score": 0.1 * (i + 1), "propensity": None}
              for i, it in enumerate(items)],
             [{"user_id": unit, "item_id": it, "price": 1.5 * i} for i, it in enumerate(items)])


def test_rows_are_labelled_by_the_rule_and_odd_events_counted(tmp_path):
    t0 = time.time() - 3 * 3600  # two hours ago and more: the hour can be closed
    w = JournalWriter(tmp_path, flush_seconds=60)
    serve(w, "r1", t0)
    serve(w, "r2", t0 + 1, unit=None)
    w.events([{"request_id": "r1", "item": "b", "type": "click", "ts": t0 + 5},
              {"request_id": "r1", "item": "b", "type": "click", "ts": t0 + 6},      # repeat
              {"request_id": "r1", "item": "c", "type": "conversion", "ts": t0 + 7},
              {"request_id": "r2", "item": "a", "type": "click", "ts": t0 + WINDOW + 5},  # late
              {"request_id": "r2", "item": "a", "type": "like", "ts": t0 + 2},       # type?
              {"request_id": "nope", "item": "a", "type": "click", "ts": t0 + 3}])   # unknown
    w.close()
    j = Joiner(tmp_path, window_seconds=WINDOW, flush_seconds=0.1, poll_seconds=0.1)
    assert j.step(now=t0 + 10) == 0  # windows still open: nothing written
    assert j.step() == 6
    j.step()  # the unknown event's wait is over by now too
    log = read_log(tmp_path)
    rows = {(r["request_id"], r["item"]): r for r in log.to_pylist()}
    assert len(rows) == 6
    assert rows[("r1", "b")]["label"] == 1 and rows[("r1", "b")]["click"] == 1
    assert rows[("r1", "c")]["label"] == 0 and rows[("r1", "c")]["conversion"] == 1
    assert rows[("r2", "a")]["label"] == 0  # its click came after the window
    assert rows[("r1", "a")]["price"] == 0.0 and rows[("r1", "c")]["item_id"] == "c"
    assert rows[("r2", "b")]["unit"] is None and rows[("r1", "a")]["unit"] == "u1"
    s = j.stats()
    assert (s["duplicate"], s["late"], s["unknown_type"], s["unknown"]) == (1, 1, 1, 1)
    hours = [p.parent for p in tmp_path.rglob("part-*.parquet")]
    assert all((h / "_SUCCESS").exists() for h in hours)


def test_events_waiting_for_their_item_survive_a_restart(tmp_path):
    """An event whose item is not in any journal yet waits (it may be in another process's
    unflushed journal). Across a joiner's restart it still joins its item when that comes,
    or is counted unknown when its wait ends: counted once either way."""
    t0 = time.time() - 3 * 3600
    w = JournalWriter(tmp_path, flush_seconds=60)
    w.events([{"request_id": "r1", "item": "b", "type": "click", "ts": t0 + 5},
              {"request_id": "nope", "item": "a", "type": "click", "ts": t0 + 3}])
    w.close()
    j = Joiner(tmp_path, window_seconds=WINDOW)
    assert j.step(now=t0 + 10) == 0 and j.stats()["orphan_events"] == 2
    j.stop()
    w2 = JournalWriter(tmp_path, flush_seconds=60)  # another process's journal, later
    serve(w2, "r1", t0)
    w2.close()
    j = Joiner(tmp_path, window_seconds=WINDOW)
    assert j.stats()["orphan_events"] == 2  # read again from the saved state
    assert j.step() == 3
    s = j.stats()
    assert (s["events_click"], s["unknown"], s["orphan_events"]) == (1, 1, 0), s
    rows = {r["item"]: r["label"] for r in read_log(tmp_path).to_pylist()}
    assert rows == {"a": 0, "b": 1, "c": 0}
    j.stop()
    j = Joiner(tmp_path, window_seconds=WINDOW)  # nothing is counted twice
    j.step()
    assert (j.stats()["events_click"], j.stats()["unknown"]) == (1, 1)
    j.stop()


def test_arms_with_different_features_keep_all_their_columns_in_one_part(tmp_path):
    t0 = time.time() - 3 * 3600
    w = JournalWriter(tmp_path, flush_seconds=60)
    meta = {"unit": "u1", "forced": False, "served_at": t0}
    item = [{"item": "a", "position": 0, "score": 0.5, "propensity": None}]
    # the candidate's model reads one feature, control's three; the candidate row comes first
    w.served({**meta, "request_id": "r1", "variant": "candidate", "model_version": "lr@1"},
             item, [{"segment": "s1"}])
    w.served({**meta, "request_id": "r2", "variant": "control", "model_version": "fm@1",
              "served_at": t0 + 1}, item, [{"segment": "s1", "user_id": "u1", "age": 30}])
    w.close()
    j = Joiner(tmp_path, window_seconds=WINDOW)
    assert j.step() == 2
    parts = list(tmp_path.rglob("part-*.parquet"))
    assert len(parts) == 1  # one part holds both arms
    rows = {r["variant"]: r for r in read_log(tmp_path).to_pylist()}
    assert (rows["control"]["user_id"], rows["control"]["age"]) == ("u1", 30)
    assert (rows["candidate"]["user_id"], rows["candidate"]["age"]) == (None, None)


def test_one_joiner_per_log_and_a_second_server_waits_its_turn(tmp_path):
    from sampan.config.serve import FeedbackConfig

    j = Joiner(tmp_path, window_seconds=WINDOW)
    with pytest.raises(LogBusy, match=f"pid {os.getpid()}.*one joiner per feedback.dir"):
        Joiner(tmp_path, window_seconds=WINDOW, lock_wait=0.2)
    w = JournalWriter(tmp_path, flush_seconds=60)
    serve(w, "r1", time.time() - WINDOW - 10)
    w.close()
    # a server's joiner, in its own process: it waits while the log is held, then joins
    p = JoinerProcess(FeedbackConfig(dir=str(tmp_path), window_seconds=WINDOW)).start()
    try:
        time.sleep(2.0)
        assert not list(tmp_path.rglob("part-*.parquet")) and p.stats() == {}
        j.stop()
        for _ in range(200):
            if p.stats().get("written"):
                break
            time.sleep(0.1)
        assert p.stats()["written"] == 3 and p.stats()["pending"] == 0
        assert read_log(tmp_path).num_rows == 3
    finally:
        p.stop()
    assert not p.process.is_alive()
    Joiner(tmp_path, window_seconds=WINDOW, lock_wait=0.2).stop()  # let go of the log


def test_a_restart_loses_nothing_and_writes_nothing_twice(tmp_path):
    now = time.time()
    w = JournalWriter(tmp_path, flush_seconds=60)
    for i in range(10):  # the first five old enough to be written, the rest still open
        serve(w, f"r{i}", now - WINDOW - 50 + (i // 5) * 100)
    w.events([{"request_id": "r7", "item": "a", "type": "click", "ts": now - 1}])
    w.flush()
    j = Joiner(tmp_path, window_seconds=WINDOW)
    assert j.step(now=now) == 15
    j.stop()
    # more traffic while no joiner runs; a new one takes up the pending rows and the new ones
    serve(w, "r10", now + 1)
    w.events([{"request_id": "r8", "item": "c", "type": "click", "ts": now + 2}])
    w.close()
    j2 = Joiner(tmp_path, window_seconds=WINDOW)
    assert j2.pending.keys() >= {("r7", "a"), ("r8", "c")}
    assert j2.step(now=now + 2 * WINDOW) == 18
    log = read_log(tmp_path).to_pylist()
    keys = [(r["request_id"], r["item"]) for r in log]
    assert len(keys) == len(set(keys)) == 33
    labels = {(r["request_id"], r["item"]): r["label"] for r in log}
    assert labels[("r7", "a")] == 1 and labels[("r8", "c")] == 1 and sum(labels.values()) == 2
    assert j2.stats()["served"] == 33  # counted once, not again on the replay


def test_an_item_that_reaches_the_journal_late_is_still_written(tmp_path):
    """A line flushed after the joiner has written past its served_at (another worker's
    slow journal, a loaded machine) is written on the next pass, not skipped."""
    now = time.time()
    w1 = JournalWriter(tmp_path, flush_seconds=60)
    serve(w1, "r1", now - WINDOW - 20)
    w1.flush()
    j = Joiner(tmp_path, window_seconds=WINDOW)
    assert j.step(now=now) == 3
    w2 = JournalWriter(tmp_path, flush_seconds=60)  # served before the cut, flushed after it
    serve(w2, "r2", now - WINDOW - 10)
    w2.events([{"request_id": "r2", "item": "b", "type": "click", "ts": now - WINDOW - 5}])
    w2.close()
    assert j.step(now=now + 1) == 3
    log = read_log(tmp_path).to_pylist()
    assert len(log) == 6 and sum(r["label"] for r in log if r["request_id"] == "r2") == 1
    w1.close()
    j.stop()
    # a restart replays nothing of it a second time
    assert Joiner(tmp_path, window_seconds=WINDOW).step(now=now + 2) == 0


def test_a_killed_writer_loses_at_most_one_flush_interval(tmp_path):
    flush = 0.2
    child = textwrap.dedent(f"""
        import os, sys, time
        from sampan.serving.feedback import JournalWriter
        w = JournalWriter(sys.argv[1], flush_seconds={flush})
        side = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        i = 0
        while True:
            w.served({{"request_id": f"r{{i}}", "unit": "u", "variant": "control",
                       "model_version": "m", "forced": False, "served_at": time.time()}},
                     [{{"item": "a", "position": 0, "score": 0.5, "propensity": None}}],
                     [{{"item_id": "a"}}])
            os.write(side, f"{{i}} {{time.time()}}\\n".encode())  # handed over, and when
            i += 1
            time.sleep(0.002)
    """)
    side = tmp_path / "handed.txt"
    p = subprocess.Popen([sys.executable, "-c", child, str(tmp_path / "log"), str(side)],
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    time.sleep(2.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    killed = time.time()
    handed = [line.split() for line in side.read_text().splitlines() if line.strip()]
    journal = next((tmp_path / "log" / JOURNAL).glob("*.jsonl"))
    lines = [x for x in journal.read_bytes().split(b"\n") if x]
    saved = len(lines) - (0 if journal.read_bytes().endswith(b"\n") else 1)
    lost = len(handed) - saved
    # every row handed over before the last flush interval (and a margin for the
    # scheduler) is on disk
    old_enough = sum(float(t) < killed - flush - 0.3 for _, t in handed)
    print(f"handed {len(handed)}, saved {saved}, lost {lost}")
    assert 0 <= lost and saved >= old_enough
    assert saved > 100


def test_feedback_config_refuses_a_label_event_it_does_not_accept():
    from sampan.config import FeedbackConfig

    with pytest.raises(ValueError, match="label_events"):
        FeedbackConfig(label_events=["purchase"])
    # written parts are ordinary Parquet the stream's directory source reads
    assert pq is not None


def test_shown_rows_also_go_to_kafka_and_a_failed_send_changes_nothing(tmp_path,
                                                                       kafka_broker):
    """feedback.kafka: each shown item's row is sent, keyed request_id:item, before the
    joiner's checkpoint; unshown candidates are not; a send that fails leaves every row
    pending and nothing written, and the next pass delivers."""
    from sampan.config import FeedbackConfig
    from sampan.serving.feedback import DeliveryError, KafkaSink, saved_failure, saved_stats

    ck, brokers = kafka_broker
    now = time.time()
    w = JournalWriter(tmp_path, flush_seconds=60)
    serve(w, "r1", now - WINDOW - 10)
    serve(w, "r2", now - WINDOW - 5)
    w.served({"request_id": "r2", "unit": "u1", "variant": "control", "model_version": "m@1",
              "forced": False, "served_at": now - WINDOW - 5},
             [{"item": "d", "position": -1, "score": 0.05, "propensity": 0.1}],
             [{"user_id": "u1", "item_id": "d", "price": 0.0}])  # scored, not shown
    w.events([{"request_id": "r1", "item": "b", "type": "click", "ts": now - WINDOW - 8}])
    w.close()
    cfg = FeedbackConfig(dir=str(tmp_path), window_seconds=WINDOW,
                         kafka={"brokers": "127.0.0.1:9", "topic": "feedback"})
    j = Joiner.from_config(cfg)
    j.sink = KafkaSink(cfg.kafka, timeout=1.0)  # nothing listens there
    for _ in range(2):  # each failed pass counts its own rows: none are left queued
        with pytest.raises(DeliveryError, match="6 of 6 rows were not delivered"):
            j.step(now=now)
        assert len(j.sink.producer) == 0
    assert len(j.pending) == 7 and not any(tmp_path.rglob("*.parquet"))
    # a queue too small for the pass's rows: the wait for room is bounded too
    tiny = KafkaSink(cfg.kafka.model_copy(update={"options": {
        "queue.buffering.max.messages": "2"}}), timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(DeliveryError, match="6 of 6"):
        tiny.send([j._row(r) for r in j.pending.values() if r["position"] >= 0])
    assert time.monotonic() - t0 < 5
    # a joiner that keeps failing says so where /readyz and /metrics read (the checkpoint
    # itself unchanged), until a pass succeeds
    j.poll_seconds = 0.01
    j.run(done=lambda: j.counts["errors"] >= 3)
    assert saved_stats(tmp_path)["errors"] == 3
    assert "not delivered" in saved_failure(tmp_path)["error"]
    j.sink = KafkaSink(cfg.kafka.model_copy(update={"brokers": brokers}))
    assert j.step(now=now) == 7
    assert saved_failure(tmp_path) is None and saved_stats(tmp_path)["errors"] == 3
    j.stop()
    c = ck.Consumer({"bootstrap.servers": brokers, "group.id": "t", "log_level": 0,
                     "auto.offset.reset": "earliest"})
    c.subscribe(["feedback"])
    got: dict = {}
    deadline = time.time() + 20
    while len(got) < 6 and time.time() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            got[m.key().decode()] = json.loads(m.value())
    c.close()
    log = {f"{r['request_id']}:{r['item']}": r for r in read_log(tmp_path).to_pylist()}
    assert set(got) == set(log) and len(got) == 6  # the unshown "r2:d" is not sent
    assert got["r1:b"]["label"] == 1 and got["r1:b"]["price"] == log["r1:b"]["price"]
    assert sum(r["label"] for r in got.values()) == 1
    assert j.stats()["kafka_sent"] == 6
