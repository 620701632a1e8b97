"""Soak test: `sampan serve` under mixed predict / rank / recommend traffic for 10 minutes at
the highest client count whose p99 stays under 50 ms, with a reload every minute and a bad
bundle (one flipped byte) every third reload. Prints requests, errors by status, p50/p99
per minute and the server's RSS over time; a flat RSS line and no error but the refused bad
reloads are expected.

Trains and exports DeepFM and a two-tower model on MovieLens-100k first (needs
``../shared/data``), unless ``--bundle`` and ``--retrieval-bundle`` are given.

Usage::

    python benchmarks/soak.py                         # calibrate, then 10 minutes
    python benchmarks/soak.py --minutes 1 --clients 2  # a quick look
    python benchmarks/soak.py --readme docs/explanations/security.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy import machine  # noqa: E402
from benchmarks.serve_load import ids, start_server  # noqa: E402

TOKEN = "soak-token"


def train_and_export(work: Path, config: str, name: str) -> Path:
    run, out = work / f"run-{name}", work / f"bundle-{name}"
    subprocess.run([sys.executable, "-m", "sampan.cli", "train", config, "--run-dir", str(run),
                    "--set", "train.progress=false", "--set", "train.tensorboard=false"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "sampan.cli", "export", str(run), "--out", str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def bad_copy(bundle: Path, out: Path) -> Path:
    """The bundle with one byte of its model flipped: its checksum must refuse it."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(bundle, out)
    model = out / "model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Traffic:
    """Closed-loop clients, each on its own connection: a third of the requests each of
    ``/v1/predict`` (one record), ``/v1/rank`` (20 candidates), ``/v1/recommend``."""

    def __init__(self, url: str, users: list[str], items: list[str]):
        self.url, self.users, self.items = url, users, items
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.lat: list[float] = []
            self.status: Counter[str] = Counter()

    def take(self) -> tuple[np.ndarray, Counter]:
        with self.lock:
            lat, status = np.array(self.lat) * 1000, self.status
            self.lat, self.status = [], Counter()
        return lat, status

    def client(self, k: int, stop: threading.Event) -> None:
        import httpx

        rng = np.random.default_rng(k)
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not stop.is_set():
                user = self.users[rng.integers(len(self.users))]
                kind = rng.integers(3)
                if kind == 0:
                    path, body = "/v1/predict", {"records": [
                        {"user_id": user, "item_id": self.items[rng.integers(len(self.items))]}]}
                elif kind == 1:
                    path, body = "/v1/rank", {"context": {"user_id": user}, "k": 10,
                                              "candidates": [self.items[i] for i in rng.integers(
                                                  0, len(self.items), 20)]}
                else:
                    path, body = "/v1/recommend", {"context": {"user_id": user}, "n": 50,
                                                   "k": 10}
                t0 = time.perf_counter()
                try:
                    code = str(c.post(path, json=body).status_code)
                except httpx.HTTPError as e:
                    code = type(e).__name__
                dt = time.perf_counter() - t0
                with self.lock:
                    self.lat.append(dt)
                    self.status[code] += 1

    def run(self, clients: int, seconds: float, every: float, on_tick) -> None:
        stop = threading.Event()
        threads = [threading.Thread(target=self.client, args=(k, stop), daemon=True)
                   for k in range(clients)]
        for t in threads:
            t.start()
        t_end = time.perf_counter() + seconds
        tick = 0
        while time.perf_counter() < t_end:
            time.sleep(min(every, max(t_end - time.perf_counter(), 0)))
            tick += 1
            on_tick(tick)
        stop.set()
        for t in threads:
            t.join()


def summary(lat: np.ndarray, status: Counter, seconds: float) -> dict:
    return {"requests": int(lat.size), "requests_per_s": lat.size / seconds,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "status": dict(status)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--retrieval-bundle", type=Path)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, help="skip the calibration and use this many")
    ap.add_argument("--p99-ms", type=float, default=50.0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/soak.json"))
    ap.add_argument("--readme", type=Path)
    args = ap.parse_args()
    import httpx

    work = Path(tempfile.mkdtemp(prefix="sampan-soak-"))
    bundle = args.bundle or train_and_export(work, "configs/movielens100k_deepfm.yaml",
                                             "deepfm")
    retrieval = args.retrieval_bundle or train_and_export(
        work, "configs/movielens100k_two_tower.yaml", "two_tower")
    other = work / "bundle-copy"  # the same model under another path: a real reload
    shutil.rmtree(other, ignore_errors=True)
    shutil.copytree(bundle, other)
    bad = bad_copy(bundle, work / "bundle-bad")
    server, url = start_server(bundle, "--set", f"retrieval_bundle={retrieval}",
                               env={"SAMPAN_ADMIN_TOKEN": TOKEN})
    report: dict = {"args": " ".join(sys.argv[1:]), "machine": machine()}
    try:
        traffic = Traffic(url, ids(bundle, "user_id"), ids(bundle, "item_id"))
        traffic.run(2, 5, 5, lambda _: None)  # warm-up
        traffic.take()
        clients = args.clients
        if clients is None:  # the most clients whose p99 stays under the bound
            calib = []
            for c in (1, 2, 4, 8, 16):
                traffic.run(c, 10, 10, lambda _: None)
                s = summary(*traffic.take(), 10)
                calib.append({"clients": c, **s})
                print(f"calibrate {c:2} clients: {s['requests_per_s']:6.0f} req/s, "
                      f"p99 {s['p99_ms']:.1f} ms", flush=True)
                if s["p99_ms"] > args.p99_ms:
                    break
            ok = [r for r in calib if r["p99_ms"] <= args.p99_ms] or calib[:1]
            clients = max(ok, key=lambda r: r["requests_per_s"])["clients"]
            report["calibration"] = calib
        print(f"soak: {clients} clients for {args.minutes:g} minutes", flush=True)
        rss0 = rss_mb(server.pid)
        minutes, reloads = [], []
        totals: Counter[str] = Counter()
        lat_all: list[np.ndarray] = []

        def tick(k: int) -> None:  # every 10 s: RSS; every minute: a reload and a summary
            rss = rss_mb(server.pid)
            if k % 6:
                minutes.append({"t_s": k * 10, "rss_mb": rss})
                return
            lat, status = traffic.take()
            lat_all.append(lat)
            totals.update(status)
            m = {"t_s": k * 10, "rss_mb": rss, **summary(lat, status, 60)}
            n = len(reloads) + 1
            target = bad if n % 3 == 0 else (other if n % 2 else bundle)
            r = httpx.post(f"{url}/v1/admin/reload", json={"bundle": str(target)},
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
            reloads.append({"n": n, "bad": target == bad, "status": r.status_code})
            m["reload"] = reloads[-1]
            minutes.append(m)
            print(f"{k * 10:4d} s: {m['requests_per_s']:6.0f} req/s  p50 {m['p50_ms']:.1f} ms"
                  f"  p99 {m['p99_ms']:.1f} ms  status {dict(status)}  RSS {rss:.0f} MB  "
                  f"reload {'bad' if target == bad else 'ok'} -> {r.status_code}",
                  flush=True)

        t0 = time.perf_counter()
        traffic.run(clients, args.minutes * 60, 10, tick)
        wall = time.perf_counter() - t0
        lat, status = traffic.take()
        lat_all.append(lat)
        totals.update(status)
        lat = np.concatenate(lat_all)
        rss = [m["rss_mb"] for m in minutes]
        first = next((m["rss_mb"] for m in minutes if m["t_s"] >= 60), rss0)
        report.update(clients=clients, minutes=args.minutes, rss_start_mb=rss0,
                      rss_after_1min_mb=first, rss_end_mb=rss[-1] if rss else rss0,
                      rss_growth_after_1min=(rss[-1] - first) / first if rss else 0.0,
                      total={**summary(lat, totals, wall)},
                      errors_not_4xx=sum(v for k, v in totals.items()
                                         if not (k.isdigit() and int(k) < 500)) ,
                      reloads=reloads, timeline=minutes)
    finally:
        server.terminate()
        server.wait(timeout=10)
    t = report["total"]
    print(f"total: {t['requests']:,} requests, {t['requests_per_s']:.0f} req/s, p50 "
          f"{t['p50_ms']:.1f} ms, p99 {t['p99_ms']:.1f} ms, status {t['status']}, errors that "
          f"are not 4xx: {report['errors_not_4xx']}; reloads "
          f"{[r['status'] for r in report['reloads']]}; RSS {report['rss_start_mb']:.0f} -> "
          f"{report['rss_after_1min_mb']:.0f} (1 min) -> {report['rss_end_mb']:.0f} MB "
          f"({report['rss_growth_after_1min']:+.1%} after the first minute)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    if args.readme:
        from benchmarks._readme import update_block

        update_block(args.readme, "soak", markdown(report))


def markdown(r: dict) -> str:
    from benchmarks._readme import shown_command

    m, t = r["machine"], r["total"]
    good = [x["status"] for x in r["reloads"] if not x["bad"]]
    bad = [x["status"] for x in r["reloads"] if x["bad"]]
    lines = [
        f"Soak (`{('python benchmarks/soak.py ' + shown_command(r['args'])).strip()}`; "
        f"{m['cpu']} "
        f"({', '.join(m['isa'])}), "
        f"{m['cores']} cores, server and clients on the same machine): {r['minutes']:g} "
        f"minutes of mixed `/v1/predict`, `/v1/rank` (20 candidates) and `/v1/recommend` "
        f"traffic from {r['clients']} clients (the most whose p99 stayed under 50 ms), a "
        f"reload every minute, every third one a bundle with a flipped byte.", "",
        f"- {t['requests']:,} requests, {t['requests_per_s']:.0f} per second; p50 "
        f"{t['p50_ms']:.1f} ms, p99 {t['p99_ms']:.1f} ms; statuses {t['status']}; "
        f"**{r['errors_not_4xx']} errors that are not 4xx**.",
        f"- reloads: {len(good)} good ones answered {sorted(set(good))}, {len(bad)} bad ones "
        f"refused with {sorted(set(bad))} while the old model kept serving.",
        f"- server RSS: {r['rss_start_mb']:.0f} MB at the start, {r['rss_after_1min_mb']:.0f} "
        f"MB after the first minute, {r['rss_end_mb']:.0f} MB at the end "
        f"(**{r['rss_growth_after_1min']:+.1%}** after the first minute); per minute: "
        + ", ".join(f"{x['rss_mb']:.0f}" for x in r["timeline"] if x["t_s"] % 60 == 0) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
