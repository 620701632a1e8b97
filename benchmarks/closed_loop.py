"""The whole loop, simulated: users whose clicks are known hit a real A/B server, their
clicks flow through the feedback log to online training, and fresh models reach serving.

Everything runs for real on this machine:

- a :class:`~sampan.data.synthetic.Marketplace` world (users, items, the true click
  probability of every pair); two models trained on uniformly random impressions of it:
  control (DeepFM on ids, segment, category, age, price) and a deliberately weaker
  candidate (a logistic regression on segment and category only);
- a Kafka-protocol broker (librdkafka's mock cluster, inside the confluent-kafka wheel);
- ``sampan serve`` with the two arms (50/50 by user), exploration on the first item,
  the feedback log (Parquet and the Kafka topic); control also follows the directory
  that the stream publishes to;
- ``sampan stream`` training control's model from the topic and publishing versions;
- simulated users: each request ranks ``--candidates`` random items for a random user,
  the user sees the ``--k`` returned and clicks each with its true probability, and the
  clicks are posted to ``/v1/feedback``.

Then ``sampan experiment report`` and ``sampan experiment ope`` read the log. Printed:

- freshness: from a click to the first served model trained on its row (p50 / p95);
- each arm's CTR with the report's interval, against the oracle's expected CTR of what
  that arm showed; the report's lift against the oracle's lift;
- the OPE estimates of both trained models on the logged traffic, against the true CTR
  of their greedy choices on the same requests.

Usage::

    python benchmarks/closed_loop.py                    # 150 s of traffic, about 5 minutes
    python benchmarks/closed_loop.py --out benchmarks/results/closed_loop.json \
        --readme docs/guides/ab-tests.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy import machine  # noqa: E402
from sampan.data.kafka import LocalBroker  # noqa: E402
from sampan.data.synthetic import Marketplace, MarketplaceTruth  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_models(world: MarketplaceTruth, work: Path, rows: int) -> dict[str, Path]:
    """Control (DeepFM) and the weaker candidate (LR on segment and category), trained on
    ``rows`` uniformly random impressions; their runs and exported bundles."""
    import pyarrow.csv as pcsv
    from rich.console import Console

    from sampan.config import load_config
    from sampan.export import export_run
    from sampan.train.experiment import run_experiment

    pcsv.write_csv(world.users_table(), work / "users.csv")
    pcsv.write_csv(world.items_table(), work / "items.csv")
    pcsv.write_csv(world.impressions(rows).drop_columns(["oracle_p"]), work / "train.csv")
    joins = [{"path": str(work / "users.csv"), "by": "user_id"},
             {"path": str(work / "items.csv"), "by": "item_id"}]
    control = {
        "output_dir": str(work / "runs"), "data": {"train": str(work / "train.csv"),
                                                   "joins": joins},
        "features": {"categorical": ["user_id", "item_id", "segment", "category"],
                     "numeric": [{"name": "age", "standardize": True},
                                 {"name": "price", "log1p": True}]},
        "model": {"name": "deepfm", "embedding_dim": 16},
        "train": {"epochs": 3, "batch_size": 512, "progress": False, "tensorboard": False}}
    weak = {**control, "features": {"categorical": ["segment", "category"]},
            "model": {"name": "lr"}}
    out: dict[str, Path] = {"control_config": control}  # type: ignore[dict-item]
    for name, raw in (("control", control), ("candidate", weak)):
        run = run_experiment(load_config(raw=raw), run_dir=work / f"run-{name}",
                             console=Console(quiet=True))["run_dir"]
        out[f"{name}_run"] = Path(run)
        out[name] = Path(export_run(run, work / f"bundle-{name}"))
    return out


class Topic(threading.Thread):
    """Reads the feedback topic from the start: where each clicked row landed."""

    def __init__(self, ck, brokers: str, topic: str):
        super().__init__(daemon=True)
        self.c = ck.Consumer({"bootstrap.servers": brokers, "group.id": "closed-loop-watch",
                              "auto.offset.reset": "earliest", "log_level": 0})
        self.c.subscribe([topic])
        self.where: dict[str, tuple[str, int]] = {}  # clicked row's key -> partition, offset
        self.rows = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            m = self.c.poll(0.2)
            if m is None or m.error() is not None:
                continue
            self.rows += 1
            if json.loads(m.value())["label"] == 1:
                self.where[m.key().decode()] = (str(m.partition()), m.offset())
        self.c.close()


class Served(threading.Thread):
    """Polls /readyz: when each published version (and its stream position) started
    serving on control."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.seen: list[tuple[float, int, dict[str, int]]] = []  # time, version, offsets
        self.stop = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=10) as c:
            while not self.stop.wait(0.25):
                try:
                    pub = c.get(f"{self.url}/readyz").json().get("published")
                except (httpx.HTTPError, ValueError):
                    continue
                if pub and (not self.seen or self.seen[-1][1] != pub["version"]):
                    offsets = {str(k): int(v) for k, v in
                               (pub.get("position") or {}).get("offsets", {}).items()}
                    self.seen.append((time.time(), pub["version"], offsets))


class Users:
    """Simulated users, ``rate`` requests per second over ``threads`` threads."""

    def __init__(self, url: str, world: MarketplaceTruth, args: argparse.Namespace):
        self.url, self.world, self.args = url, world, args
        self.requests: dict[str, dict] = {}  # request id -> user, candidates, arm, ...
        self.clicks: list[tuple[float, str]] = []  # when posted, row key
        self.errors = 0
        self.error_kinds: list[str] = []
        self.lock = threading.Lock()

    def run(self, seed: int, until: float, pace: float) -> None:
        import httpx

        rng = np.random.default_rng([seed, 99])
        a, w = self.args, self.world
        with httpx.Client(timeout=30) as c:
            nxt = time.monotonic()
            while time.monotonic() < until:
                u = int(rng.integers(w.m.users))
                cands = rng.choice(w.m.items, a.candidates, replace=False)
                try:
                    r = c.post(f"{self.url}/v1/rank", json={
                        "context": {"user_id": f"u{u}"},
                        "candidates": [f"i{i}" for i in cands], "k": a.k})
                    r.raise_for_status()
                    body = r.json()
                    shown = [int(it["item"][1:]) for it in body["items"]]
                    clicked = [i for i in shown if rng.random() < w.p[u, i]]
                    if clicked:
                        f = c.post(f"{self.url}/v1/feedback", json={"events": [
                            {"request_id": body["request_id"], "item": f"i{i}",
                             "type": "click"} for i in clicked]})
                        f.raise_for_status()
                except httpx.HTTPError as e:
                    with self.lock:
                        self.errors += 1
                        if len(self.error_kinds) < 5:
                            self.error_kinds.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                now = time.time()
                with self.lock:
                    self.requests[body["request_id"]] = {
                        "user": u, "candidates": cands, "shown": shown, "arm": body["variant"],
                        "version": body["model_version"], "at": now}
                    self.clicks += [(now, f"{body['request_id']}:i{i}") for i in clicked]
                nxt += pace
                time.sleep(max(0.0, nxt - time.monotonic()))


def cli(*args: str, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "sampan.cli", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sampan {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def greedy_truth(world: MarketplaceTruth, bundle: Path, reqs: list[dict]) -> float:
    """The true CTR of the bundle's top-scored candidate on these requests."""
    from sampan.serving import Predictor

    pred = Predictor(bundle)
    users, items = world.users_table().to_pylist(), world.items_table().to_pylist()
    known = set(pred.columns)
    records = [{k: v for k, v in (users[r["user"]] | items[i]).items() if k in known}
               for r in reqs for i in r["candidates"]]
    scores = pred.predict(records)[:, 0].reshape(len(reqs), -1)
    top = scores == scores.max(1, keepdims=True)  # ties share, as the policy does
    p = np.stack([world.p[r["user"], r["candidates"]] for r in reqs])
    return float(((p * top).sum(1) / top.sum(1)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="traffic")
    ap.add_argument("--rate", type=float, default=30.0, help="requests per second")
    ap.add_argument("--candidates", type=int, default=20)
    ap.add_argument("--k", type=int, default=3, help="items shown per request")
    ap.add_argument("--epsilon", type=float, default=0.2, help="explore.epsilon")
    ap.add_argument("--window", type=float, default=10.0, help="feedback.window_seconds")
    ap.add_argument("--train-rows", type=int, default=40_000)
    ap.add_argument("--tail", type=float, default=60.0, help="seconds to wait after the "
                    "traffic for the last clicks to reach serving")
    ap.add_argument("--seed", type=int, default=0, help="the world's seed")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--readme", type=Path, help="write the figures into this Markdown page "
                    "(docs/guides/ab-tests.md)")
    args = ap.parse_args()
    import confluent_kafka as ck

    info = machine()
    print(json.dumps(info), flush=True)
    work = Path(tempfile.mkdtemp(prefix="sampan-loop-"))
    world = MarketplaceTruth(Marketplace(seed=args.seed))
    t0 = time.time()
    models = train_models(world, work, args.train_rows)
    print(f"trained control and candidate in {time.time() - t0:.0f} s ({work})", flush=True)

    broker = LocalBroker()
    brokers = broker.brokers
    broker.create("feedback")  # the stream reads the partitions that exist when it starts
    published, log_dir = work / "models", work / "feedback"
    stream_cfg = {**models["control_config"], "name": "closed-loop",
                  "output_dir": str(work / "runs"),
                  # the side tables as in training: the published versions hold no
                  # feature tables, and the server joins requests with these
                  "data": {"format": "jsonl",
                           "joins": models["control_config"]["data"]["joins"]},
                  "stream": {"source": "kafka", "format": "jsonl",
                             "kafka": {"brokers": brokers, "topic": "feedback"},
                             "publish": {"dir": str(published)}}}
    (work / "stream.yaml").write_text(yaml.safe_dump(stream_cfg))
    port = free_port()
    serve_cfg = {
        "port": port, "max_wait_ms": 1,
        "experiment": {"name": "closed-loop", "variants": [
            {"name": "control", "bundle": str(models["control"]), "watch": str(published),
             "weight": 50},
            {"name": "candidate", "bundle": str(models["candidate"]), "weight": 50}]},
        "feedback": {"dir": str(log_dir), "window_seconds": args.window,
                     "kafka": {"brokers": brokers, "topic": "feedback"}},
        "explore": {"method": "epsilon", "epsilon": args.epsilon}}
    (work / "serve.yaml").write_text(yaml.safe_dump(serve_cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    slog = open(work / "serve.log", "w")  # noqa: SIM115
    tlog = open(work / "stream.log", "w")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-m", "sampan.cli", "serve", "--config",
                               str(work / "serve.yaml")], cwd=ROOT, env=env, stdout=slog,
                              stderr=subprocess.STDOUT)
    streamer = subprocess.Popen([sys.executable, "-m", "sampan.cli", "stream",
                                 str(work / "stream.yaml"), "--from",
                                 str(models["control_run"]), "--run-dir",
                                 str(work / "online")], cwd=ROOT, env=env, stdout=tlog,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    topic, served = Topic(ck, brokers, "feedback"), Served(url)
    users = Users(url, world, args)
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"sampan serve stopped; see {work / 'serve.log'}")
            time.sleep(0.2)
        if streamer.poll() is not None:
            raise SystemExit(f"sampan stream stopped; see {work / 'stream.log'}")
        topic.start()
        served.start()
        threads = 2
        until = time.monotonic() + args.seconds
        ts = [threading.Thread(target=users.run, args=(k, until, threads / args.rate))
              for k in range(threads)]
        start = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        traffic_end = time.time()
        print(f"traffic: {len(users.requests):,} requests, {len(users.clicks):,} clicks, "
              f"{users.errors} errors in {traffic_end - start:.0f} s", flush=True)
        for e in users.error_kinds:
            print("  error:", e)
        time.sleep(args.tail)  # the last windows close, train, publish and reach serving
        if streamer.poll() is not None:
            raise SystemExit(f"sampan stream stopped; see {work / 'stream.log'}")
    finally:
        served.stop.set()
        topic.stop.set()
        server.terminate()
        server.wait(timeout=60)
        streamer.terminate()
        streamer.wait(timeout=120)
        slog.close()
        tlog.close()
    served.join()
    topic.join()

    # freshness: a click to the first served version whose stream position is past its row
    fresh, unserved = [], 0
    measured = [(t, key) for t, key in users.clicks if t <= traffic_end - args.tail]
    for t, key in measured:
        where = topic.where.get(key)
        at = None if where is None else next(
            (s for s, _, off in served.seen if s >= t and off.get(where[0], 0) > where[1]),
            None)
        if at is None:
            unserved += 1
        else:
            fresh.append(at - t)
    fresh_s = np.array(fresh)

    rep_dir = work / "report"
    print(cli("experiment", "report", str(log_dir), "--out", str(rep_dir)), flush=True)
    rep = json.loads((rep_dir / "report.json").read_text())
    from sampan.experiment.log import column, read_log

    logged = read_log(log_dir)
    in_log = set(column(logged, "request_id").astype(str))
    oracle = {}
    for arm in ("control", "candidate"):
        ps = [world.p[r["user"], i] for rid, r in users.requests.items()
              if rid in in_log and r["arm"] == arm for i in r["shown"]]
        oracle[arm] = float(np.mean(ps))
    true_lift = oracle["candidate"] / oracle["control"] - 1

    ope = {}
    explored = read_log(log_dir, unshown=True)
    ope_reqs = [users.requests[rid] for rid in sorted(set(column(explored, "request_id")
                                                          .astype(str)))
                if rid in users.requests]
    for name in ("control", "candidate"):
        out = work / f"ope-{name}.json"
        print(cli("experiment", "ope", str(log_dir), "--candidate", str(models[name]),
                  "--out", str(out)), flush=True)
        est = json.loads(out.read_text())
        # the requests it was evaluated on: the arms whose logged features it can read
        reqs = [r for r in ope_reqs if r["arm"] in est["variants"]]
        assert len(reqs) == est["requests"], (len(reqs), est["requests"])
        ope[name] = {"truth": greedy_truth(world, models[name], reqs), "arms":
                     est["variants"], "requests": est["requests"],
                     "estimates": est["estimates"],
                     "effective_sample_size": est["effective_sample_size"]}

    versions = sorted({r["version"] for r in users.requests.values() if r["arm"] == "control"})
    result = {
        "command": " ".join(sys.argv[1:]), "machine": info,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "traffic": {"requests": len(users.requests), "clicks": len(users.clicks),
                    "errors": users.errors, "control_versions_served": len(versions),
                    "topic_rows": topic.rows},
        "freshness": {"clicks": len(measured), "served": len(fresh), "unserved": unserved,
                      "p50_s": float(np.percentile(fresh_s, 50)) if fresh else None,
                      "p95_s": float(np.percentile(fresh_s, 95)) if fresh else None,
                      "max_s": float(fresh_s.max()) if fresh else None},
        "ab": {arm: {"ctr": rep["arms"][arm]["ctr"], "ctr_ci95": rep["arms"][arm]["ctr_ci95"],
                     "oracle_ctr": oracle[arm], "impressions": rep["arms"][arm]["impressions"]}
               for arm in ("control", "candidate")},
        "lift": {"report": rep["arms"]["candidate"]["lift"], "oracle": true_lift},
        "srm": rep["srm"], "ope": ope}
    lift = result["lift"]["report"]
    result["checks"] = {
        "freshness_p95_le_60s": bool(fresh) and unserved == 0 and result["freshness"]["p95_s"]
        <= 60,
        "better_arm_found": lift["ci95"][1] < 0 if true_lift < 0 else lift["ci95"][0] > 0,
        "oracle_lift_in_interval": lift["ci95"][0] <= true_lift <= lift["ci95"][1],
        "ope_covers_truth": {n: {k: v["low"] <= o["truth"] <= v["high"]
                                 for k, v in o["estimates"].items()} for n, o in ope.items()}}

    f = result["freshness"]
    print(f"\n{info['cpu']} ({', '.join(info['isa'])}), {info['cores']} cores; "
          f"{args.rate:g} requests/s for {args.seconds:g} s, feedback window {args.window:g} s, "
          "stream window and publish at their defaults")
    if fresh:
        print(f"freshness: click -> a served model trained on it: p50 {f['p50_s']:.1f} s, p95 "
              f"{f['p95_s']:.1f} s, max {f['max_s']:.1f} s ({f['served']:,} clicks; "
              f"{unserved} not served by the end); {len(versions)} control versions served")
    for arm, a in result["ab"].items():
        lo, hi = a["ctr_ci95"]
        print(f"{arm:9}: CTR {a['ctr']:.4f} [{lo:.4f}, {hi:.4f}]  oracle {a['oracle_ctr']:.4f}"
              f"  ({a['impressions']:,} impressions)")
    print(f"lift candidate vs control: report {lift['lift']:+.1%} [{lift['ci95'][0]:+.1%}, "
          f"{lift['ci95'][1]:+.1%}], p {lift['p_value']:.3g}; oracle {true_lift:+.1%}")
    for name, o in ope.items():
        line = ", ".join(f"{k.upper()} {v['estimate']:.4f} [{v['low']:.4f}, {v['high']:.4f}]"
                         for k, v in o["estimates"].items())
        print(f"OPE {name} ({o['requests']:,} requests of {'+'.join(o['arms'])}, ESS "
              f"{o['effective_sample_size']:,.0f}): truth {o['truth']:.4f}; {line}")
    print(json.dumps(result["checks"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.readme:
        from benchmarks._readme import update_block

        update_block(args.readme, "closed_loop", markdown(result))


def markdown(r: dict) -> str:
    """The README block of a run's result."""
    from benchmarks._readme import shown_command

    m, s, f, lift = r["machine"], r["settings"], r["freshness"], r["lift"]
    lines = [
        f"The closed loop (`python benchmarks/closed_loop.py {shown_command(r['command'])}`; "
        f"{m['cpu']} "
        f"({', '.join(m['isa'])}), {m['cores']} cores, everything on this machine): "
        f"{s['rate']:g} requests/s for {s['seconds']:g} s, {s['candidates']} candidates "
        f"ranked and {s['k']} shown per request, 50/50 by user, epsilon {s['epsilon']:g} "
        f"on the first item, feedback window {s['window']:g} s; control follows what "
        "`sampan stream` publishes from the feedback topic.", "",
        f"- freshness, a click to a served model trained on it: p50 {f['p50_s']:.1f} s, "
        f"p95 {f['p95_s']:.1f} s ({f['served']:,} clicks, {f['unserved']} never served; "
        f"{r['traffic']['control_versions_served']} control versions served, "
        f"{r['traffic']['errors']} failed requests)"]
    for arm, a in r["ab"].items():
        lo, hi = a["ctr_ci95"]
        lines.append(f"- {arm}: CTR {a['ctr']:.4f} [{lo:.4f}, {hi:.4f}], the oracle's "
                     f"{a['oracle_ctr']:.4f} ({a['impressions']:,} impressions)")
    rep = lift["report"]
    lines.append(f"- lift of the candidate: {rep['lift']:+.1%} [{rep['ci95'][0]:+.1%}, "
                 f"{rep['ci95'][1]:+.1%}] (p {rep['p_value']:.2g}); the oracle's "
                 f"{lift['oracle']:+.1%}; sample ratio p {r['srm']['p_value']:.2f}")
    for name, o in r["ope"].items():
        est = ", ".join(f"{k.upper()} {v['estimate']:.4f} [{v['low']:.4f}, {v['high']:.4f}]"
                        for k, v in o["estimates"].items())
        lines.append(f"- OPE of the {name} bundle on {o['requests']:,} explored requests "
                     f"({'+'.join(o['arms'])}; effective sample size "
                     f"{o['effective_sample_size']:,.0f}): {est}; the truth "
                     f"{o['truth']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
