"""Schemathesis against a real ``sampan serve``, from the server's own OpenAPI document, all
checks on, the admin routes with the token: a DeepFM bundle (numeric and categorical
features, ranking by one of them) and a DIN bundle with feature tables and live histories.

Every generated request the document describes must be answered as documented (status,
content type, headers, body schema), every request it does not describe must be refused,
and no request may fail the server. The bounded run takes a third of
``SAMPAN_FUZZ_EXAMPLES`` cases an operation (50 unless set: every case is an HTTP round
trip, and the suite has a 10-minute budget); ``pytest -m long_fuzz`` runs 60 times as
many."""

from __future__ import annotations

import pytest
from rich.console import Console

from sampan.config import load_config
from sampan.export import export_run
from sampan.train.experiment import run_experiment
from tests.conftest import Served, din_live_bundle
from tests.fuzz import EXAMPLES, fuzz

schemathesis = pytest.importorskip("schemathesis", reason="Schemathesis is in the dev extra")

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _deepfm(root):  # type: ignore[no-untyped-def]
    cfg = load_config(raw={"output_dir": str(root), "preset": "criteo", "data": {
        "format": "synthetic", "synthetic": {"rows": 3000}},
        "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [8]},
        "train": {"epochs": 1, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=root / "run-deepfm", console=Console(quiet=True))
    return export_run(run["run_dir"], root / "bundle-deepfm")


def _served(bundle, *more):  # type: ignore[no-untyped-def]
    return Served([str(bundle), "--set", "max_records=50", "--set", "max_body_bytes=200000",
                   *more], env={"SAMPAN_ADMIN_TOKEN": TOKEN}, grpc=False)


@pytest.fixture(scope="module")
def deepfm_api(tmp_path_factory):  # type: ignore[no-untyped-def]
    srv = _served(_deepfm(tmp_path_factory.mktemp("st-deepfm")), "--set", "item_key=C1")
    yield schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    srv.stop()


@pytest.fixture(scope="module")
def din_api(tmp_path_factory):  # type: ignore[no-untyped-def]
    srv = _served(din_live_bundle(tmp_path_factory.mktemp("st-din")))
    yield schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    srv.stop()


deepfm = schemathesis.pytest.from_fixture("deepfm_api")
din = schemathesis.pytest.from_fixture("din_api")


BOUNDED = max(1, EXAMPLES // 3)


@deepfm.parametrize()
@fuzz(BOUNDED)
def test_deepfm_server_answers_as_documented(case):  # type: ignore[no-untyped-def]
    case.call_and_validate(headers=AUTH)


@din.parametrize()
@fuzz(BOUNDED)
def test_din_server_with_live_state_answers_as_documented(case):  # type: ignore
    case.call_and_validate(headers=AUTH)


@pytest.mark.long_fuzz
@deepfm.parametrize()
@fuzz(EXAMPLES * 20)
def test_deepfm_server_long(case):  # type: ignore[no-untyped-def]
    case.call_and_validate(headers=AUTH)


@pytest.mark.long_fuzz
@din.parametrize()
@fuzz(EXAMPLES * 20)
def test_din_server_long(case):  # type: ignore[no-untyped-def]
    case.call_and_validate(headers=AUTH)
