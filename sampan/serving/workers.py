"""``sampan serve --workers N``: the worker processes uvicorn starts keep the same bundles
(a shared file under a lock) and their Prometheus metrics are added up."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from sampan.config import ServeConfig
from sampan.serving.http import create_app
from sampan.serving.predictor import Predictor
from sampan.serving.service import ServerState


class ReloadSync:
    """Keeps the worker processes of one ``sampan serve --workers N`` on the same bundles.

    The workers share a small JSON file: the served ``bundle`` and ``retrieval_bundle``,
    the ``generation`` (reloads so far) and, for each bundle, the generation that last
    loaded it (``bundle_gen``, ``retrieval_gen``: a bundle exported again to the same path
    and reloaded is loaded again everywhere). The worker that takes a reload loads the
    bundles first (so a bad bundle never reaches the file), then writes the next
    generation under an exclusive file lock; every worker polls the file every
    ``interval`` seconds and loads what a newer generation changed. Within a worker, a
    reload and the watcher take turns, so the file and what the worker serves never
    disagree for longer than one poll. A worker that uvicorn starts again later reads the
    file, so it serves the current bundles, not those of the command line.
    """

    def __init__(self, path: str | Path, state: ServerState, interval: float = 0.5):
        self.path = Path(path)
        self.state = state
        self.interval = interval
        self._lock = threading.Lock()
        self.seen = self.read()  # the file as this worker last applied it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sampan-reload-sync",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def create(path: str | Path, bundle: str, retrieval_bundle: str | None) -> None:
        """The file for a new server, at generation 0."""
        Path(path).write_text(json.dumps({
            "bundle": bundle, "retrieval_bundle": retrieval_bundle, "generation": 0,
            "bundle_gen": 0, "retrieval_gen": 0}))

    def read(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    def reload(self, bundle: str | None, retrieval_bundle: str | None
               ) -> tuple[Predictor | None, Any, int]:
        """Load the bundles here (``None`` leaves that one as it is), then tell the other
        workers: returns what :meth:`ServerState.load` does and the new generation."""
        with self._lock:  # one reload at a time in this worker, watcher included
            predictor, retriever = self.state.load(bundle, retrieval_bundle)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time among the workers
                current = self.read()
                g = current["generation"] + 1
                current["generation"] = g
                if bundle is not None:
                    current.update(bundle=bundle, bundle_gen=g)
                if retrieval_bundle is not None:
                    current.update(retrieval_bundle=retrieval_bundle, retrieval_gen=g)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(current))
                os.replace(tmp, self.path)  # atomic: readers see the old or the new file
            # What this worker serves now: what it just loaded, and for the other bundle
            # what it had before; if another worker changed that one meanwhile, the
            # watcher's next poll loads it.
            old = self.seen
            self.seen = {**current, **({} if bundle is not None else {
                "bundle": old["bundle"], "bundle_gen": old["bundle_gen"]}),
                **({} if retrieval_bundle is not None else {
                    "retrieval_bundle": old["retrieval_bundle"],
                    "retrieval_gen": old["retrieval_gen"]})}
        return predictor, retriever, g

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Load whatever the file's bundles changed since this worker last looked."""
        with self._lock:
            try:
                current = self.read()
            except (OSError, ValueError):
                return  # the server is shutting down
            seen = self.seen
            bundle = current["bundle"] if current["bundle_gen"] > seen["bundle_gen"] else None
            retrieval = current["retrieval_bundle"] \
                if current["retrieval_gen"] > seen["retrieval_gen"] else None
            if bundle is None and retrieval is None:
                return
            self.seen = current
            try:
                self.state.load(bundle, retrieval)
                self.state.reloads.labels("ok").inc()
            except Exception as e:  # noqa: BLE001 - keep serving the old model; say why
                self.state.reloads.labels("failed").inc()
                print(f"sampan worker {os.getpid()}: cannot load generation "
                      f"{current['generation']} ({current}): {e}", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        self._stop.set()




def forget_dead_workers() -> list[int]:
    """Drop the live-only gauges (``sampan_model_info``) of workers that are gone, so that
    /metrics shows the models of running workers only; returns their pids. A worker that
    uvicorn starts in place of one that died calls this first. Counters and histograms of
    dead workers stay: their counts still belong in the totals."""
    from prometheus_client import multiprocess

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return []
    dead = set()
    for f in Path(path).glob("gauge_live*_*.db"):
        pid = f.stem.rsplit("_", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            dead.add(int(pid))
        except PermissionError:  # alive, another user's
            pass
    for pid in dead:
        try:
            multiprocess.mark_process_dead(pid, path)
        except FileNotFoundError:  # another new worker removed them first
            pass
    return sorted(dead)


def app_from_env():  # type: ignore[no-untyped-def]
    """uvicorn factory for ``--workers N``: the config comes in ``SAMPAN_SERVE_CONFIG``, the
    reload file shared by the workers (see :class:`ReloadSync`) in ``SAMPAN_SERVE_SYNC``."""
    cfg = ServeConfig.model_validate(json.loads(os.environ["SAMPAN_SERVE_CONFIG"]))
    sync_path = os.environ.get("SAMPAN_SERVE_SYNC")
    if sync_path:  # a worker started after a reload serves the current bundles
        current = json.loads(Path(sync_path).read_text())
        cfg = cfg.model_copy(update={"bundle": current["bundle"],
                                     "retrieval_bundle": current.get("retrieval_bundle")})
    forget_dead_workers()
    state = ServerState(cfg)
    if sync_path:
        state.sync = ReloadSync(sync_path, state)
        _say_once(Path(sync_path).parent / "events-note", _events_note(state))
    app = create_app(state)
    if cfg.grpc_port is not None and os.environ.get("SAMPAN_GRPC_IN_WORKER") == "1":
        from sampan.serving.grpc_server import start_grpc

        # every worker binds the port (gRPC sets SO_REUSEPORT); keep the server referenced
        app.state.grpc_server = start_grpc(state, cfg.host, cfg.grpc_port)
    return app


def _events_note(state: ServerState) -> str | None:
    """Why /v1/events will be refused (409) by these workers, if it will: the served model
    reads live histories, and each worker would keep its own in memory."""
    live = state.live
    if live is None or live.shared or state.cfg.workers < 2:
        return None
    return (f"warning: live histories by {live.key} are kept in memory, one copy per worker: "
            "/v1/events answers 409 with --workers > 1, so the histories stay as the bundle "
            "left them (feature_store.backend=redis shares them)")


def _say_once(marker: Path, note: str | None) -> None:
    """Print ``note`` on stderr from the first worker that gets here (the one that creates
    ``marker`` in the workers' shared folder), not once a worker."""
    if note is None:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    print(note, file=sys.stderr, flush=True)
