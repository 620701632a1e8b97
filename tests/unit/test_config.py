import pytest
import yaml

from sampan.config import ConfigError, dump_config, load_config


def write(tmp_path, data):
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


BASE = {"preset": "criteo", "data": {"format": "synthetic"}}


def test_builtin_default_is_deepfm_on_synthetic():
    cfg = load_config(None)
    assert cfg.model.name == "deepfm"
    assert cfg.data.format == "synthetic"
    assert len(cfg.features.numeric) == 13
    # C1..C26 plus the 13 log^2-binned counts of the Criteo preset
    assert len(cfg.features.categorical) == 39


def test_misspelt_top_level_section_names_nearest_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "trian": {"epochs": 1}}))
    msg = str(e.value)
    assert "'trian'" in msg and "did you mean 'train'" in msg and "top level" in msg


def test_misspelt_nested_key_names_where_and_nearest(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "train": {"bach_size": 64}}))
    msg = str(e.value)
    assert "unknown key 'bach_size' in train" in msg
    assert "did you mean 'batch_size'" in msg


def test_misspelt_key_inside_a_list_item(tmp_path):
    data = {"data": {"format": "synthetic"},
            "features": {"categorical": [{"name": "C1", "min_cout": 3}]}}
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, data))
    msg = str(e.value)
    assert "features.categorical[0]" in msg and "did you mean 'min_count'" in msg


def test_misspelt_model_option_checked_against_that_model(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "model": {"name": "deepfm", "mpl": [8]}}))
    assert "unknown key 'mpl' in model" in str(e.value)
    assert "did you mean 'mlp'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "model": {"name": "lr", "mlp": [8]}}))
    assert "unknown key 'mlp' in model" in str(e.value)


def test_unknown_model_lists_known_models(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "model": {"name": "deepfn"}}))
    msg = str(e.value)
    assert "'deepfn'" in msg and "Did you mean 'deepfm'" in msg and "lr" in msg


def test_wrong_type_names_expected_type(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, "train": {"epochs": "many"}}))
    msg = str(e.value)
    assert "train.epochs" in msg and "integer" in msg and "'many'" in msg


def test_precedence_defaults_file_set(tmp_path):
    path = write(tmp_path, {**BASE, "train": {"epochs": 7, "batch_size": 32}})
    cfg = load_config(path, overrides=["train.epochs=2", "model.mlp=[8, 4]"])
    assert cfg.train.epochs == 2  # --set beats the file
    assert cfg.train.batch_size == 32  # the file beats the default
    assert cfg.train.lr == 1e-3  # package default
    assert cfg.model.mlp == [8, 4]  # YAML-parsed value


def test_set_into_list_by_index_and_bad_index(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, overrides=["features.categorical.0.min_count=9"])
    assert cfg.features.categorical[0].min_count == 9
    assert cfg.features.categorical[1].min_count == 3
    with pytest.raises(ConfigError, match="not an index"):
        load_config(path, overrides=["features.categorical.99.min_count=9"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(path, overrides=["train.epochs"])


def test_split_fractions_must_add_up(tmp_path):
    data = {**BASE, "data": {"format": "synthetic",
                             "split": {"train": 0.8, "valid": 0.3, "test": 0.1}}}
    with pytest.raises(ConfigError, match="add up to 1.0"):
        load_config(write(tmp_path, data))


def test_file_source_required_unless_synthetic(tmp_path):
    with pytest.raises(ConfigError, match="data.train is required"):
        load_config(write(tmp_path, {"preset": "criteo", "data": {"format": "csv"}}))


def test_shorthand_defaults_and_their_validation(tmp_path):
    data = {"data": {"format": "synthetic"},
            "features": {"categorical_defaults": {"min_count": 4}, "categorical": ["a", "b"],
                         "numeric_defaults": {"log1p": True, "buckets": 0}, "numeric": ["x"]}}
    cfg = load_config(write(tmp_path, data))
    assert [f.min_count for f in cfg.features.categorical] == [4, 4]
    assert cfg.features.numeric[0].log1p is True
    data["features"]["categorical_defaults"] = {"min_cnt": 4}
    with pytest.raises(ConfigError, match="did you mean 'min_count'"):
        load_config(write(tmp_path, data))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, overrides=["train.epochs=1", "model.embedding_dim=8"])
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    again = load_config(p)
    assert again.model_dump() == cfg.model_dump()
    assert again.model.mlp == cfg.model.mlp


def test_a_misspelt_model_key_fails_from_python_too():
    """Issue 15: ExperimentConfig.model_validate used to drop every model option, a typo
    included; the model section is now validated against the named model wherever a config
    is built."""
    from pydantic import ValidationError

    from sampan.config import ExperimentConfig

    base = {"features": {"categorical": ["a"]}}
    with pytest.raises(ValidationError, match="model.typo_key"):
        ExperimentConfig.model_validate({**base, "model": {"name": "deepfm", "mlp": [7],
                                                           "typo_key": 1}})
    cfg = ExperimentConfig.model_validate({**base, "model": {"name": "dcn_v2", "mlp": [7]}})
    assert cfg.model.mlp == [7] and cfg.model.cross_layers == 3  # kept, with its defaults
    with pytest.raises(ValidationError, match="unknown model 'deepfn'"):
        ExperimentConfig.model_validate({**base, "model": {"name": "deepfn"}})


def test_importing_the_models_imports_no_data_code():
    """Issue 15: Batch lives in sampan/batch.py (torch only)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sys, sampan.models; "
                        "assert 'pyarrow' not in sys.modules, 'pyarrow imported'"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_engine_ray_without_ray_fails_at_load_with_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ConfigError, match=r"pip install 'sampan\[ray\]'"):
        load_config(raw={"name": "x", "preset": "criteo",
                         "data": {"format": "synthetic", "engine": "ray"}})
    plain = load_config(raw={"name": "x", "preset": "criteo", "data": {"format": "synthetic"}})
    assert plain.data.engine == "local"


def test_a_finished_run_prepared_on_ray_opens_without_ray(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # evaluating on a machine without Ray
    cfg = load_config(raw={"name": "x", "preset": "criteo",
                           "data": {"format": "synthetic", "engine": "ray"}}, finished=True)
    assert cfg.data.engine == "ray"


def test_a_key_yaml_read_as_a_boolean_is_explained():
    """`on: user_id` in a join: YAML reads `on` as true; the message says so and lists the
    keys there (the join's is `by`)."""
    raw = yaml.safe_load("data: {train: x.csv, joins: [{path: u.csv, on: user_id}]}\n"
                         "features: {categorical: [a]}\n")
    with pytest.raises(ConfigError, match=r"a key in data.joins\[0\] was read as True: YAML "
                                          r"reads an unquoted on, off, yes or no as a boolean"
                                          r".*valid keys are: path, by, key"):
        load_config(raw=raw)


def test_a_metric_the_model_does_not_report_fails_at_load_with_the_ones_it_does():
    tune = {"space": {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}}
    for raw, where in (({"train": {"early_stopping": {"metric": "recall@10"}}},
                        "train.early_stopping.metric"),
                       ({"tune": {**tune, "metric": "ndcg@10"}}, "tune.metric")):
        with pytest.raises(ConfigError) as e:
            load_config(raw={**BASE, **raw})
        msg = str(e.value)
        assert where in msg and "task: binary" in msg and "auc, logloss" in msg
    with pytest.raises(ConfigError, match="set features.group"):
        load_config(raw={**BASE, "train": {"early_stopping": {"metric": "gauc"}}})
    with pytest.raises(ConfigError, match=r"tune.metric: .*unknown metric 'aucc'"):
        load_config(raw={**BASE, "tune": {**tune, "metric": "aucc"}})
    with pytest.raises(ConfigError, match="recall@50, hitrate@50, ndcg@50, mrr"):
        load_config(raw={**BASE, "model": {"name": "two_tower"},
                         "train": {"early_stopping": {"metric": "recall@10"}}})
    assert load_config(raw={**BASE, "model": {"name": "two_tower", "k": 10},
                            "tune": {**tune, "metric": "ndcg@10"}}).tune.metric == "ndcg@10"
    assert load_config(raw={**BASE, "model": {"name": "sasrec"}, "train": {
        "early_stopping": {"metric": "hitrate@20"}}}).train.early_stopping.metric == "hitrate@20"


def test_the_metric_names_are_the_ones_evaluation_reports():
    import numpy as np
    import torch

    from sampan.metrics import MetricAccumulator, metric_names, metrics_of_ranks
    from sampan.tasks.next_item import CUTOFFS, rank_metrics

    z, y = torch.randn(64, 1), (torch.rand(64, 1) < 0.3).float()
    for grouped in (False, True):
        acc = MetricAccumulator()
        acc.update(z, y, torch.arange(64) % 8 if grouped else None)
        assert set(metric_names("binary", grouped=grouped)) <= set(acc.compute())
    got = metrics_of_ranks(torch.tensor([1, 3, 0]), torch.tensor([0, 1, 2]), 3, 7)
    assert set(metric_names("retrieval", k=7)) <= set(got)
    got = rank_metrics(np.array([1.0, 4.0, 30.0]), tuple(sorted({*CUTOFFS, 15})))
    assert set(metric_names("next_item", k=15)) <= set(got)
