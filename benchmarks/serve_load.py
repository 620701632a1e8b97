"""Serving load test: start `sampan serve` on a bundle, drive it with concurrent clients for
a fixed time, report throughput, latency percentiles and errors (HTTP and gRPC).

Without ``--bundle`` it trains and exports DeepFM on MovieLens-100k first (needs
``../shared/data``). Each scenario sends ``/v1/rank`` requests for a random user with
``--candidates`` random movies (features joined from the feature store); ``predict``
scenarios send one record per request.

Usage::

    python benchmarks/serve_load.py                       # 1 and 8 clients, 10 s each
    python benchmarks/serve_load.py --bundle B --clients 1 4 16 --seconds 20 --readme README.md
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


def start_server(bundle: Path, *options: str, env: dict | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """``sampan serve BUNDLE --port P OPTIONS`` in its own process, once ready: the process
    and its URL."""
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "sampan.cli", "serve", str(bundle),
                               "--port", str(port), *options], cwd=ROOT,
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
            lat[k].append(time.perf_counter() - t0)
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
            "p99_ms": float(np.percentile(all_lat, 99)), "max_ms": float(all_lat.max())}


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


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"Serving load (`python benchmarks/serve_load.py {report['args']}`; "
             f"{m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores; server and clients "
             "on the same machine): "
             f"`/v1/rank` with {report['candidates']} candidates per request, features joined "
             "from the in-memory feature store.", "",
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
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/serve_load.json"))
    ap.add_argument("--readme", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sampan-load-"))
    bundle = args.bundle or make_bundle(work)
    gport = free_port()
    server, url = start_server(bundle, "--grpc-port", str(gport))
    try:
        users, items = ids(bundle, "user_id"), ids(bundle, "item_id")
        results = []
        scenarios = [("http", HttpRank(url, users, items, args.candidates))]
        if not args.no_grpc:
            scenarios.append(("grpc", GrpcRank(f"127.0.0.1:{gport}", users, items,
                                               args.candidates)))
        for proto, call in scenarios:
            drive(call, 1, 1.0)  # warm-up
            for c in args.clients:
                r = {"protocol": proto, **drive(call, c, args.seconds)}
                print(f"{proto:5} clients {c:3}: {r['requests_per_s']:8,.0f} req/s  "
                      f"p50 {r['p50_ms']:6.2f} ms  p95 {r['p95_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}", flush=True)
                results.append(r)
    finally:
        server.terminate()
        server.wait(timeout=10)
    report = {"args": " ".join(sys.argv[1:]), "candidates": args.candidates,
              "machine": machine(),
              "results": results}
    Path(args.json).write_text(json.dumps(report, indent=1))
    if args.readme:
        from benchmarks._readme import update_block

        update_block(args.readme, "serve_load", markdown(report))


if __name__ == "__main__":
    main()
