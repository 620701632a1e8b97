"""features.fit_rows: vocabularies fitted on the first rows of the train split only (a
vocabulary fixed at launch), while the model trains on all of them."""

import json

from sampan.config import load_config
from sampan.data.store import build_store
from tests.conftest import tiny_config


def test_vocabularies_are_fitted_on_the_first_rows_only(tmp_path):
    def store(fit_rows, name):
        raw = tiny_config(tmp_path, rows=6000)
        raw["data"]["synthetic"]["drift"] = 1.0  # later rows hold ids the first ones lack
        raw["data"]["split"] = {"method": "sequential", "train": 0.8, "valid": 0.1,
                                "test": 0.1}
        raw["features"] = {"fit_rows": fit_rows} if fit_rows else {}
        cfg = load_config(raw=raw)
        st = build_store(cfg, tmp_path / name)
        return json.loads((tmp_path / name / "manifest.json").read_text()), st

    whole, full = store(None, "whole")
    first, part = store(1000, "first")
    assert whole["fitted_on"]["rows"] == 4800 and first["fitted_on"]["rows"] == 1000
    c3 = {f["feature"]: f for f in first["features"]}["C3"]
    c3_whole = {f["feature"]: f for f in whole["features"]}["C3"]
    assert c3["ids"] < c3_whole["ids"]  # fewer values known
    # the model still trains on every train row; the later ones are mostly OOV (id 1)
    assert len(part.split("train")) == len(full.split("train")) == 4800
    col = [s.name for s in part.schema.sparse].index("C3")
    late = part.split("train").sparse[-1000:, col]
    assert (late == 1).mean() > 0.5
