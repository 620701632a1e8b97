"""Issue 45, item 9: signed bundles. The sha256s of a bundle catch accidental damage only: a
manifest edited on purpose, its ``manifest_sha256`` recomputed with ``manifest_digest``,
still opens. With a bundle key (HMAC-SHA256) the export signs the manifest digest, and a
loader or server holding the key refuses that edit, an unsigned bundle and one signed with
another key: in Python, at ``sampan serve`` start (an experiment's arms) and on a reload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from rich.console import Console

from sampan.bundle import (
    KEY_ENV,
    KEY_FILE_ENV,
    Bundle,
    BundleKey,
    bundle_key,
    manifest_digest,
    verification_note,
)
from sampan.config import load_config
from sampan.errors import BundleError, ConfigError
from sampan.export import export_run
from sampan.serving import Predictor
from sampan.train.experiment import run_experiment
from tests import web
from tests.conftest import Served, free_port, tiny_config
from tests.integration.test_cli import sampan_here

KEY = "k3y-for-the-signing-tests-0123456789abcdef"
OTHER = "another-key-of-at-least-16-bytes"
TOKEN = "test-token"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """A tiny run exported signed with KEY, and unsigned."""
    root = tmp_path_factory.mktemp("signing")
    with pytest.MonkeyPatch.context() as mp:  # whatever the shell holds: no key but KEY
        mp.delenv(KEY_ENV, raising=False)
        mp.delenv(KEY_FILE_ENV, raising=False)
        cfg = load_config(raw=tiny_config(root, rows=1500, epochs=1))
        run = run_experiment(cfg, console=Console(quiet=True))["run_dir"]
        signed = export_run(run, root / "signed", key=KEY)
        unsigned = export_run(run, root / "unsigned")
    return {"run": run, "signed": signed, "unsigned": unsigned}


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def attacked(bundles, tmp_path):
    """The tester's attack: ``model`` edited in manifest.json, ``manifest_sha256``
    recomputed with the public ``manifest_digest``; the signature left as it was."""
    out = tmp_path / "attacked"
    shutil.copytree(bundles["signed"], out)
    m = json.loads((out / "manifest.json").read_text())
    m["model"] = "lr"
    m["manifest_sha256"] = manifest_digest(m)
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def a_record(predictor):
    return {c: None for c in predictor.columns}  # every feature missing: still scored


def test_a_signed_bundle_opens_and_scores_with_its_key(bundles, monkeypatch):
    m = json.loads((bundles["signed"] / "manifest.json").read_text())
    assert m["signature"]["algorithm"] == "hmac-sha256"
    assert m["manifest_sha256"] == manifest_digest(m)  # the digest leaves the signature out
    assert "signature" not in json.loads((bundles["unsigned"] / "manifest.json").read_text())
    b = Bundle(bundles["signed"], key=KEY)
    assert b.signature_verified
    p = Predictor(bundles["signed"], key=KEY)
    assert p.predict([a_record(p)]).shape == (1, 1)
    monkeypatch.setenv(KEY_ENV, KEY)  # the environment's key, as a server gets it
    assert Bundle(bundles["signed"]).signature_verified
    monkeypatch.delenv(KEY_ENV)
    assert not Bundle(bundles["signed"]).signature_verified  # no key: checksums only


def test_the_edited_and_redigested_manifest_is_refused_with_a_key(bundles, tmp_path,
                                                                  monkeypatch):
    b = attacked(bundles, tmp_path)
    # documented: without a key the checksums cannot tell this edit from an export
    assert Bundle(b).manifest["model"] == "lr"
    with pytest.raises(BundleError, match=r"its signature does not verify.*edited and its "
                                          r"sha256 recomputed") as e:
        Bundle(b, key=KEY)
    assert str(b) in str(e.value)
    with pytest.raises(BundleError, match="signature does not verify"):
        Predictor(b, key=KEY)
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(BundleError, match=f"signature does not verify with the bundle key "
                                          f"from {KEY_ENV}"):
        Predictor(b)
    # nor does a made-up signature
    m = json.loads((b / "manifest.json").read_text())
    m["signature"]["value"] = "0" * 64
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="signature does not verify"):
        Bundle(b)


def test_an_unsigned_bundle_is_refused_with_a_key(bundles, tmp_path):
    with pytest.raises(BundleError, match=r"is not signed, and a bundle key is set") as e:
        Bundle(bundles["unsigned"], key=KEY)
    assert str(bundles["unsigned"]) in str(e.value)
    # the signature stripped from a signed bundle (its digest is unchanged): refused too
    b = tmp_path / "stripped"
    shutil.copytree(bundles["signed"], b)
    m = json.loads((b / "manifest.json").read_text())
    del m["signature"]
    (b / "manifest.json").write_text(json.dumps(m))
    Bundle(b)
    with pytest.raises(BundleError, match="is not signed"):
        Bundle(b, key=KEY)
    m["signature"] = "deadbeef"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="malformed signature"):
        Bundle(b, key=KEY)


def test_a_bundle_signed_with_another_key_is_refused(bundles):
    with pytest.raises(BundleError, match="signature does not verify"):
        Bundle(bundles["signed"], key=OTHER)
    with pytest.raises(BundleError, match="signature does not verify"):
        Predictor(bundles["signed"], key=OTHER.encode())


def test_the_key_comes_from_one_place_and_a_bad_one_is_an_error(tmp_path, monkeypatch):
    assert bundle_key() is None
    assert "checksums only" in verification_note(None)
    monkeypatch.setenv(KEY_ENV, KEY)
    key = bundle_key()
    assert key.secret == KEY.encode() and key.source == KEY_ENV
    assert KEY not in repr(key) and KEY not in verification_note(key)
    assert "signature required" in verification_note(key)
    f = tmp_path / "key"
    f.write_text(KEY + "\n")  # as `echo` writes it: the newline is not part of the key
    with pytest.raises(ConfigError, match="given 2 ways"):
        bundle_key(f)
    monkeypatch.delenv(KEY_ENV)
    assert bundle_key(f).secret == KEY.encode()
    monkeypatch.setenv(KEY_FILE_ENV, str(f))
    assert bundle_key().secret == KEY.encode()
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="cannot read the bundle key file"):
        bundle_key()
    monkeypatch.delenv(KEY_FILE_ENV)
    monkeypatch.setenv(KEY_ENV, "")  # an empty secret never means "unsigned" silently
    with pytest.raises(ConfigError, match="is empty"):
        bundle_key()
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        bundle_key()
    with pytest.raises(ConfigError, match="at least 16"):
        BundleKey(b"short")


def test_sampan_export_signs_with_a_key_file(bundles, tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    r = sampan_here("export", str(bundles["run"]), "--out", str(tmp_path / "b"),
                    "--key-file", str(f), check=True)
    # (the console wraps long lines: compare without its line breaks)
    assert f"signed with HMAC-SHA256 (key from key file {f})" in r.stdout.replace("\n", "")
    Bundle(tmp_path / "b", key=KEY)
    with pytest.raises(BundleError, match="signature does not verify"):
        Bundle(tmp_path / "b", key=OTHER)


def test_a_server_with_a_key_refuses_unsigned_arms_at_start(bundles):
    r = subprocess.run(
        [sys.executable, "-m", "sampan", "serve", "--variant", f"a={bundles['signed']}:50",
         "--variant", f"b={bundles['unsigned']}:50", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, KEY_ENV: KEY, "COLUMNS": "200"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "signature required" in r.stdout
    assert f"bundle {bundles['unsigned']} is not signed" in r.stderr


def test_serve_with_a_key_file_names_the_file_it_was_given(bundles, tmp_path):
    f = tmp_path / "bundle.key"
    f.write_text(KEY)
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, KEY_FILE_ENV)}
    r = subprocess.run(
        [sys.executable, "-m", "sampan", "serve", str(bundles["unsigned"]), "--key-file",
         str(f), "--port", str(free_port())], capture_output=True, text=True, timeout=60,
        env={**env, "COLUMNS": "300"})
    assert r.returncode == 2, r.stdout + r.stderr
    # the file the option named, not the variable serve hands it to its processes by
    assert f"(key file {f.resolve()}):" in r.stderr, r.stderr


def test_reload_through_a_real_server_refuses_with_a_json_error(bundles, tmp_path):
    bad = attacked(bundles, tmp_path)
    srv = Served([str(bundles["signed"])], env={KEY_ENV: KEY, "SAMPAN_ADMIN_TOKEN": TOKEN},
                 grpc=False)
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        r = web.post(f"{srv.url}/v1/admin/reload", json={"bundle": str(bad)}, headers=auth,
                     timeout=60)
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["field"] == "bundle"
        assert str(bad) in body["error"] and "signature does not verify" in body["error"]
        r = web.post(f"{srv.url}/v1/admin/reload", json={"bundle": str(bundles["unsigned"])},
                     headers=auth, timeout=60)
        assert r.status_code == 400 and "is not signed" in r.json()["error"], r.text
        r = web.post(f"{srv.url}/v1/admin/reload",  # the retrieval bundle: checked alike
                     json={"retrieval_bundle": str(bundles["unsigned"])}, headers=auth,
                     timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["field"] == "retrieval_bundle" and "is not signed" in r.json()["error"]
        # the signed bundle still serves, and reloads
        assert web.get(f"{srv.url}/readyz").status_code == 200
        r = web.post(f"{srv.url}/v1/admin/reload", json={"bundle": str(bundles["signed"])},
                     headers=auth, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        out = srv.stop()
    assert f"bundles: signature required (HMAC-SHA256, key from {KEY_ENV})" in out
    assert KEY not in out
