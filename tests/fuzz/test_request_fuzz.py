"""Fuzzing the request parsers of a real `sampan serve` (uvicorn + gRPC in its own
process): whatever a client sends, REST answers JSON with a status below 500 and gRPC
answers OK or INVALID_ARGUMENT, and the server answers /healthz after every case on the
same connection.

``SAMPAN_FUZZ_EXAMPLES`` sets the bounded example count CI runs; the ``long_fuzz`` tests
(``pytest -m long_fuzz``) run 20 times as many."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from benchmarks.serve_load import start_server
from sampan.config import load_config
from sampan.export import export_run
from sampan.train.experiment import run_experiment
from tests.conftest import free_port
from tests.fuzz import EXAMPLES, fuzz

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-serve")
    cfg = load_config(raw={"output_dir": str(root), "preset": "criteo", "data": {
                               "format": "synthetic", "synthetic": {"rows": 3000}},
                           "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [8]},
                           "train": {"epochs": 1, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=root / "run", console=Console(quiet=True))["run_dir"]
    bundle = export_run(run, root / "bundle")
    gport = free_port()
    proc, url = start_server(bundle, "--grpc-port", str(gport), "--set",
                             "max_body_bytes=100000", "--set", "max_records=50", "--set",
                             "item_key=C1", env={"SAMPAN_ADMIN_TOKEN": TOKEN})
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client, gport, bundle
    proc.terminate()
    proc.wait(timeout=10)


FEATURES = [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                   st.floats(allow_nan=True, allow_infinity=True), text,
                   st.sampled_from(["\ud800", "\udfff\ud800", "\x00", "1e400", "NaN", "-0"]))
value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)), max_leaves=5)
record = st.one_of(
    st.dictionaries(st.sampled_from(FEATURES), value, max_size=6),
    st.fixed_dictionaries({f: scalar for f in FEATURES}),  # every feature, odd values
    st.dictionaries(text, value, max_size=3))
bodies = st.one_of(
    st.builds(lambda r: {"records": r}, st.lists(record, max_size=4)),
    st.builds(lambda c, cand, k, t: {"context": c, "candidates": cand, "k": k, "task": t},
              record, st.lists(st.one_of(text, st.integers()), max_size=4),
              st.integers(-3, 2 ** 40), st.integers(-2, 3)),
    st.builds(lambda c, n, k: {"context": c, "n": n, "k": k}, record,
              st.integers(-1, 10 ** 6), st.integers(-1, 100)),
    st.builds(lambda b: {"bundle": b}, st.one_of(text, st.sampled_from(
        ["../../etc", "/dev/zero", "/proc/self/mem", "\ud800", "a\x00b"]))),
    value)
ROUTES = ["/v1/predict", "/v1/rank", "/v1/recommend", "/v1/admin/reload", "/nowhere"]


def encode(body) -> bytes:  # type: ignore[no-untyped-def]
    """JSON as a client might send it: surrogates escaped, NaN/Infinity as Python writes."""
    return json.dumps(body, allow_nan=True).encode()


def check_http(client, route, raw, auth) -> None:  # type: ignore[no-untyped-def]
    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = f"Bearer {TOKEN}"
    r = client.post(route, content=raw, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert set(r.json()) >= ({"error", "field"} if r.status_code >= 400 else set())
    assert client.get("/healthz").status_code == 200


def rest_body(client, route, body, auth):  # type: ignore[no-untyped-def]
    if route == "/v1/admin/reload" and isinstance(body, dict) and "bundle" not in body:
        auth = False  # a reload only takes bundle paths; the others test the token check
    check_http(client, route, encode(body), auth)


def rest_bytes(client, route, raw):  # type: ignore[no-untyped-def]
    check_http(client, route, raw, False)


def grpc_case(gport, method, raw):  # type: ignore[no-untyped-def]
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
        call = ch.unary_unary(f"/sampan.v1.Scoring/{method}")
        try:
            call(raw, timeout=30)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())


def grpc_struct(gport, method, body):  # type: ignore[no-untyped-def]
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    pb, _ = stubs()
    s = Struct()
    try:
        s.update({k: v for k, v in body.items() if isinstance(k, str)}
                 if isinstance(body, dict) else {})
    except (ValueError, TypeError):
        return  # not expressible as a Struct: the client library refuses it first
    msg = pb.PredictRequest(records=[s]) if method == "Predict" else pb.RankRequest(
        context=s, candidates=["a", "b"], k=3)
    grpc_case(gport, method, msg.SerializeToString())


rest_case = dict(route=st.sampled_from(ROUTES), body=bodies, auth=st.booleans())
bytes_case = dict(route=st.sampled_from(ROUTES), raw=st.one_of(
    st.binary(max_size=200), st.text(max_size=50).map(lambda t: t.encode("utf-8", "replace")),
    st.sampled_from([b"", b"{", b'{"records": [', b"\xff\xfe", b'{"records": [{}]}' * 3,
                     b'{"records": NaN}', b'{"records": [{"C1": "\\ud800"}]}'])))
grpc_bytes = dict(method=st.sampled_from(["Predict", "Rank"]), raw=st.binary(max_size=200))
grpc_structs = dict(method=st.sampled_from(["Predict", "Rank"]), body=record)


def _run(server, examples, case, fn, uses):  # type: ignore[no-untyped-def]
    client, gport, _ = server
    args = {"client": client, "gport": gport}

    def body(**kw):  # type: ignore[no-untyped-def]
        fn(**{k: args[k] for k in uses}, **kw)

    fuzz(examples)(given(**case)(body))()
    assert client.get("/healthz").status_code == 200


CASES = {"rest_json": (rest_case, rest_body, ["client"]),
         "rest_bytes": (bytes_case, rest_bytes, ["client"]),
         "grpc_bytes": (grpc_bytes, grpc_case, ["gport"]),
         "grpc_struct": (grpc_structs, grpc_struct, ["gport"])}


@pytest.mark.parametrize("case", list(CASES))
def test_any_request_is_answered_below_500(server, case):
    _run(server, EXAMPLES, *CASES[case])


@pytest.mark.long_fuzz
@pytest.mark.parametrize("case", list(CASES))
def test_any_request_is_answered_below_500_long(server, case):
    _run(server, EXAMPLES * 20, *CASES[case])
