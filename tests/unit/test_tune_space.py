"""The tune: section and its study, without training: the space's checks at load time, the
values a trial draws, the grid, best.yaml, and the reclaiming of a killed process's trial."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from sampan.config import ConfigError, TuneConfig, load_config
from sampan.tune.space import as_overrides, check_space, grid, sample, trial_config
from tests.conftest import tiny_config

optuna = pytest.importorskip("optuna")

BRANCHED = {
    "train.lr": {"low": 1.0e-3, "high": 1.0e-2, "log": True},
    "model.mlp": {"choices": [[16], [32, 16]]},
    "model.name": {"choices": ["deepfm", "dcn_v2"],
                   "when": {"dcn_v2": {"model.cross_layers": {"low": 1, "high": 3}}}},
}


def write(tmp_path, space, **tune):
    raw = {**tiny_config(tmp_path), "tune": {"space": space, **tune}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("spec, words", [
    ({"low": 0.1}, "needs both low and high"),
    ({"low": 1.0, "high": 0.5}, "must be below high"),
    ({"low": 0.0, "high": 1.0, "log": True}, "needs low > 0"),
    ({"low": 0.1, "high": 1.0, "choices": [1, 2]}, "not both"),
    ({"choices": ["a", "b"], "when": {"c": {"x": {"choices": [1]}}}}, "'c' is not one of"),
    ({"low": 1, "high": 4, "when": {"1": {}}}, "needs choices"),
    ({"choices": [1, 1]}, "repeat"),
])
def test_a_bad_parameter_is_named_at_load_time(tmp_path, spec, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_config(write(tmp_path, {"train.lr": spec}))
    assert "tune.space.train.lr" in str(e.value)


def test_a_misspelt_tune_key_gets_the_nearest_one(tmp_path):
    path = write(tmp_path, {"train.lr": {"low": 0.001, "high": 0.01}}, trails=5)
    with pytest.raises(ConfigError, match="did you mean 'trials'"):
        load_config(path)


def test_space_keys_and_values_are_checked_against_the_config(tmp_path):
    cfg = write(tmp_path, BRANCHED)
    with pytest.raises(ConfigError, match=r"(?s)tune\.space: train\.lrr=.*did you mean 'lr'"):
        check_space(cfg, [], TuneConfig(space={"train.lrr": {"low": 0.1, "high": 1.0}}).space)
    # the high end is refused (dropout is a probability): found before any trial runs
    with pytest.raises(ConfigError, match=r"model\.dropout=1\.5"):
        check_space(cfg, [], TuneConfig(space={"model.dropout": {"low": 0.0,
                                                                 "high": 1.5}}).space)
    # cross_layers is a dcn_v2 option: fine in its branch, refused for deepfm
    assert check_space(cfg, [], TuneConfig(space=BRANCHED).space) == 8
    with pytest.raises(ConfigError, match=r"(?s)cross_layers.*unknown key"):
        check_space(cfg, [], TuneConfig(space={"model.cross_layers": {"low": 1,
                                                                      "high": 2}}).space)


def test_a_trial_draws_config_values_and_only_its_branch(tmp_path):
    space = TuneConfig(space=BRANCHED).space
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        values = sample(trial, space)
        study.tell(trial, 0.0)
        assert 1e-3 <= values["train.lr"] <= 1e-2
        assert values["model.mlp"] in ([16], [32, 16])  # a list, not its label
        assert ("model.cross_layers" in values) == (values["model.name"] == "dcn_v2")
        if "model.cross_layers" in values:
            assert isinstance(values["model.cross_layers"], int)
        seen.add(values["model.name"])
        cfg = trial_config(write(tmp_path, BRANCHED), [], values)
        assert cfg.tune is None and cfg.model.name == values["model.name"]
        assert cfg.train.lr == pytest.approx(values["train.lr"])
    assert seen == {"deepfm", "dcn_v2"}


def test_the_grid_multiplies_only_a_choices_own_branch():
    space = TuneConfig(space={**BRANCHED, "train.lr": {"low": 0.001, "high": 0.003,
                                                       "step": 0.001}}).space
    points = grid(space)
    # lr 3 x mlp 2 x (deepfm 1 + dcn_v2 x 3 cross layers)
    assert len(points) == 3 * 2 * 4
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)
    assert {p["model.mlp"] for p in points} == {"[16]", "[32, 16]"}
    with pytest.raises(ConfigError, match="grid needs choices or a step"):
        grid(TuneConfig(space={"train.lr": {"low": 0.001, "high": 0.01}}).space)


def test_overrides_read_back_as_the_values():
    values = {"a": 0.001, "b": [256, 128], "c": "deepfm", "d": None, "e": 1e-8, "f": True}
    back = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in as_overrides(values))}
    assert back == values


def test_best_yaml_is_the_file_with_the_trials_values_and_loads_to_its_config(tmp_path):
    from sampan.config import dump_config
    from sampan.tune.study import prepare
    from sampan.tune.summary import write_best_yaml

    path = write(tmp_path, BRANCHED)
    job = prepare(path, ["train.epochs=3"], tmp_path / "study")
    values = {"train.lr": 0.004, "model.mlp": [32, 16], "model.name": "dcn_v2",
              "model.cross_layers": 2}
    out = write_best_yaml(job, values, tmp_path / "best.yaml", "best of 1\nfrom exp.yaml")
    text = out.read_text()
    assert text.startswith("# best of 1\n# from exp.yaml\n") and "tune:" not in text
    cfg = load_config(out)
    assert cfg.tune is None and cfg.model.name == "dcn_v2" and cfg.model.cross_layers == 2
    assert cfg.train.epochs == 3  # the study's --set is kept
    assert dump_config(cfg) == dump_config(trial_config(path, ["train.epochs=3"], values))
    # the folder's study is the same one when opened again; another space is refused
    assert prepare(path, ["train.epochs=3"], tmp_path / "study").budget == 30
    other = write(tmp_path, {"train.lr": {"low": 0.001, "high": 0.01}})
    with pytest.raises(ConfigError, match="made from another search space; resume"):
        prepare(other, ["train.epochs=3"], tmp_path / "study")
    # the refusal names what differs, with both values where they are short
    path = write(tmp_path, BRANCHED)  # (the same file again)
    with pytest.raises(ConfigError, match=r"another sampler \(tpe then, random now\)"):
        prepare(path, ["train.epochs=3", "tune.sampler=random"], tmp_path / "study")
    with pytest.raises(ConfigError, match="made from another experiment; resume"):
        prepare(path, ["train.epochs=4"], tmp_path / "study")


def test_a_dead_processs_trial_is_failed_and_queued_again(tmp_path):
    from rich.console import Console

    from sampan.tune.study import HOST, _start_time, counts, prepare, reclaim

    job = prepare(write(tmp_path, BRANCHED), [], tmp_path / "study")
    study = job.study()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t = study.ask()
    sample(t, job.tune.space)
    storage = job.storage()
    storage.set_trial_system_attr(job.trial_id(t.number), "sampan_owner",
                                  {"host": HOST, "pid": dead.pid, "start": "1"})
    live = study.ask()  # ours: alive
    storage.set_trial_system_attr(job.trial_id(live.number), "sampan_owner", {
        "host": HOST, "pid": os.getpid(), "start": _start_time(os.getpid())})
    young = study.ask()  # no owner yet, just asked: kept
    assert reclaim(job, study, Console(quiet=True)) == 1
    c = counts(study)
    assert (c["fail"], c["running"], c["waiting"]) == (1, 2, 1)
    again = study.ask()  # the queued retry comes first, with the dead trial's values
    sample(again, job.tune.space)
    assert again.params == study.trials[t.number].params
    assert study.trials[again.number].user_attrs["retry_of"] == t.number
    assert young.number != again.number


def test_a_number_choice_opens_its_branch_by_its_value():
    space = TuneConfig(space={"model.embedding_dim": {
        "choices": [8, 16], "when": {8: {"train.lr": {"choices": [0.1, 0.2]}}}}}).space
    assert sorted(grid(space), key=str) == sorted(
        [{"model.embedding_dim": 8, "train.lr": 0.1},
         {"model.embedding_dim": 8, "train.lr": 0.2}, {"model.embedding_dim": 16}], key=str)


def test_the_pruners_count_in_hundredths_of_an_epoch_and_the_deadline_stops_asking(tmp_path):
    from rich.console import Console

    from sampan.tune.study import EPOCH_UNITS, counts, prepare, pruner, work

    job = prepare(write(tmp_path, BRANCHED), [], tmp_path / "study")
    tc = job.tune
    assert isinstance(pruner(tc), optuna.pruners.MedianPruner)
    hb = pruner(tc.model_copy(update={"pruner": "hyperband"}))
    assert isinstance(hb, optuna.pruners.HyperbandPruner) and hb._min_resource == EPOCH_UNITS
    assert isinstance(pruner(tc.model_copy(update={"pruner": "none"})),
                      optuna.pruners.NopPruner)
    job.deadline = 0.0  # --timeout passed: no trial is asked for
    assert work(job, 0, Console(quiet=True)) == 0
    assert sum(counts(job.study()).values()) == 0


def test_set_adds_or_changes_one_entry_of_the_space(tmp_path):
    """--set tune.space.PATH: PATH is one whole space key (dotted), or a key and a field."""
    path = write(tmp_path, BRANCHED)
    cfg = load_config(path, overrides=["tune.space.model.dropout={low: 0.0, high: 0.3}",
                                       "tune.space.train.lr.high=0.05"])
    space = cfg.tune.space
    assert space["model.dropout"].low == 0.0 and space["model.dropout"].high == 0.3
    assert space["train.lr"].high == 0.05 and space["train.lr"].low == 1.0e-3
    with pytest.raises(ConfigError, match="'dropoot' in model: did you mean 'dropout'"):
        check_space(path, ["tune.space.model.dropoot={low: 0.0, high: 0.3}"],
                    load_config(path, overrides=[
                        "tune.space.model.dropoot={low: 0.0, high: 0.3}"]).tune.space)
