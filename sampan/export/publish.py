"""Publishing a stream run's model to serving: a model directory of versions.

Each version is a full bundle (``sampan export``: parity-checked against PyTorch before it
is written) in ``DIR/v000012/``; ``DIR/versions.json`` lists them::

    {"latest": 12,
     "versions": [{"version": 12, "parent": 11, "path": "v000012", "windows": 340,
                   "rows": 1700000, "position": {...}, "created": 1796150000.0,
                   "manifest_sha256": "..."}, ...]}

``position`` is the stream position the version was trained up to. ``versions.json`` is
replaced atomically after the bundle is whole, so a reader (``sampan serve --watch DIR``)
never sees a version that is being written. The oldest versions beyond ``keep`` are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sampan.config import PublishConfig
from sampan.errors import BundleError

VERSIONS = "versions.json"


def read_versions(directory: str | Path) -> dict[str, Any]:
    """``versions.json`` of a model directory (``{"latest": 0, "versions": []}`` when none
    was published yet)."""
    path = Path(directory) / VERSIONS
    if not path.exists():
        return {"latest": 0, "versions": []}
    try:
        out = json.loads(path.read_text())
    except ValueError as e:
        raise BundleError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(out, dict) or not isinstance(out.get("versions"), list):
        raise BundleError(f"{path}: expected {{'latest': N, 'versions': [...]}}")
    return out


class Publisher:
    """Called after each checkpoint of a stream run: publishes a new version every
    ``every_windows`` windows or ``every_seconds`` seconds (whichever comes first), and at
    the end of the stream. A run's first checkpoint publishes, unless the run resumes and
    already published: then its last version (``versions.json`` names each version's run)
    is where the count goes on from."""

    def __init__(self, cfg: PublishConfig, run: Path, console: Any = None):
        self.cfg, self.run, self.console = cfg, Path(run), console
        self.dir = Path(cfg.dir)  # made by the first version: a run that fails first
        # (brokers down) leaves no empty folder behind
        self.windows_at = -1  # the window count of the last version
        self.time_at = time.monotonic()
        # a resumed run goes on from its own last version, not from a first push
        mine = [v for v in read_versions(self.dir)["versions"]
                if v.get("run") == str(self.run.resolve())]
        if mine:
            self.windows_at = int(mine[-1]["windows"])
            self.time_at -= max(0.0, time.time() - float(mine[-1].get("created", time.time())))
        self.seconds: list[float] = []  # how long each export took

    def __call__(self, info: dict[str, Any]) -> dict[str, Any] | None:
        c = self.cfg
        due = info.get("final", False) or self.windows_at < 0 or (
            c.every_windows is not None and info["windows"] - self.windows_at
            >= c.every_windows) or (
            c.every_seconds is not None and time.monotonic() - self.time_at >= c.every_seconds)
        if not due or info["windows"] == self.windows_at:
            return None
        return self.publish(info)

    def publish(self, info: dict[str, Any]) -> dict[str, Any]:
        from sampan.export.bundle import export_run

        t0 = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        versions = read_versions(self.dir)
        number = int(versions.get("latest", 0)) + 1
        name = f"v{number:06d}"
        # no feature tables: a stream run's rows are not files to read again, and a
        # publish must be quick (users' histories come from events in serving)
        out = export_run(self.run, self.dir / name, overwrite=True, feature_tables=False)
        manifest = json.loads((out / "manifest.json").read_text())
        entry = {"version": number, "parent": versions.get("latest") or None, "path": name,
                 "run": str(self.run.resolve()), "windows": info["windows"], "rows": info["rows"],
                 "position": info["position"], "created": round(time.time(), 3),
                 "manifest_sha256": manifest.get("manifest_sha256"),
                 "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}
        kept = [v for v in versions["versions"] if v["version"] != number] + [entry]
        gone, kept = kept[:-self.cfg.keep], kept[-self.cfg.keep:]
        tmp = self.dir / (VERSIONS + ".tmp")
        tmp.write_text(json.dumps({"latest": number, "versions": kept}, indent=1))
        os.replace(tmp, self.dir / VERSIONS)
        for v in gone:
            shutil.rmtree(self.dir / v["path"], ignore_errors=True)
        self.windows_at, self.time_at = info["windows"], time.monotonic()
        self.seconds.append(time.perf_counter() - t0)
        if self.console is not None:
            self.console.print(f"published {name} ({entry['bytes'] / 1e6:.1f} MB, window "
                               f"{info['windows']}) to {self.dir} in "
                               f"{self.seconds[-1]:.1f} s", highlight=False)
        return entry
