"""Serving load test: start `sampan serve` on a bundle, drive it with concurrent clients for
a fixed time, report throughput, latency percentiles and errors (HTTP and gRPC).

Without ``--bundle`` it trains and exports DeepFM on MovieLens-100k first (needs
``../shared/data``). Each scenario sends ``/v1/rank`` requests for a random user with
``--candidates`` random movies (features joined from the feature store).

``--taobao`` serves a real-time recommender instead: DIN and two-tower trained (one
epoch) on the Taobao UserBehavior sample, users' histories in the live store. Its
scenarios: ``/v1/rank`` where the client sends the user's history itself (the baseline),
``/v1/rank`` with only the user id (history from the live store), and ``/v1/recommend``
(retrieval top-``--candidates``, then DIN), each client posting one event for its user
every ``--events-every`` requests (not timed).

``--feedback`` measures what the feedback log costs: two servers on the same bundle, one
logging every returned item (``feedback.dir``) and one not, loaded in turn in
``--chunk``-second slices until each has had ``--seconds``; the logging server's clients
post a click on one returned item every ``--click-every`` responses (not timed). Printed:
each server's latency and failures, the p99 ratio, and what the joiner wrote.

Usage::

    python benchmarks/serve_load.py                       # 1 and 8 clients, 10 s each
    python benchmarks/serve_load.py --bundle B --clients 1 4 16 --seconds 20 \
        --readme docs/guides/serving.md
    python benchmarks/serve_load.py --taobao --clients 1 4 --readme docs/guides/serving.md
    python benchmarks/serve_load.py --feedback --clients 1 4 --seconds 60 \
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_bundle(work: Path) -> Path:
    out = work / "bundle"
    subprocess.run([sys.executable, "-m", "sampan.cli", "train",
                    "configs/movielens100k_deepfm.yaml", "--run-dir", str(work / "run"),
                    "--set", "train.progress=false", "--set", "train.tensorboard=false"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "sampan.cli", "export", str(work / "run"),
                    "--out", str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def make_taobao(work: Path) -> tuple[Path, Path]:
    """DIN and two-tower bundles of the Taobao sample (the shipped configs, one epoch)."""
    from sampan.data.behaviour import BuildOptions, build_sequences

    raw = ROOT.parent / "shared/data/taobao_userbehavior/UserBehavior_sample_96168.csv.gz"
    samples = work / "samples.parquet"
    build_sequences(str(raw), samples, BuildOptions(
        columns=["user_id", "item_id", "category_id", "behavior", "timestamp"], header=False,
        targets="positive", negatives=1, max_len=20))
    out = []
    for name in ("taobao_din", "taobao_two_tower"):
        subprocess.run([sys.executable, "-m", "sampan.cli", "train", f"configs/{name}.yaml",
                        "--run-dir", str(work / name), "--set", f"data.train={samples}",
                        "--set", "train.epochs=1", "--set", "train.progress=false",
                        "--set", "train.tensorboard=false"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "sampan.cli", "export", str(work / name),
                        "--out", str(work / f"bundle-{name}")], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        out.append(work / f"bundle-{name}")
    return out[0], out[1]


def start_server(bundle: Path, *options: str, env: dict | None = None,
                 cwd: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``sampan serve BUNDLE --port P OPTIONS`` in its own process (run in ``cwd``), once
    ready: the process and its URL."""
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "sampan.cli", "serve", str(bundle),
                               "--port", str(port), *options], cwd=cwd,
                              env={**os.environ, **(env or {})},
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.1)
        if server.poll() is not None:
            break
    server.kill()
    raise RuntimeError(f"sampan serve {bundle} did not become ready")


def ids(bundle: Path, column: str) -> list[str]:
    """Known ids of ``column`` from the bundle's vocabulary (requests use real users)."""
    from sampan.data.pipeline import FeaturePipeline

    pipe = FeaturePipeline.load(bundle / "pipeline")
    enc = next(e for e in pipe.categorical if (e.spec.column or e.spec.name) == column)
    return [str(v) for v in enc.vocab_.to_pylist()]


def drive(call, clients: int, seconds: float) -> dict:
    lat: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        state = call.setup() if hasattr(call, "setup") else None
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            ok = call(rng, state)
            took = time.perf_counter() - t0
            if isinstance(ok, tuple):  # the call timed its own request
                ok, took = ok
            lat[k].append(took)
            errors[k] += 0 if ok else 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    all_lat = np.array([x for lst in lat for x in lst]) * 1000
    return {"clients": clients, "requests": int(all_lat.size), "errors": int(sum(errors)),
            "requests_per_s": all_lat.size / wall,
            "p50_ms": float(np.percentile(all_lat, 50)),
            "p95_ms": float(np.percentile(all_lat, 95)),
            "p99_ms": float(np.percentile(all_lat, 99)), "max_ms": float(all_lat.max()),
            "_lat": all_lat}


class HttpRank:
    def __init__(self, url: str, users: list[str], items: list[str], n: int):
        self.url, self.users, self.items, self.n = url, users, items, n

    def setup(self):  # one connection per client
        import httpx

        return httpx.Client(timeout=30)

    def __call__(self, rng, client) -> bool:
        body = {"context": {"user_id": self.users[rng.integers(len(self.users))]},
                "candidates": [self.items[i] for i in rng.integers(0, len(self.items),
                                                                    self.n)], "k": 10}
        r = client.post(f"{self.url}/v1/rank", json=body)
        return r.status_code == 200


class HttpRankClicks(HttpRank):
    """:class:`HttpRank` whose user clicks one returned item every ``click_every``
    responses (posted to ``/v1/feedback`` after the timed request; a failed post counts as
    a failure); none when ``click_every`` is None."""

    def __init__(self, url: str, users: list[str], items: list[str], n: int,
                 click_every: int | None):
        super().__init__(url, users, items, n)
        self.click_every = click_every

    def setup(self):
        return [super().setup(), 0]

    def __call__(self, rng, state):
        client, count = state
        state[1] += 1
        body = {"context": {"user_id": self.users[rng.integers(len(self.users))]},
                "candidates": [self.items[i] for i in rng.integers(0, len(self.items),
                                                                    self.n)], "k": 10}
        t0 = time.perf_counter()
        r = client.post(f"{self.url}/v1/rank", json=body)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            return False, took
        if self.click_every and count % self.click_every == 0:
            out = r.json()
            item = out["items"][rng.integers(len(out["items"]))]["item"]
            f = client.post(f"{self.url}/v1/feedback", json={"events": [
                {"request_id": out["request_id"], "item": item, "type": "click"}]})
            return f.status_code == 200, took
        return True, took


def feedback_cost(args, bundle: Path, work: Path) -> dict:
    """Two servers of ``bundle``, with and without the feedback log, loaded in turn."""
    import httpx

    log = work / "feedback"
    on, on_url = start_server(bundle, "--set", f"feedback.dir={log}", "--set",
                              f"feedback.window_seconds={args.window}")
    off, off_url = start_server(bundle)
    try:
        users, items = ids(bundle, "user_id"), ids(bundle, "item_id")
        calls = {"off": HttpRankClicks(off_url, users, items, args.candidates, None),
                 "on": HttpRankClicks(on_url, users, items, args.candidates,
                                      args.click_every)}
        for call in calls.values():
            drive(call, 1, 1.0)  # warm-up
        results = []
        for c in args.clients:
            parts: dict[str, list[dict]] = {"off": [], "on": []}
            slices = max(1, round(args.seconds / args.chunk))
            for i in range(slices):  # alternate, the first one swapped each time
                for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    parts[name].append(drive(calls[name], c, args.seconds / slices))
            for name, ps in parts.items():
                lat = np.concatenate([p.pop("_lat") for p in ps])
                r = {"logging": name, "clients": c, "seconds": args.seconds,
                     "requests": int(lat.size), "errors": sum(p["errors"] for p in ps),
                     "requests_per_s": lat.size / args.seconds,
                     **{f"p{q}_ms": float(np.percentile(lat, q)) for q in (50, 95, 99)},
                     "max_ms": float(lat.max())}
                print(f"feedback log {name:3} clients {c:3}: {r['requests_per_s']:8,.0f} "
                      f"req/s  p50 {r['p50_ms']:6.2f} ms  p95 {r['p95_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}", flush=True)
                results.append(r)
        time.sleep(args.window + 3)  # the last windows close
        ready = httpx.get(f"{on_url}/readyz").json()
    finally:
        for s in (on, off):
            s.terminate()
            s.wait(timeout=30)
    from sampan.experiment.log import read_log

    written = read_log(log)
    clicked = int(np.sum(written.column("label").to_numpy()))
    by = {(r["logging"], r["clients"]): r for r in results}
    ratios = {c: by[("on", c)]["p99_ms"] / by[("off", c)]["p99_ms"] for c in args.clients}
    for c, q in ratios.items():
        print(f"clients {c}: p99 with the log / without = {q:.3f}")
    print(f"the log holds {written.num_rows:,} rows, {clicked:,} clicked; "
          f"the server's feedback counts: {json.dumps(ready.get('feedback', {}))}")
    return {"results": results, "p99_ratio": ratios, "log_rows": written.num_rows,
            "log_clicks": clicked, "window_seconds": args.window,
            "click_every": args.click_every}


class LiveCall:
    """``/v1/rank`` (``route="rank"``) or ``/v1/recommend`` for a random user of the live
    store, through :class:`sampan.client.Client`; with ``explicit`` the request carries
    the user's history (the caller-side baseline). One event every ``events_every``."""

    def __init__(self, url: str, route: str, users: dict[str, tuple[list, list]],
                 items: list[str], n: int, events_every: int, explicit: bool = False):
        self.url, self.route, self.n = url, route, n
        self.users, self.names, self.items = users, list(users), items
        self.events_every, self.explicit = events_every, explicit

    def setup(self):
        from sampan.client import Client

        return [Client(self.url, timeout=30), 0]

    def __call__(self, rng, state) -> bool:
        from sampan.client import ServingError

        client, count = state
        user = self.names[rng.integers(len(self.names))]
        state[1] += 1
        try:
            if self.events_every and count % self.events_every == 0:
                client.events([{"user_id": user,
                                "item_id": self.items[rng.integers(len(self.items))]}])
            context = {"user_id": user}
            if self.explicit:
                hist, cats = self.users[user]
                context |= {"hist_item_id": hist, "hist_category_id": cats}
            if self.route == "recommend":
                client.recommend(context, n=self.n, k=10)
            else:
                client.rank(context, [self.items[i] for i in rng.integers(0, len(self.items),
                                                                          self.n)], k=10)
            return True
        except ServingError:
            return False


class GrpcRank:
    def __init__(self, target: str, users: list[str], items: list[str], n: int):
        self.target, self.users, self.items, self.n = target, users, items, n

    def setup(self):
        import grpc

        from sampan.serving.grpc_server import stubs

        pb, svc = stubs()
        return pb, svc.ScoringStub(grpc.insecure_channel(self.target))

    def __call__(self, rng, state) -> bool:
        import grpc
        from google.protobuf.struct_pb2 import Struct

        pb, stub = state
        ctx = Struct()
        ctx.update({"user_id": self.users[rng.integers(len(self.users))]})
        try:
            stub.Rank(pb.RankRequest(context=ctx, k=10, candidates=[
                self.items[i] for i in rng.integers(0, len(self.items), self.n)]))
            return True
        except grpc.RpcError:
            return False


def markdown_feedback(report: dict) -> str:
    m, f = report["machine"], report["feedback"]
    from benchmarks._readme import shown_command

    lines = [f"The feedback log's cost (`python benchmarks/serve_load.py "
             f"{shown_command(report['args'])}`; "
             f"{m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores; server and clients "
             f"on the same machine): `/v1/rank` with {report['candidates']} candidates, "
             "top 10 returned and logged, a click posted every "
             f"{f['click_every']} responses; two servers of the same bundle, with and "
             "without `feedback.dir`, loaded in turn. The log then held "
             f"{f['log_rows']:,} rows ({f['log_clicks']:,} clicked).", "",
             "| feedback log | clients | seconds | requests/s | p50 ms | p95 ms | p99 ms | "
             "failed |", "|---|---|---|---|---|---|---|---|"]
    for r in f["results"]:
        lines.append(f"| {r['logging']} | {r['clients']} | {r['seconds']:g} | "
                     f"{r['requests_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
                     f"{r['p99_ms']:.2f} | {r['errors']} |")
    lines += ["", "p99 with the log / without: " + ", ".join(
        f"{q:.2f} ({c} client{'' if c == 1 else 's'})" for c, q in f["p99_ratio"].items())]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m = report["machine"]
    what = (f"DIN and two-tower on the Taobao sample, one event per "
            f"{report.get('events_every')} requests per client; `/v1/rank` with "
            f"{report['candidates']} candidates, the history sent by the client (baseline) "
            "or read from the live store; `/v1/recommend` retrieving "
            f"{report['candidates']} then ranking them" if report.get("taobao") else
            f"`/v1/rank` with {report['candidates']} candidates per request, features "
            "joined from the in-memory feature store")
    from benchmarks._readme import shown_command

    lines = [f"Serving load (`python benchmarks/serve_load.py "
             f"{shown_command(report['args'])}`; "
             f"{m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores; server and clients "
             f"on the same machine): {what}.", "",
             "| protocol | clients | requests/s | p50 ms | p95 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['protocol']} | {r['clients']} | {r['requests_per_s']:,.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{r['errors']} |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.accuracy import machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--no-grpc", action="store_true")
    ap.add_argument("--taobao", action="store_true", help="DIN + two-tower, live store")
    ap.add_argument("--retrieval-bundle", type=Path,
                    help="with --taobao and --bundle: served bundles instead of training")
    ap.add_argument("--events-every", type=int, default=10)
    ap.add_argument("--server-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="serve config overrides (e.g. threads=1)")
    ap.add_argument("--feedback", action="store_true",
                    help="the feedback log's cost: with and without it, in turn")
    ap.add_argument("--chunk", type=float, default=10.0,
                    help="with --feedback: seconds of each turn")
    ap.add_argument("--click-every", type=int, default=5,
                    help="with --feedback: a click posted every N responses")
    ap.add_argument("--window", type=float, default=5.0,
                    help="with --feedback: feedback.window_seconds")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/serve_load.json"))
    ap.add_argument("--readme", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sampan-load-"))
    retrieval = None
    if args.taobao and args.bundle and args.retrieval_bundle:
        bundle, retrieval = args.bundle, args.retrieval_bundle
    elif args.taobao:
        bundle, retrieval = make_taobao(work)
    else:
        bundle = args.bundle or make_bundle(work)
    if args.feedback:
        report = {"args": " ".join(sys.argv[1:]), "candidates": args.candidates,
                  "machine": machine(), "feedback": feedback_cost(args, bundle, work)}
        Path(args.json.replace("serve_load.json", "serve_load_feedback.json")).write_text(
            json.dumps(report, indent=1))
        if args.readme:
            from benchmarks._readme import update_block

            update_block(args.readme, "serve_load_feedback", markdown_feedback(report))
        return
    gport = free_port()
    extra = ["--set", f"retrieval_bundle={retrieval}"] if retrieval else []
    extra += [x for kv in args.server_set for x in ("--set", kv)]
    server, url = start_server(bundle, "--grpc-port", str(gport), *extra)
    try:
        users, items = ids(bundle, "user_id"), ids(bundle, "item_id")
        results = []
        scenarios = [("http", HttpRank(url, users, items, args.candidates))]
        if args.taobao:
            import pyarrow.parquet as pq

            t = pq.read_table(bundle / "features" / "users.parquet").to_pydict()
            live = {u: (h, c) for u, h, c in zip(t["user_id"], t["hist_item_id"],
                                                 t["hist_category_id"], strict=True)}
            e = args.events_every
            scenarios = [
                ("rank, history sent", LiveCall(url, "rank", live, items, args.candidates, e,
                                                explicit=True)),
                ("rank, live store", LiveCall(url, "rank", live, items, args.candidates, e)),
                ("recommend, live", LiveCall(url, "recommend", live, items, args.candidates,
                                             e))]
        elif not args.no_grpc:
            scenarios.append(("grpc", GrpcRank(f"127.0.0.1:{gport}", users, items,
                                               args.candidates)))
        for proto, call in scenarios:
            drive(call, 1, 1.0)  # warm-up
            for c in args.clients:
                r = {"protocol": proto, **drive(call, c, args.seconds)}
                r.pop("_lat")
                print(f"{proto:18} clients {c:3}: {r['requests_per_s']:8,.0f} req/s  "
                      f"p50 {r['p50_ms']:6.2f} ms  p95 {r['p95_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}", flush=True)
                results.append(r)
    finally:
        server.terminate()
        server.wait(timeout=10)
    report = {"args": " ".join(sys.argv[1:]), "candidates": args.candidates,
              "machine": machine(), "taobao": args.taobao,
              "events_every": args.events_every if args.taobao else None,
              "results": results}
    key = "serve_load_live" if args.taobao else "serve_load"
    Path(args.json.replace("serve_load.json", f"{key}.json")).write_text(
        json.dumps(report, indent=1))
    if args.readme:
        from benchmarks._readme import update_block

        update_block(args.readme, key, markdown(report))


if __name__ == "__main__":
    main()
