"""Freshness: how long until a never-seen item that is clicked heavily moves its served score.

Everything runs for real on this machine: a Kafka-protocol broker (librdkafka's mock
cluster, inside the confluent-kafka wheel), ``sampan stream`` training from scratch with a
dynamic item table and publishing a version every ``--publish-seconds``, and ``sampan serve
--watch`` swapping the versions in. A producer thread writes click events at ``--rate``
events per second: users and items at random with a low click rate. Then, one after the
other, ``--items`` new items appear (a share ``--fresh-share`` of the events, clicked 90 %
of the time); for each, the time from its first event to the first served score that moved
by ``--move`` from the score the server gave it before is measured.

Prints the machine, the default-settings figures (p50 / p95 seconds to a moved score),
what bounds them (window, publish interval, export time, watch interval), and the push
size against rows touched x row bytes.

Usage::

    python benchmarks/freshness.py                 # 4 fresh items, about 3 minutes
    python benchmarks/freshness.py --items 8 --out results/freshness.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import machine  # noqa: E402
from sampan.data.kafka import LocalBroker  # noqa: E402
from sampan.export.publish import read_versions  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Producer(threading.Thread):
    """Click events at ``rate`` per second; ``fresh`` (when set) takes ``share`` of them."""

    def __init__(self, ck, brokers: str, rate: int, share: float, seed: int = 0):
        super().__init__(daemon=True)
        self.p = ck.Producer({"bootstrap.servers": brokers, "linger.ms": 20, "log_level": 0})
        self.rate, self.share, self.rng = rate, share, random.Random(seed)
        self.fresh: str | None = None
        self.first_sent: dict[str, float] = {}
        self.sent = 0
        self.stop = threading.Event()
        self.keys: set[tuple[str, str]] = set()  # (feature, value) since the last reset

    def event(self) -> bytes:
        r = self.rng
        item = f"i{int(r.paretovariate(1.2)) % 5000}"
        click = r.random() < 0.08
        if self.fresh is not None and r.random() < self.share:
            item, click = self.fresh, r.random() < 0.9
            self.first_sent.setdefault(item, time.time())
        user = f"u{r.randrange(20000)}"
        self.keys.update({("user_id", user), ("item_id", item)})
        return json.dumps({"user_id": user, "item_id": item, "click": int(click),
                           "ts": round(time.time(), 3)}).encode()

    def run(self) -> None:
        t0 = time.monotonic()
        self.error: BaseException | None = None
        try:
            self._produce(t0)
        except BaseException as e:  # told by the main thread
            self.error = e
            raise

    def _produce(self, t0: float) -> None:
        while not self.stop.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.sent < due:
                self.p.produce("clicks", value=self.event(), partition=0)
                self.sent += 1
            self.p.poll(0)
            time.sleep(0.01)
        self.p.flush(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--rate", type=int, default=2000, help="events per second")
    ap.add_argument("--fresh-share", type=float, default=0.05)
    ap.add_argument("--move", type=float, default=0.1, help="score change that counts")
    ap.add_argument("--window-rows", type=int, default=50_000, help="stream.window_rows "
                    "(the default)")
    ap.add_argument("--window-seconds", type=float, default=20.0, help="stream."
                    "window_seconds (the default)")
    ap.add_argument("--publish-seconds", type=float, default=20.0, help="stream.publish."
                    "every_seconds (the default)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per item")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import confluent_kafka as ck

    info = machine()
    print(json.dumps(info))
    broker = LocalBroker()
    brokers = broker.brokers
    work = Path(tempfile.mkdtemp(prefix="sampan-fresh-"))
    models = work / "models"
    cfg = {
        "name": "freshness", "output_dir": str(work / "runs"),
        "data": {"format": "jsonl"},
        "features": {"label": "click", "categorical": [
            "user_id", {"name": "item_id", "dynamic": {"capacity": 200_000}}]},
        "model": {"name": "deepfm", "embedding_dim": 16, "mlp": [64, 32]},
        "train": {"batch_size": 512, "lr": 0.003, "warmup_steps": 10, "tensorboard": False},
        "stream": {"source": "kafka", "format": "jsonl", "time_column": "ts",
                   "window_rows": args.window_rows, "window_seconds": args.window_seconds,
                   "kafka": {"brokers": brokers, "topic": "clicks"},
                   "publish": {"dir": str(models), "every_seconds": args.publish_seconds}},
    }
    (work / "stream.yaml").write_text(yaml.safe_dump(cfg))
    prod = Producer(ck, brokers, args.rate, args.fresh_share)
    prod.start()
    env = {**os.environ, "SAMPAN_ADMIN_TOKEN": "x"}
    log = open(work / "stream.log", "w")  # noqa: SIM115
    streamer = subprocess.Popen([sys.executable, "-m", "sampan", "stream",
                                 str(work / "stream.yaml"), "--run-dir", str(work / "run")],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    server = None
    results: dict = {"machine": info, "settings": vars(args) | {"out": str(args.out)},
                     "items": []}
    try:
        import httpx

        t0 = time.monotonic()
        while read_versions(models)["latest"] < 1:
            if streamer.poll() is not None or time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"no version was published; see {work / 'stream.log'}")
            time.sleep(0.5)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "sampan", "serve", "--watch",
                                   str(models), "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=30) as c:
            while True:
                try:
                    if c.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)

            def score(item: str) -> float:
                recs = [{"user_id": f"u{u}", "item_id": item} for u in range(50)]
                r = c.post(f"{url}/v1/predict", json={"records": recs})
                r.raise_for_status()
                return float(np.mean(r.json()["probabilities"]))

            for k in range(args.items):
                item = f"fresh{k}"
                before = score(item)
                prod.keys.clear()
                prod.fresh = item
                while item not in prod.first_sent:
                    time.sleep(0.01)
                while True:
                    if prod.error is not None or streamer.poll() is not None:
                        raise SystemExit(f"the producer ({prod.error!r}) or the stream "
                                         f"stopped; see {work / 'stream.log'}")
                    now = score(item)
                    waited = time.time() - prod.first_sent[item]
                    if abs(now - before) >= args.move or waited > args.timeout:
                        break
                    time.sleep(0.2)
                pub = c.get(f"{url}/readyz").json().get("published", {})
                rec = {"item": item, "seconds": round(waited, 2), "before": round(before, 4),
                       "after": round(now, 4), "moved": abs(now - before) >= args.move,
                       "served_version": pub.get("version")}
                print(json.dumps(rec), flush=True)
                results["items"].append(rec)
                prod.fresh = None
                time.sleep(2.0)
        touched = len(prod.keys)
    finally:
        prod.stop.set()
        if server is not None:
            server.terminate()
            server.communicate(timeout=30)
        streamer.terminate()
        streamer.wait(timeout=120)
        log.close()
    secs = np.array([r["seconds"] for r in results["items"]])
    versions = read_versions(models)["versions"]
    last = versions[-1] if versions else {}
    dim_bytes = 16 * 4
    results["summary"] = {
        "p50_s": float(np.percentile(secs, 50)), "p95_s": float(np.percentile(secs, 95)),
        "all_moved": all(r["moved"] for r in results["items"]),
        "push_bytes": last.get("bytes"),
        "rows_touched_last_item": touched, "touched_row_bytes": touched * dim_bytes,
        "versions": len(versions)}
    print(json.dumps(results["summary"]))
    print(f"freshness: p50 {results['summary']['p50_s']:.1f} s, p95 "
          f"{results['summary']['p95_s']:.1f} s to a served score that moved by "
          f"{args.move} (window {args.window_rows:,} rows / {args.window_seconds:g} s, "
          f"publish every {args.publish_seconds:g} s, watch every 1 s, {args.rate:,} "
          f"events/s); push {last.get('bytes', 0) / 1e6:.2f} MB (a full bundle) against "
          f"{touched:,} rows touched x {dim_bytes} B = {touched * dim_bytes / 1e6:.2f} MB")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
