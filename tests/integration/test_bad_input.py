"""Bad input found by review: each case fails clearly or is quarantined, never silently."""

import json

import numpy as np
import pyarrow as pa
import pytest

from sampan.config import ConfigError, NumericFeature, load_config
from sampan.data.sources import DataError
from sampan.data.transforms import NumericEncoder
from sampan.train.experiment import run_experiment

HEADER = "label,x,c\n"


def csv_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return "".join(f"{int(rng.random() < 0.3)},{rng.integers(0, 50)},c{rng.integers(0, 20)}\n"
                   for _ in range(n))


def cfg_for(tmp_path, path, **over):
    raw = {"output_dir": str(tmp_path / "runs"), "data": {"train": str(path), **over},
           "features": {"numeric": ["x"], "categorical": ["c"]},
           "model": {"name": "lr"},
           "train": {"epochs": 1, "batch_size": 64, "progress": False, "tensorboard": False}}
    return raw


def test_empty_valid_file_is_an_empty_split(tmp_path):
    train, valid = tmp_path / "t.csv", tmp_path / "v.csv"
    train.write_text(HEADER + csv_rows(300))
    valid.write_text(HEADER)
    raw = cfg_for(tmp_path, train, valid=str(valid))
    results = run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    manifest = json.loads((tmp_path / "r" / "data" / "manifest.json").read_text())
    assert manifest["splits"]["valid"]["rows"] == 0
    assert "valid" not in results and results["test"]["rows"] > 0


def test_out_of_range_and_spaced_numbers_and_bad_labels(tmp_path):
    path = tmp_path / "t.csv"
    body = csv_rows(200)
    path.write_text(HEADER + body + "1,1e400,cX\n" + "2,3,cY\n" + "0, 7 ,cZ\n")
    raw = cfg_for(tmp_path, path, max_bad_fraction=0.05)
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    manifest = json.loads((tmp_path / "r" / "data" / "manifest.json").read_text())
    assert manifest["rejects"] == {"read": 203, "kept": 201, "rejected": 2,
                                   "reasons": {"unparsable_number": 1, "label_out_of_range": 1},
                                   "blank_lines": 0}
    rejects = [json.loads(x) for x in
               (tmp_path / "r" / "data" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"], r["column"]) for r in rejects] == [
        (202, "unparsable_number", "x"), (203, "label_out_of_range", "label")]


def test_all_rows_rejected_fails_early_with_a_hint(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("".join("1\t2\tc\n" for _ in range(3000)))
    raw = cfg_for(tmp_path, path, format="tsv", header=False, columns=["label", "x", "c", "extra"],
                  block_size=4096)
    with pytest.raises(DataError, match="all rejected.*data.columns"):
        run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")


def test_reusing_a_run_directory_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + csv_rows(200))
    raw = cfg_for(tmp_path, path)
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    with pytest.raises(FileExistsError, match="--resume"):
        run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")


def test_batch_norm_with_a_last_batch_of_one_row(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + csv_rows(250))
    raw = cfg_for(tmp_path, path, split={"train": 0.8, "valid": 0.1, "test": 0.1})
    raw["model"] = {"name": "deepfm", "batch_norm": True, "mlp": [8], "embedding_dim": 4}
    raw["train"]["batch_size"] = 199  # 200 train rows -> batches of 199 and 1
    results = run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    assert results["steps"] == 1


def test_standardize_is_stable_for_large_offsets():
    enc = NumericEncoder(NumericFeature(name="x", standardize=True))
    x = 1.7e9 + (np.arange(30_000) % 3)
    for part in np.array_split(x, 7):
        enc.partial_fit(pa.array(part))
    enc.finalize()
    assert enc.std_ == pytest.approx(np.std(x), rel=1e-9)
    assert enc.mean_ == pytest.approx(np.mean(x), rel=1e-12)


def test_config_checks_found_in_review(tmp_path):
    base = {"data": {"format": "synthetic"}, "preset": "criteo"}
    with pytest.raises(ConfigError, match="features.group"):
        load_config(raw={**base, "train": {"early_stopping": {"metric": "gauc"}}})
    with pytest.raises(ConfigError, match="numeric_defaults: unknown key 'fil'.*'fill'"):
        load_config(raw={"data": {"format": "synthetic"},
                         "features": {"numeric_defaults": {"fil": 1}, "numeric": ["a"],
                                      "categorical": ["b"]}})
    with pytest.raises(ConfigError, match="embeds categorical features.*numeric ones only.*mmoe"):
        load_config(raw={"data": {"format": "synthetic"}, "features": {
            "numeric": ["a"], "numeric_defaults": {"buckets": 0}}})  # no bucket twin either


def test_disk_full_is_one_error_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """Issue 13: a full disk gave a raw traceback and left data/staging and .tmp-* files;
    now it is a DataError (BundleError for export), and what was half-written is gone."""
    import errno

    from sampan.data import store as store_mod
    from sampan.errors import BundleError
    from sampan.export import bundle as bundle_mod
    from sampan.export import export_run

    path = tmp_path / "t.csv"
    path.write_text(HEADER + csv_rows(300))
    raw = cfg_for(tmp_path, path)
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*args, **kwargs):
        raise full

    with monkeypatch.context() as m:
        m.setattr(store_mod._SplitWriter, "append", no_space)
        with pytest.raises(DataError, match="no space left"):
            run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r" / "data").iterdir()) == [".sampan-store"]
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "r2")
    export_run(tmp_path / "r2", tmp_path / "bundle")
    before = (tmp_path / "bundle" / "manifest.json").read_text()
    with monkeypatch.context() as m:
        m.setattr(bundle_mod.shutil, "copytree", no_space)
        with pytest.raises(BundleError, match="no space left"):
            export_run(tmp_path / "r2", tmp_path / "bundle", overwrite=True)
    assert (tmp_path / "bundle" / "manifest.json").read_text() == before  # old one kept
    assert sorted(p.name for p in tmp_path.iterdir() if "bundle" in p.name) == ["bundle"]
    assert not list(tmp_path.rglob(".*.tmp-*")) and not list(tmp_path.rglob("staging"))
