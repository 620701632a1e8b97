"""A model in the user's own file trains, exports and serves like a built-in one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from sampan.config import ConfigError, load_config
from sampan.config.plugins import load
from sampan.models import get_model_class
from sampan.testing import check_model
from tests import web
from tests.conftest import ROOT
from tests.integration.test_defaults import small_csv

USER_MODELS = '''
"""My rankers (a user's file, outside the sampan package)."""
from typing import Literal

import torch
from torch import nn

from sampan.config import ModelConfig
from sampan.layers import FeatureEmbedding, bias_terms
from sampan.models import register_model


@register_model("sum_ranker")
class SumRanker(nn.Module):
    """First-order terms plus an MLP over the sum of the field vectors."""

    class Config(ModelConfig):
        name: Literal["sum_ranker"] = "sum_ranker"
        hidden: int = 8

    def __init__(self, schema, cfg):
        super().__init__()
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std)
        self.mlp = nn.Sequential(nn.Linear(cfg.embedding_dim, cfg.hidden), nn.ReLU(),
                                 nn.Linear(cfg.hidden, 1))

    def output_bias(self):
        return bias_terms(self.features.bias)

    def forward(self, batch):
        linear, v = self.features(batch)
        return linear + self.mlp(v.sum(dim=1))


@register_model("frozen_ranker")
class FrozenRanker(SumRanker):
    """Broken on purpose: its MLP never sees the data, so it gets no gradient."""

    class Config(ModelConfig):
        name: Literal["frozen_ranker"] = "frozen_ranker"
        hidden: int = 8

    def forward(self, batch):
        linear, _ = self.features(batch)
        return linear + 0 * self.mlp[0].bias.sum().detach()
'''


@pytest.fixture
def user_file(tmp_path):
    """The user's file; its models leave the process-wide registry after the test."""
    from sampan.config import plugins, registry

    models, loaded = dict(registry._MODELS), dict(plugins._LOADED)
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent(USER_MODELS))
    yield path
    registry._MODELS.clear()
    registry._MODELS.update(models)
    plugins._LOADED.clear()
    plugins._LOADED.update(loaded)


def test_check_model_passes_a_sound_model_and_names_what_a_broken_one_lacks(user_file):
    load(str(user_file))
    check_model(get_model_class("sum_ranker"))
    check_model("sum_ranker", hidden=4)
    with pytest.raises(AssertionError, match="FrozenRanker: .* got no gradient"):
        check_model(get_model_class("frozen_ranker"))


def test_a_plugin_that_fails_to_import_is_one_line_naming_file_and_line(tmp_path, user_file):
    bad = tmp_path / "broken.py"
    bad.write_text("x = 1\ndef f(:\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed: SyntaxError: .*"
                                          r"broken.py:2\)"):
        load(str(bad))
    missing = tmp_path / "needs.py"
    missing.write_text("import not_a_real_package_xyz\n")
    with pytest.raises(ConfigError, match=r"ModuleNotFoundError: No module named "
                                          r"'not_a_real_package_xyz' \(.*needs.py:1\)"):
        load(str(missing))
    clash = tmp_path / "clash.py"
    clash.write_text(textwrap.dedent(USER_MODELS).replace('register_model("sum_ranker")',
                                                          'register_model("deepfm")'))
    with pytest.raises(ConfigError, match=r"'deepfm' is registered twice: by "
                                          r"sampan.models.deepfm.DeepFM and .*SumRanker"):
        load(str(clash))


def test_plugin_errors_are_config_errors(tmp_path):
    base = {"data": {"train": "x.csv"}, "features": {"categorical": ["a"]}}
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(raw={**base, "plugins": [str(tmp_path / "missing.py")]})
    with pytest.raises(ConfigError, match="no module named 'not_a_module_xyz'"):
        load_config(raw={**base, "plugins": ["not_a_module_xyz"]})
    with pytest.raises(ConfigError, match="Known models"):
        load_config(raw={**base, "model": {"name": "sum_rankr"}})


def test_a_user_model_trains_exports_and_serves_from_the_cli(tmp_path, user_file):
    from benchmarks.serve_load import start_server

    small_csv(tmp_path / "d.csv", rows=1500)
    cfg = {"name": "mine", "output_dir": str(tmp_path / "runs"),
           "plugins": ["my_models.py"],  # relative to the config file, not the cwd
           "data": {"train": str(tmp_path / "d.csv")},
           "features": {"categorical": ["a", "b"], "numeric": ["x"]},
           "model": {"name": "sum_ranker", "hidden": 6},
           "train": {"progress": False, "tensorboard": False}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    run, bundle = tmp_path / "run", tmp_path / "bundle"

    def sampan(*args):
        r = subprocess.run([sys.executable, "-m", "sampan", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"sampan {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
        return r

    sampan("train", str(tmp_path / "exp.yaml"), "--run-dir", str(run))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["plugins"] == [str(user_file.resolve())]
    assert saved["model"] == {**saved["model"], "name": "sum_ranker", "hidden": 6}
    results = json.loads((run / "results.json").read_text())
    assert results["model"] == "sum_ranker"
    assert results["test"]["auc"] > 0.6  # small_csv's labels follow a and x
    # a new process (eval, export) loads the same code from the saved config
    evaluated = json.loads(sampan("eval", str(run)).stdout)
    assert evaluated["auc"] == pytest.approx(results["test"]["auc"], abs=1e-6)
    sampan("export", str(run), "--out", str(bundle))
    server, url = start_server(bundle)
    try:
        r = web.post(f"{url}/v1/predict", json={"records": [
            {"a": "v1", "b": "2", "x": 3.5}, {"a": "v2", "b": "0", "x": 0.1}]})
        assert r.status_code == 200, r.text
        probs = r.json()["probabilities"]
        assert len(probs) == 2 and all(0.0 < p[0] < 1.0 for p in probs)
    finally:
        server.terminate()
        server.wait(timeout=30)


USER_READER = '''
"""A reader of a key=value log (a user's file): one record per line, fields split by ';'."""
import gzip

import pyarrow as pa

from sampan.data import register_reader


@register_reader("kv_log")
def read_kv_log(path, options):
    sep = options.get("separator", ";")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [dict(kv.split("=", 1) for kv in line.strip().split(sep)) for line in f]
    for lo in range(0, len(rows), 150):  # chunks, in file order
        yield pa.Table.from_pylist(rows[lo:lo + 150])
'''


def test_a_reader_of_your_own_trains_predicts_and_rejects_by_reason(tmp_path):
    import pyarrow.csv as pacsv

    from tests.integration.test_defaults import small_csv

    small_csv(tmp_path / "d.csv")
    rows = pacsv.read_csv(tmp_path / "d.csv").to_pylist()
    rows[7]["label"] = "yes"  # the 8th record: not a label
    rows[3]["x"] = ""  # "x=": an empty value is missing (filled), not unparsable
    (tmp_path / "clicks.log").write_text("".join(
        "|".join(f"{k}={v}" for k, v in r.items()) + "\n" for r in rows))
    (tmp_path / "readers.py").write_text(USER_READER)
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "kv", "output_dir": str(tmp_path / "runs"), "plugins": ["readers.py"],
        "data": {"train": str(tmp_path / "clicks.log"), "format": "kv_log",
                 "reader_options": {"separator": "|"}},
        "features": {"categorical": ["a", "b"], "numeric": ["x"]},
        "model": {"name": "lr"}, "train": {"epochs": 1, "tensorboard": False}}))
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "sampan", "train", str(cfg), "--run-dir",
                        str(run)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    rejects = [json.loads(x) for x in (run / "data" / "rejects.jsonl").read_text().splitlines()]
    assert [(x["line"], x["column"], x["value"]) for x in rejects] == [(8, "label", "yes")]
    assert json.loads((run / "results.json").read_text())["test"]["auc"] > 0.5
    # new rows in the same format, through the saved run's reader
    (tmp_path / "new.log").write_text("".join(
        "|".join(f"{k}={v}" for k, v in r.items() if k != "label") + "\n" for r in rows[:5]))
    r = subprocess.run([sys.executable, "-m", "sampan", "predict", str(run),
                        str(tmp_path / "new.log"), "--out", str(tmp_path / "p.csv")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 6


def test_an_unknown_format_names_the_nearest_and_a_builtin_name_is_refused(tmp_path):
    from sampan.data import register_reader

    with pytest.raises(ConfigError, match="Did you mean 'parquet'"):
        load_config(raw={"data": {"train": "x", "format": "parqet"},
                         "features": {"categorical": ["a"]}})
    with pytest.raises(ConfigError, match="built in"):
        register_reader("csv")(lambda path, options: iter(()))


def test_a_model_whose_config_name_differs_from_its_registered_name_is_refused():
    from typing import Literal

    from torch import nn

    from sampan.config import ModelConfig
    from sampan.config.registry import register_model

    with pytest.raises(ConfigError, match=r"registered as 'sum_ranker', but its Config.name "
                                          r"is Literal\['sumranker'\]"):
        @register_model("sum_ranker")
        class SumRanker(nn.Module):
            class Config(ModelConfig):
                name: Literal["sumranker"] = "sumranker"
