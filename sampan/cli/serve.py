"""``sampan serve``: a bundle over HTTP (and gRPC), in one process or ``--workers N``."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from sampan.cli.base import KeyFileOpt, app, console, fail


@app.command()
def serve(
    bundle: Annotated[str | None, typer.Argument(
        help="Bundle directory (from `sampan export`); or give `bundle:` in --config.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Serve config YAML (see sampan.config.ServeConfig).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind [127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [8000].")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Also serve gRPC on this port.")] = None,
    workers: Annotated[int | None, typer.Option(help="HTTP worker processes [1].")] = None,
    watch: Annotated[str | None, typer.Option(
        "--watch", metavar="DIR", help="Follow a model directory that `sampan stream` "
        "publishes to: each new version is checked (checksums, export parity, a scored "
        "record) and swapped in without a dropped request; POST /v1/admin/rollback goes "
        "back one version.")] = None,
    variant: Annotated[list[str] | None, typer.Option(
        "--variant", metavar="NAME=BUNDLE_OR_WATCH_DIR:WEIGHT",
        help="An arm of an A/B experiment (repeat per arm; the first is control): a bundle, "
        "or a model directory `sampan stream` publishes to, and its relative weight. Each "
        "user (context or record field user_id, serve config unit_key) stays in one arm "
        "across requests, restarts and workers.")] = None,
    experiment: Annotated[str | None, typer.Option(
        help="The experiment's name with --variant: the salt of the users' assignment "
        "[the arms' names joined].")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE", help="Override a serve config value, e.g. --set "
        "feedback.dir=feedback/ --set max_batch_rows=4096. Values are parsed as YAML. "
        "Repeatable; applied after --config.")] = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Serve a bundle over HTTP (FastAPI under uvicorn) and optionally gRPC.

    Routes: `POST /v1/predict` (raw records -> probabilities), `POST /v1/rank` (context +
    candidate item ids -> top-k, user and item features joined from the feature store),
    `POST /v1/recommend` (retrieval, then ranking), `POST /v1/events` (users' behaviour, for
    their live histories), `POST /v1/feedback` (what users did with served items, for the
    feedback log), `GET /healthz`, `GET /readyz`, `GET /metrics` (Prometheus), and the admin
    routes `POST /v1/admin/reload`, `/v1/admin/rollback` and `/v1/admin/weights` (they need
    the bearer token from `admin_token` or `SAMPAN_ADMIN_TOKEN`). API docs at `/docs`.

    With a bundle key (`--key-file`, `SAMPAN_BUNDLE_KEY` or `SAMPAN_BUNDLE_KEY_FILE`; the
    key `sampan export` signed with) every bundle is refused unless its signature verifies:
    at start, on reload, the retrieval bundle, each arm and each watched version. Without
    one, bundles are checked for accidental damage only (their sha256s).
    """
    import os

    import uvicorn

    from sampan.bundle import KEY_FILE_ENV, KEY_FILE_FROM_OPTION_ENV, bundle_key, verification_note
    from sampan.config import load_serve_config

    signing = bundle_key(key_file)  # a bad key setting fails here, before anything is loaded
    if key_file is not None:  # every bundle this process (and its workers) opens: checked
        os.environ[KEY_FILE_ENV] = os.environ[KEY_FILE_FROM_OPTION_ENV] = \
            str(Path(key_file).resolve())

    overrides = list(set_ or [])
    for key, value in (("bundle", bundle), ("host", host), ("port", port),
                       ("grpc_port", grpc_port), ("workers", workers), ("watch", watch)):
        if value is not None:
            overrides.append(f"{key}={value}")
    if variant:
        from sampan.serving.variants import parse_variant

        if bundle is not None or watch is not None:
            fail("--variant names each arm's bundle or watch directory: give no BUNDLE or "
                 "--watch with it")
        arms = []
        for text in variant:
            name, source, weight = parse_variant(text)
            kind = "bundle" if (Path(source) / "manifest.json").exists() else "watch"
            arms.append({"name": name, kind: source, "weight": weight})
        exp = {"name": experiment or "-".join(a["name"] for a in arms), "variants": arms}
        overrides.append(f"experiment={json.dumps(exp)}")  # YAML reads JSON
    elif experiment is not None:
        fail("--experiment names the experiment of --variant arms: give the arms with it")
    cfg = load_serve_config(config, overrides)
    if cfg.bundle is None and cfg.workers > 1 and cfg.experiment is None:
        from sampan.serving.watcher import ModelWatcher

        cfg = cfg.model_copy(update={"bundle": ModelWatcher(None, cfg.watch, 1.0).adopt(None)})
    _check_free(cfg.host, cfg.port, "port")
    if cfg.grpc_port is not None:
        _check_free(cfg.host, cfg.grpc_port, "grpc_port")
    where = f"http://{cfg.host}:{cfg.port}" + (
        f" and gRPC {cfg.host}:{cfg.grpc_port}" if cfg.grpc_port is not None else "")
    if cfg.workers > 1:
        import shutil
        import tempfile

        from sampan.serving.workers import ReloadSync

        shared = tempfile.mkdtemp(prefix="sampan-serve-")
        ReloadSync.create(f"{shared}/bundle.json", cfg.bundle, cfg.retrieval_bundle)
        os.environ["SAMPAN_SERVE_CONFIG"] = cfg.model_dump_json()
        os.environ["SAMPAN_SERVE_SYNC"] = f"{shared}/bundle.json"
        os.makedirs(f"{shared}/metrics")  # every worker's Prometheus metrics, added up
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = f"{shared}/metrics"
        os.environ["SAMPAN_GRPC_IN_WORKER"] = "1"
        console.print(verification_note(signing), highlight=False)
        what = cfg.bundle if cfg.experiment is None else \
            f"experiment {cfg.experiment.name!r} (" + ", ".join(
                f"{v.name}: {v.bundle or v.watch}" for v in cfg.experiment.variants) + ")"
        _say_allocation(cfg)
        console.print(f"serving {what} on {where} with {cfg.workers} workers",
                      highlight=False)
        joiner = None
        if cfg.feedback.dir is not None:  # the workers journal; this process joins
            from sampan.serving.feedback import JoinerProcess

            joiner = JoinerProcess(cfg.feedback).start()
        try:
            from sampan.serving.http import JSONErrorsProtocol

            with _closing_on_sigterm():
                uvicorn.run("sampan.serving.workers:app_from_env", factory=True,
                            host=cfg.host, port=cfg.port, workers=cfg.workers,
                            log_level="warning", http=JSONErrorsProtocol)
        finally:
            if joiner is not None:
                joiner.stop()
            shutil.rmtree(shared, ignore_errors=True)
        return
    from sampan.serving.http import JSONErrorsProtocol, create_app
    from sampan.serving.service import ServerState

    console.print(verification_note(signing), highlight=False)
    state = ServerState(cfg)
    grpc_server = None
    if cfg.grpc_port is not None:
        from sampan.serving.grpc_server import start_grpc

        grpc_server = start_grpc(state, cfg.host, cfg.grpc_port)
    _say_allocation(cfg)
    for name, arm in state.arms.items():
        p = arm.predictor
        share = f" [{state.allocation.shares()[name]:.0%} of users]" \
            if state.allocation is not None else ""
        label = "" if state.allocation is None else f"{name}: "
        console.print(f"serving {label}{p.bundle.manifest.get('model')} ({p.version}){share} "
                      f"on {where}", highlight=False)
    for line in _serving_notes(state):
        console.print(line, highlight=False)
    try:
        with _closing_on_sigterm():
            uvicorn.run(create_app(state), host=cfg.host, port=cfg.port, log_level="warning",
                        http=JSONErrorsProtocol)
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=1)
        state.close()


@contextlib.contextmanager
def _closing_on_sigterm() -> Iterator[None]:
    """SIGTERM stops the server as Ctrl-C does, and the process then closes what it holds
    (the feedback journal's last records, the joiner, the watchers) and exits 0. uvicorn
    shuts down gracefully on it, then raises it again for the handler it found: the
    default one killed the process before any of that closing ran."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serving_notes(state: Any) -> list[str]:
    """What else the server answers from: the retrieval model of /v1/recommend, and the
    feature store its requests are joined with."""
    out = []
    if (r := state.retriever) is not None:
        own = " (the served model's own user tower)" if state.retrieval_own else ""
        out.append(f"retrieval: {r.predictor.bundle.manifest.get('model')} "
                   f"({r.predictor.version}){own} for /v1/recommend, {len(r.items):,} items")
    fs, tables = state.cfg.feature_store, state.store.tables if state.store else None
    if tables is not None:
        redis = fs.backend == "redis"  # (counting a Redis table's keys scans them all)
        out.append(f"feature store: {f'Redis at {fs.url}' if redis else 'memory'}, tables "
                   "keyed by " + ", ".join(by if redis else f"{by} ({tables.size(by):,} rows)"
                                           for by in tables.keys))
    if state.live is not None:
        out.append(f"live histories: by {state.live.key}, in "
                   + (f"Redis at {fs.url}" if fs.backend == "redis" else "memory"))
    return out


def _check_free(host: str, port: int, key: str) -> None:
    """Fail before loading anything when another process listens on ``host:port`` (the
    server would load its bundles, say it serves, then stop)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e} (the serve config's host)")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC
        try:
            sock.bind(addr)
        except OSError as e:
            fail(f"cannot listen on {host}:{port}: {e.strerror or e}; is another server "
                 f"there? choose another {key} (--{key.replace('_', '-')})")


def _say_allocation(cfg: Any) -> None:
    """A note when the experiment's saved allocation (weights changed while serving) is
    served instead of the weights the command line or config gives."""
    from sampan.serving.service import allocation_path
    from sampan.serving.variants import Allocation

    if cfg.experiment is None:
        return
    given = [(v.name, v.weight) for v in cfg.experiment.variants]
    path = allocation_path(cfg)
    kept = Allocation.load_or_start(path, given)
    if kept.counts() == Allocation.from_weights(given).counts():
        return
    total = sum(w for _, w in given)
    console.print(f"experiment: the allocation saved in {path} (weights changed while "
                  "serving) is kept over the weights given ("
                  + ", ".join(f"{n} {w / total:.0%}" for n, w in given)
                  + "); remove that file to start from the given ones", highlight=False)
