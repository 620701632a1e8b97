"""``sampan serve --watch DIR``: follow a model directory that a stream run publishes to
(:mod:`sampan.export.publish`), checking each new version before it is served."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sampan.serving.predictor import Predictor
from sampan.serving.service import ServingBundleError

if TYPE_CHECKING:
    from sampan.serving.service import ServerState


class ModelWatcher:
    """Follows a model directory that a stream run publishes to
    (:mod:`sampan.export.publish`): every ``interval`` seconds it reads ``versions.json``,
    and a newer version is checked (the bundle's checksums, its recorded export parity,
    one scored record) and swapped in by :meth:`ServerState.load`, between two model
    calls: no request is dropped. A version that fails its checks is refused (and
    counted) and the current one keeps serving. :meth:`rollback` goes back to the
    version served before and holds there until a version newer than the one rolled back
    from is published."""

    MAX_PARITY = 1e-4

    def __init__(self, state: ServerState | None, directory: str, interval: float,
                 arm: str | None = None):
        self.state, self.dir, self.interval = state, Path(directory), interval
        self.arm = arm  # the server's arm this directory feeds (None: control)
        self.serving: dict[str, Any] | None = None  # the versions.json entry being served
        self.previous: list[dict[str, Any]] = []  # served before, most recent last
        self.refused: set[int] = set()
        self.hold_until = 0  # after a rollback: versions up to this one are not applied
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def _versions(self) -> dict[str, Any]:
        from sampan.export.publish import read_versions

        return read_versions(self.dir)

    def adopt(self, bundle: str | None) -> str:
        """The bundle to start with: ``bundle`` (a version of the directory, or any
        bundle), else the directory's latest version."""
        v = self._versions()
        if bundle is not None:
            name = Path(bundle).resolve()
            self.serving = next((e for e in v["versions"]
                                 if (self.dir / e["path"]).resolve() == name), None)
            return bundle
        entry = next((e for e in v["versions"] if e["version"] == v["latest"]), None)
        if entry is None:
            raise ServingBundleError("watch", f"{self.dir} holds no published version yet "
                                     "(start `sampan stream` with stream.publish.dir there)")
        self.serving = entry
        return str(self.dir / entry["path"])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sampan-watch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the server keeps serving; said in /metrics
                self.errors.append(str(e))
                del self.errors[:-10]

    def poll(self) -> dict[str, Any] | None:
        """Apply the newest version if it is new and passes its checks; returns it."""
        v = self._versions()
        latest = int(v.get("latest", 0))
        current = self.serving["version"] if self.serving else 0
        if latest <= max(current, self.hold_until) or latest in self.refused:
            return None
        entry = next((e for e in v["versions"] if e["version"] == latest), None)
        if entry is None:
            return None
        return self._apply(entry)

    def _check(self, entry: dict[str, Any]) -> Any:
        def check(p: Predictor) -> None:
            m = p.bundle.manifest  # its files matched their checksums when it opened
            if entry.get("manifest_sha256") and m.get("manifest_sha256") != \
                    entry["manifest_sha256"]:
                raise ServingBundleError("bundle", "its manifest is not the one "
                                         "versions.json names")
            diff = m.get("parity", {}).get("max_abs_diff")
            if diff is None or not diff <= self.MAX_PARITY:
                raise ServingBundleError("bundle", f"its export parity {diff} is above "
                                         f"{self.MAX_PARITY}")
            # every feature missing: the graph must still score
            probs = p.predict([dict.fromkeys(p.columns)])
            if not bool(np.isfinite(probs).all()):
                raise ServingBundleError("bundle", "it scores a record as non-finite")
        return check

    def _apply(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        path = str(self.dir / entry["path"])
        try:
            self.state.load(path, check=self._check(entry), arm=self.arm)
        except ServingBundleError as e:
            self.refused.add(int(entry["version"]))
            self.state.reloads.labels("refused").inc()
            self.errors.append(f"version {entry['version']}: {e}")
            self._say(f"refused version {entry['version']} ({path}): {e}; still serving "
                      f"version {self.serving['version'] if self.serving else '-'}")
            return None
        self.state.reloads.labels("ok").inc()
        if self.serving is not None:
            self.previous.append(self.serving)
            del self.previous[:-5]
        self.serving = entry
        self._say(f"now serving version {entry['version']} ({path}"
                  + (f", window {entry['windows']:,}" if "windows" in entry else "") + ")")
        return entry

    def _say(self, what: str) -> None:
        """A line on the server's log (stderr) for each swap, refusal and rollback; with
        several workers, each says it, naming itself."""
        cfg = getattr(self.state, "cfg", None)
        who = f" (worker {os.getpid()})" if cfg is not None and cfg.workers > 1 else ""
        print(f"watch{who}: {what}", file=sys.stderr, flush=True)

    def rollback(self) -> dict[str, Any]:
        """Back to the version served before this one (raises
        :class:`ServingBundleError` when there is none, or it can no longer be opened)."""
        if not self.previous:
            raise ServingBundleError("watch", "no earlier version was served to roll back to")
        back = self.previous[-1]
        rolled_from = self.serving["version"] if self.serving else 0
        self.state.load(str(self.dir / back["path"]), check=self._check(back), arm=self.arm)
        self.previous.pop()
        self.serving = back
        self.hold_until = max(self.hold_until, rolled_from)
        self._say(f"rolled back from version {rolled_from} to version {back['version']}; "
                  f"held there until a version newer than {rolled_from} is published")
        return back
