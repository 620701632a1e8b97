"""The PaddleRec bridge (issue 43) on the nine PaddleRec model folders in ../shared/paddlerec.

Parity of meaning is checked against plain-Python readings of each layout written here from
the readers' documented behaviour (not by importing the readers, which need paddle): the
same rows, the same values for every feature and label.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from rich.console import Console

from sampan.compat.paddlerec import convert, read_layout
from sampan.config import ConfigError, load_config
from sampan.data.pipeline import FeaturePipeline
from sampan.data.rejects import RejectLog
from sampan.data.sources import expand_paths, read_source
from tests import web
from tests.conftest import ROOT, Served
from tests.integration.test_cli import sampan_here

PADDLEREC = Path(os.environ.get("SAMPAN_PADDLEREC", ROOT.parent / "shared" / "paddlerec"))
FOLDERS = ["rank/logistic_regression", "rank/fm", "rank/wide_deep", "rank/deepfm", "rank/dnn",
           "rank/dcn", "rank/din", "multitask/mmoe", "multitask/esmm"]
MODELS = {"logistic_regression": "lr", "fm": "fm", "wide_deep": "wide_deep",
          "deepfm": "deepfm", "dnn": "dnn", "dcn": "dcn", "din": "din", "mmoe": "mmoe",
          "esmm": "esmm"}

pytestmark = [pytest.mark.realdata, pytest.mark.skipif(
    not PADDLEREC.is_dir(), reason=f"PaddleRec fixtures not present at {PADDLEREC}")]


def files_of(folder: Path, key: str) -> list[Path]:
    raw = yaml.safe_load((folder / "config.yaml").read_text())
    return expand_paths(str(folder / raw["runner"][key]))


# ------------------------------------------------------------- plain-Python readings
def read_slots(path: Path, sparse: list[str], dense: str, width: int) -> list[dict]:
    """criteo_reader / reader / criteo_lr_reader: each ``slot:value`` token goes to its slot;
    a missing slot is padded with 0 (a dense slot with ``width`` zeros); the DCN reader
    skips an empty value."""
    rows = []
    for line in path.read_text().splitlines():
        got: dict[str, list] = {s: [] for s in [*sparse, dense]}
        for tok in line.strip().split(" "):
            slot, _, value = tok.partition(":")
            if slot in got and value != "":
                got[slot].append(int(value) if slot in sparse else float(value))
        for s in sparse:
            got[s] = got[s] or [0]
        got[dense] = got[dense] or [0.0] * width
        rows.append(got)
    return rows


def read_din(path: Path) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        f = line.strip().split(";")
        if len(f) < 5:
            continue
        out.append((f[0].split(), f[1].split(), f[2], f[3], float(f[4])))
    return out


def read_census(path: Path) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        v = [float(x) for x in line.strip().split(",")]
        out.append((v[2:], int(v[1]), int(v[0])))  # data, income, marital
    return out


def read_esmm(path: Path, fields: list[str], max_len: int = 3) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        f = line.strip().split(",")
        got: dict[str, list[int]] = {k: [] for k in fields}
        for elem in f[4:]:
            k, v = elem.strip().split(":")
            if k in got:
                got[k].append(int(v))
        out.append((int(f[1]), int(f[2]), {k: v[:max_len] for k, v in got.items()}))
    return out


def sampan_rows(cfg, role: str = "train") -> pa.Table:
    log = RejectLog(None)
    table = pa.concat_tables(read_source(cfg.data, getattr(cfg.data, role),
                                         FeaturePipeline(cfg.features).roles(), log))
    assert log.rejected == 0
    return table


PLAIN = {"slot": lambda f, lay: [r[lay.sparse_slots[0]][0] for r in read_slots(
             f, lay.sparse_slots, lay.dense_slots[0], lay.dense_shape[0])],
         "din": lambda f, lay: [r[4] for r in read_din(f)],
         "census": lambda f, lay: [r[1] for r in read_census(f)],
         "esmm": lambda f, lay: [r[0] for r in read_esmm(f, lay.fields)]}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_test_files_are_read_as_the_reader_reads_them(folder: str) -> None:
    """The rows and the (first) label of test_data_dir, which for mmoe and esmm are files
    of their own."""
    path = PADDLEREC / folder
    cfg = load_config(path / "config.yaml")
    t = sampan_rows(cfg, "test")
    runner = yaml.safe_load((path / "config.yaml").read_text())["runner"]
    layout = read_layout(path, runner["train_reader_path"])
    want = [y for f in files_of(path, "test_data_dir") for y in PLAIN[layout.kind](f, layout)]
    assert t.num_rows == len(want)
    assert as_int(t.column(cfg.features.labels[0]).to_pylist()) == [int(y) for y in want]


def as_int(values: list) -> list[int]:
    return [0 if v is None else int(v) for v in values]


@pytest.mark.parametrize("folder", FOLDERS)
def test_sampan_reads_what_the_paddlerec_reader_yields(folder: str) -> None:
    path = PADDLEREC / folder
    cfg = load_config(path / "config.yaml")
    t = sampan_rows(cfg)
    files = files_of(path, "train_data_dir")
    layout = read_layout(path, yaml.safe_load((path / "config.yaml").read_text())["runner"]
                         ["train_reader_path"])
    if layout.kind == "slot":
        label, *sparse = layout.sparse_slots
        dense, width = layout.dense_slots[0], layout.dense_shape[0]
        want = [r for f in files for r in read_slots(f, layout.sparse_slots, dense, width)]
        assert t.num_rows == len(want)
        assert as_int(t.column(label).to_pylist()) == [r[label][0] for r in want]
        if len(sparse) == 1:  # the LR layout: feat_idx holds num_field values
            n = cfg.features.categorical
            assert len(n) == 39 == len(cfg.features.numeric)
            for i in range(39):
                assert as_int(t.column(f"{sparse[0]}_{i + 1}").to_pylist()) == \
                    [r[sparse[0]][i] for r in want]
        else:
            assert [f.name for f in cfg.features.categorical] == sparse
            for s in sparse:
                assert as_int(t.column(s).to_pylist()) == [r[s][0] for r in want]
        for i in range(width):
            got = [0.0 if v is None else v for v in t.column(f"{dense}_{i + 1}").to_pylist()]
            assert got == pytest.approx([r[dense][i] for r in want])
        assert len(cfg.features.numeric) == width
    elif layout.kind == "din":
        want = [r for f in files for r in read_din(f)]
        assert t.num_rows == len(want) == 100
        assert t.column("hist_item_id").to_pylist() == [" ".join(r[0]) for r in want]
        assert t.column("hist_cat_id").to_pylist() == [" ".join(r[1]) for r in want]
        assert t.column("item_id").to_pylist() == [r[2] for r in want]
        assert t.column("cat_id").to_pylist() == [r[3] for r in want]
        assert t.column("label").to_pylist() == [r[4] for r in want]
        longest = max(len(r[0]) for r in want)
        assert {f.max_len for f in cfg.features.lists} == {longest}  # nothing is cut
    elif layout.kind == "census":
        want = [r for f in files for r in read_census(f)]
        assert t.num_rows == len(want)
        assert as_int(t.column("label_income").to_pylist()) == [r[1] for r in want]
        assert as_int(t.column("label_marital").to_pylist()) == [r[2] for r in want]
        assert len(cfg.features.numeric) == len(want[0][0]) == 499
        for i in (0, 1, 7, 498):
            assert t.column(f"feature_{i + 1}").to_pylist() == [r[0][i] for r in want]
        assert cfg.features.labels == ["label_income", "label_marital"]  # PaddleRec's order
    else:  # esmm
        want = [r for f in files for r in read_esmm(f, layout.fields)]
        assert t.num_rows == len(want)
        assert as_int(t.column("click").to_pylist()) == [r[0] for r in want]
        assert as_int(t.column("ctcvr").to_pylist()) == [r[1] for r in want]
        assert len(cfg.features.lists) == 23
        # the pipeline keeps the first 3 values of each field, as the reader does
        pipe = FeaturePipeline(cfg.features)
        pipe.fit(iter([t]))
        enc = pipe.transform(t)
        for spec in cfg.features.lists:
            assert spec.keep == "first" and spec.max_len == 3
            raw = t.column(spec.column).to_pylist()
            assert [[int(x) for x in (v or [])][:3] for v in raw] == \
                [r[2][spec.column] for r in want]
            ids = enc["sequences"][spec.name]
            assert ids.shape == (len(want), 3)
            assert [int((row != 0).sum()) for row in ids] == \
                [len(r[2][spec.column]) for r in want]


# ---------------------------------------------------------------------------- converting
@pytest.mark.parametrize("variant", ["config.yaml", "config_bigdata.yaml"])
@pytest.mark.parametrize("folder", FOLDERS)
def test_every_key_is_accounted_for_and_none_is_unsupported(folder: str, variant: str) -> None:
    path = PADDLEREC / folder / variant
    raw = yaml.safe_load(path.read_text())
    conv = convert(path)
    leaves = []

    def walk(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(f"{prefix}.{k}", v)
            else:
                leaves.append(f"{prefix}.{k}")

    walk("runner", raw["runner"])
    walk("hyper_parameters", raw["hyper_parameters"])
    assert [r.key for r in conv.rows] == leaves  # nothing dropped silently
    assert conv.unsupported == []
    assert conv.model == MODELS[Path(folder).name]
    cfg = load_config(raw=conv.config)  # the converted config loads as any other
    assert cfg.train.batch_size == raw["runner"]["train_batch_size"]
    assert cfg.train.epochs == raw["runner"]["epochs"]
    opt = raw["hyper_parameters"]["optimizer"]
    assert cfg.train.lr == opt.get("learning_rate", opt.get("learning_rate_base_lr"))
    # data folders are taken relative to the config's folder, as PaddleRec does
    assert cfg.data.train == str((path.parent / raw["runner"]["train_data_dir"]).resolve())


def test_hyper_parameters_land_where_they_belong() -> None:
    dcn = load_config(PADDLEREC / "rank/dcn/config.yaml")
    assert (dcn.model.cross_layers, dcn.model.cross_l2, dcn.model.mlp, dcn.model.embedding_dim,
            dcn.model.batch_norm) == (2, 5e-5, [512, 256, 128], 9, False)
    assert (dcn.train.optimizer, dcn.train.sparse_optimizer, dcn.train.lr) == \
        ("adam", "adam", 1e-4)
    din = load_config(PADDLEREC / "rank/din/config.yaml")
    assert (din.train.optimizer, din.train.sparse_optimizer, din.train.momentum,
            din.train.lr) == ("sgd", "sgd", 0.0, 0.85)
    assert (din.model.activation, din.model.attention_activation, din.model.embedding_dim) == \
        ("sigmoid", "sigmoid", 64)
    mmoe = load_config(PADDLEREC / "multitask/mmoe/config.yaml")
    assert (mmoe.model.experts, mmoe.model.expert_mlp, mmoe.model.tower_mlp) == (8, [16], [8])
    lr = load_config(PADDLEREC / "rank/logistic_regression/config.yaml")
    assert lr.train.embedding_l1 == 0.001 and lr.model.name == "lr"
    esmm = load_config(PADDLEREC / "multitask/esmm/config.yaml")
    assert (esmm.model.tower_mlp, esmm.model.embedding_dim) == ([256, 64], 12)
    assert esmm.features.labels == ["click", "ctcvr"]
    deepfm = load_config(PADDLEREC / "rank/deepfm/config.yaml", overrides=["train.epochs=1"])
    assert deepfm.model.field_weights is False and deepfm.train.epochs == 1  # --set wins


def test_every_fixture_trains_and_prints_its_metrics(tmp_path) -> None:
    """``sampan train <folder>/config.yaml``, unchanged, for all nine folders (one process
    for the nine, so that the test stays short; the CLI path is the next test's)."""
    from sampan.train.experiment import run_experiment

    for folder in FOLDERS:
        cfg = load_config(PADDLEREC / folder / "config.yaml",
                          overrides=["train.progress=false", "train.tensorboard=false"])
        out = run_experiment(cfg, run_dir=tmp_path / Path(folder).name,
                             console=Console(quiet=True))
        assert out["test"]["rows"] > 0, folder
        assert 0.0 <= out["test"]["logloss"] < 5.0, folder


def test_the_cli_trains_a_paddlerec_folder_then_eval_export_and_serve_work(tmp_path) -> None:
    run = tmp_path / "dnn"
    cmd = [sys.executable, "-m", "sampan.cli"]
    p = subprocess.run([*cmd, "train", str(PADDLEREC / "rank/dnn/config.yaml"), "--run-dir",
                        str(run), "--set", "train.progress=false"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "PaddleRec dnn (slot text, criteo_reader) as Sampan's dnn" in p.stdout
    assert "test" in p.stdout and "auc" in p.stdout
    # the run read back and exported (in this process: the CLI's handlers)
    sampan_here("eval", str(run), check=True)
    bundle = tmp_path / "bundle"
    sampan_here("export", str(run), "--out", str(bundle), check=True)
    line = (PADDLEREC / "rank/dnn/data/sample_data/train/sample_train.txt").read_text() \
        .splitlines()[1]
    record: dict = {}
    for tok in line.split():
        slot, _, value = tok.partition(":")
        if slot == "dense_feature":
            record[f"dense_feature_{sum(k.startswith('dense') for k in record) + 1}"] = \
                float(value)
        elif slot != "click":
            record[slot] = value
    srv = Served([str(bundle)], grpc=False)
    try:

        r = web.post(f"{srv.url}/v1/predict", json={"records": [record]})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["labels"] == ["click"] and len(got["probabilities"]) == 1
        assert 0.0 < got["probabilities"][0][0] < 1.0
    finally:
        srv.stop()


def test_convert_writes_a_config_that_trains_as_the_original(tmp_path) -> None:
    out = tmp_path / "mmoe.yaml"
    p = subprocess.run([sys.executable, "-m", "sampan.cli", "convert", "paddlerec",
                        str(PADDLEREC / "multitask/mmoe/config.yaml"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    for text in ("hyper_parameters.expert_num", "model.experts", "ignored",
                 "runner.use_gpu", "Sampan settings that train as PaddleRec does"):
        assert text in p.stdout
    assert "0 not supported" in p.stdout and p.stdout.count("not supported") == 1
    assert load_config(out).model_dump() == \
        load_config(PADDLEREC / "multitask/mmoe/config.yaml").model_dump()


# ---------------------------------------------------------------- other model folders
def _folder(tmp_path: Path, name: str, source: str, hyper: dict, reader_edit=None) -> Path:
    """A PaddleRec folder of another model that reads a fixture's layout: its reader (a
    copy, or a near-copy) and data, and the hyper-parameters PaddleRec's own config for that
    model has."""
    src = PADDLEREC / source
    dst = tmp_path / name
    shutil.copytree(src, dst)
    raw = yaml.safe_load((src / "config.yaml").read_text())
    raw["hyper_parameters"] = hyper
    (dst / "config.yaml").write_text(yaml.safe_dump(raw))
    if reader_edit is not None:
        reader = dst / f"{raw['runner']['train_reader_path']}.py"
        reader.write_text(reader_edit(reader.read_text()))
    return dst / "config.yaml"


def test_other_paddlerec_folders_with_these_layouts_convert(tmp_path) -> None:
    opt = {"class": "Adam", "learning_rate": 0.001, "strategy": "async"}
    criteo = {"optimizer": opt, "sparse_inputs_slots": 27, "sparse_feature_number": 1000001,
              "sparse_feature_dim": 9, "dense_input_dim": 13, "distributed_embedding": 0}
    xdeepfm = _folder(tmp_path, "xdeepfm", "rank/deepfm", {
        **criteo, "fc_sizes": [512, 256, 128, 32], "layer_sizes_dnn": [512, 256, 128],
        "layer_sizes_cin": [128, 32]})
    ple = _folder(tmp_path, "ple", "multitask/mmoe", {
        "feature_size": 499, "task_num": 2, "shared_num": 2, "exp_per_task": 3,
        "level_number": 1, "expert_size": 16, "tower_size": 8, "optimizer": opt})
    bottom = _folder(tmp_path, "share_bottom", "multitask/mmoe", {
        "feature_size": 499, "bottom_size": 117, "task_num": 2, "tower_size": 8,
        "optimizer": opt})
    # dcn_v2's reader is DCN's with log(x + 1) on the dense values
    dcn_v2 = _folder(tmp_path, "dcn_v2", "rank/dcn", {
        **criteo, "is_Stacked": True, "use_low_rank_mixture": False, "low_rank": 256,
        "num_experts": 1, "fc_sizes": [768, 768], "cross_num": 2, "l2_reg_cross": 3e-5,
        "dnn_use_bn": False, "clip_by_norm": 10.0}, reader_edit=lambda s: s.replace(
            "feasign = float(slot_feasign[1])",
            "feasign = float(slot_feasign[1])\n                            "
            "feasign = np.log(feasign + 1)"))
    for path, model in ((xdeepfm, "xdeepfm"), (ple, "ple"), (bottom, "mmoe"),
                        (dcn_v2, "dcn_v2")):
        conv = convert(path)
        assert conv.unsupported == [], (model, conv.unsupported)
        cfg = load_config(path, overrides=["train.epochs=1", "train.progress=false"])
        assert cfg.model.name == model
    assert load_config(xdeepfm).model.cin == [128, 32]
    b = load_config(bottom).model
    assert (b.experts, b.expert_mlp, b.tower_mlp) == (1, [117], [8])  # shared bottom
    p = load_config(ple).model
    assert (p.shared_experts, p.task_experts, p.levels) == (2, 3, 1)
    v2 = load_config(dcn_v2)
    assert v2.features.numeric_defaults["log1p"] is True and v2.model.structure == "stacked"
    # a reader renamed but declaring the same slots is read from its source
    assert read_layout(dcn_v2.parent, "reader").dense_transform == "log1p"
    # a mixture of low-rank experts is said to be unsupported, not dropped
    mix = _folder(tmp_path / "m", "dcn_v2", "rank/dcn", {
        **criteo, "use_low_rank_mixture": True, "low_rank": 32, "num_experts": 4})
    assert {r.key for r in convert(mix).unsupported} == {
        "hyper_parameters.use_low_rank_mixture", "hyper_parameters.num_experts"}


def test_unknown_readers_and_models_fail_naming_the_known_ones(tmp_path) -> None:
    cfg = _folder(tmp_path, "dnn", "rank/dnn", yaml.safe_load(
        (PADDLEREC / "rank/dnn/config.yaml").read_text())["hyper_parameters"])
    (cfg.parent / "criteo_reader.py").write_text("print('a layout of its own')\n")
    with pytest.raises(ConfigError, match="a layout the bridge does not know; known: slot"):
        convert(cfg)
    raw = yaml.safe_load(cfg.read_text())
    raw["runner"]["train_reader_path"] = "my_reader"
    cfg.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="'my_reader' is not a reader PaddleRec ships; "
                                          "known readers: criteo_reader"):
        convert(cfg)
    odd = tmp_path / "tdm"
    shutil.copytree(PADDLEREC / "rank/dnn", odd)
    with pytest.raises(ConfigError, match="not a PaddleRec model the bridge maps.*dnn"):
        convert(odd / "config.yaml")
    with pytest.raises(ConfigError, match="not a PaddleRec config"):
        load_config(ROOT / "configs/criteo_deepfm.yaml", source="paddlerec")
