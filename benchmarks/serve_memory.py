"""Server memory under concurrent large requests: RSS of `sampan serve` while N clients
each post a 10,000-record `/v1/predict` at once (DeepFM on the Criteo sample, every record
with its 39 raw fields), in rounds, then after the burst.

Printed per concurrency: the peak RSS during the rounds, the RSS 3 s after the last one,
and the replies by status (200, and 503 for requests refused by admission control). With
``--before PATH`` it runs the same rounds against a second checkout (e.g. a worktree of the
commit before admission control: ``git worktree add /tmp/before <commit>``) first, on the
same bundle.

Usage::

    python benchmarks/serve_memory.py --clients 1 16 64 256
    python benchmarks/serve_memory.py --clients 1 16 64 --before /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import start_server  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "criteo" / "criteo_kaggle_train_sample_10k.txt.gz"


def make_bundle(work: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "sampan.cli", "train", "configs/criteo_deepfm.yaml",
                    "--run-dir", str(work / "run"), "--set", "train.epochs=1",
                    "--set", "train.progress=false", "--set", "train.tensorboard=false"],
                   cwd=ROOT, check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "sampan.cli", "export", str(work / "run"), "--out",
                    str(work / "bundle")], cwd=ROOT, check=True, env=env,
                   capture_output=True)
    return work / "bundle"


def body(records: int) -> bytes:
    """``records`` rows of the Criteo sample as raw records (the file's own values)."""
    import gzip

    names = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]
    rows = []
    with gzip.open(DATA, "rt") as f:
        for line in f:
            values = line.rstrip("\n").split("\t")
            rec = {}
            for name, v in zip(names[1:], values[1:], strict=True):
                rec[name] = (float(v) if name.startswith("I") else v) if v != "" else None
            rows.append(rec)
            if len(rows) == records:
                break
    while len(rows) < records:
        rows += rows[:records - len(rows)]
    return json.dumps({"records": rows}).encode()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.02)


async def burst(url: str, payload: bytes, clients: int, rounds: int) -> Counter:
    import httpx

    codes: Counter = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one() -> None:
            try:
                r = await c.post(f"{url}/v1/predict", content=payload,
                                 headers={"content-type": "application/json"})
                codes[str(r.status_code)] += 1
            except httpx.HTTPError as e:
                codes[type(e).__name__] += 1
        for _ in range(rounds):
            await asyncio.gather(*[one() for _ in range(clients)])
    return codes


def measure(root: Path, bundle: Path, payload: bytes, levels: list[int], rounds: int,
            label: str) -> list[dict]:
    server, url = start_server(bundle, "--set", "max_body_bytes=16777216",
                               env={"PYTHONPATH": str(root)}, cwd=root)
    out = []
    try:
        start = rss(server.pid)
        for n in levels:
            sampler = Sampler(server.pid)
            sampler.start()
            t0 = time.perf_counter()
            codes = asyncio.run(burst(url, payload, n, rounds))
            seconds = time.perf_counter() - t0
            sampler.stop.set()
            sampler.join()
            time.sleep(3)
            row = {"code": label, "clients": n, "start_mb": start / 2**20,
                   "peak_mb": sampler.peak / 2**20, "after_mb": rss(server.pid) / 2**20,
                   "replies": dict(codes), "seconds": seconds}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--before", type=Path, help="another checkout to measure first")
    ap.add_argument("--before-clients", type=int, nargs="+", default=None,
                    help="its concurrencies (default: --clients)")
    args = ap.parse_args()
    payload = body(args.records)
    from sampan.layers.kernels import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['name']} ({', '.join(cpu['isa'])}), {os.cpu_count()} cores; "
          f"{args.records:,} records a request, "
          f"{len(payload) / 2**20:.1f} MiB; {args.rounds} rounds per concurrency")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = make_bundle(Path(tmp))
        rows = []
        if args.before is not None:
            rows += measure(args.before, bundle, payload, args.before_clients or args.clients,
                            args.rounds, "before")
        rows += measure(ROOT, bundle, payload, args.clients, args.rounds, "this")
    print("\n| code | clients | peak RSS MB | RSS after MB | replies | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        replies = ", ".join(f"{k}: {v}" for k, v in sorted(r["replies"].items()))
        print(f"| {r['code']} | {r['clients']} | {r['peak_mb']:.0f} | {r['after_mb']:.0f} | "
              f"{replies} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
